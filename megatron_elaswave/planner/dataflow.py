"""Dataflow scheduling: which replica runs which micro-batches of the global batch.

Guarantees of :func:`balance_microbatches` plus :func:`assign_microbatch_ids`:

* the global batch keeps its size exactly: the ids handed out are a permutation of ``0..M-1``;
* the counts minimise the predicted step time ``max_r T_r(n_r)``, where a replica's pipeline time is
  ``T_r(n) = fill_r + n * per_microbatch_r`` (1F1B; ``T_r(0) = 0``), so in steady state a replica
  runs micro-batches in proportion to its speed ``1 / per_microbatch_r``;
* the result is a deterministic function of integer inputs (ties go to the lower replica index);
* a replica keeps as many of its previous ids as its new count allows, so a change moves as few
  micro-batches between replicas as it can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class ReplicaSpeed:
    """The 1F1B step-time model of one replica: ``fill_ns + n * per_microbatch_ns``."""

    replica: int
    """Replica index."""
    fill_ns: int
    """Pipeline fill and drain: the part of the step that does not grow with micro-batches."""
    per_microbatch_ns: int
    """Time each extra micro-batch adds (the slowest stage's forward plus backward)."""

    def __post_init__(self) -> None:
        if self.fill_ns < 0 or self.per_microbatch_ns < 1:
            raise ValueError("fill_ns must be >= 0 and per_microbatch_ns >= 1")

    def step_ns(self, num_microbatches: int) -> int:
        return 0 if num_microbatches == 0 else self.fill_ns + num_microbatches * self.per_microbatch_ns


def pipeline_speed(replica: int, stage_times_ns: Sequence[tuple[int, int]], send_ns: int) -> ReplicaSpeed:
    """1F1B model of a pipeline from its stages' ``(forward, backward)`` times: every micro-batch
    crosses every stage once, and the slowest stage paces the rest."""
    per_stage = [forward + backward for forward, backward in stage_times_ns]
    slowest = max(per_stage)
    fill = sum(per_stage) - slowest + 2 * (len(per_stage) - 1) * send_ns
    return ReplicaSpeed(replica=replica, fill_ns=fill, per_microbatch_ns=max(slowest, 1))


def balance_microbatches(speeds: Sequence[ReplicaSpeed], total: int) -> dict[int, int]:
    """Micro-batch count per replica minimising the slowest replica's step time (exact)."""
    if not speeds:
        raise ValueError("no replica left to run the global batch")
    if total < 0:
        raise ValueError("total must be non-negative")
    fill = np.array([s.fill_ns for s in speeds], dtype=np.int64)
    per = np.array([s.per_microbatch_ns for s in speeds], dtype=np.int64)

    def capacity(deadline: int) -> np.ndarray:
        """Micro-batches each replica finishes within ``deadline``."""
        return np.maximum((deadline - fill) // per, 0)

    low, high = 0, int((fill + total * per).min())  # the fastest replica alone meets `high`
    while low < high:
        middle = (low + high) // 2
        if int(capacity(middle).sum()) >= total:
            high = middle
        else:
            low = middle + 1
    counts = capacity(low - 1) if low > 0 else np.zeros(len(speeds), dtype=np.int64)
    # Replicas whose next micro-batch ends exactly at the optimum take the remainder, by index.
    missing = total - int(counts.sum())
    at_optimum = capacity(low)
    order = sorted(range(len(speeds)), key=lambda i: speeds[i].replica)
    for i in order:
        if missing == 0:
            break
        if at_optimum[i] > counts[i]:
            counts[i] += 1
            missing -= 1
    return {speeds[i].replica: int(counts[i]) for i in order}


def assign_microbatch_ids(
    counts: Mapping[int, int], previous: Mapping[int, Sequence[int]], total: int
) -> dict[int, tuple[int, ...]]:
    """Global micro-batch ids per replica: each replica keeps the lowest of its previous ids up to
    its new count; the ids left over go, in ascending order, to the replicas (by index) that need
    more. ``previous`` may name replicas that no longer run (their ids are redistributed)."""
    if sum(counts.values()) != total or any(c < 0 for c in counts.values()):
        raise ValueError(f"counts must be non-negative and sum to {total}")
    seen = [i for ids in previous.values() for i in ids]
    if sorted(seen) != list(range(total)):
        raise ValueError(f"previous ids must be a permutation of 0..{total - 1}")
    kept = {r: sorted(previous.get(r, ()))[: counts[r]] for r in counts}
    taken = {i for ids in kept.values() for i in ids}
    pool = iter(i for i in range(total) if i not in taken)
    result = {}
    for replica in sorted(counts):
        ids = kept[replica] + [next(pool) for _ in range(counts[replica] - len(kept[replica]))]
        result[replica] = tuple(sorted(ids))
    return result


def resize_deal(counts: Mapping[int, int], total: int,
                lockstep: int = 1) -> dict[int, tuple[int, ...]]:
    """Global micro-batch ids per replica for a global batch of ``total`` micro-batches (a batch
    size ramp-up), dealt in the proportions of ``counts`` (each replica's current share).

    New counts are proportional to ``counts`` (largest remainders, ties to the lower replica
    index); the ids ``0..total-1`` go out one at a time to the replica furthest below its count,
    so equal counts deal round-robin, as Megatron-LM's sampler does. Replicas in lockstep (sets
    of ``lockstep`` consecutive indices, which ``counts`` gives equal counts) keep equal counts:
    they are dealt as one, ``total`` being a multiple of ``lockstep``."""
    if total < 0 or not counts or sum(counts.values()) <= 0:
        raise ValueError("a global batch needs replicas with micro-batches and total >= 0")
    if total % lockstep:
        raise ValueError(f"{total} micro-batches cannot be dealt evenly to sets of {lockstep} "
                         "replicas in lockstep")
    leaders = {r: c for r, c in counts.items() if r % lockstep == 0}
    whole = sum(leaders.values())
    exact = {r: leaders[r] * (total // lockstep) / whole for r in sorted(leaders)}
    per_set = {r: int(exact[r]) for r in sorted(leaders)}
    for r in sorted(leaders, key=lambda r: (-(exact[r] - per_set[r]), r))[
            : total // lockstep - sum(per_set.values())]:
        per_set[r] += 1
    new = {r: per_set[r - r % lockstep] for r in counts}
    order = sorted(counts)
    dealt: dict[int, list[int]] = {r: [] for r in order}
    for i in range(total):
        replica = min((r for r in order if len(dealt[r]) < new[r]),
                      key=lambda r: (len(dealt[r]) / new[r], r))
        dealt[replica].append(i)
    return {r: tuple(ids) for r, ids in dealt.items()}
