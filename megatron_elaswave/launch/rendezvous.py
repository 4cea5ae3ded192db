"""How node launchers form a job: the job store hosted or reached, node ranks taken, every
launcher joined with matching settings, and a lost node's place taken by its replacement."""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from megatron_elaswave.errors import first_line
from megatron_elaswave.launch.config import LaunchConfig, LaunchError, UsageError
from megatron_elaswave.launch.console import log
from megatron_elaswave.launch.keys import NODE_ARRIVALS_KEY, node_key, node_lost_key
from megatron_elaswave.launch.signals import SignalLatch
from megatron_elaswave.launch.store import (
    NodeRecord,
    change_node_state,
    from_json,
    serve_store,
    store_listener,
    to_json,
)
from megatron_elaswave.waiting import wait_until

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore


# torch is imported where a store is created, not at module level: a bad command line should
# fail in milliseconds, not after the seconds that importing torch takes.

_JOIN_POLL_INTERVAL_S = 0.1
"""The longest pause between two looks for the other launchers or the store: they start in
seconds."""


# Bounds every store call of an agent, so that a stalled store host cannot freeze its supervision.
STORE_TIMEOUT = timedelta(seconds=30)


def wait_for(
    ready: Callable[[], bool],
    timeout_s: float,
    signals: SignalLatch,
    waiting_for: Callable[[], str],
) -> None:
    """Poll ``ready`` until it holds; a forwarded signal (raised) or the timeout
    (:class:`LaunchError`) ends the wait."""
    if not wait_until(ready, timeout_s, check=signals.raise_if_received,
                      max_pause_s=_JOIN_POLL_INTERVAL_S):
        raise LaunchError(f"timed out after {timeout_s:g} s waiting for {waiting_for()}")


def host_store(config: LaunchConfig, listener: socket.socket | None = None) -> TCPStore:
    """Node 0's ``TCPStore``, on ``listener`` if given, else on the master port once it is found
    free (:func:`_listen`); the store takes the socket over."""
    if listener is None:
        listener = _listen(config)
        if listener is None:
            raise UsageError(f"cannot host the job store on --master-port {config.master_port}: "
                             f"{os.strerror(errno.EADDRINUSE)}")
    try:
        return serve_store(listener, config.master_addr, STORE_TIMEOUT)
    except RuntimeError as error:
        raise LaunchError(f"cannot host the job store: {first_line(error)}") from None


def take_node_rank(config: LaunchConfig, signals: SignalLatch) -> tuple[LaunchConfig, Store]:
    """This agent's node rank when it was given none, and the job store.

    Without :attr:`~LaunchConfig.store`, the agent on the machine of the master address that
    binds the master port first hosts the store and is node 0; the others take 1, 2, ... in the
    order they reach it. With the store on etcd, all are clients and take 0, 1, ... in that
    order. An agent that finds every node rank taken is refused in one line: a lost node is
    replaced with ``--rejoin`` and its node rank.
    """
    if config.store is None and is_this_machine(config.master_addr):
        listener = _listen(config)
        if listener is not None:
            placed = dataclasses.replace(config, node_rank=0)
            return placed, host_store(placed, listener)
    store = connect(config, signals)
    first = 1 if config.store is None else 0
    node_rank = first + store.add(NODE_ARRIVALS_KEY, 1) - 1
    if node_rank >= config.nnodes:
        raise UsageError(f"all {config.nnodes} node ranks of this job are taken; to replace a "
                         "lost node, start its launcher with --rejoin --node-rank R")
    return dataclasses.replace(config, node_rank=node_rank), store


def is_this_machine(host: str) -> bool:
    """Whether ``host`` names an address of this machine: one that a socket here can bind."""
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, address in addresses:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((address[0], 0, *address[2:]))
            except OSError:
                continue
        return True
    return False


def _listen(config: LaunchConfig) -> socket.socket | None:
    """A socket listening on the master port, for the job store to take over (found before
    torch is imported: a port in use fails in milliseconds); ``None`` if another process
    listens there (another agent hosts the store)."""
    try:
        return store_listener(config.master_addr, config.master_port)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            return None
        raise UsageError(f"cannot host the job store on --master-port {config.master_port}: "
                         f"{error.strerror}") from None


def connect(config: LaunchConfig, signals: SignalLatch) -> Store:
    if config.store is not None:
        return _connect_etcd(config, signals)
    from torch.distributed import TCPStore  # meanwhile node 0's launcher imports it too

    address = (config.master_addr, config.master_port)
    # Probe with a plain socket first: TCPStore's own retries log a stack trace per attempt.
    wait_for(
        lambda: accepts_connections(address),
        config.join_timeout_s,
        signals,
        lambda: f"the job store at {address[0]}:{address[1]} (hosted by node rank 0's launcher)",
    )
    return TCPStore(*address, is_master=False, timeout=STORE_TIMEOUT)


def _connect_etcd(config: LaunchConfig, signals: SignalLatch) -> Store:
    """The job's namespace on the etcd cluster, once a member accepts connections."""
    try:
        from megatron_elaswave.launch.etcd_store import EtcdStore
    except ImportError as error:
        raise UsageError(f"--store etcd:// needs the etcd3gw package ({error}); install "
                         "megatron-elaswave[etcd]") from None
    address = config.etcd_address
    wait_for(lambda: any(map(accepts_connections, address.endpoints)), config.join_timeout_s,
                signals, lambda: f"a member of the etcd cluster {address.describe()}")
    return EtcdStore(address, STORE_TIMEOUT)


def accepts_connections(address: tuple[str, int]) -> bool:
    """Whether a TCP server (the job store) listens at ``address``."""
    try:
        socket.create_connection(address, timeout=1.0).close()
    except OSError:
        return False
    return True


def join(store: Store, config: LaunchConfig, signals: SignalLatch, liveness: str) -> bool:
    """Register this node agent, reachable by its watchers at ``liveness`` (``HOST:PORT``), and
    wait until all ``nnodes`` have, with matching settings.

    Returns whether this agent took the place of a node that was declared lost (``--rejoin``).
    """
    mine = to_json(
        NodeRecord(
            node_rank=config.node_rank,
            host=socket.gethostname(),
            pid=os.getpid(),
            nproc_per_node=config.nproc_per_node,
            run_id=config.run_id,
            liveness=liveness,
        )
    )
    holder = store.compare_set(node_key(config.node_rank), "", mine).decode()
    replaces_lost_node = holder != mine
    if replaces_lost_node:
        _replace_lost_node(store, config, signals, from_json(NodeRecord, holder), mine)
    keys = [node_key(node_rank) for node_rank in range(config.nnodes)]

    def missing() -> str:
        absent = [str(n) for n, key in enumerate(keys) if not store.check([key])]
        return f"the launchers of node ranks {', '.join(absent)} to join"

    wait_for(lambda: store.check(keys), config.join_timeout_s, signals, missing)
    for raw in store.multi_get(keys):
        node = from_json(NodeRecord, raw)
        if node.run_id != config.run_id:
            raise UsageError(
                f"node rank {node.node_rank} runs job {node.run_id!r}, not {config.run_id!r}"
            )
        if node.nproc_per_node != config.nproc_per_node:
            raise UsageError(
                f"node rank {node.node_rank} starts {node.nproc_per_node} workers, this node "
                f"{config.nproc_per_node}: --nproc-per-node must be the same on every node"
            )
    return replaces_lost_node


def _replace_lost_node(store: Store, config: LaunchConfig, signals: SignalLatch,
                       previous: NodeRecord, mine: str) -> None:
    """Take the place of ``previous``, the agent that held this node rank, once node 0 has
    declared it lost; without ``--rejoin`` a node rank that is taken is an error."""
    where = f"launcher pid {previous.pid} on {previous.host}"
    if not config.rejoin:
        stale = ("; the etcd store keeps the keys of a job with the same --run-id that did not "
                 "end cleanly: use another --run-id" if config.store is not None else "")
        raise UsageError(f"node rank {config.node_rank} has already joined this job ({where}); "
                         f"to replace a lost node, start its launcher with --rejoin{stale}")
    if config.is_store_host:
        raise UsageError("node rank 0 hosts the job store: it cannot be replaced (it can with "
                         "the store on etcd, --store)")
    lost = node_lost_key(config.node_rank)
    if not store.check([lost]):
        log(f"node rank {config.node_rank} is held by {where}: waiting until the nodes that "
             "watch it declare it lost")
    wait_for(lambda: store.check([lost]), config.join_timeout_s, signals,
                lambda: f"node rank {config.node_rank} ({where}) to be declared lost")
    store.set(node_key(config.node_rank), mine)
    store.delete_key(lost)
    change_node_state(store, config.node_rank, None)  # its watchers watch it again
    log(f"replacing lost node rank {config.node_rank}: its workers join the running job")
