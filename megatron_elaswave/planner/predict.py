"""Simulated step time, throughput and energy of a layout at given clocks.

The bridge from the planner's integer costs to :mod:`megatron_elaswave.simulator`: a stage's
forward and backward times at clock ``f`` are its nominal times times
``compute_bound_fraction / f + (1 - compute_bound_fraction)``, but for the MoE all-to-alls in
them, which no clock changes. The replicas of a lockstep set (an MoE job's replicas that share
expert-parallel groups) are simulated as one unit, at the slowest clock any of them gives each
stage: its all-to-alls wait for the slowest member.
"""

from __future__ import annotations

from megatron_elaswave.layout import Layout, Replica
from megatron_elaswave.planner.cost import CostModel
from megatron_elaswave.planner.frequency import PowerModel
from megatron_elaswave.simulator.step import ReplicaWork, StepPrediction, predict_step


def stage_work(
    cost: CostModel, ranges, clocks, load_factor=None
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Per-stage forward, backward and all-to-all seconds of one micro-batch at the given clocks
    (the all-to-alls are part of both the forward and the backward), each stage's times
    multiplied by ``load_factor[s]`` when given."""
    fraction = cost.compute_bound_fraction
    last = len(ranges) - 1
    forward, backward, all_to_all = [], [], []
    for i, ((first, end), clock) in enumerate(zip(ranges, clocks)):
        f, b = cost.stage_forward_backward_ns(first, end, is_first=i == 0, is_last=i == last)
        exchange = cost.stage_all_to_all_ns(first, end)
        factor = fraction / clock + 1 - fraction
        load = (load_factor[i] if load_factor else 1.0) / 1e9
        forward.append(((f - exchange) * factor + exchange) * load)
        backward.append(((b - exchange) * factor + exchange) * load)
        all_to_all.append(exchange * load)
    return tuple(forward), tuple(backward), tuple(all_to_all)


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


def lockstep_units(layout: Layout, clocks) -> list[tuple[Replica, tuple[float, ...], int]]:
    """``(replica, clocks, members)`` of every lockstep set of a layout whose replica ``i`` runs
    at ``clocks[i]``: its first replica (all have its stages and micro-batch count,
    :meth:`~megatron_elaswave.layout.Layout.validate`), each stage's slowest clock among its
    members, and how many they are. A dense layout's sets are its replicas."""
    units: dict[int, tuple[Replica, list[tuple[float, ...]]]] = {}
    for replica, replica_clocks in zip(layout.replicas, clocks):
        key = layout.lockstep_set(replica.index)
        units.setdefault(key, (replica, []))[1].append(tuple(replica_clocks))
    return [(first, tuple(min(stage) for stage in zip(*members)), len(members))
            for first, members in units.values()]


def layout_prediction(
    cost: CostModel, layout: Layout, clocks, idle_devices: int, power: PowerModel
) -> StepPrediction:
    """Simulate a layout whose replica ``i`` runs its stages at ``clocks[i]``, each lockstep set
    as one unit."""
    work, built = [], {}
    for replica, unit_clocks, members in lockstep_units(layout, clocks):
        ranges = tuple((s.first_layer, s.last_layer) for s in replica.stages)
        key = (ranges, unit_clocks)
        if key not in built:  # replicas of one shape share their costs
            built[key] = (
                stage_work(cost, ranges, unit_clocks),
                stage_sync_s(cost, ranges, len(layout.replicas)),
            )
        (forward, backward, all_to_all), sync = built[key]
        work.append(
            ReplicaWork(
                forward_s=forward,
                backward_s=backward,
                devices=tuple(len(s.ranks) for s in replica.stages),
                clocks=unit_clocks,
                num_microbatches=replica.num_microbatches,
                send_s=cost.send_ns / 1e9,
                sync_s=sync,
                num_chunks=replica.virtual_stages,
                all_to_all_s=all_to_all,
                lockstep=members,
            )
        )
    return predict(cost, work, idle_devices, power)
