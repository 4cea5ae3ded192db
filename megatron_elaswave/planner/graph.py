"""Graph scheduling: a minimax contiguous partition of a replica's layers over its stages.

:func:`solve_partition` guarantees, for a :class:`PartitionProblem`:

* every stage gets a non-empty contiguous range, and the ranges cover the layers in order;
* every stage fits its memory cap;
* the slowest stage is as fast as any partition allows (``optimal_bottleneck_ns``);
* among the partitions whose slowest stage is within ``tolerance`` of that optimum, the returned one
  moves the fewest bytes; ties go to the faster bottleneck, then to the earliest boundaries.

Both passes are exact dynamic programmes over integers, ``O(stages * layers^2)``, vectorised with
numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

_INF = np.int64(2**62)


@dataclass(frozen=True)
class PartitionProblem:
    """One replica's layers and stages, with all costs as integers (nanoseconds, bytes)."""

    layer_time_ns: Sequence[int]
    """Forward plus backward time of each layer for one micro-batch."""
    layer_static_bytes: Sequence[int]
    """Memory of each layer that does not depend on the schedule (parameters, gradients, optimizer)."""
    layer_activation_bytes: Sequence[int]
    """Activation memory of each layer per micro-batch in flight."""
    stage_extra_time_ns: Sequence[int]
    """Per stage: time of what it holds besides layers (embedding on the first, loss on the last)."""
    stage_extra_bytes: Sequence[int]
    """Per stage: memory of what it holds besides layers."""
    stage_in_flight: Sequence[int]
    """Per stage: micro-batches whose activations it holds at peak."""
    memory_cap_bytes: int | None
    """Memory each stage must fit in; ``None`` for no cap."""
    layer_move_bytes: Sequence[int]
    """Bytes to copy when a layer lands on a stage that does not hold it now."""
    current_stage: Sequence[int]
    """Per layer: index of the stage that holds it now, or -1 when no live stage does."""
    tolerance: float = 0.0
    """Relative slack on the optimal bottleneck within which fewer moved bytes win."""

    def __post_init__(self) -> None:
        num_layers, num_stages = len(self.layer_time_ns), len(self.stage_extra_time_ns)
        per_layer = (
            self.layer_static_bytes,
            self.layer_activation_bytes,
            self.layer_move_bytes,
            self.current_stage,
        )
        if any(len(v) != num_layers for v in per_layer):
            raise ValueError("every per-layer sequence must have one entry per layer")
        if len(self.stage_extra_bytes) != num_stages or len(self.stage_in_flight) != num_stages:
            raise ValueError("every per-stage sequence must have one entry per stage")
        if not 1 <= num_stages <= num_layers:
            raise ValueError(f"cannot give {num_layers} layers to {num_stages} non-empty stages")
        if any(not -1 <= s < num_stages for s in self.current_stage):
            raise ValueError("current_stage entries must be -1 or a stage index")
        if not self.tolerance >= 0:
            raise ValueError("tolerance must be non-negative")

    @property
    def num_layers(self) -> int:
        return len(self.layer_time_ns)

    @property
    def num_stages(self) -> int:
        return len(self.stage_extra_time_ns)


@dataclass(frozen=True)
class Partition:
    """A solution of a :class:`PartitionProblem`."""

    ranges: tuple[tuple[int, int], ...]
    """Per stage, ``(first, last)`` layer, inclusive."""
    bottleneck_ns: int
    """Time of the slowest stage of this partition."""
    optimal_bottleneck_ns: int
    """Time of the slowest stage of a minimax-optimal partition."""
    moved_bytes: int
    """Bytes copied to reach this partition."""


def _prefix(values: Sequence[int]) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(np.asarray(values, dtype=np.int64))))


def solve_partition(problem: PartitionProblem) -> Partition | None:
    """The partition described in the module docstring, or ``None`` when no partition fits memory."""
    num_layers, num_stages = problem.num_layers, problem.num_stages
    time_prefix = _prefix(problem.layer_time_ns)
    static_prefix = _prefix(problem.layer_static_bytes)
    activation_prefix = _prefix(problem.layer_activation_bytes)
    move_prefix = _prefix(problem.layer_move_bytes)
    current = np.asarray(problem.current_stage)
    move = np.asarray(problem.layer_move_bytes, dtype=np.int64)

    # Matrices indexed [j, i]: the stage holds layers j..i-1.
    span = lambda prefix: prefix[None, :] - prefix[:, None]  # noqa: E731
    time_span, static_span, activation_span = span(time_prefix), span(static_prefix), span(activation_prefix)
    total_moved_span = span(move_prefix)
    non_empty = np.triu(np.ones((num_layers + 1, num_layers + 1), dtype=bool), k=1)

    stage_time, stage_ok, stage_moved = [], [], []
    for s in range(num_stages):
        stage_time.append(time_span + problem.stage_extra_time_ns[s])
        memory = static_span + problem.stage_in_flight[s] * activation_span + problem.stage_extra_bytes[s]
        ok = (
            non_empty
            if problem.memory_cap_bytes is None
            else non_empty & (memory <= problem.memory_cap_bytes)
        )
        stage_ok.append(ok)
        kept_prefix = _prefix(np.where(current == s, move, 0))
        stage_moved.append(total_moved_span - span(kept_prefix))

    # Pass 1: the minimax bottleneck.
    best = np.where(stage_ok[0][0], stage_time[0][0], _INF)
    for s in range(1, num_stages):
        candidates = np.maximum(best[:, None], stage_time[s])
        candidates = np.where(stage_ok[s] & (best[:, None] < _INF), candidates, _INF)
        best = candidates.min(axis=0)
    optimum = int(best[num_layers])
    if optimum >= _INF:
        return None
    threshold = int(optimum * (1.0 + problem.tolerance))

    # Pass 2: fewest moved bytes, then fastest bottleneck, among stages no slower than threshold.
    allowed = [ok & (t <= threshold) for ok, t in zip(stage_ok, stage_time)]
    moved = np.where(allowed[0][0], stage_moved[0][0], _INF)
    bottleneck = np.where(allowed[0][0], stage_time[0][0], _INF)
    choices = []
    for s in range(1, num_stages):
        reachable = allowed[s] & (moved[:, None] < _INF)
        cand_moved = np.where(reachable, moved[:, None] + stage_moved[s], _INF)
        cand_bottleneck = np.where(reachable, np.maximum(bottleneck[:, None], stage_time[s]), _INF)
        least_moved = cand_moved.min(axis=0)
        tied = cand_moved == least_moved[None, :]
        least_bottleneck = np.where(tied, cand_bottleneck, _INF).min(axis=0)
        choice = np.argmax(tied & (cand_bottleneck == least_bottleneck[None, :]), axis=0)
        choices.append(choice)
        moved, bottleneck = least_moved, least_bottleneck

    ends = [num_layers]
    for choice in reversed(choices):
        ends.append(int(choice[ends[-1]]))
    ends.append(0)
    ends.reverse()
    ranges = tuple((ends[s], ends[s + 1] - 1) for s in range(num_stages))
    return Partition(
        ranges=ranges,
        bottleneck_ns=int(bottleneck[num_layers]),
        optimal_bottleneck_ns=optimum,
        moved_bytes=int(moved[num_layers]),
    )
