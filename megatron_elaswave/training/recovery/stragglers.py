"""Stragglers: re-deal the global batch's micro-batches, or move layers, when part of the job runs
persistently slower, and settle there.

Every iteration each active rank reports how long its replica's pipeline took to reach the
gradient reduction (before it, replicas do not wait for each other, so a slow rank slows only
its own replica), how long the rest of the previous step took (the reduction and the optimizer
step, which every replica waits for alike) and how long the last layout change took; the values
travel in the iteration's existing all-reduce, so every rank sees the same ones and evaluates the
same pure functions: they all switch at the same iteration without agreeing through the store.

**Micro-batches.** The detector keeps, for each replica, the times measured at each number of
micro-batches it has run (the last ``window`` at each count). A replica's time at a count it has
run is the median measured there; at another count, the 1F1B model ``T(n) = fill + n * per`` fitted
to its measurements (with one count measured, ``fill`` is the pipeline's ``stages - 1`` slots).
The fitted models give a candidate deal (:func:`balance_microbatches`); the job switches to it
when the predicted step, measurements first, is at least ``min_gain`` faster than the measured
one (its square to go back to the deal the last re-deal left), counting the part of the step
every replica waits for, and ``window`` iterations have been measured since the last change. A replica's time need not grow linearly with its share (a rank
paused from outside hides its pauses while it waits at the reduction): since counts already
measured are never predicted, the job does not go back to a deal it measured slower, and so
settles. A replica whose time at its present count moves by ``min_gain`` from what it first was
there, in two whole windows in a row (a straggler that recovered, or one that got worse, not the
jitter of a busy host), has its other measurements dropped.

**Layers.** Where re-dealing cannot help (one replica) or does not pay, layers move. Each stage
also reports the forward time of its transformer layers and of the rest of its forward
(embedding, output layer, loss), and the detector models a stage holding ``n`` layers as
``rest + n * per_layer``. Only a slow device moves layers: a stage's time per layer must be at
least ``slow_stage_factor`` times the median of the other stages of its replica, in four
iterations of five (the 20th percentile of the window's ratios), so that the jitter of a busy
host, which makes a different stage the slowest from one iteration to the next, moves nothing. :meth:`StragglerDetector.layer_proposal` then gives the replica's stages the
contiguous layer counts that make its slowest stage as fast as it can be
(:func:`balanced_layer_counts`); a replica goes back to the counts the planner chose only once
its stages are within the square root of that factor (hysteresis). A move must also pay for
itself: the time it saves over the next ``window`` iterations must exceed what the last layout
change took (before any, one step). A model whose stages differ in cost by construction (the
output layer) keeps the planner's layout. Moving layers changes stages and groups, so it runs as
a layout change at the step boundary (:mod:`.relayout`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from megatron_elaswave.layout import Layout, Replica, StageInstance
from megatron_elaswave.planner.dataflow import ReplicaSpeed, assign_microbatch_ids, balance_microbatches
from megatron_elaswave.planner.replan import expand_lockstep


@dataclass(frozen=True)
class RebalanceConfig:
    """When micro-batches are re-dealt and layers moved."""

    window: int = 5
    """Iterations measured at one deal before the next change may be decided; also the
    measurements kept at each count, and the iterations a layer move must pay for itself in."""
    min_gain: float = 1.15
    """Smallest predicted speed-up of the step that justifies a change."""
    slow_stage_factor: float = 1.5
    """A stage whose time per transformer layer is at least this many times that of the fastest
    stage of its replica runs on a slow device: layers move off it."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.min_gain <= 1:  # a gain of 1 would change the deal for nothing, back and forth
            raise ValueError(f"min_gain must be > 1, got {self.min_gain}")
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
class StepTimes:
    """What one iteration's reduced report says beside the stages' times."""

    shared_s: float = 0.0
    """The previous step's time after the pipelines: the gradient reduction and the optimizer
    step, which every replica waits for alike."""
    change_s: float = 0.0
    """How long the last layout change took (0 before any)."""


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


class ReplicaTimes:
    """One replica's pipeline times, by the number of micro-batches it ran (module docstring)."""

    def __init__(self, window: int, min_gain: float) -> None:
        self.window = window
        self.min_gain = min_gain
        self.by_count: dict[int, deque[float]] = {}
        self._windows: dict[int, list[float]] = {}
        """Per count, the medians of its whole windows of samples, the first one first."""
        self._filled: dict[int, int] = {}

    def add(self, count: int, seconds: float) -> None:
        samples = self.by_count.setdefault(count, deque(maxlen=self.window))
        samples.append(seconds)
        self._filled[count] = self._filled.get(count, 0) + 1
        if self._filled[count] % self.window:
            return
        medians = self._windows.setdefault(count, [])
        medians.append(statistics.median(samples))
        # The replica itself changed (a straggler recovered, or got worse): two whole windows in
        # a row moved by the minimum gain, the same way, from the first one at this count.
        first, recent = medians[0], medians[1:][-2:]
        if len(recent) == 2 and (all(m >= self.min_gain * first for m in recent)
                                 or all(first >= self.min_gain * m for m in recent)):
            self.by_count = {count: samples}
            self._windows = {count: [medians[-1]]}
            self._filled = {count: self._filled[count]}

    def measured(self, count: int) -> float | None:
        """The median time measured at ``count``, once ``window`` samples are in; else None."""
        samples = self.by_count.get(count, ())
        return statistics.median(samples) if len(samples) == self.window else None

    def model(self, stages: int) -> tuple[float, float]:
        """``(fill, per)`` of ``T(n) = fill + n * per`` fitted to the counts measured."""
        points = [(count, time_s) for count in sorted(self.by_count)
                  if (time_s := self.measured(count)) is not None]
        if len(points) >= 2:
            counts = [n for n, _ in points]
            mean_n, mean_t = statistics.fmean(counts), statistics.fmean(t for _, t in points)
            spread = sum((n - mean_n) ** 2 for n in counts)
            per = sum((n - mean_n) * (t - mean_t) for n, t in points) / spread
            if per > 0:
                return max(0.0, mean_t - per * mean_n), per
        count, time_s = points[-1]
        per = time_s / (stages - 1 + count)
        return (stages - 1) * per, per

    def predict(self, count: int, stages: int) -> float:
        measured = self.measured(count)
        if measured is not None:
            return measured
        fill, per = self.model(stages)
        return fill + count * per


class StragglerDetector:
    """Keeps the recent times of one layout; proposes a better deal of micro-batches, or of
    layers between the stages of a replica."""

    def __init__(self, config: RebalanceConfig = RebalanceConfig()) -> None:
        self.config = config
        self._replicas: dict[int, ReplicaTimes] = {}
        self._since_change = 0
        self._shared: deque[float] = deque(maxlen=config.window)
        self._change_s = 0.0
        self._compute: deque[dict[int, StageCompute]] = deque(maxlen=config.window)
        self._planned_counts: dict[int, tuple[int, ...]] = {}
        self._left: dict[int, int] | None = None
        """The deal of micro-batches the last re-deal left: going back to it takes the square
        of the minimum gain."""

    def reset(self, planned: Layout | None = None) -> None:
        """Forget every time measured: the stages changed. ``planned``: a layout the planner
        chose (at the start, after a recovery or a grow), whose layer counts a replica goes back
        to once its stages are even again."""
        self._replicas.clear()
        self._compute.clear()
        self._since_change = 0
        self._left = None
        if planned is not None:
            self._planned_counts = {replica.index: _layer_counts(replica)
                                    for replica in planned.replicas}

    def redealt(self) -> None:
        """The micro-batches were re-dealt: the stages and what was measured at each count stay;
        the next change waits for ``window`` iterations of the new deal."""
        self._since_change = 0

    def observe(self, layout: Layout, pipeline_s: dict[int, float],
                compute: dict[int, StageCompute] | None = None,
                step: StepTimes = StepTimes()) -> None:
        """Record one iteration: ``pipeline_s`` maps the first rank of each stage instance (its
        tensor-parallel peers take as long) to the time its pipeline took, ``compute`` to its
        stage's forward compute; ``step`` what the rest of the report says."""
        self._since_change += 1
        for replica in layout.replicas:
            times = self._replicas.setdefault(
                replica.index, ReplicaTimes(self.config.window, self.config.min_gain))
            times.add(replica.num_microbatches,
                      max(pipeline_s[stage.ranks[0]] for stage in replica.stages))
        self._shared.append(step.shared_s)
        self._change_s = step.change_s
        if compute is not None:
            self._compute.append(dict(compute))

    @property
    def _settled(self) -> bool:
        """Whether ``window`` iterations have been measured since the last change."""
        return self._since_change >= self.config.window

    def _shared_s(self) -> float:
        return statistics.median(self._shared) if self._shared else 0.0

    def proposal(self, layout: Layout) -> Rebalance | None:
        """The better deal of micro-batches, once it pays (module docstring); else ``None``."""
        if not self._settled or len(layout.replicas) < 2:
            return None
        if any(self._replicas[r.index].measured(r.num_microbatches) is None
               for r in layout.replicas):
            return None
        speeds, stages = [], {r.index: len(r.stages) for r in layout.replicas}
        size = layout.lockstep_size
        for replica in layout.replicas:
            fill, per = self._replicas[replica.index].model(stages[replica.index])
            speeds.append(ReplicaSpeed(replica.index, max(0, round(fill * 1e9)),
                                       max(1, round(per * 1e9))))
        # Replicas in lockstep run at the pace of the slowest of them, as many micro-batches
        # each: their set is dealt as one.
        speeds = [ReplicaSpeed(leader, max(s.fill_ns for s in members),
                               max(s.per_microbatch_ns for s in members))
                  for leader, members in _by_lockstep_set(speeds, size).items()]
        # A replica with virtual stages keeps as many micro-batches as it has stages: the
        # interleaved schedule it is built for runs no fewer.
        minimum = {r.index: len(r.stages) if r.virtual_stages > 1 else 1 for r in layout.replicas}
        counts = _at_least(expand_lockstep(
            balance_microbatches(speeds, layout.global_num_microbatches // size), size), minimum)
        if all(counts[r.index] == r.num_microbatches for r in layout.replicas):
            return None

        def step_s(deal: dict[int, int]) -> float:
            return self._shared_s() + max(self._replicas[index].predict(n, stages[index])
                                          for index, n in deal.items())

        now = {r.index: r.num_microbatches for r in layout.replicas}
        gain = step_s(now) / step_s(counts)
        needed = self.config.min_gain ** (2 if counts == self._left else 1)
        if gain < needed:
            return None
        # Like a layer move, it must pay for itself within the window: by what the last layout
        # change took here (a re-deal moves no state; none measured yet, it costs nothing).
        if self.config.window * (step_s(now) - step_s(counts)) <= self._change_s:
            return None
        self._left = now
        ids = assign_microbatch_ids(counts, {r.index: r.microbatch_ids for r in layout.replicas},
                                    layout.global_num_microbatches)
        slowest = max(speeds, key=lambda s: s.per_microbatch_ns)
        fastest = min(speeds, key=lambda s: s.per_microbatch_ns)
        reason = (f"replica {slowest.replica} takes {slowest.per_microbatch_ns / fastest.per_microbatch_ns:.2f}x "
                  f"as long per micro-batch as replica {fastest.replica}")
        new = replace(layout, replicas=tuple(r.keeping_chunks(r.stages, tuple(ids[r.index]))
                                             for r in layout.replicas))
        return Rebalance(new, gain, reason)

    def layer_proposal(self, layout: Layout) -> Rebalance | None:
        """Layers moved between the stages of replicas with a slow stage (or back to the planned
        counts where the stages are even again), once ``window`` iterations are in, the step is
        predicted ``min_gain`` faster and the move pays for itself; else ``None``."""
        if len(self._compute) < self.config.window or not self._settled:
            return None
        if layout.lockstep_size > 1:  # replicas in lockstep keep equal stages: none moves alone
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
            target, reason = self._target_counts(replica.index, leaders, counts, per_layer, rest,
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
        shared = self._shared_s()
        step_now, step_then = step_now + shared, step_then + shared
        if not reasons or step_now < self.config.min_gain * step_then:
            return None
        cost = self._change_s or step_now
        if self.config.window * (step_now - step_then) <= cost:  # it would not pay for itself
            return None
        return Rebalance(replace(layout, replicas=tuple(replicas)), step_now / step_then,
                         "; ".join(reasons))

    def _target_counts(self, index: int, leaders: list[int], counts: tuple[int, ...],
                       per_layer: list[float], rest: list[float],
                       num_layers: int) -> tuple[tuple[int, ...], str]:
        """The layer counts replica ``index`` should have, and why they differ from ``counts``
        (empty when they do not)."""
        if len(counts) < 2 or min(per_layer) <= 0:  # nothing to move, or nothing measured
            return counts, ""
        slowdown = self._persistent_slowdown(leaders, counts)
        if slowdown >= self.config.slow_stage_factor:
            target = balanced_layer_counts(per_layer, rest, num_layers)
            why = (f"a stage of replica {index} takes {slowdown:.2f}x as long per layer as "
                   f"another; its stages now hold {list(target)} layers")
        elif slowdown < math.sqrt(self.config.slow_stage_factor):
            target = self._planned_counts.get(index, counts)
            if len(target) != len(counts):
                target = counts
            why = f"the stages of replica {index} are even again: back to {list(target)} layers"
        else:  # between the two thresholds: stay
            return counts, ""
        return target, why if target != counts else ""

    def _persistent_slowdown(self, leaders: list[int], counts: tuple[int, ...]) -> float:
        """How many times as long per layer the slowest stage takes as the median of the others,
        in four iterations of five: for each stage, the 20th percentile of its per-iteration
        ratio over the window; the largest of those. Jitter that makes a different stage the
        slowest from one iteration to the next does not add up to a slow stage."""
        ratios: list[list[float]] = [[] for _ in leaders]
        for times in self._compute:
            per_layer = [times[rank].layers_s / count for rank, count in zip(leaders, counts)]
            if min(per_layer) <= 0:
                return 0.0
            for stage, own in enumerate(per_layer):
                others = statistics.median(per_layer[:stage] + per_layer[stage + 1:])
                ratios[stage].append(own / others)
        return max(sorted(stage)[len(stage) // 5] for stage in ratios)


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


def _by_lockstep_set(speeds: list[ReplicaSpeed], size: int) -> dict[int, list[ReplicaSpeed]]:
    """``speeds`` grouped by lockstep set, keyed by the set's first replica."""
    sets: dict[int, list[ReplicaSpeed]] = {}
    for speed in speeds:
        sets.setdefault(speed.replica - speed.replica % size, []).append(speed)
    return sets


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
