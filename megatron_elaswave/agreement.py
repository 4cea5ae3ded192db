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

Keys, besides those of :mod:`megatron_elaswave.monitor`:

===================================  ==========================================================
``rt/gen<g>/joined/<rank>``          set when launch rank ``rank`` enters the agreement of ``g``
``rt/gen<g>/decision``               the :class:`Decision` (JSON) that ends generation ``g``
===================================  ==========================================================
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import Store

    from megatron_elaswave.monitor import FailureMonitor

AGREEMENT_DELAY_ENV = "ELASWAVE_AGREEMENT_DELAY_S"
"""Fault injection for tests: the proposer pauses this many seconds once it could commit, then
looks again, so that a test can fail another rank while the agreement is in progress."""


def joined_key(generation: int, rank: int) -> str:
    return f"rt/gen{generation}/joined/{rank}"


def decision_key(generation: int) -> str:
    return f"rt/gen{generation}/decision"


@dataclass(frozen=True)
class Decision:
    """Who continues after a failure: the membership of a new generation."""

    generation: int
    """The generation this decision starts; it ends generation ``generation - 1``."""
    survivors: tuple[int, ...]
    """Launch ranks that continue, in order: ``survivors[i]`` has rank ``i`` in the new
    generation's process group."""
    failed: tuple[int, ...]
    """Launch ranks of the ended generation that are excluded, sorted."""
    joined: tuple[int, ...] = ()
    """Launch ranks that join the job in the new generation, sorted: a decision that grows the
    job (:mod:`megatron_elaswave.training.relayout`) rather than one that ends a failure."""

    @classmethod
    def initial(cls, world_size: int) -> Decision:
        """Generation 0: every launched rank, in launch order."""
        return cls(0, tuple(range(world_size)), ())

    @property
    def new_ranks(self) -> dict[int, int]:
        """``{launch rank: rank in the new generation}`` of every survivor."""
        return {rank: index for index, rank in enumerate(self.survivors)}

    def new_rank(self, rank: int) -> int:
        """Rank of launch rank ``rank`` in the new generation's process group."""
        return self.survivors.index(rank)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Decision:
        fields = json.loads(raw)
        return cls(fields["generation"], tuple(fields["survivors"]), tuple(fields["failed"]),
                   tuple(fields.get("joined", ())))


class Excluded(SystemExit):
    """This rank was declared failed by the others: it must leave the job.

    A :class:`SystemExit`, so that a training loop catching ``Exception`` does not swallow it and
    an uncaught one ends the process with status 1 and the message, without a traceback.
    """

    def __init__(self, rank: int, decision: Decision) -> None:
        super().__init__(
            f"rank {rank} was excluded from the job: the other ranks decided it had failed in "
            f"generation {decision.generation - 1} and continue without it as generation "
            f"{decision.generation} (survivors {list(decision.survivors)}); exiting"
        )
        self.decision = decision


def agree(store: Store, monitor: FailureMonitor) -> Decision:
    """Decide, with the other survivors, who failed in ``monitor``'s generation.

    Call it once ``monitor`` has noticed a failure (after :meth:`FailureMonitor.report_error`
    or once ``monitor.failure_detected`` is set). Blocks until a decision is committed; every
    survivor gets the same one. Raises :class:`Excluded` if this rank is not a survivor. Then
    call ``monitor.advance(decision)`` and form the new group
    (:func:`megatron_elaswave.world.init_generation`).
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
        self.store.set(joined_key(self.generation, self.rank), "")
        while True:
            committed = self._committed()
            if committed is not None:
                return committed
            proposal = self._proposal()
            if proposal is not None and self.pause_s > 0:
                time.sleep(self.pause_s)
                self.pause_s = 0.0  # then look again: a failure meanwhile enlarges the set
            elif proposal is not None:
                raw = self.store.compare_set(decision_key(self.generation), "", proposal.to_json())
                return Decision.from_json(raw)
            else:
                time.sleep(self.poll_interval_s)

    def _committed(self) -> Decision | None:
        key = decision_key(self.generation)
        return Decision.from_json(self.store.get(key)) if self.store.check([key]) else None

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
        missing = {rank for rank in survivors if not self._has_joined(rank)}
        if missing and waited <= self.timeout_s:
            return None
        self.unresponsive |= missing
        return Decision(
            generation=self.generation + 1,
            survivors=tuple(rank for rank in survivors if rank not in missing),
            failed=tuple(sorted(failed | missing)),
        )

    def _waited_for(self, proposer: int) -> float:
        """Seconds since ``proposer`` became the proposer, as far as this rank knows."""
        now = time.monotonic()
        if proposer != self.proposer:
            self.proposer, self.proposer_since = proposer, now
        return now - self.proposer_since

    def _has_joined(self, rank: int) -> bool:
        if rank not in self.joined and self.store.check([joined_key(self.generation, rank)]):
            self.joined.add(rank)
        return rank in self.joined
