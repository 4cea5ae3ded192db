"""Agreement: after a failure, the survivors decide through the job store who failed.

The process groups of a generation cannot be trusted once a member failed, so the agreement
uses only the job store, which the launcher hosts outside every worker. It guarantees:

* **One decision per generation.** The decision that ends generation ``g`` is written once, with
  ``compare_set``, to ``rt/gen<g>/decision``; whoever writes first wins and every rank adopts
  what is there. Two ranks that both believe they should propose cannot split the job.
* **No fixed leader.** The proposer is the lowest launch rank of the generation that this
  process does not believe failed. If the proposer fails, the others' monitors see it (death
  record or heartbeat) and the next one takes over; a proposer that is alive but does not
  commit within ``2 * agreement_timeout_s`` is treated as failed the same way. So the world's
  rank 0 may die like any other.
* **Failures during the agreement enlarge the failed set.** The proposer waits until every
  member it believes alive has joined (``rt/gen<g>/joined/<rank>``), re-reading its monitor's
  suspects each time, and commits only the set it believes at that moment. A member that has not
  joined within ``agreement_timeout_s`` is declared failed too. A failure that lands after the
  commit is a failure of the next generation and starts the next agreement.
* **Growth uses the same key.** A decision that adds ranks at a step boundary is committed on the
  same key with the same ``compare_set``, so a generation ends either with a failure or with a
  grow, never both; a failure noticed after a grow was committed is a failure of the grown
  generation.
* **An excluded rank leaves.** A rank that finds itself among the failed of the committed
  decision (it was stopped or too slow, not dead) raises :class:`Excluded`, which exits the
  process with a message, rather than rejoin a job that has moved on without it; its monitor
  ends the process the same way if its loop is stuck in an old collective.

The decision also says why each failed rank was excluded and when the failure began, as the
proposer saw it (the launchers' death records first), so every survivor reports the same.

Keys (:mod:`megatron_elaswave.launch.keys`): ``rt/gen<g>/joined/<rank>`` is set when ``rank`` enters
the agreement that ends ``g``; ``rt/gen<g>/decision`` holds the :class:`Decision` (JSON).
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

from megatron_elaswave.launch.decisions import Decision, Excluded
from megatron_elaswave.launch.keys import decision_key, joined_key, round_key
from megatron_elaswave.launch.store import read_deaths, read_if_set
from megatron_elaswave.runtime.monitor import HEARTBEAT, FailureMonitor
from megatron_elaswave.waiting import wait_until

if TYPE_CHECKING:
    from torch.distributed import Store

AGREEMENT_DELAY_ENV = "ELASWAVE_AGREEMENT_DELAY_S"
"""Fault injection for tests: the proposer pauses this many seconds once it could commit, then
looks again, so that a test can fail another rank while the agreement is in progress."""


def agree(store: Store, monitor: FailureMonitor) -> Decision:
    """Decide, with the other survivors, who failed in ``monitor``'s generation.

    Call it once ``monitor`` has noticed a failure (after :meth:`FailureMonitor.report_error`
    or once ``monitor.failure_detected`` is set). Blocks until a decision is committed; every
    survivor gets the same one. Raises :class:`Excluded` if this rank is not a survivor. Then
    call ``monitor.advance(decision)`` and form the new group
    (:func:`megatron_elaswave.runtime.world.init_generation`).
    """
    if monitor.failure is None:
        raise RuntimeError("agree() needs a failure: call monitor.report_error(error) first")
    decision = _Round(store, monitor).run()
    if monitor.rank not in decision.survivors:
        raise Excluded(monitor.rank, decision)
    return decision


class _Round:
    """One rank's part in the agreement that ends one generation."""

    def __init__(self, store: Store, monitor: FailureMonitor) -> None:
        self.store = store
        self.monitor = monitor
        self.rank = monitor.rank
        self.generation = monitor.generation
        self.members = monitor.members
        self.timeout_s = monitor.config.agreement_timeout_s
        self.poll_interval_s = monitor.config.poll_interval_s
        self.unresponsive: set[int] = set()
        """Members this rank gave up waiting for, on top of its monitor's suspects."""
        self.joined: set[int] = set()
        self.proposer: int | None = None
        self.proposer_since = time.monotonic()
        self.pause_s = float(os.environ.get(AGREEMENT_DELAY_ENV, "0"))

    def run(self) -> Decision:
        committed = self._committed()
        if committed is not None:  # a rank resumed after the others decided writes nothing
            return committed
        self.store.set(joined_key(self.generation, self.rank), "")
        committed: Decision | None = None
        proposal: Decision | None = None

        def decided_or_ready() -> bool:
            nonlocal committed, proposal
            committed = self._committed()
            proposal = None if committed is not None else self._proposal()
            return committed is not None or proposal is not None

        while True:
            wait_until(decided_or_ready, None, max_pause_s=self.poll_interval_s)
            if committed is not None:
                return committed
            if self.pause_s > 0:
                time.sleep(self.pause_s)
                self.pause_s = 0.0  # then look again: a failure meanwhile enlarges the set
                continue
            raw = self.store.compare_set(decision_key(self.generation), "", proposal.to_json())
            return Decision.from_json(raw)

    def _committed(self) -> Decision | None:
        raw = read_if_set(self.store, decision_key(self.generation))
        return None if raw is None else Decision.from_json(raw)

    def _proposal(self) -> Decision | None:
        """The decision to commit if this rank is the proposer and every live member has
        joined (or had ``agreement_timeout_s`` to); ``None`` while it must wait."""
        failed = set(self.monitor.suspects()) | self.unresponsive
        survivors = [rank for rank in self.members if rank not in failed]
        waited = self._waited_for(proposer=survivors[0])
        if survivors[0] != self.rank:
            if waited > 2 * self.timeout_s:
                self.unresponsive.add(survivors[0])  # alive, perhaps, but not committing
            return None
        if not self._all_joined(survivors) and waited <= self.timeout_s:
            return None
        missing = {rank for rank in survivors if not self._has_joined(rank)}
        self.unresponsive |= missing
        failed |= missing
        causes, failed_at = self._evidence(failed)
        return Decision(
            generation=self.generation + 1,
            survivors=tuple(rank for rank in survivors if rank not in missing),
            failed=tuple(sorted(failed)),
            causes=tuple(sorted(causes.items())),
            failed_at=failed_at,
            error=self._error() if not failed else "",
        )

    def _evidence(self, failed: set[int]) -> tuple[dict[int, str], float]:
        """Why each of ``failed`` failed and when the first sign of it was: the launchers'
        death records, else this rank's suspicions, else its wait in the agreement. A hang
        dates from its last heartbeat, ``heartbeat_timeout_s`` before it was noticed."""
        heartbeat_s = self.monitor.config.heartbeat_timeout_s
        suspects = self.monitor.suspects()
        known, unread = self.monitor.recorded_deaths()
        deaths = {death.rank: death for death in read_deaths(self.store, start=unread)}
        deaths = {rank: death for rank, death in {**deaths, **known}.items() if rank in failed}
        causes = {rank: (deaths[rank].describe() if rank in deaths
                         else suspects[rank].detail if rank in suspects
                         else f"did not join the agreement within {self.timeout_s:g} s")
                  for rank in failed}
        signs = [death.time for death in deaths.values()]
        signs += [s.time - (heartbeat_s if s.cause == HEARTBEAT else 0.0)
                  for rank, s in suspects.items() if rank in failed]
        notice = self._notice()
        if notice is not None:
            signs.append(notice["time"] - (heartbeat_s if notice["cause"] == HEARTBEAT else 0.0))
        return causes, min(signs, default=time.time())

    def _notice(self) -> dict | None:
        """The failure notice of the first rank that announced this round."""
        raw = read_if_set(self.store, round_key(self.generation))
        return None if raw is None else json.loads(raw)

    def _error(self) -> str:
        """The error that started a round in which no rank failed."""
        notice = self._notice()
        return (f"rank {notice['rank']}: {notice['detail']}" if notice
                else "an error with no rank failing")

    def _waited_for(self, proposer: int) -> float:
        """Seconds since ``proposer`` became the proposer, as far as this rank knows."""
        now = time.monotonic()
        if proposer != self.proposer:
            self.proposer, self.proposer_since = proposer, now
        return now - self.proposer_since

    def _all_joined(self, ranks: list[int]) -> bool:
        """Whether every one of ``ranks`` has joined: one request for all those not yet seen."""
        unseen = [rank for rank in ranks if rank not in self.joined]
        if unseen and not self.store.check([joined_key(self.generation, r) for r in unseen]):
            return False
        self.joined.update(unseen)
        return True

    def _has_joined(self, rank: int) -> bool:
        if rank not in self.joined and self.store.check([joined_key(self.generation, rank)]):
            self.joined.add(rank)
        return rank in self.joined
