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

Where re-dealing cannot help (one replica) or does not pay, layers move instead. Each stage also
reports the forward time of its transformer layers and of the rest of its forward (embedding,
output layer, loss), and the detector models a stage holding ``n`` layers as
``rest + n * per_layer``. Only a slow device moves layers: when a stage's time per layer is at
least ``slow_stage_factor`` times that of the fastest stage of its replica,
:meth:`StragglerDetector.layer_proposal` gives the replica's stages the contiguous layer counts
that make its slowest stage as fast as it can be (:func:`balanced_layer_counts`); once the
stages are even again, the replica goes back to the counts the planner chose. A model whose
stages differ in cost by construction (the output layer) keeps the planner's layout. Moving
layers changes stages and groups, so it runs as a layout change at the step boundary
(:mod:`.relayout`).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from megatron_elaswave.layout import Layout, Replica, StageInstance
from megatron_elaswave.planner.dataflow import ReplicaSpeed, assign_microbatch_ids, balance_microbatches


@dataclass(frozen=True)
class RebalanceConfig:
    """When micro-batches are re-dealt."""

    window: int = 5
    """Iterations whose median pipeline times are compared (and waited for after a change)."""
    min_gain: float = 1.15
    """Smallest predicted speed-up of the step that justifies a change."""
    slow_stage_factor: float = 1.5
    """A stage whose time per transformer layer is at least this many times that of the fastest
    stage of its replica runs on a slow device: layers move off it."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.min_gain < 1:
            raise ValueError(f"min_gain must be >= 1, got {self.min_gain}")
        if self.slow_stage_factor <= 1:
            raise ValueError(f"slow_stage_factor must be > 1, got {self.slow_stage_factor}")


@dataclass(frozen=True)
class StageCompute:
    """One stage instance's forward compute in one iteration, all its micro-batches."""

    layers_s: float
    """Time in its transformer layers."""
    rest_s: float
    """Time in the rest of its forward (embedding, output layer, loss): it stays with the stage
    whatever layers the stage holds."""


@dataclass(frozen=True)
class Rebalance:
    """A decision: the layout to switch to and why."""

    layout: Layout
    predicted_gain: float
    """Predicted step time now divided by the predicted step time after the change."""
    reason: str


class ForwardTimer:
    """Sums the forward time of the modules it hooks (none nested in another) since
    :meth:`restart`; hooks registered earlier on them (an injected slowdown) count too."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self.total_s = 0.0
        self._started = 0.0
        for module in modules:
            module.register_forward_pre_hook(self._start)
            module.register_forward_hook(self._stop)

    def restart(self) -> None:
        self.total_s = 0.0

    def _start(self, module, inputs) -> None:
        self._started = time.perf_counter()

    def _stop(self, module, inputs, output) -> None:
        self.total_s += time.perf_counter() - self._started


class StragglerDetector:
    """Keeps the recent times of one layout; proposes a better deal of micro-batches, or of
    layers between the stages of a replica."""

    def __init__(self, config: RebalanceConfig = RebalanceConfig()) -> None:
        self.config = config
        self._times: deque[dict[int, float]] = deque(maxlen=config.window)
        self._compute: deque[dict[int, StageCompute]] = deque(maxlen=config.window)
        self._planned_counts: dict[int, tuple[int, ...]] = {}

    def reset(self, planned: Layout | None = None) -> None:
        """Forget the times measured (the layout changed). ``planned``: a layout the planner
        chose (at the start, after a recovery or a grow), whose layer counts a replica goes back
        to once its stages are even again."""
        self._times.clear()
        self._compute.clear()
        if planned is not None:
            self._planned_counts = {replica.index: _layer_counts(replica)
                                    for replica in planned.replicas}

    def observe(self, layout: Layout, pipeline_s: dict[int, float],
                compute: dict[int, StageCompute] | None = None) -> None:
        """Record one iteration: ``pipeline_s`` maps the first rank of each stage instance (its
        tensor-parallel peers take as long) to the time its pipeline took, ``compute`` to its
        stage's forward compute."""
        self._times.append({
            replica.index: max(pipeline_s[stage.ranks[0]] for stage in replica.stages)
            for replica in layout.replicas})
        if compute is not None:
            self._compute.append(dict(compute))

    def layer_proposal(self, layout: Layout) -> Rebalance | None:
        """Layers moved between the stages of replicas with a slow stage (or back to the planned
        counts where the stages are even again), once ``window`` iterations are in and the step
        is predicted ``min_gain`` faster; else ``None``."""
        if len(self._compute) < self.config.window:
            return None
        step_now = step_then = 0.0
        replicas, reasons = [], []
        for replica in layout.replicas:
            leaders = [stage.ranks[0] for stage in replica.stages]
            counts = _layer_counts(replica)
            per_layer = [statistics.median(times[rank].layers_s for times in self._compute) / count
                         for rank, count in zip(leaders, counts)]
            rest = [statistics.median(times[rank].rest_s for times in self._compute)
                    for rank in leaders]
            target, reason = self._target_counts(replica.index, per_layer, rest, counts,
                                                 layout.num_layers)
            # 1F1B: (stages - 1 + micro-batches) slots of the slowest stage's per-micro-batch time
            slots = (len(replica.stages) - 1 + replica.num_microbatches) / replica.num_microbatches
            now = slots * max(r + n * p for r, n, p in zip(rest, counts, per_layer))
            then = slots * max(r + n * p for r, n, p in zip(rest, target, per_layer))
            step_now, step_then = max(step_now, now), max(step_then, then)
            replicas.append(replica.keeping_chunks(_restage(replica.stages, target),
                                                   replica.microbatch_ids))
            if reason:
                reasons.append(reason)
        if not reasons or step_now < self.config.min_gain * step_then:
            return None
        return Rebalance(replace(layout, replicas=tuple(replicas)), step_now / step_then,
                         "; ".join(reasons))

    def _target_counts(self, index: int, per_layer: list[float], rest: list[float],
                       counts: tuple[int, ...], num_layers: int) -> tuple[tuple[int, ...], str]:
        """The layer counts replica ``index`` should have, and why they differ from ``counts``
        (empty when they do not)."""
        if len(counts) < 2 or min(per_layer) <= 0:  # nothing to move, or nothing measured
            return counts, ""
        slowdown = max(per_layer) / min(per_layer)
        if slowdown >= self.config.slow_stage_factor:
            target = balanced_layer_counts(per_layer, rest, num_layers)
            why = (f"a stage of replica {index} takes {slowdown:.2f}x as long per layer as "
                   f"another; its stages now hold {list(target)} layers")
        else:
            target = self._planned_counts.get(index, counts)
            if len(target) != len(counts):
                target = counts
            why = f"the stages of replica {index} are even again: back to {list(target)} layers"
        return target, why if target != counts else ""

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
        # A replica with virtual stages keeps as many micro-batches as it has stages: the
        # interleaved schedule it is built for runs no fewer.
        minimum = {r.index: len(r.stages) if r.virtual_stages > 1 else 1 for r in layout.replicas}
        counts = _at_least(balance_microbatches(speeds, layout.global_num_microbatches), minimum)
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
        new = replace(layout, replicas=tuple(r.keeping_chunks(r.stages, tuple(ids[r.index]))
                                             for r in layout.replicas))
        return Rebalance(new, gain, reason)


def balanced_layer_counts(per_layer_s: list[float], rest_s: list[float],
                          num_layers: int) -> tuple[int, ...]:
    """Layers per stage, at least one each, minimising the slowest stage's time
    ``rest_s[i] + count * per_layer_s[i]``: each layer in turn goes to the stage that would finish
    it soonest (optimal for this bottleneck objective, every stage's time growing with its
    count)."""
    if num_layers < len(per_layer_s):
        raise ValueError(f"{num_layers} layers cannot fill {len(per_layer_s)} stages")
    counts = [1] * len(per_layer_s)
    for _ in range(num_layers - len(counts)):
        stage = min(range(len(counts)),
                    key=lambda i: (rest_s[i] + (counts[i] + 1) * per_layer_s[i], i))
        counts[stage] += 1
    return tuple(counts)


def _layer_counts(replica: Replica) -> tuple[int, ...]:
    return tuple(stage.last_layer - stage.first_layer + 1 for stage in replica.stages)


def _restage(stages: tuple[StageInstance, ...], counts: tuple[int, ...]) -> tuple[StageInstance, ...]:
    first, restaged = 0, []
    for stage, count in zip(stages, counts):
        restaged.append(StageInstance(stage.ranks, first, first + count - 1))
        first += count
    return tuple(restaged)


def _at_least(counts: dict[int, int], minimum: dict[int, int]) -> dict[int, int]:
    """Give every replica its ``minimum`` of micro-batches (one at least: a replica with none
    would still take part in every collective of the step while contributing nothing), taken
    from those with the most to spare. The layout re-dealt meets the minimums, so the total
    covers them."""
    counts = dict(counts)
    for replica in counts:
        while counts[replica] < minimum[replica]:
            donor = max(counts, key=lambda r: (counts[r] - minimum[r], -r))
            counts[donor] -= 1
            counts[replica] += 1
    return counts
