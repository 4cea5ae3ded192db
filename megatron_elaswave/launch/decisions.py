"""What an agreement decides: the :class:`Decision` that ends a generation, and :class:`Excluded`
for a rank it leaves out.

A decision is written once per generation to the job store (:mod:`megatron_elaswave.runtime.agreement`
for a failure, :mod:`megatron_elaswave.training.recovery.relayout` for a grow or a layer move) and read by the monitors,
the trainers and the launchers; it carries why and when the failure happened, as its proposer
saw it, so every survivor reports the same.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


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
    job (:mod:`megatron_elaswave.training.recovery.relayout`) rather than one that ends a failure."""
    causes: tuple[tuple[int, str], ...] = ()
    """``(rank, why it was excluded)`` for each failed rank: the launcher's death record
    (``killed by SIGKILL``) or what the proposer saw (a silent heartbeat, no agreement)."""
    failed_at: float = 0.0
    """Unix time of the earliest sign of the failure the proposer knew of (a hang dates from
    its last heartbeat); 0 for a grow."""
    error: str = ""
    """With no failed rank: the error that started the round (``rank R: ...``)."""
    relayout: bool = False
    """A decision that changes the layout at a step boundary, a grow or a layer move, rather
    than one that ends a failure: its plan is published beside it
    (:mod:`megatron_elaswave.training.recovery.relayout`)."""

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

    def cause(self, rank: int) -> str:
        """Why ``rank`` was excluded."""
        return dict(self.causes).get(rank, "declared failed by another rank")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Decision:
        fields = json.loads(raw)
        return cls(fields["generation"], tuple(fields["survivors"]), tuple(fields["failed"]),
                   tuple(fields.get("joined", ())),
                   tuple((int(rank), cause) for rank, cause in fields.get("causes", ())),
                   fields.get("failed_at", 0.0), fields.get("error", ""),
                   fields.get("relayout", False))


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
