"""The ``elaswave-run`` agent: starts one node's workers, watches them, and reports every death.

One agent runs per node (``--nnodes`` of them form a job). This module holds its loop
(:class:`_NodeAgent`); its parts stand in modules of their own: what it was asked to run
(:mod:`~megatron_elaswave.launch.config`), how the nodes form a job
(:mod:`~megatron_elaswave.launch.rendezvous`), the node's workers
(:mod:`~megatron_elaswave.launch.workers`), the watch over other nodes
(:mod:`~megatron_elaswave.launch.node_watch`), the fence of excluded workers
(:mod:`~megatron_elaswave.launch.fence`) and the alert relay
(:mod:`~megatron_elaswave.launch.alerts`). Unlike torchrun's agent it never stops
the survivors when a worker dies: it records the death in the job store and lets the workers
decide what to do. It guarantees:

* **The store outlives every worker.** The agent of node rank 0 hosts the job's ``TCPStore``
  in its own process; the other agents and all workers are clients (:mod:`megatron_elaswave.launch.store`
  lists the keys). With ``--store etcd://...`` the store is the job's namespace on an etcd
  cluster (:mod:`megatron_elaswave.launch.etcd_store`) instead, and every agent, node 0's included, is
  a client: any node can be lost. Agents wait until all ``--nnodes`` of them have joined before
  any worker starts. An agent given no node rank (``--rdzv-backend c10d``) takes one as it
  reaches the store, the agent that hosts it being node 0 (:func:`~megatron_elaswave.launch.rendezvous.take_node_rank`).
* **Deaths are reported at once.** A worker that exits with a non-zero code or is killed by a
  signal is recorded as a :class:`~megatron_elaswave.launch.store.WorkerDeath` as soon as it
  ends (its pidfd wakes the agent, on Linux), elsewhere within
  :data:`~megatron_elaswave.launch.workers.POLL_INTERVAL_S`; a worker that exits with 0 is
  recorded as a normal exit.
* **A node fails as a whole.** Workers are started with ``PR_SET_PDEATHSIG`` (Linux), so killing
  an agent kills its workers. Every agent heartbeats through the store and watches the
  :data:`~megatron_elaswave.launch.node_watch.WATCHED_NODES` running nodes that follow it in node-rank order, wrapping around (so every
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
  (:mod:`megatron_elaswave.training.recovery.relayout`) instead of forming the job's first process group.
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

import signal
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from megatron_elaswave.launch.alerts import AlertRelay
from megatron_elaswave.launch.config import LaunchConfig
from megatron_elaswave.launch.console import log, plural, signal_name
from megatron_elaswave.launch.etcd_store import HistoryCompaction
from megatron_elaswave.launch.fence import ExclusionFence
from megatron_elaswave.launch.guarded_store import GuardedStore
from megatron_elaswave.launch.keys import node_done_key, node_lost_key
from megatron_elaswave.launch.liveness import LivenessListener
from megatron_elaswave.launch.node_watch import NodeWatch
from megatron_elaswave.launch.rendezvous import connect, host_store, join, take_node_rank
from megatron_elaswave.launch.signals import Interrupted, SignalLatch
from megatron_elaswave.launch.store import change_node_state
from megatron_elaswave.launch.workers import POLL_INTERVAL_S, WorkerPool

if TYPE_CHECKING:
    from megatron_elaswave.launch.spawn import ForkServer
    from torch.distributed import Store


LOST_NODE_EXIT_STATUS = 1
"""Exit status of an agent that found its node declared lost."""


LOST_STORE_EXIT_STATUS = 1
"""Exit status of an agent that lost the job store (node 0's agent is gone, and the job with it)."""


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


def run(config: LaunchConfig, worker_base_env: Mapping[str, str],
        fork_server: ForkServer | None) -> int:
    """Run this node's part of the job to its end, its workers started with
    ``worker_base_env`` and forked from ``fork_server`` (``None``: executed); returns the
    agent's exit status."""
    with SignalLatch() as signals:
        try:
            if config.node_rank is None:
                config, store = take_node_rank(config, signals)
            else:
                store = (host_store(config) if config.is_store_host
                         else connect(config, signals))
            replaces_lost_node = join(store, config, signals, _listen_for_watchers(config))
        except Interrupted as interrupt:
            log(f"received {signal_name(interrupt.signum)} before the workers started")
            return 128 + interrupt.signum
        return _NodeAgent(config, store, signals, worker_base_env, fork_server,
                          rejoining=replaces_lost_node).run()


def _listen_for_watchers(config: LaunchConfig) -> str:
    """Open this agent's liveness port (:mod:`~megatron_elaswave.launch.liveness`), held until
    the process ends; returns its ``HOST:PORT``, or ``""`` if none could be opened (the nodes
    that watch this one then go by its heartbeat alone)."""
    try:
        return LivenessListener(config.store_host).address
    except OSError as error:
        log(f"no liveness port ({error}): a loss of this node is found by its heartbeat alone")
        return ""


class _NodeAgent:
    """Runs one node's part of the job once it has formed: one supervision loop drives the
    node's workers (:class:`~megatron_elaswave.launch.workers.WorkerPool`), the watch over other nodes (:class:`~megatron_elaswave.launch.node_watch.NodeWatch`),
    the fence of excluded workers (:class:`~megatron_elaswave.launch.fence.ExclusionFence`) and the alert relay
    (:class:`~megatron_elaswave.launch.alerts.AlertRelay`), and ends the node's part when they are done, a signal arrives, the
    node was declared lost or the job store is gone."""

    def __init__(
        self,
        config: LaunchConfig,
        store: Store,
        signals: SignalLatch,
        worker_base_env: Mapping[str, str],
        fork_server: ForkServer | None,
        *,
        rejoining: bool = False,
    ) -> None:
        self._config = config
        self._store = GuardedStore(store)
        self._signals = signals
        self._peers = NodeWatch(config, self._store)
        self._alerts = AlertRelay(self._store)
        self._workers = WorkerPool(config, self._store, worker_base_env, fork_server,
                                    self._alerts.path, rejoining=rejoining)
        self._fence = ExclusionFence(config, self._store, self._workers)
        self._next_heartbeat = 0.0
        self._compaction = (HistoryCompaction(config.store_compaction_interval_s, log)
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
            log(
                f"{returncodes.count(0)} of {plural(self._config.nproc_per_node, 'worker')} "
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
            if self._peers.agents_gone:
                self._store.call(self._peers.declare_agents_gone)
            if time.monotonic() >= self._next_heartbeat:
                self._next_heartbeat = time.monotonic() + self._peers.interval_s
                if (declared := self._peers.heartbeat_finds_node_lost()) is not None:
                    log(f"this node was declared lost by node rank {declared}; killing its "
                         "workers")
                    return LOST_NODE_EXIT_STATUS
                self._store.call(self._peers.watch)
                self._store.call(self._compact_history)
                self._fence.kill_excluded()
                if self._store.lost is not None:
                    return self._stop_without_store()
            self._workers.wait(POLL_INTERVAL_S)
        self._store.call(lambda store: self._compact_history(store, finish=True))
        if not self._config.is_store_host:
            # Workers that lost the store may all have left before a heartbeat found it gone:
            # one more look, so that this agent says so too. Node 0 keeps the store up until
            # this node is done, so a job that ended well still finds it.
            self._store.call(lambda store: store.check([node_lost_key(self._config.node_rank)]))
            if self._store.lost is not None:
                return self._stop_without_store()
        return job_exit_status(self._workers.returncodes)

    def _compact_history(self, store: Store, finish: bool = False) -> None:
        """On etcd, the lowest running node's agent keeps the cluster's history bounded; when
        it is lost or done, the next one does. ``finish``: this agent's last turn, when its
        workers have ended."""
        me = self._config.node_rank
        if self._compaction is None or me != min(self._peers.running_nodes | {me}):
            return
        if finish:
            self._compaction.finish(store)
        else:
            self._compaction.tick(store, time.monotonic())

    def _shut_down(self, signum: int) -> int:
        """Forward ``signum``, give the workers the grace period, then SIGKILL the rest."""
        grace_s = self._config.grace_after(signum)
        saving = (self._config.shutdown_grace_s is None and signum == signal.SIGTERM
                  and "--exit-signal-handler" in self._config.script_args)
        log(
            f"received {signal_name(signum)}; forwarding it to "
            f"{plural(len(self._workers.running), 'worker')}, SIGKILL after {grace_s:g} s"
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
        log(f"lost the job store at {where}: the job cannot go on; stopping this node's workers")
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
