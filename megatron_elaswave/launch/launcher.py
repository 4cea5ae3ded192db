"""The ``elaswave-run`` agent: starts one node's workers, watches them, and reports every death.

One agent runs per node (``--nnodes`` of them form a job). Unlike torchrun's agent it never stops
the survivors when a worker dies: it records the death in the job store and lets the workers
decide what to do. It guarantees:

* **The store outlives every worker.** The agent of node rank 0 hosts the job's ``TCPStore``
  in its own process; the other agents and all workers are clients (:mod:`megatron_elaswave.launch.store`
  lists the keys). With ``--store etcd://...`` the store is the job's namespace on an etcd
  cluster (:mod:`megatron_elaswave.launch.etcd_store`) instead, and every agent, node 0's included, is
  a client: any node can be lost. Agents wait until all ``--nnodes`` of them have joined before
  any worker starts. An agent given no node rank (``--rdzv-backend c10d``) takes one as it
  reaches the store, the agent that hosts it being node 0 (:func:`_take_node_rank`).
* **Deaths are reported at once.** A worker that exits with a non-zero code or is killed by a
  signal is recorded as a :class:`~megatron_elaswave.launch.store.WorkerDeath` within
  :data:`POLL_INTERVAL_S`; a worker that exits with 0 is recorded as a normal exit.
* **A node fails as a whole.** Workers are started with ``PR_SET_PDEATHSIG`` (Linux), so killing
  an agent kills its workers. Every agent heartbeats through the store and watches the
  :data:`WATCHED_NODES` running nodes that follow it in node-rank order, wrapping around (so every
  node is watched by that many others and the store serves a few reads per node, whatever the
  number of nodes); the first watcher to find a node silent for ``--node-timeout`` seconds
  declares it lost and records the deaths of its workers. Silence is counted on the watcher's
  time (:mod:`megatron_elaswave.launch.silence`): a watcher's own stall is not blamed on the others. An
  agent that finds its node declared lost (it was stalled, not dead) kills its workers, so a
  node the job has given up on cannot come back into it.
* **Workers start forked from a preloaded server** (:mod:`megatron_elaswave.launch.spawn`), unless
  ``--preload none``: they are the agent's own children all the same, so everything below holds
  for them as for workers it executes.
* **Replacements join the running job.** With ``--rejoin``, a worker that dies is started again
  in its slot (same rank) after ``--rejoin-delay`` seconds, at most ``--max-rejoins`` times per
  slot and never once a worker of the node has finished or stopped the job (status 2, bad
  input, or 3, cannot continue: there is no job left to join); and an agent started for a node rank
  that node 0 declared lost takes the node's place, clears the declaration and starts its
  workers. Such workers have ``ELASWAVE_REJOIN=1`` in their environment: they ask to join
  (:mod:`megatron_elaswave.training.relayout`) instead of forming the job's first process group.
* **Excluded workers are fenced.** The agent reads the decisions the workers commit in the
  store (:mod:`megatron_elaswave.runtime.agreement`); a worker of its node that a decision excluded
  (stopped or hung, not dead) and that still runs ``--exclusion-grace`` seconds later is
  killed, so that the job can end. Its end is a survived failure.
* **Losing the store ends the job.** An agent that loses the job store (node 0's agent died, or
  the etcd cluster lost its quorum) says so in one line, gives its workers ``--shutdown-grace``
  seconds to leave (they notice on their own), kills the rest and exits with 1.
* **No orphans.** SIGINT, SIGTERM and SIGHUP are forwarded to the workers; those still running
  ``--shutdown-grace`` seconds later (10 s; for SIGTERM to workers that save a checkpoint on it,
  ``--exit-signal-handler``, their own bound on that save: ``--distributed-timeout-minutes``), or
  at a second signal, are killed with SIGKILL. Whatever goes wrong in the agent itself, it kills
  its workers before it exits.

Exit status of an agent, judged on its own node's workers:

* ``0`` when the job finished: at least one worker exited with 0, and every worker that failed
  did so before the first one exited with 0 (the failures were survived);
* otherwise the status of the first worker that failed: its exit code, or 128 + signal number;
* ``128 + signal number`` when the agent was stopped by a signal; ``1`` when its node was
  declared lost, it lost the job store, or the job could not form; ``2`` for a bad command line (including a port
  already in use, and node agents that disagree on ``--nproc-per-node`` or ``--run-id``).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

from megatron_elaswave.errors import first_line
from megatron_elaswave.launch.alerts import NODE_ALERTS_ENV, write_relayed_count
from megatron_elaswave.launch.decisions import Decision
from megatron_elaswave.launch.etcd_store import EtcdAddress, HistoryCompaction, StoreURLError
from megatron_elaswave.launch.keys import (
    ALERT_COUNT_KEY,
    NODE_ARRIVALS_KEY,
    NODE_CHANGES_KEY,
    decision_key,
    node_done_key,
    node_heartbeat_key,
    node_key,
    node_lost_key,
)
from megatron_elaswave.launch.proctitle import MEGATRON_LM_RUNNER
from megatron_elaswave.launch.silence import Heartbeat, HeartbeatSilence, ring_neighbours
from megatron_elaswave.launch.spawn import (
    DEFAULT_PRELOAD,
    ForkedWorker,
    ForkServer,
    ForkServerError,
    can_fork_workers,
    die_with_parent,
    reap_orphans,
)
from megatron_elaswave.launch.store import (
    EXITED,
    NODE_LOST,
    SIGNALED,
    STORE_ADDR_ENV,
    STORE_PORT_ENV,
    REJOIN_ENV,
    NodeRecord,
    WorkerDeath,
    WorkerExit,
    WorkerRecord,
    change_node_state,
    from_json,
    publish_worker,
    read_deaths,
    read_exit,
    read_node_states,
    read_worker,
    record_death,
    record_exit,
    to_json,
)

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore

POLL_INTERVAL_S = 0.05
"""How often the agent polls its workers: the bound on the delay before a death is recorded."""

WATCHED_NODES = 2
"""How many running nodes each agent watches the heartbeat of, and so how many watch each node."""

LOST_NODE_EXIT_STATUS = 1
"""Exit status of an agent that found its node declared lost."""

JOB_OVER_STATUSES = frozenset({0, 2, 3})
"""Worker exit statuses that end the job for every worker: training finished, bad input (the
training script's one-line error), and cannot continue (the state is lost; the survivors
stopped). ``--rejoin`` starts no worker once one has ended with any of them."""

LOST_STORE_EXIT_STATUS = 1
"""Exit status of an agent that lost the job store (node 0's agent is gone, and the job with it)."""

_JOIN_POLL_INTERVAL_S = 0.1
# Bounds every store call of an agent, so that a stalled store host cannot freeze its supervision.
_STORE_TIMEOUT = timedelta(seconds=30)
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

DEFAULT_SHUTDOWN_GRACE_S = 10.0
"""How long workers may take to exit after a forwarded signal, unless told (``--shutdown-grace``)."""


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value of ``flag`` in a worker's ``args`` (``--flag V`` or ``--flag=V``), if given."""
    for at, arg in enumerate(args):
        if arg == flag and at + 1 < len(args):
            return args[at + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None

_T = TypeVar("_T")


class LaunchError(Exception):
    """The job cannot run; the message is one line meant for the user."""

    exit_status = 1


class UsageError(LaunchError):
    """The command line asks for something impossible, or the job store's port is taken."""

    exit_status = 2


def is_megatron_lm_script(path: str) -> bool:
    """Whether ``path`` is a script at the root of a Megatron-LM checkout (beside its
    ``megatron/training`` package), like Megatron-LM's ``pretrain_gpt.py``."""
    root = os.path.dirname(os.path.abspath(path))
    return os.path.isfile(os.path.join(root, "megatron", "training", "__init__.py"))


@dataclass(frozen=True)
class LaunchConfig:
    """What ``elaswave-run`` was asked to run on this node."""

    script: str
    """Path of the training script, or a module name when ``run_as_module``."""
    script_args: tuple[str, ...] = ()
    """Arguments passed to the script, unchanged."""
    run_as_module: bool = False
    """Run ``python -m script`` instead of ``python script``."""
    nproc_per_node: int = 1
    """Workers per node; the same on every node."""
    nnodes: int = 1
    """Number of node agents that form the job."""
    node_rank: int | None = 0
    """This agent's node rank; node rank 0 hosts the job store. ``None``: the agent takes one
    as it reaches the job store (:func:`run`; ``--rdzv-backend c10d`` without a node rank)."""
    master_addr: str = "127.0.0.1"
    """Address of node rank 0, where the job store listens."""
    master_port: int = 29500
    """Port of the job store (of node 0's ``TCPStore``; with :attr:`store`, it is only handed to
    the workers as ``MASTER_PORT``)."""
    store: str | None = None
    """``etcd://HOST:PORT[,HOST:PORT...]``: keep the job store on that etcd cluster, under the
    namespace ``elaswave/<run id>/``; ``None``: node rank 0's agent hosts a ``TCPStore``."""
    store_compaction_interval_s: float = 60.0
    """With :attr:`store`: how often the lowest running node's agent compacts the etcd
    cluster's history (:class:`~megatron_elaswave.launch.etcd_store.HistoryCompaction`); 0
    leaves it to the cluster."""
    run_id: str = "none"
    """Job id; agents with different ids refuse to form a job together."""
    log_dir: str | None = None
    """Directory for ``rank<r>.log`` (stdout and stderr of each worker); ``None`` to inherit."""
    shutdown_grace_s: float | None = None
    """After a forwarded signal, how long workers may take to exit before SIGKILL; ``None``: not
    given (:meth:`grace_after`)."""
    join_timeout_s: float = 300.0
    """How long to wait for the store and for all node agents to join."""
    node_timeout_s: float = 10.0
    """Heartbeat silence after which node rank 0 declares another node lost."""
    rejoin: bool = False
    """Start a dead worker again in its slot, and let this agent take the place of a lost node
    with the same node rank (module docstring)."""
    rejoin_delay_s: float = 5.0
    """With ``rejoin``: seconds between a worker's death and its replacement's start."""
    max_rejoins: int = 3
    """With ``rejoin``: how many times one slot is started again."""
    exclusion_grace_s: float = 10.0
    """How long a worker that the job excluded (stopped or hung, not dead) has to leave by
    itself before the agent kills it."""
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    """Modules a fork server imports once, while the job forms, to fork every worker from
    (:mod:`megatron_elaswave.launch.spawn`); empty to execute each worker afresh."""
    role: str = "default"
    """The workers' ``ROLE_NAME`` (torchrun's ``--role``)."""

    def grace_after(self, signum: int | None) -> float:
        """How long the workers may take to exit after ``signum`` is forwarded (``None``: after
        the job store is lost): ``--shutdown-grace``; else, for SIGTERM to workers that save a
        checkpoint on it (``--exit-signal-handler``), the bound they put on finishing that save
        (their ``--distributed-timeout-minutes``, Megatron's default 10); else 10 s."""
        if self.shutdown_grace_s is not None:
            return self.shutdown_grace_s
        if signum == signal.SIGTERM and "--exit-signal-handler" in self.script_args:
            minutes = _flag_value(self.script_args, "--distributed-timeout-minutes")
            return 60 * float(minutes if minutes is not None else 10)
        return DEFAULT_SHUTDOWN_GRACE_S

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1, got {self.nnodes}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise UsageError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}"
            )
        if not 0 < self.master_port < 2**16:
            raise UsageError(f"--master-port must be in 1..65535, got {self.master_port}")
        if ((self.shutdown_grace_s or 0) < 0 or self.join_timeout_s <= 0
                or self.node_timeout_s <= 0):
            raise UsageError("timeouts must be positive (and --shutdown-grace not negative)")
        if self.store_compaction_interval_s < 0:
            raise UsageError("--store-compaction-interval must not be negative")
        if self.rejoin_delay_s < 0 or self.max_rejoins < 0 or self.exclusion_grace_s < 0:
            raise UsageError("--rejoin-delay, --max-rejoins and --exclusion-grace must not be "
                             "negative")
        if not self.run_as_module and not os.path.isfile(self.script):
            raise UsageError(f"no such script: {self.script}")
        if self.store is not None:
            try:
                self.etcd_address
            except StoreURLError as error:
                raise UsageError(f"--store {error}") from None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def is_store_host(self) -> bool:
        """Whether this agent hosts the job store (node 0, without :attr:`store`)."""
        return self.node_rank == 0 and self.store is None

    @property
    def etcd_address(self) -> EtcdAddress | None:
        """The job's namespace on the etcd cluster of :attr:`store`, if any."""
        return None if self.store is None else EtcdAddress.parse(self.store, self.run_id)

    def global_rank(self, local_rank: int, node_rank: int | None = None) -> int:
        node = self.node_rank if node_rank is None else node_rank
        return node * self.nproc_per_node + local_rank

    def worker_command(self) -> list[str]:
        """The command line of every worker (unbuffered, so logs keep up with a failure)."""
        return [sys.executable, "-u", *self.worker_argv()]

    def worker_argv(self) -> list[str]:
        """What follows the interpreter and its flags in :meth:`worker_command`. A script of a
        Megatron-LM checkout runs through the adaptor's runner."""
        if self.run_as_module:
            entry = ["-m", self.script]
        elif is_megatron_lm_script(self.script):
            entry = ["-m", MEGATRON_LM_RUNNER, self.script]
        else:
            entry = [self.script]
        return [*entry, *self.script_args]

    @staticmethod
    def shared_worker_env(base: Mapping[str, str]) -> dict[str, str]:
        """The part of :meth:`worker_env` that is the same for every worker of the node."""
        env = dict(base)
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def worker_env(self, local_rank: int, base: Mapping[str, str], *,
                   restart_count: int = 0, rejoining: bool = False) -> dict[str, str]:
        """``base`` plus what torchrun sets, plus where the job store is and, for a replacement
        worker, :data:`~megatron_elaswave.launch.store.REJOIN_ENV`.

        ``TORCHELASTIC_USE_AGENT_STORE=True`` makes ``init_process_group(init_method="env://")``
        connect to the agent's store as a client instead of hosting a store in rank 0. With the
        store on etcd there is no agent's store to connect to: it is ``False``, and the
        runtime forms its groups on the etcd store itself.
        """
        env = self.shared_worker_env(base)
        rank, world_size = self.global_rank(local_rank), str(self.world_size)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE=world_size,
            LOCAL_WORLD_SIZE=str(self.nproc_per_node),
            GROUP_RANK=str(self.node_rank),
            GROUP_WORLD_SIZE=str(self.nnodes),
            NODE_RANK=str(self.node_rank),
            ROLE_NAME=self.role,
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=world_size,
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
            TORCHELASTIC_RUN_ID=self.run_id,
            TORCHELASTIC_USE_AGENT_STORE=str(self.store is None),
            TORCHELASTIC_RESTART_COUNT=str(restart_count),
            TORCHELASTIC_MAX_RESTARTS=str(self.max_rejoins if self.rejoin else 0),
        )
        if self.store is None:
            env[STORE_ADDR_ENV] = self.master_addr
            env[STORE_PORT_ENV] = str(self.master_port)
        else:
            env[STORE_ADDR_ENV] = self.etcd_address.url
            env.pop(STORE_PORT_ENV, None)
        if rejoining:
            env[REJOIN_ENV] = "1"
        else:
            env.pop(REJOIN_ENV, None)
        return env


def job_exit_status(returncodes: Sequence[int]) -> int:
    """A node's exit status from its workers' return codes, in the order the workers ended.

    Return codes follow :mod:`subprocess`: ``-N`` means killed by signal ``N``. See the module
    docstring for the rule.
    """
    first_success = next((i for i, code in enumerate(returncodes) if code == 0), None)
    if first_success is not None and not any(returncodes[first_success:]):
        return 0
    first_failure = next((code for code in returncodes if code != 0), 0)
    return 128 - first_failure if first_failure < 0 else first_failure


def run(config: LaunchConfig) -> int:
    """Run this node's part of the job to its end; returns the agent's exit status."""
    if config.log_dir is not None:
        try:
            os.makedirs(config.log_dir, exist_ok=True)
        except OSError as error:
            raise UsageError(f"cannot create --log-dir {config.log_dir}: {error.strerror}")
    worker_base_env = dict(os.environ)
    # c10d logs a warning with a stack trace when a store connection drops; the agent reports
    # that itself, in one line. Takes effect where torch is imported, below.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    fork_server = _start_fork_server(config, worker_base_env)  # preloads while the job forms
    try:
        with _SignalLatch() as signals:
            try:
                if config.node_rank is None:
                    config, store = _take_node_rank(config, signals)
                else:
                    store = (_host_store(config) if config.is_store_host
                             else _connect(config, signals))
                replaces_lost_node = _join(store, config, signals)
            except _Interrupted as interrupt:
                _log(f"received {_signal_name(interrupt.signum)} before the workers started")
                return 128 + interrupt.signum
            return _NodeAgent(config, store, signals, worker_base_env, fork_server,
                              rejoining=replaces_lost_node).run()
    finally:
        if fork_server is not None:
            fork_server.close()


def _start_fork_server(config: LaunchConfig, worker_base_env: Mapping[str, str]
                       ) -> ForkServer | None:
    """The fork server that starts this node's workers, or ``None`` to execute them."""
    if not config.preload or not can_fork_workers():
        return None
    try:
        return ForkServer(config.preload, config.shared_worker_env(worker_base_env))
    except (ForkServerError, OSError) as error:
        _log(f"starting workers without preloading: {error}")
        return None


def _log(message: str) -> None:
    print(f"[elaswave-run] {message}", file=sys.stderr, flush=True)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'' if len(ranks) == 1 else 's'} {', '.join(map(str, ranks))}"


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _SignalLatch:
    """Queues the forwarded signals for the agent's loop instead of raising where they land."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _SignalLatch:
        for signum in _FORWARDED_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def raise_if_received(self) -> None:
        if self.received:
            raise _Interrupted(self.received[0])


def _wait_until(
    ready: Callable[[], bool],
    timeout_s: float,
    signals: _SignalLatch,
    waiting_for: Callable[[], str],
) -> None:
    """Poll ``ready`` until it holds; a forwarded signal or the timeout ends the wait."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        signals.raise_if_received()
        if time.monotonic() > deadline:
            raise LaunchError(f"timed out after {timeout_s:g} s waiting for {waiting_for()}")
        time.sleep(_JOIN_POLL_INTERVAL_S)


# torch is imported where a store is created, not at module level: a bad command line should
# fail in milliseconds, not after the seconds that importing torch takes.


def _host_store(config: LaunchConfig, listener: socket.socket | None = None) -> TCPStore:
    """Node 0's ``TCPStore``, on ``listener`` if given (the store takes the socket over), else on
    the master port once it is found free."""
    if listener is None:
        _check_port_free(config.master_port)
    from torch.distributed import TCPStore

    try:
        return TCPStore(
            config.master_addr,
            config.master_port,
            is_master=True,
            wait_for_workers=False,
            timeout=_STORE_TIMEOUT,
            master_listen_fd=None if listener is None else listener.detach(),
        )
    except RuntimeError as error:
        raise LaunchError(f"cannot host the job store: {first_line(error)}") from None


def _take_node_rank(config: LaunchConfig, signals: _SignalLatch) -> tuple[LaunchConfig, Store]:
    """This agent's node rank when it was given none, and the job store.

    Without :attr:`~LaunchConfig.store`, the agent on the machine of the master address that
    binds the master port first hosts the store and is node 0; the others take 1, 2, ... in the
    order they reach it. With the store on etcd, all are clients and take 0, 1, ... in that
    order. An agent that finds every node rank taken is refused in one line: a lost node is
    replaced with ``--rejoin`` and its node rank.
    """
    if config.store is None and is_this_machine(config.master_addr):
        listener = _listen(config.master_port)
        if listener is not None:
            placed = dataclasses.replace(config, node_rank=0)
            return placed, _host_store(placed, listener)
    store = _connect(config, signals)
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


def _listen(port: int) -> socket.socket | None:
    """A socket listening on ``port`` of every address of this machine, for the job store to
    take over; ``None`` if another process listens there (another agent hosts the store)."""
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", port))
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            return None
        raise UsageError(f"cannot host the job store on port {port}: {error.strerror}") from None


def _check_port_free(port: int) -> None:
    """Fail fast on a port in use, before importing torch (TCPStore still reports a race)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds
        try:
            probe.bind(("", port))
        except OSError as error:
            raise UsageError(
                f"cannot host the job store on --master-port {port}: {error.strerror}"
            ) from None


def _connect(config: LaunchConfig, signals: _SignalLatch) -> Store:
    if config.store is not None:
        return _connect_etcd(config, signals)
    from torch.distributed import TCPStore  # meanwhile node 0's launcher imports it too

    address = (config.master_addr, config.master_port)
    # Probe with a plain socket first: TCPStore's own retries log a stack trace per attempt.
    _wait_until(
        lambda: accepts_connections(address),
        config.join_timeout_s,
        signals,
        lambda: f"the job store at {address[0]}:{address[1]} (hosted by node rank 0's launcher)",
    )
    return TCPStore(*address, is_master=False, timeout=_STORE_TIMEOUT)


def _connect_etcd(config: LaunchConfig, signals: _SignalLatch) -> Store:
    """The job's namespace on the etcd cluster, once a member accepts connections."""
    try:
        from megatron_elaswave.launch.etcd_store import EtcdStore
    except ImportError as error:
        raise UsageError(f"--store etcd:// needs the etcd3gw package ({error}); install "
                         "megatron-elaswave[etcd]") from None
    address = config.etcd_address
    _wait_until(lambda: any(map(accepts_connections, address.endpoints)), config.join_timeout_s,
                signals, lambda: f"a member of the etcd cluster {address.describe()}")
    return EtcdStore(address, _STORE_TIMEOUT)


def accepts_connections(address: tuple[str, int]) -> bool:
    """Whether a TCP server (the job store) listens at ``address``."""
    try:
        socket.create_connection(address, timeout=1.0).close()
    except OSError:
        return False
    return True


def _join(store: Store, config: LaunchConfig, signals: _SignalLatch) -> bool:
    """Register this node agent and wait until all ``nnodes`` have, with matching settings.

    Returns whether this agent took the place of a node that was declared lost (``--rejoin``).
    """
    mine = to_json(
        NodeRecord(
            node_rank=config.node_rank,
            host=socket.gethostname(),
            pid=os.getpid(),
            nproc_per_node=config.nproc_per_node,
            run_id=config.run_id,
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

    _wait_until(lambda: store.check(keys), config.join_timeout_s, signals, missing)
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


def _replace_lost_node(store: Store, config: LaunchConfig, signals: _SignalLatch,
                       previous: NodeRecord, mine: str) -> None:
    """Take the place of ``previous``, the agent that held this node rank, once node 0 has
    declared it lost; without ``--rejoin`` a node rank that is taken is an error."""
    where = f"launcher pid {previous.pid} on {previous.host}"
    if not config.rejoin:
        stale = (f"; the etcd store keeps the keys of a job with the same --run-id that did not "
                 f"end cleanly: use another --run-id" if config.store is not None else "")
        raise UsageError(f"node rank {config.node_rank} has already joined this job ({where}); "
                         f"to replace a lost node, start its launcher with --rejoin{stale}")
    if config.is_store_host:
        raise UsageError("node rank 0 hosts the job store: it cannot be replaced (it can with "
                         "the store on etcd, --store)")
    lost = node_lost_key(config.node_rank)
    if not store.check([lost]):
        _log(f"node rank {config.node_rank} is held by {where}: waiting until the nodes that "
             "watch it declare it lost")
    _wait_until(lambda: store.check([lost]), config.join_timeout_s, signals,
                lambda: f"node rank {config.node_rank} ({where}) to be declared lost")
    store.set(node_key(config.node_rank), mine)
    store.delete_key(lost)
    change_node_state(store, config.node_rank, None)  # its watchers watch it again
    _log(f"replacing lost node rank {config.node_rank}: its workers join the running job")


class _NodeAgent:
    """Runs one node's part of the job once it has formed: one supervision loop drives the
    node's workers (:class:`_WorkerPool`), the watch over other nodes (:class:`_PeerWatch`),
    the fence of excluded workers (:class:`_ExclusionFence`) and the alert relay
    (:class:`_AlertRelay`), and ends the node's part when they are done, a signal arrives, the
    node was declared lost or the job store is gone."""

    def __init__(
        self,
        config: LaunchConfig,
        store: Store,
        signals: _SignalLatch,
        worker_base_env: Mapping[str, str],
        fork_server: ForkServer | None,
        *,
        rejoining: bool = False,
    ) -> None:
        self._config = config
        self._store = _GuardedStore(store)
        self._signals = signals
        self._peers = _PeerWatch(config, self._store)
        self._alerts = _AlertRelay(self._store)
        self._workers = _WorkerPool(config, self._store, worker_base_env, fork_server,
                                    self._alerts.path, rejoining=rejoining)
        self._fence = _ExclusionFence(config, self._store, self._workers)
        self._next_heartbeat = 0.0
        self._compaction = (HistoryCompaction(config.store_compaction_interval_s, _log)
                            if config.store is not None and config.store_compaction_interval_s
                            else None)

    def run(self) -> int:
        try:
            self._alerts.relay()
            self._fence.skip_past_decisions()
            self._workers.schedule_first_starts()
            status = self._supervise()
        finally:
            self._workers.kill_all()
            self._alerts.close()
        node_rank = self._config.node_rank
        self._store.call(lambda store: store.set(node_done_key(node_rank), str(status)))
        self._store.call(lambda store: change_node_state(store, node_rank, "done"))
        if self._config.store is not None:
            self._store.call(self._delete_the_job_if_over)
        returncodes = self._workers.returncodes
        failed = sum(1 for code in returncodes if code != 0)
        if status or failed:
            _log(
                f"{returncodes.count(0)} of {_plural(self._config.nproc_per_node, 'worker')} "
                f"finished, {failed} failed; exit status {status}"
            )
        return status

    def _supervise(self) -> int:
        """Run until every local worker has ended and every other node has finished or been
        lost (node 0 must keep the store up until then); returns the exit status."""
        while not self._workers.idle or self._keeps_the_store_for_others():
            self._workers.reap()
            self._alerts.relay()
            # A fork can take a second on a loaded machine: beat between them, or node 0 may
            # declare a node lost while it starts its workers.
            self._workers.start_due(before_starts=self._fence.read_decisions,
                                    after_each_start=self._peers.beat)
            if self._signals.received:
                return self._shut_down(self._signals.received[0])
            if time.monotonic() >= self._next_heartbeat:
                self._next_heartbeat = time.monotonic() + self._peers.interval_s
                if (declared := self._peers.heartbeat_finds_node_lost()) is not None:
                    _log(f"this node was declared lost by node rank {declared}; killing its "
                         "workers")
                    return LOST_NODE_EXIT_STATUS
                self._store.call(self._peers.watch)
                self._store.call(self._compact_history)
                self._fence.kill_excluded()
                if self._store.lost is not None:
                    return self._stop_without_store()
            time.sleep(POLL_INTERVAL_S)
        if not self._config.is_store_host:
            # Workers that lost the store may all have left before a heartbeat found it gone:
            # one more look, so that this agent says so too. Node 0 keeps the store up until
            # this node is done, so a job that ended well still finds it.
            self._store.call(lambda store: store.check([node_lost_key(self._config.node_rank)]))
            if self._store.lost is not None:
                return self._stop_without_store()
        return job_exit_status(self._workers.returncodes)

    def _compact_history(self, store: Store) -> None:
        """On etcd, the lowest running node's agent keeps the cluster's history bounded; when
        it is lost or done, the next one does."""
        me = self._config.node_rank
        if self._compaction is not None and me == min(self._peers.running_nodes | {me}):
            self._compaction.tick(store, time.monotonic())

    def _shut_down(self, signum: int) -> int:
        """Forward ``signum``, give the workers the grace period, then SIGKILL the rest."""
        grace_s = self._config.grace_after(signum)
        saving = (self._config.shutdown_grace_s is None and signum == signal.SIGTERM
                  and "--exit-signal-handler" in self._config.script_args)
        _log(
            f"received {_signal_name(signum)}; forwarding it to "
            f"{_plural(len(self._workers.running), 'worker')}, SIGKILL after {grace_s:g} s"
            + (" (they save a checkpoint on it: --exit-signal-handler; the bound is their "
               "--distributed-timeout-minutes)" if saving else "")
        )
        self._workers.signal(signum)
        self._workers.wait_then_kill(grace_s, self._signals)
        return 128 + signum

    def _stop_without_store(self) -> int:
        """The store host is gone, and the job with it: the workers, which lose it too, get the
        shutdown grace to say so and leave; then the rest are killed."""
        config = self._config
        where = (f"{config.master_addr}:{config.master_port} (node 0's agent; {self._store.lost})"
                 if config.store is None
                 else f"{config.etcd_address.describe()} ({self._store.lost})")
        _log(f"lost the job store at {where}: the job cannot go on; stopping this node's workers")
        self._workers.cancel_starts()
        self._workers.wait_then_kill(config.grace_after(None), self._signals)
        return LOST_STORE_EXIT_STATUS

    def _delete_the_job_if_over(self, store: Store) -> None:
        """On etcd, the last agent to end deletes the job's keys, once every node is done. (Not
        when a node was declared lost: its agent, if it was only stopped, must find its fence
        when it wakes.)"""
        if store.check([node_done_key(n) for n in range(self._config.nnodes)]):
            for key in store.list_keys():
                store.delete_key(key)

    def _keeps_the_store_for_others(self) -> bool:
        """Whether this agent hosts the job store and another node still runs: it must keep the
        store up until that node is done."""
        if not self._config.is_store_host or self._store.lost is not None:
            return False
        return bool(self._peers.running_nodes - {self._config.node_rank})


@dataclass
class _Worker:
    record: WorkerRecord
    process: subprocess.Popen | ForkedWorker
    member: bool
    """Whether the job counts it among its members: a first worker of a node that formed the
    job; a replacement once a decision takes it in (:class:`_ExclusionFence` marks it then)."""


class _WorkerPool:
    """One node's workers: starts them, reaps them, starts dead ones again (``--rejoin``) and
    stops them.

    Guarantees: every start is published in the job store, and every end recorded there (a
    death or a normal exit) when :meth:`reap` finds it; no slot is started again once a worker
    of the node has ended the job (:data:`JOB_OVER_STATUSES`); a fork server that fails leaves
    the workers to be executed instead.
    """

    def __init__(
        self,
        config: LaunchConfig,
        store: _GuardedStore,
        worker_base_env: Mapping[str, str],
        fork_server: ForkServer | None,
        relayed_alerts: str,
        *,
        rejoining: bool,
    ) -> None:
        self._config = config
        self._store = store
        self._worker_base_env = worker_base_env
        self._fork_server = fork_server
        """Forks the workers once its preload is done; ``None`` to execute them."""
        self._relayed_alerts = relayed_alerts
        """The file the workers read the job's alert count in (:class:`_AlertRelay`)."""
        self._rejoining = rejoining
        """The node replaces a lost one: its first workers join a running job too."""
        self._running: dict[int, _Worker] = {}
        self._returncodes: list[int] = []
        self._due_starts: dict[int, float] = {}
        """``{local rank: monotonic time}`` of the starts due: the first ones, and the
        replacements (``--rejoin``)."""
        self._starts: dict[int, int] = {}
        """How many times each local rank was started."""
        self._fenced: set[int] = set()
        """Pids of the workers killed because the job had excluded them."""

    @property
    def running(self) -> Mapping[int, _Worker]:
        """``{rank: worker}`` of the workers that run."""
        return self._running

    @property
    def returncodes(self) -> list[int]:
        """The return codes of the workers that ended, in the order they ended, but for those
        killed because the job had excluded them: the job went on without them."""
        return self._returncodes

    @property
    def idle(self) -> bool:
        """Whether no worker runs and no start is due."""
        return not self._running and not self._due_starts

    def schedule_first_starts(self) -> None:
        """Make every local rank due now; :meth:`start_due` starts them."""
        now = time.monotonic()
        self._due_starts = {local_rank: now for local_rank in range(self._config.nproc_per_node)}

    def start_due(self, before_starts: Callable[[], None],
                  after_each_start: Callable[[], None]) -> None:
        """Start the workers that are due, once the fork server (if any) has preloaded;
        ``before_starts`` runs first, ``after_each_start`` after each one is started and
        published."""
        now = time.monotonic()
        due = [local_rank for local_rank, when in self._due_starts.items() if now >= when]
        if not due or not self._can_start():
            return
        before_starts()
        for local_rank in due:
            del self._due_starts[local_rank]
            self._start(local_rank)
            after_each_start()
            if self._starts[local_rank] > 1:
                rank = self._config.global_rank(local_rank)
                _log(f"started worker rank {rank} (pid {self._running[rank].record.pid}) "
                     "again; it joins the job at the next step boundary")

    def cancel_starts(self) -> None:
        """Start no more workers: the job is over."""
        self._due_starts.clear()

    def reap(self) -> None:
        """Record the end of each worker that ended and schedule its start again (``--rejoin``);
        execute the workers from now on if the fork server died; reap the workers' orphans."""
        for rank, worker in list(self._running.items()):
            returncode = worker.process.poll()
            if returncode is not None:
                del self._running[rank]
                if worker.record.pid not in self._fenced:  # the job went on without it
                    self._returncodes.append(returncode)
                self._report_end(worker.record, returncode)
                if returncode in JOB_OVER_STATUSES:
                    self._due_starts.clear()  # the job is ending: nothing left to join
                else:
                    self._schedule_restart(worker.record)
        if self._fork_server is not None and self._fork_server.process.poll() is not None:
            try:  # the reason it gave, if it failed to preload
                self._fork_server.ready()
                error = ForkServerError(
                    f"the fork server exited with {self._fork_server.process.returncode}")
            except ForkServerError as failure:
                error = failure
            self._stop_forking(error)
        # As a subreaper the agent adopts its workers' orphans: they end here.
        known = {worker.process.pid for worker in self._running.values()}
        if self._fork_server is not None:
            known.add(self._fork_server.process.pid)
        reap_orphans(known)

    def fence(self, worker: _Worker) -> None:
        """SIGKILL ``worker``, which the job excluded; its end does not count in
        :attr:`returncodes`."""
        self._fenced.add(worker.record.pid)
        worker.process.kill()

    def signal(self, signum: int) -> None:
        for worker in self._running.values():
            worker.process.send_signal(signum)

    def wait_then_kill(self, grace_s: float, signals: _SignalLatch) -> None:
        """Give the workers ``grace_s`` seconds (or until a second signal) to end, then
        SIGKILL those still running."""
        deadline = time.monotonic() + grace_s
        while self._running and time.monotonic() < deadline:
            if len(signals.received) > 1:
                break  # a second signal: stop waiting
            time.sleep(POLL_INTERVAL_S)
            self.reap()
        if self._running:
            _log(f"killing the workers still running: {_ranks(list(self._running))}")
            self.signal(signal.SIGKILL)
            for worker in self._running.values():
                worker.process.wait()
            self.reap()

    def kill_all(self) -> None:
        """SIGKILL whatever still runs, without reporting: the agent is leaving."""
        self.signal(signal.SIGKILL)
        for worker in self._running.values():
            worker.process.wait()
        self._running.clear()

    def _start(self, local_rank: int) -> None:
        worker = self._spawn(local_rank)
        self._running[worker.record.rank] = worker
        self._store.call(lambda store: publish_worker(store, worker.record))

    def _spawn(self, local_rank: int) -> _Worker:
        config = self._config
        rank = config.global_rank(local_rank)
        restart_count = self._starts.get(local_rank, 0)
        self._starts[local_rank] = restart_count + 1
        rejoins = self._rejoining or restart_count > 0
        env = config.worker_env(local_rank, self._worker_base_env, restart_count=restart_count,
                                rejoining=rejoins)
        env[NODE_ALERTS_ENV] = self._relayed_alerts
        log_path = self._log_path(rank)
        append = restart_count > 0
        process: subprocess.Popen | ForkedWorker | None = None
        if self._fork_server is not None:
            try:
                process = self._fork_server.spawn(config.worker_argv(), env, log_path, append)
            except ForkServerError as error:
                self._stop_forking(error)
        if process is None:
            process = self._execute(env, log_path, append)
        record = WorkerRecord(
            rank=rank,
            local_rank=local_rank,
            node_rank=config.node_rank,
            pid=process.pid,
            host=socket.gethostname(),
        )
        return _Worker(record, process, member=not rejoins)

    def _execute(self, env: Mapping[str, str], log_path: str | None,
                 append: bool) -> subprocess.Popen:
        log = None if log_path is None else open(log_path, "ab" if append else "wb")
        try:
            return subprocess.Popen(
                self._config.worker_command(),
                env=env,
                stdout=log,
                stderr=None if log is None else subprocess.STDOUT,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
            )
        finally:
            if log is not None:
                log.close()  # the worker has its own descriptor

    def _log_path(self, rank: int) -> str | None:
        if self._config.log_dir is None:
            return None
        return os.path.join(self._config.log_dir, f"rank{rank}.log")

    def _can_start(self) -> bool:
        """Whether workers can start now: the fork server (if any) has preloaded."""
        if self._fork_server is None:
            return True
        try:
            return self._fork_server.ready()
        except ForkServerError as error:
            self._stop_forking(error)
            return True

    def _stop_forking(self, error: ForkServerError) -> None:
        _log(f"starting workers without preloading: {error}")
        assert self._fork_server is not None
        self._fork_server.close()
        self._fork_server = None

    def _schedule_restart(self, worker: WorkerRecord) -> None:
        config = self._config
        if not config.rejoin or JOB_OVER_STATUSES.intersection(self._returncodes):
            return
        restarts = self._starts[worker.local_rank] - 1
        if restarts >= config.max_rejoins:
            _log(f"worker rank {worker.rank} was started again {_plural(restarts, 'time')} "
                 f"already (--max-rejoins {config.max_rejoins}); not restarting it")
            return
        self._due_starts[worker.local_rank] = time.monotonic() + config.rejoin_delay_s
        _log(f"restarting worker rank {worker.rank} in {config.rejoin_delay_s:g} s to rejoin "
             "the job")

    def _report_end(self, worker: WorkerRecord, returncode: int) -> None:
        now = time.time()
        if returncode == 0:
            ended = WorkerExit(
                rank=worker.rank,
                local_rank=worker.local_rank,
                node_rank=worker.node_rank,
                pid=worker.pid,
                time=now,
            )
            self._store.call(lambda store: record_exit(store, ended))
            return
        signal_name = _signal_name(-returncode) if returncode < 0 else None
        death = WorkerDeath(
            rank=worker.rank,
            local_rank=worker.local_rank,
            node_rank=worker.node_rank,
            pid=worker.pid,
            exit_code=None if signal_name else returncode,
            signal=signal_name,
            cause=SIGNALED if signal_name else EXITED,
            time=now,
        )
        self._store.call(lambda store: record_death(store, death))
        how = f"killed by {signal_name}" if signal_name else f"exited with code {returncode}"
        still = _plural(len(self._running), "worker")
        _log(f"worker rank {worker.rank} (pid {worker.pid}) {how}; {still} still running")


class _PeerWatch:
    """This node's heartbeat, and the watch over the :data:`WATCHED_NODES` running nodes that
    follow it in node-rank order.

    Guarantees: a watched node whose heartbeat is silent for ``--node-timeout`` seconds of this
    agent's attentive time (:class:`~megatron_elaswave.launch.silence.HeartbeatSilence`) is
    declared lost once, by the first of its watchers to find it, which then records the deaths
    of its workers that had not already ended.
    """

    def __init__(self, config: LaunchConfig, store: _GuardedStore) -> None:
        self._config = config
        self._store = store
        self._heartbeat = Heartbeat(node_heartbeat_key(config.node_rank))
        self.interval_s = min(1.0, config.node_timeout_s / 4)
        """How often the agent beats and reads the heartbeats of the nodes it watches."""
        self._peers = HeartbeatSilence((), interval_s=self.interval_s,
                                       timeout_s=config.node_timeout_s, now=time.monotonic())
        """The nodes this agent watches, and how long each agent's heartbeat is silent."""
        self._running_nodes: set[int] = set(range(config.nnodes))
        self._lost_nodes: set[int] = set()
        """Nodes known to be declared lost: one that runs again was replaced."""
        self._node_changes_seen = -1
        """The count of node changes when :attr:`running_nodes` was read."""

    @property
    def running_nodes(self) -> Set[int]:
        """The nodes neither lost nor done, as of the last change of the nodes."""
        return self._running_nodes

    def beat(self) -> None:
        """Beat this node's heartbeat, which the agents of the nodes before it watch."""
        self._store.call(self._heartbeat.beat)

    def heartbeat_finds_node_lost(self) -> int | None:
        """Beat this node's heartbeat; return the node rank of the agent that declared this node
        lost, if one did."""
        self.beat()
        lost = node_lost_key(self._config.node_rank)
        raw = self._store.call(lambda store: store.get(lost) if store.check([lost]) else None)
        return None if raw is None else json.loads(raw).get("by", 0)

    def watch(self, store: Store) -> None:
        """Follow the changes of the nodes, and declare lost a watched node that fell silent."""
        self._read_running_nodes(store)
        # add, not multi_get, which would wait for the counter of a node that never beat
        heartbeats = {n: store.add(node_heartbeat_key(n), 0) for n in self._peers.peers}
        for node_rank, silence_s in self._peers.read(heartbeats, time.monotonic()).items():
            self._peers.forget(node_rank)
            self._declare_lost(store, node_rank, silence_s)

    def _read_running_nodes(self, store: Store) -> None:
        """Re-read which nodes run (neither lost nor done), when a node changed since the last
        read; watch the :data:`WATCHED_NODES` that follow this one from then on."""
        changes = store.add(NODE_CHANGES_KEY, 0)
        if changes == self._node_changes_seen:
            return
        self._node_changes_seen = changes
        states = read_node_states(store)
        lost, self._running_nodes = states.lost, states.running(self._config.nnodes)
        me = self._config.node_rank
        watched = set(ring_neighbours(sorted(self._running_nodes | {me}), me, WATCHED_NODES))
        for node_rank in set(self._peers.peers) - watched:
            self._peers.forget(node_rank)
        for node_rank in sorted(watched - set(self._peers.peers)):
            self._peers.add(node_rank)
            if node_rank in self._lost_nodes:
                _log(f"node {node_rank} rejoined the job")
        self._lost_nodes = (self._lost_nodes | lost) - self._running_nodes

    def _declare_lost(self, store: Store, node_rank: int, silence_s: float) -> None:
        """Fence the node first (if it comes back, its agent kills its workers), then record
        the deaths of its workers that have not already ended. Only the first agent to declare
        it does so: another watcher may have found it silent too."""
        now = time.time()
        mine = json.dumps({"time": now, "silence_s": silence_s, "by": self._config.node_rank})
        if store.compare_set(node_lost_key(node_rank), "", mine).decode() != mine:
            return
        change_node_state(store, node_rank, "lost")
        already_dead = {(death.rank, death.pid) for death in read_deaths(store)}
        recorded = []
        for local_rank in range(self._config.nproc_per_node):
            rank = self._config.global_rank(local_rank, node_rank)
            worker = read_worker(store, rank)
            pid = None if worker is None else worker.pid
            if (rank, pid) in already_dead or read_exit(store, rank) is not None:
                continue
            death = WorkerDeath(
                rank=rank,
                local_rank=local_rank,
                node_rank=node_rank,
                pid=pid,
                exit_code=None,
                signal=None,
                cause=NODE_LOST,
                time=now,
            )
            record_death(store, death)
            recorded.append(rank)
        deaths = f"recorded deaths for {_ranks(recorded)}" if recorded else "no worker left"
        _log(f"node {node_rank} lost: no heartbeat for {silence_s:.1f} s; {deaths}")


class _ExclusionFence:
    """Kills this node's workers that the job excluded (stopped or hung, not dead) and that
    still run ``--exclusion-grace`` seconds after the agent read the decision: such a process
    never leaves by itself, and the job (and its agent) could not end while it runs.

    Guarantees: only a member of the job (:attr:`_Worker.member`) is fenced, and only the very
    process the decision excluded; a worker that left by itself in the meantime is not waited
    for, and no replacement started in its slot is touched.
    """

    def __init__(self, config: LaunchConfig, store: _GuardedStore, workers: _WorkerPool) -> None:
        self._grace_s = config.exclusion_grace_s
        self._store = store
        self._workers = workers
        self._excluded: dict[int, tuple[int, float]] = {}
        """``{rank: (pid, monotonic time)}``: members a decision excluded while they ran."""
        self._next_generation = 0
        """The generation whose ending decision the agent reads next."""

    def skip_past_decisions(self) -> None:
        """Start reading decisions after those committed before this node's workers exist
        (an agent that replaces a lost node arrives in a running job)."""
        while self._store.call(self._read_decision) is not None:
            self._next_generation += 1

    def read_decisions(self) -> None:
        """Apply the decisions committed since the last read to the workers that run now. Call
        it before a replacement starts: a decision about the worker it replaces (one that
        joined it, one that excluded it) must not be taken for one about the replacement."""
        running = self._workers.running
        while (decision := self._store.call(self._read_decision)) is not None:
            self._next_generation += 1
            for rank in decision.failed:
                worker = running.get(rank)
                if worker is not None and worker.member:
                    self._excluded[rank] = (worker.record.pid, time.monotonic())
            for rank in decision.joined:
                if (worker := running.get(rank)) is not None:
                    worker.member = True

    def kill_excluded(self) -> None:
        """Read the decisions committed since the last call, and kill the workers they excluded
        whose grace is over."""
        self.read_decisions()
        running = self._workers.running
        for rank, (pid, since) in list(self._excluded.items()):
            worker = running.get(rank)
            if worker is None or worker.record.pid != pid:
                del self._excluded[rank]  # it left by itself
            elif time.monotonic() - since >= self._grace_s:
                del self._excluded[rank]
                _log(f"worker rank {rank} (pid {pid}) was excluded by the job; killing it")
                self._workers.fence(worker)

    def _read_decision(self, store: Store) -> Decision | None:
        """The decision that ended generation :attr:`_next_generation`, if committed."""
        key = decision_key(self._next_generation)
        return Decision.from_json(store.get(key)) if store.check([key]) else None


class _AlertRelay:
    """Hands the job's alert count to this node's workers in a file, which their alert
    listeners read instead of the store (:mod:`megatron_elaswave.launch.alerts`): one read per
    node and poll, not per worker."""

    def __init__(self, store: _GuardedStore) -> None:
        self._store = store
        self._dir = tempfile.mkdtemp(prefix="elaswave-node-")
        self.path = os.path.join(self._dir, "alerts")
        """The file the workers read the count in (:data:`NODE_ALERTS_ENV`)."""
        self._seen = -1

    def relay(self) -> None:
        """Read the job's alert count, and write it to :attr:`path` if it moved."""
        count = self._store.call(lambda store: store.add(ALERT_COUNT_KEY, 0))
        if count is not None and count != self._seen:
            write_relayed_count(self.path, count)
            self._seen = count

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


class _GuardedStore:
    """The agent's calls to the job store. A call that fails marks the store lost (its host
    died, or the etcd cluster lost its quorum) instead of raising; every later call is skipped,
    and the supervision loop acts on :attr:`lost`."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.lost: str | None = None
        """Why the job store was lost, once it was."""

    def call(self, call: Callable[[Store], _T]) -> _T | None:
        """Run a store call; ``None`` once the store is gone."""
        if self.lost is not None:
            return None
        try:
            return call(self._store)
        except RuntimeError as error:  # torch.distributed.DistError
            self.lost = first_line(error)
            return None
