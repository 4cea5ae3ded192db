"""One node's workers, from their start to the record of their end (:class:`WorkerPool`)."""

from __future__ import annotations

import functools
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from megatron_elaswave.launch.alerts import NODE_ALERTS_ENV
from megatron_elaswave.launch.config import LaunchConfig
from megatron_elaswave.launch.console import log, plural, rank_list, signal_name
from megatron_elaswave.launch.guarded_store import GuardedStore
from megatron_elaswave.launch.signals import SignalLatch
from megatron_elaswave.launch.spawn import (
    ForkServer,
    ForkServerError,
    ForkedWorker,
    die_with_parent,
    reap_orphans,
)
from megatron_elaswave.launch.store import (
    EXITED,
    SIGNALED,
    WorkerDeath,
    WorkerExit,
    WorkerRecord,
    publish_worker,
    record_death,
    record_exit,
)


POLL_INTERVAL_S = 0.05
"""How often the agent looks at its workers, the job store and the other nodes. A worker's end
wakes it at once where the platform can watch a process (Linux's pidfds); elsewhere this bounds
the delay before a death is recorded."""


JOB_OVER_STATUSES = frozenset({0, 2, 3})
"""Worker exit statuses that end the job for every worker: training finished, bad input (the
training script's one-line error), and cannot continue (the state is lost; the survivors
stopped). ``--rejoin`` starts no worker once one has ended with any of them."""


@dataclass
class Worker:
    record: WorkerRecord
    process: subprocess.Popen | ForkedWorker
    member: bool
    """Whether the job counts it among its members: a first worker of a node that formed the
    job; a replacement once a decision takes it in (:class:`~megatron_elaswave.launch.fence.ExclusionFence` marks it then)."""
    end_watch: int | None = None
    """A descriptor that becomes readable when the process ends (its pidfd), closed once it is
    reaped; ``None`` where the platform has none."""


class WorkerPool:
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
        store: GuardedStore,
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
        """The file the workers read the job's alert count in (:class:`~megatron_elaswave.launch.alerts.AlertRelay`)."""
        self._rejoining = rejoining
        """The node replaces a lost one: its first workers join a running job too."""
        self._running: dict[int, Worker] = {}
        self._returncodes: list[int] = []
        self._due_starts: dict[int, float] = {}
        """``{local rank: monotonic time}`` of the starts due: the first ones, and the
        replacements (``--rejoin``)."""
        self._starts: dict[int, int] = {}
        """How many times each local rank was started."""
        self._fenced: set[int] = set()
        """Pids of the workers killed because the job had excluded them."""

    @property
    def running(self) -> Mapping[int, Worker]:
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
                log(f"started worker rank {rank} (pid {self._running[rank].record.pid}) "
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
                _close_watch(worker)
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

    def wait(self, timeout_s: float) -> None:
        """Return as soon as a worker ends, or after ``timeout_s``."""
        watches = [w.end_watch for w in self._running.values() if w.end_watch is not None]
        if watches:
            select.select(watches, [], [], timeout_s)
        else:
            time.sleep(timeout_s)

    def fence(self, worker: Worker) -> None:
        """SIGKILL ``worker``, which the job excluded; its end does not count in
        :attr:`returncodes`."""
        self._fenced.add(worker.record.pid)
        worker.process.kill()

    def signal(self, signum: int) -> None:
        for worker in self._running.values():
            worker.process.send_signal(signum)

    def wait_then_kill(self, grace_s: float, signals: SignalLatch) -> None:
        """Give the workers ``grace_s`` seconds (or until a second signal) to end, then
        SIGKILL those still running."""
        deadline = time.monotonic() + grace_s
        while self._running and time.monotonic() < deadline:
            if len(signals.received) > 1:
                break  # a second signal: stop waiting
            self.wait(POLL_INTERVAL_S)
            self.reap()
        if self._running:
            log(f"killing the workers still running: {rank_list(list(self._running))}")
            self.signal(signal.SIGKILL)
            for worker in self._running.values():
                worker.process.wait()
            self.reap()

    def kill_all(self) -> None:
        """SIGKILL whatever still runs, without reporting: the agent is leaving."""
        self.signal(signal.SIGKILL)
        for worker in self._running.values():
            worker.process.wait()
            _close_watch(worker)
        self._running.clear()

    def _start(self, local_rank: int) -> None:
        worker = self._spawn(local_rank)
        worker.end_watch = _watch_end(worker.process.pid)
        self._running[worker.record.rank] = worker
        self._store.call(lambda store: publish_worker(store, worker.record))

    def _spawn(self, local_rank: int) -> Worker:
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
        return Worker(record, process, member=not rejoins)

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
        log(f"starting workers without preloading: {error}")
        assert self._fork_server is not None
        self._fork_server.close()
        self._fork_server = None

    def _schedule_restart(self, worker: WorkerRecord) -> None:
        config = self._config
        if not config.rejoin or JOB_OVER_STATUSES.intersection(self._returncodes):
            return
        restarts = self._starts[worker.local_rank] - 1
        if restarts >= config.max_rejoins:
            log(f"worker rank {worker.rank} was started again {plural(restarts, 'time')} "
                 f"already (--max-rejoins {config.max_rejoins}); not restarting it")
            return
        self._due_starts[worker.local_rank] = time.monotonic() + config.rejoin_delay_s
        log(f"restarting worker rank {worker.rank} in {config.rejoin_delay_s:g} s to rejoin "
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
        killed_by = signal_name(-returncode) if returncode < 0 else None
        death = WorkerDeath(
            rank=worker.rank,
            local_rank=worker.local_rank,
            node_rank=worker.node_rank,
            pid=worker.pid,
            exit_code=None if killed_by else returncode,
            signal=killed_by,
            cause=SIGNALED if killed_by else EXITED,
            time=now,
        )
        self._store.call(lambda store: record_death(store, death))
        how = f"killed by {killed_by}" if killed_by else f"exited with code {returncode}"
        still = plural(len(self._running), "worker")
        log(f"worker rank {worker.rank} (pid {worker.pid}) {how}; {still} still running")


def _watch_end(pid: int) -> int | None:
    """A pidfd of ``pid`` (the process is this agent's child, so the pid is not reused before
    it is reaped), or ``None`` where the platform has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux, or a kernel before 5.3
        return None


def _close_watch(worker: Worker) -> None:
    if worker.end_watch is not None:
        os.close(worker.end_watch)
        worker.end_watch = None
