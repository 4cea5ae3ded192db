"""Workers the job excluded (stopped or hung, not dead), killed once their grace is over
(:class:`ExclusionFence`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from megatron_elaswave.launch.config import LaunchConfig
from megatron_elaswave.launch.console import log
from megatron_elaswave.launch.decisions import Decision
from megatron_elaswave.launch.guarded_store import GuardedStore
from megatron_elaswave.launch.keys import decision_key
from megatron_elaswave.launch.store import read_if_set
from megatron_elaswave.launch.workers import WorkerPool

if TYPE_CHECKING:
    from torch.distributed import Store


class ExclusionFence:
    """Kills this node's workers that the job excluded (stopped or hung, not dead) and that
    still run ``--exclusion-grace`` seconds after the agent read the decision: such a process
    never leaves by itself, and the job (and its agent) could not end while it runs.

    Guarantees: only a member of the job (:attr:`Worker.member`) is fenced, and only the very
    process the decision excluded; a worker that left by itself in the meantime is not waited
    for, and no replacement started in its slot is touched.
    """

    def __init__(self, config: LaunchConfig, store: GuardedStore, workers: WorkerPool) -> None:
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
                log(f"worker rank {rank} (pid {pid}) was excluded by the job; killing it")
                self._workers.fence(worker)

    def _read_decision(self, store: Store) -> Decision | None:
        """The decision that ended generation :attr:`_next_generation`, if committed."""
        raw = read_if_set(store, decision_key(self._next_generation))
        return None if raw is None else Decision.from_json(raw)
