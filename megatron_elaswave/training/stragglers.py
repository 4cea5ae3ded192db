"""Stragglers: re-deal the global batch's micro-batches when a replica runs persistently slower.

Every iteration each active rank reports how long its replica's pipeline took to reach the
gradient reduction (before it, replicas do not wait for each other, so a slow rank slows only
its own replica); the times travel in the iteration's existing all-reduce. From the median of
the last ``window`` iterations the detector models each replica as 1F1B,
``T_r(n) = (p_r - 1 + n) * c_r`` for ``n`` micro-batches on ``p_r`` stages, and asks the
planner's dataflow (:func:`balance_microbatches`) for the counts that minimise the slowest
replica. When that is predicted faster than now by at least ``min_gain``, the job switches to
it at the next step boundary: same stages and groups, the same global micro-batch ids dealt
differently, so the global batch, its samples and (with per-token loss) the gradients are
unchanged. A straggler that recovers is handled the same way, back towards an even deal.

Every rank sees the same reduced times and evaluates the same pure function, so they all switch
at the same iteration without agreeing through the store.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, replace

from megatron_elaswave.layout import Layout
from megatron_elaswave.planner.dataflow import ReplicaSpeed, assign_microbatch_ids, balance_microbatches


@dataclass(frozen=True)
class RebalanceConfig:
    """When micro-batches are re-dealt."""

    window: int = 5
    """Iterations whose median pipeline times are compared (and waited for after a change)."""
    min_gain: float = 1.15
    """Smallest predicted speed-up of the step that justifies a change."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.min_gain < 1:
            raise ValueError(f"min_gain must be >= 1, got {self.min_gain}")


@dataclass(frozen=True)
class Rebalance:
    """A decision: the layout to switch to and why."""

    layout: Layout
    predicted_gain: float
    """Predicted step time now divided by the predicted step time after the change."""
    reason: str


class StragglerDetector:
    """Keeps the recent pipeline times of one layout; proposes a better deal of micro-batches."""

    def __init__(self, config: RebalanceConfig = RebalanceConfig()) -> None:
        self.config = config
        self._times: deque[dict[int, float]] = deque(maxlen=config.window)

    def reset(self) -> None:
        """Forget the times measured (the layout changed)."""
        self._times.clear()

    def observe(self, layout: Layout, pipeline_s: dict[int, float]) -> None:
        """Record one iteration: ``pipeline_s`` maps the first rank of each stage instance (its
        tensor-parallel peers take as long) to the time its pipeline took."""
        self._times.append({
            replica.index: max(pipeline_s[stage.ranks[0]] for stage in replica.stages)
            for replica in layout.replicas})

    def proposal(self, layout: Layout) -> Rebalance | None:
        """The better deal, once ``window`` iterations are in and it pays; else ``None``."""
        if len(self._times) < self.config.window or len(layout.replicas) < 2:
            return None
        speeds, now_s = [], 0.0
        for replica in layout.replicas:
            replica_s = statistics.median(times[replica.index] for times in self._times)
            fill = len(replica.stages) - 1
            per_microbatch_s = replica_s / (fill + replica.num_microbatches)
            now_s = max(now_s, replica_s)
            per_ns = max(1, round(per_microbatch_s * 1e9))
            speeds.append(ReplicaSpeed(replica.index, fill * per_ns, per_ns))
        counts = _at_least_one_each(balance_microbatches(speeds, layout.global_num_microbatches))
        then_s = max(s.step_ns(counts[s.replica]) for s in speeds) / 1e9
        gain = now_s / then_s
        if gain < self.config.min_gain:
            return None
        ids = assign_microbatch_ids(counts, {r.index: r.microbatch_ids for r in layout.replicas},
                                    layout.global_num_microbatches)
        slowest = max(speeds, key=lambda s: s.per_microbatch_ns)
        fastest = min(speeds, key=lambda s: s.per_microbatch_ns)
        reason = (f"replica {slowest.replica} takes {slowest.per_microbatch_ns / fastest.per_microbatch_ns:.2f}x "
                  f"as long per micro-batch as replica {fastest.replica}")
        new = replace(layout, replicas=tuple(replace(r, microbatch_ids=ids[r.index])
                                             for r in layout.replicas))
        return Rebalance(new, gain, reason)


def _at_least_one_each(counts: dict[int, int]) -> dict[int, int]:
    """Keep every replica busy with one micro-batch at least: a replica with none would still
    take part in every collective of the step while contributing nothing."""
    counts = dict(counts)
    for replica in counts:
        if counts[replica] == 0:
            donor = max(counts, key=lambda r: (counts[r], -r))
            counts[donor] -= 1
            counts[replica] = 1
    return counts
