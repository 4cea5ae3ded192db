"""Simulated step time, throughput and energy of a layout at given clocks.

The bridge from the planner's integer costs to :mod:`megatron_elaswave.simulator`: a stage's
forward and backward times at clock ``f`` are its nominal times times
``compute_bound_fraction / f + (1 - compute_bound_fraction)``.
"""

from __future__ import annotations

from megatron_elaswave.layout import Layout
from megatron_elaswave.planner.cost import CostModel
from megatron_elaswave.planner.frequency import PowerModel
from megatron_elaswave.simulator.step import ReplicaWork, StepPrediction, predict_step


def stage_work(
    cost: CostModel, ranges, clocks, load_factor=None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-stage forward and backward seconds of one micro-batch at the given clocks, each stage's
    times multiplied by ``load_factor[s]`` when given."""
    fraction = cost.compute_bound_fraction
    last = len(ranges) - 1
    forward, backward = [], []
    for i, ((first, end), clock) in enumerate(zip(ranges, clocks)):
        f, b = cost.stage_forward_backward_ns(first, end, is_first=i == 0, is_last=i == last)
        factor = (fraction / clock + 1 - fraction) * (load_factor[i] if load_factor else 1.0) / 1e9
        forward.append(f * factor)
        backward.append(b * factor)
    return tuple(forward), tuple(backward)


def stage_sync_s(cost: CostModel, ranges, num_replicas: int) -> float:
    """Data-parallel synchronisation of the slowest stage of a pipeline with these layer ranges."""
    last = len(ranges) - 1
    return (
        max(
            cost.stage_sync_ns(first, end, is_first=i == 0, is_last=i == last, num_replicas=num_replicas)
            for i, (first, end) in enumerate(ranges)
        )
        / 1e9
    )


def predict(
    cost: CostModel, replicas: list[ReplicaWork], idle_devices: int, power: PowerModel
) -> StepPrediction:
    """Simulate replicas of the job of ``cost``, each with its schedule (1F1B, or interleaved
    for a replica of several chunks per stage)."""
    return predict_step(
        replicas,
        micro_batch_size=cost.job.micro_batch_size,
        tokens_per_microbatch=cost.tokens_per_microbatch,
        idle_devices=idle_devices,
        power=power,
    )


def layout_prediction(
    cost: CostModel, layout: Layout, clocks, idle_devices: int, power: PowerModel
) -> StepPrediction:
    """Simulate a layout whose replica ``i`` runs its stages at ``clocks[i]``."""
    work, built = [], {}
    for replica, replica_clocks in zip(layout.replicas, clocks):
        ranges = tuple((s.first_layer, s.last_layer) for s in replica.stages)
        key = (ranges, tuple(replica_clocks))
        if key not in built:  # replicas of one shape share their costs
            built[key] = (
                *stage_work(cost, ranges, replica_clocks),
                stage_sync_s(cost, ranges, len(layout.replicas)),
            )
        forward, backward, sync = built[key]
        work.append(
            ReplicaWork(
                forward_s=forward,
                backward_s=backward,
                devices=tuple(len(s.ranks) for s in replica.stages),
                clocks=tuple(replica_clocks),
                num_microbatches=replica.num_microbatches,
                send_s=cost.send_ns / 1e9,
                sync_s=sync,
                num_chunks=replica.virtual_stages,
            )
        )
    return predict(cost, work, idle_devices, power)
