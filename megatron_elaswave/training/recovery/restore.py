"""The store protocol of a state restore, after a recovery or at a layout change: agree on the
iteration to roll back to, hand the small state to ranks that held no stage, and commit the new
layout once every member has restored.

Every member of the restore calls the same steps in the same order; each waits for the others
through the store (keys under ``rt/gen<g>/restore/``, :mod:`megatron_elaswave.launch.keys`), and a
failure noticed meanwhile interrupts the wait, so no member commits a layout another one has not
reached. What the members exchange (their holdings, the rollback iteration, the small state)
and their count of those restored go through the generation's store
(:mod:`megatron_elaswave.runtime.generation_store`); the outcome, which the next recovery starts
from, through the job store.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from megatron_elaswave.launch.keys import ABANDONED, COMMITTED, restore_prefix
from megatron_elaswave.launch.store import WaitInterrupted, read_when_set
from megatron_elaswave.layout import Layout
from megatron_elaswave.runtime import wire
from megatron_elaswave.runtime.snapshot import SnapshotTag, newest_whole_iteration
from megatron_elaswave.waiting import wait_until

from .outcomes import CannotContinue

if TYPE_CHECKING:
    from torch.distributed import Store


@dataclass(frozen=True)
class RestoreRound:
    """One rank's part in the restore that starts ``generation``."""

    store: Store
    """The job store: the restore's outcome."""
    exchange: Store
    """The generation's store: what the members exchange."""
    generation: int
    rank: int
    members: tuple[int, ...]
    """Launch ranks that take part, sorted."""
    timeout: timedelta
    """How long a step waits for every member."""
    abort: threading.Event
    """Set when a failure is noticed: interrupts every wait."""

    @property
    def prefix(self) -> str:
        return restore_prefix(self.generation)

    def rollback_iteration(self, held: list[SnapshotTag], lost: set[int]) -> int:
        """The newest iteration whose state survives whole: some layout's set of snapshots of it
        is held complete by the members together
        (:func:`~megatron_elaswave.runtime.snapshot.newest_whole_iteration`). ``held`` is this rank's
        snapshots, ``lost`` the ranks failed since the state was last restored. Raises
        :class:`~.outcomes.CannotContinue` if there is none."""
        self.exchange.set(f"{self.prefix}/held/{self.rank}",
                          json.dumps([list(tag) for tag in held]))
        # The lowest member reads every holding and publishes the outcome, which the others
        # read: one key each, where reading every holding on every member is N^2.
        outcome = f"{self.prefix}/rollback"
        if self.rank == self.members[0]:
            self.exchange.set(outcome, json.dumps(self._rollback(lost)))
        [raw] = read_when_set(self.exchange, [outcome], self.timeout, self.abort)
        decided = json.loads(raw)
        if "error" in decided:
            raise CannotContinue(decided["error"])
        return decided["iteration"]

    def _rollback(self, lost: set[int]) -> dict:
        holdings = read_when_set(self.exchange, [f"{self.prefix}/held/{member}"
                                                 for member in self.members],
                                 self.timeout, self.abort)
        everything = [SnapshotTag(*tag) for raw in holdings for tag in json.loads(raw)]
        iteration = newest_whole_iteration(everything)
        if iteration is not None:
            return {"iteration": iteration}
        newest = max((tag.iteration for tag in everything), default=0)
        kept = {tag.rank for tag in everything if tag.iteration == newest}
        gone = sorted(lost - kept)
        return {"error": f"no survivor holds a snapshot of ranks {gone}, which failed together "
                         "with every rank that held a copy (--elastic-snapshot-replicas sets how "
                         "many ranks do)" if gone else
                         "no iteration has a complete set of surviving snapshots"}

    def share_state(self, state: dict | None, records: list[dict], old: Layout, new: Layout,
                    lost: set[int]) -> tuple[dict | None, list[dict]]:
        """The small state (iteration, schedule, Adam step, RNG) and the iteration records held
        back (every holder holds the same) for a rank that held no stage in ``old`` (a
        replacement, or a spare back at work), which may log from now on: the lowest surviving
        holder of each TP rank publishes its own when ``new`` has such ranks. ``state`` and
        ``records`` are this rank's own."""
        newcomers = new.active_ranks() - old.active_ranks()
        if not newcomers:
            return state, records
        holders = sorted(old.active_ranks() - lost)
        position = old.position(self.rank)
        if position is not None and self.rank == min(
                r for r in holders if old.position(r)[2] == position[2]):
            self.exchange.set(f"{self.prefix}/state/tp{position[2]}",
                              wire.dumps((state, records)))
        if self.rank not in newcomers:
            return state, records
        key = f"{self.prefix}/state/tp{new.position(self.rank)[2]}"
        [raw] = read_when_set(self.exchange, [key], self.timeout, self.abort)
        shared_state, shared_records = wire.loads(raw)
        return (shared_state if state is None else state), shared_records

    def commit(self) -> None:
        """Return once every member has restored: then each takes the new layout as the one
        whose state the ranks hold. The members count themselves in the generation's store;
        the outcome is one job-store key written once with ``compare_set``: committed by the
        first member that sees every member counted, abandoned by the first that notices a
        failure (or waits past the timeout, or loses the generation's store with its host)
        before that. Every member follows it, so the next recovery starts from one view of the
        state. Raises :class:`~megatron_elaswave.launch.store.WaitInterrupted` when the restore
        was abandoned."""
        restored, everyone = f"{self.prefix}/restored", len(self.members)

        def all_restored() -> bool:
            try:
                return self.exchange.add(restored, 0) >= everyone
            except WaitInterrupted:  # the generation's store went down with its host
                return False

        try:
            self.exchange.add(restored, 1)  # a count, not a key per member: a poll reads one key
            wait_until(all_restored, self.timeout.total_seconds(), abandon=self.abort)
        except WaitInterrupted:
            pass  # not counted: abandon, unless another member committed first
        proposal = COMMITTED if all_restored() else ABANDONED
        if self.store.compare_set(f"{self.prefix}/outcome", "", proposal).decode() == COMMITTED:
            return
        raise WaitInterrupted("the restore was abandoned: a failure was noticed before every "
                              "member had restored")
