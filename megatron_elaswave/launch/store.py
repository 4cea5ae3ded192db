"""The job store: what the launcher publishes about a job's processes, and how to read it.

``elaswave-run`` hosts one ``torch.distributed.TCPStore`` per job, inside the launcher of node
rank 0, at ``MASTER_ADDR:MASTER_PORT``, or keeps it on an etcd cluster with ``--store etcd://...``
(:mod:`megatron_elaswave.launch.etcd_store`). Because no worker hosts it, it stays reachable when any
worker dies, including rank 0; on etcd, when any node is lost, node 0 included. Workers reach
it with :func:`connect_store`.

The launchers own every key under ``elaswave/``; workers only read them. Workers keep their own
keys under ``rt/``, namespaced by generation where a job outlives its process groups, so that a
rebuilt group never reads a stale key. :mod:`megatron_elaswave.launch.keys` names them all.

Deaths are numbered in the order they were recorded, so a reader polls with a cursor::

    seen = 0
    while ...:
        new = read_deaths(store, start=seen)
        seen += len(new)
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from megatron_elaswave.launch.config import STORE_ADDR_ENV, STORE_PORT_ENV
from megatron_elaswave.launch.etcd_address import ETCD_URL_SCHEME, EtcdAddress
from megatron_elaswave.launch.etcd_store import EtcdStore
from megatron_elaswave.launch.keys import (
    ALERT_COUNT_KEY,
    COLLECTED_KEY,
    DEATH_COUNT_KEY,
    NODE_CHANGES_KEY,
    NODES_STATE_KEY,
    death_key,
    decision_key,
    exit_key,
    generation_prefixes,
    silence_count_key,
    silence_key,
    worker_key,
)
from megatron_elaswave.launch.liveness import address_toward
from megatron_elaswave.waiting import wait_until

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore

# Causes of a WorkerDeath.
EXITED = "exit"
SIGNALED = "signal"
NODE_LOST = "node_lost"

_Record = TypeVar("_Record")


def to_json(record: Any) -> str:
    return json.dumps(asdict(record), sort_keys=True)


def from_json(cls: type[_Record], raw: bytes | str) -> _Record:
    """Decode a record, ignoring fields this version does not know (written by a newer one)."""
    known = {field.name for field in fields(cls)}
    return cls(**{k: v for k, v in json.loads(raw).items() if k in known})


@dataclass(frozen=True)
class NodeRecord:
    """One node launcher, as registered when it joins the job."""

    node_rank: int
    """The launcher's ``--node-rank``."""
    host: str
    """Host name of the machine it runs on."""
    pid: int
    """Process id of the launcher."""
    nproc_per_node: int
    """Workers it starts; every node of a job must start the same number."""
    run_id: str
    """The job's ``--run-id``; launchers of different jobs refuse to join each other."""
    liveness: str = ""
    """``HOST:PORT`` of the launcher's :class:`~megatron_elaswave.launch.liveness.LivenessListener`,
    which the launchers that watch the node hold a connection to."""


@dataclass(frozen=True)
class WorkerRecord:
    """A worker process, as spawned by its node's launcher."""

    rank: int
    """Global rank: ``node_rank * nproc_per_node + local_rank``."""
    local_rank: int
    """Index of the worker among its node's workers."""
    node_rank: int
    """Node rank of the launcher that spawned it."""
    pid: int
    """Process id, on ``host``."""
    host: str
    """Host name of the machine it runs on."""


@dataclass(frozen=True)
class WorkerExit:
    """A worker that finished normally (exit code 0)."""

    rank: int
    """Global rank of the worker."""
    local_rank: int
    """Index of the worker among its node's workers."""
    node_rank: int
    """Node rank of its launcher."""
    pid: int
    """Process id it had."""
    time: float
    """Unix time at which its launcher saw it exit."""


@dataclass(frozen=True)
class WorkerDeath:
    """A worker that stopped without finishing: non-zero exit, a signal, or its node was lost."""

    rank: int
    """Global rank of the worker."""
    local_rank: int
    """Index of the worker among its node's workers."""
    node_rank: int
    """Node rank of its launcher."""
    pid: int | None
    """Process id it had; ``None`` if its node was lost before the pid was published."""
    exit_code: int | None
    """Its non-zero exit code, or ``None`` if it was killed by a signal or its node was lost."""
    signal: str | None
    """Name of the signal that killed it (``"SIGKILL"``), or ``None``."""
    cause: str
    """``"exit"`` (non-zero exit code), ``"signal"``, or ``"node_lost"``: its node's launcher
    stopped heartbeating, so the worker is presumed dead (and is killed if it is not)."""
    time: float
    """Unix time at which the death was detected (for a lost node: when it was declared lost)."""

    def describe(self) -> str:
        """``killed by SIGKILL``, ``exited with 1`` or ``its node was lost``."""
        if self.cause == NODE_LOST:
            return "its node was lost"
        return f"killed by {self.signal}" if self.signal else f"exited with {self.exit_code}"


def connect_store(timeout: timedelta = timedelta(seconds=300)) -> Store:
    """A client of the job store, from inside a worker started by ``elaswave-run``: the
    ``TCPStore`` of node 0's launcher, or the job's namespace on an etcd cluster
    (:mod:`megatron_elaswave.launch.etcd_store`) when the launcher ran with ``--store etcd://...``.

    ``timeout`` bounds both connecting and every later blocking call (``get``, ``wait``).
    """
    from torch.distributed import TCPStore

    try:
        host = os.environ[STORE_ADDR_ENV]
        if host.startswith(ETCD_URL_SCHEME):
            return EtcdStore(EtcdAddress.parse(host), timeout)
        port = int(os.environ[STORE_PORT_ENV])
    except KeyError as missing:
        raise RuntimeError(f"{missing} is not set: this process was not started by elaswave-run")
    return TCPStore(host, port, is_master=False, timeout=timeout)


_default_group_stores: list[Store] = []
"""The job stores written in Python that default groups rendezvous on: torch keeps only their
C++ half, so the Python objects must live as long as the groups."""


def default_group_store(timeout: timedelta) -> Store | None:
    """Where a worker's first default group rendezvous when the job store is on etcd (there is
    no launcher's ``TCPStore`` for ``init_method="env://"`` to connect to), or ``None``: then
    ``env://`` connects to node 0's launcher."""
    if not os.environ.get(STORE_ADDR_ENV, "").startswith(ETCD_URL_SCHEME):
        return None
    from torch.distributed import PrefixStore

    _default_group_stores.append(connect_store(timeout))
    return PrefixStore("default_pg/", _default_group_stores[-1])


def store_listener(host: str, port: int) -> socket.socket:
    """A socket listening on ``port`` (0: a free one) of every address of this machine, for a
    ``TCPStore`` whose clients reach it at ``host`` to take over (``master_listen_fd``). Raises
    ``OSError`` (``EADDRINUSE`` where another process listens there).

    IPv4 only where ``host`` is an IPv4 address. torch names each peer that a store accepts by a
    reverse lookup, in the store's event loop: ``/etc/hosts`` answers it for an IPv4 address it
    lists (the loopback, often a cluster's nodes), but a dual-stack socket reports its IPv4
    peers as IPv4-mapped IPv6 addresses, which go to the resolver, and a resolver that drops the
    query stalls every request to the store for its timeout (docs/launcher.md, "Connections
    that take 5 seconds")."""
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        version = None  # a host name: its clients may resolve it to either family
    if version == 4:
        return socket.create_server(("", port))
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port), family=socket.AF_INET6 if version == 6
                                else socket.AF_INET)


def serve_store(listener: socket.socket, host: str, timeout: timedelta) -> TCPStore:
    """A ``TCPStore`` hosted on ``listener`` (:func:`store_listener`), which it takes over; the
    listener is closed if the store cannot start (torch's ``RuntimeError``)."""
    from torch.distributed import TCPStore

    with listener:
        store = TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                         timeout=timeout, master_listen_fd=listener.fileno())
        listener.detach()  # the store owns the socket now
    return store


def generation_store_address() -> str | None:
    """This machine's address for a store that a worker hosts for one generation's bulk traffic
    (:mod:`megatron_elaswave.runtime.generation_store`) when the job store is on etcd: the one
    on the route to the cluster, which the other nodes reach too. ``None`` on node 0's
    ``TCPStore``, which serves that traffic as fast."""
    host = os.environ.get(STORE_ADDR_ENV, "")
    if not host.startswith(ETCD_URL_SCHEME):
        return None
    return address_toward(EtcdAddress.parse(host).endpoints[0][0])


def store_address() -> str:
    """Where the job store of this worker is, for messages: ``HOST:PORT`` or the etcd cluster."""
    host = os.environ.get(STORE_ADDR_ENV, "")
    if host.startswith(ETCD_URL_SCHEME):
        return EtcdAddress.parse(host).describe()
    return f"{host}:{os.environ.get(STORE_PORT_ENV, '')}"


@dataclass(frozen=True)
class NodeStates:
    """Which nodes of the job were declared lost and which are done, kept in one key
    (``elaswave/nodes/state``) so that a launcher reads them in one request."""

    lost: frozenset[int] = frozenset()
    done: frozenset[int] = frozenset()

    def running(self, nnodes: int) -> set[int]:
        return set(range(nnodes)) - self.lost - self.done


def read_node_states(store: Store) -> NodeStates:
    raw = read_if_set(store, NODES_STATE_KEY)
    if raw is None:
        return NodeStates()
    states = json.loads(raw)
    return NodeStates(frozenset(states["lost"]), frozenset(states["done"]))


def change_node_state(store: Store, node_rank: int, state: str | None) -> None:
    """Mark ``node_rank`` ``"lost"``, ``"done"``, or neither (``None``: it was replaced), then
    bump ``elaswave/nodes/changes``. Safe against launchers changing other nodes at once."""
    while True:
        current = store.compare_set(NODES_STATE_KEY, "", "")  # the value, created if missing
        states = json.loads(current) if current else {"lost": [], "done": []}
        for name in ("lost", "done"):
            members = set(states[name]) - {node_rank}
            states[name] = sorted(members | ({node_rank} if state == name else set()))
        desired = json.dumps(states, sort_keys=True)
        if store.compare_set(NODES_STATE_KEY, current, desired).decode() == desired:
            break
    store.add(NODE_CHANGES_KEY, 1)


def publish_worker(store: Store, worker: WorkerRecord) -> None:
    store.set(worker_key(worker.rank), to_json(worker))


def read_if_set(store: Store, key: str) -> bytes | None:
    """The value of ``key``, or ``None`` while it is missing. On etcd one request: a check and a
    get are two round trips to a quorum there."""
    if isinstance(store, EtcdStore):
        return store.get_if_set(key)
    return store.get(key) if store.check([key]) else None


def read_worker(store: Store, rank: int) -> WorkerRecord | None:
    """The record of ``rank``'s worker, or ``None`` while it has not been spawned."""
    raw = read_if_set(store, worker_key(rank))
    return None if raw is None else from_json(WorkerRecord, raw)


def record_exit(store: Store, worker_exit: WorkerExit) -> None:
    store.set(exit_key(worker_exit.rank), to_json(worker_exit))


def read_exit(store: Store, rank: int) -> WorkerExit | None:
    """How ``rank``'s worker finished, or ``None`` if it has not finished normally."""
    raw = read_if_set(store, exit_key(rank))
    return None if raw is None else from_json(WorkerExit, raw)


def record_death(store: Store, death: WorkerDeath) -> int:
    """Append ``death`` to the job's death list and raise an alert; returns its index."""
    index = store.add(DEATH_COUNT_KEY, 1) - 1
    store.set(death_key(index), to_json(death))
    raise_alert(store)
    return index


def raise_alert(store: Store) -> None:
    """Tell every alert listener (:mod:`megatron_elaswave.launch.alerts`) that something they must read
    was written (a death record, a failure announcement, a silence): one write, whatever the
    size of the job."""
    store.add(ALERT_COUNT_KEY, 1)


@dataclass(frozen=True)
class Silence:
    """A member of a generation whose heartbeat a neighbour found silent for its timeout."""

    generation: int
    """The generation in which it was found silent."""
    rank: int
    """Launch rank of the silent member."""
    watcher: int
    """Launch rank of the member that watched it."""
    silent_s: float
    """Seconds of silence the watcher counted (its own pauses left out)."""
    time: float
    """Unix time at which the watcher concluded it."""


def report_silence(store: Store, silence: Silence) -> None:
    """Append ``silence`` to its generation's list and raise an alert."""
    index = store.add(silence_count_key(silence.generation), 1) - 1
    store.set(silence_key(silence.generation, index), to_json(silence))
    raise_alert(store)


def read_silences(store: Store, generation: int, start: int = 0) -> list[Silence]:
    """Silences reported in ``generation`` from index ``start`` on, in order; never blocks (as
    :func:`read_deaths`)."""
    return _read_numbered(store, Silence, silence_count_key(generation),
                          lambda index: silence_key(generation, index), start)


def collect_generations(store: Store, below: int) -> int:
    """Delete the keys of every generation below ``below`` not yet collected (all but their
    decisions, :func:`megatron_elaswave.launch.keys.generation_prefixes`); returns how many keys were
    deleted. Call it once generation ``below + 1`` has started: nobody reads those keys any
    more. Safe to call from several processes at once."""
    first = store.add(COLLECTED_KEY, 0)
    if first >= below:
        return 0
    prefixes = tuple(prefix for generation in range(first, below)
                     for prefix in generation_prefixes(generation))
    kept = {decision_key(generation) for generation in range(first, below)}
    deleted = 0
    for key in store.list_keys():
        if key.startswith(prefixes) and key not in kept:
            deleted += bool(store.delete_key(key))
    store.compare_set(COLLECTED_KEY, str(first), str(below))  # another collector may be ahead
    return deleted


def read_deaths(store: Store, start: int = 0) -> list[WorkerDeath]:
    """Deaths recorded from index ``start`` on, in order. Never blocks.

    A writer numbers a death before it writes it, so the list stops at the first death that is
    numbered but not yet written; the next call, from ``start + len(result)``, picks it up.
    """
    return _read_numbered(store, WorkerDeath, DEATH_COUNT_KEY, death_key, start)


def _read_numbered(store: Store, cls: type[_Record], count_key: str,
                   key_of: Callable[[int], str], start: int) -> list[_Record]:
    """Records numbered by the counter ``count_key`` and kept at ``key_of(index)``, from index
    ``start`` on, up to the first one numbered but not yet written."""
    records = []
    for index in range(start, store.add(count_key, 0)):
        raw = read_if_set(store, key_of(index))
        if raw is None:
            break
        records.append(from_json(cls, raw))
    return records


class WaitInterrupted(RuntimeError):
    """A wait for keys that peers set was given up: a failure was detected meanwhile, or the
    keys did not all appear in time."""


def read_when_set(store: Store, keys: list[str], timeout: timedelta,
                  failure: threading.Event | None = None) -> list[bytes]:
    """The values of ``keys``, read once every one is set; raises as :func:`wait_for_keys`."""
    wait_for_keys(store, keys, timeout, failure)
    return store.multi_get(keys) if len(keys) > 1 else [store.get(keys[0])]


def wait_for_keys(store: Store, keys: list[str], timeout: timedelta,
                  failure: threading.Event | None = None) -> None:
    """Return once every key of ``keys`` exists. Raises :class:`WaitInterrupted` as soon as
    ``failure`` is set (the peer that was to set a key may be dead: the caller recovers instead
    of waiting the timeout out), or after ``timeout``."""
    if wait_until(lambda: store.check(keys), timeout.total_seconds(), abandon=failure):
        return
    if failure is not None and failure.is_set():
        raise WaitInterrupted(f"a failure was detected while waiting for {len(keys)} keys")
    missing = [key for key in keys if not store.check([key])]
    raise WaitInterrupted(f"keys not set within {timeout.total_seconds():g} s: {missing}")
