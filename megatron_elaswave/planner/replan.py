"""The ElasWave recovery plan: a pure function of (old layout, failed ranks, costs).

:func:`plan_recovery` combines the four schedules:

1. graph: a replica that lost stage instances re-partitions its layers over its surviving stages
   (:mod:`~megatron_elaswave.planner.graph`); the surviving members of a failed stage instance
   become spares;
2. a replica with no stage left, or whose layers no longer fit its stages' memory, is dissolved:
   its live ranks become spares. Dissolving a replica enlarges everyone's optimizer share, so the
   memory check repeats until no replica dissolves;
3. dataflow: the global batch's micro-batch ids are dealt over the remaining replicas in proportion
   to their speed (:mod:`~megatron_elaswave.planner.dataflow`);

Replicas that share expert-parallel groups (a lockstep set of an MoE job,
:meth:`~megatron_elaswave.layout.Layout.lockstep_set`) are planned as one: each keeps as many
stages as the most damaged of them has left (:func:`keep_lockstep`; the others' extra stages
become spares), all take the first one's partition, the set is dissolved whole, and micro-batches
are dealt to it one per member at a time. Their experts stay on the ranks at the same expert
coordinates, so no expert is re-sharded; the layers move as in a dense job, their experts with
them.
4. ZeRO migration (:mod:`~megatron_elaswave.planner.zero`) and clocks
   (:mod:`~megatron_elaswave.planner.frequency`).

Every decision is taken on integers, so all survivors that evaluate it compute the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from megatron_elaswave.layout import Layout, StageInstance
from megatron_elaswave.planner.cost import CostModel
from megatron_elaswave.planner.dataflow import assign_microbatch_ids, balance_microbatches, pipeline_speed
from megatron_elaswave.planner.frequency import ClockPlan, PowerModel, ReplicaLoad, plan_clocks, stage_load
from megatron_elaswave.planner.graph import PartitionProblem, solve_partition
from megatron_elaswave.planner.predict import layout_prediction
from megatron_elaswave.planner.zero import MigrationPlan, interleaved_migration


class PlanError(RuntimeError):
    """The failed set leaves the job unable to run (no replica can hold the model)."""


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of :func:`plan_recovery`."""

    tolerance: float = 0.02
    """Relative slack on the optimal bottleneck within which a partition moving fewer bytes wins."""
    dvfs: bool = True
    """Plan per-stage clocks; otherwise every stage runs at the nominal clock."""
    power: PowerModel = field(default_factory=PowerModel)
    """Power model and clock levels for the clock plan."""
    migration: bool = True
    """Plan the migration's transfers, taking the failed ranks' optimizer state from their
    first snapshot buddy in the old layout (:class:`~.zero.StateLostError` when that failed
    too). A running job, which knows which snapshots its survivors hold, turns it off."""

    def __post_init__(self) -> None:
        if not self.tolerance >= 0:
            raise ValueError("tolerance must be non-negative")


@dataclass(frozen=True)
class RecoveryPlan:
    """The new layout and everything needed to reach and run it."""

    layout: Layout
    failed_ranks: frozenset[int]
    dissolved_replicas: tuple[int, ...]
    """Replicas that no longer run; their live ranks are spares."""
    migration: MigrationPlan | None
    """``None`` when :attr:`PlanOptions.migration` is off."""
    clocks: ClockPlan
    """Clocks in the order of ``layout.replicas`` and their stages."""

    def frequencies(self) -> dict[int, float]:
        """Relative clock (1.0 = nominal) of every rank that holds a stage."""
        return {
            rank: clock
            for replica, replica_clocks in zip(self.layout.replicas, self.clocks.clocks)
            for stage, clock in zip(replica.stages, replica_clocks)
            for rank in stage.ranks
        }


def stage_times_ns(cost: CostModel, stages: tuple[StageInstance, ...]) -> list[tuple[int, int]]:
    """``(forward, backward)`` per micro-batch of each stage of a pipeline."""
    last = len(stages) - 1
    return [
        cost.stage_forward_backward_ns(s.first_layer, s.last_layer, is_first=i == 0, is_last=i == last)
        for i, s in enumerate(stages)
    ]


def sync_ns(cost: CostModel, layout: Layout) -> int:
    """Data-parallel synchronisation time of the slowest stage instance."""
    n = len(layout.replicas)
    slowest = 0
    seen = set()
    for replica in layout.replicas:
        last = len(replica.stages) - 1
        for i, s in enumerate(replica.stages):
            key = (s.first_layer, s.last_layer, i == 0, i == last)
            if key not in seen:
                seen.add(key)
                slowest = max(
                    slowest, cost.stage_sync_ns(*key[:2], is_first=key[2], is_last=key[3], num_replicas=n)
                )
    return slowest


def replica_loads(cost: CostModel, layout: Layout) -> list[ReplicaLoad]:
    """The clock planner's view of every replica of a layout."""
    cache: dict[tuple, tuple] = {}
    loads = []
    for replica in layout.replicas:
        key = tuple((s.first_layer, s.last_layer, len(s.ranks)) for s in replica.stages)
        if key not in cache:
            cache[key] = tuple(
                stage_load(f, b, len(s.ranks), cost.compute_bound_fraction,
                           2 * cost.stage_all_to_all_ns(s.first_layer, s.last_layer))
                for (f, b), s in zip(stage_times_ns(cost, replica.stages), replica.stages)
            )
        loads.append(ReplicaLoad(cache[key], replica.num_microbatches, cost.send_ns))
    return loads


def nominal_clock_plan(cost: CostModel, layout: Layout, idle_devices: int, power: PowerModel) -> ClockPlan:
    """A clock plan with every stage at the nominal clock (no DVFS)."""
    one_level = PowerModel(power.static_w, power.dynamic_w, power.exponent, (1.0,))
    return plan_clocks(
        replica_loads(cost, layout), sync_ns=sync_ns(cost, layout), idle_devices=idle_devices, power=one_level
    )


def _fits(cost: CostModel, stages: tuple[StageInstance, ...], num_replicas: int, cache: dict) -> bool:
    key = (tuple((s.first_layer, s.last_layer) for s in stages), num_replicas)
    if key not in cache:
        cache[key] = all(
            cost.fits(cost.stage_memory_bytes(s.first_layer, s.last_layer, i, len(stages), num_replicas))
            for i, s in enumerate(stages)
        )
    return cache[key]


def repartition(
    cost: CostModel,
    before: tuple[StageInstance, ...],
    stages: tuple[StageInstance, ...],
    num_replicas: int,
    tolerance: float,
) -> tuple[StageInstance, ...] | None:
    """New layer ranges for a replica's live ``stages`` (in pipeline order), given the ranges it
    had ``before``; ``None`` when the layers cannot fit their memory."""
    num_layers = cost.job.num_layers
    index_of = {s.ranks: i for i, s in enumerate(stages)}
    current = [-1] * num_layers
    for s in before:
        if s.ranks in index_of:
            for layer in range(s.first_layer, s.last_layer + 1):
                current[layer] = index_of[s.ranks]
    count = len(stages)
    problem = PartitionProblem(
        layer_time_ns=cost.layer_time_ns,
        layer_static_bytes=cost.layer_static_bytes(num_replicas),
        layer_activation_bytes=cost.activation_bytes,
        stage_extra_time_ns=[
            (cost.embedding.forward_ns + cost.embedding.backward_ns if i == 0 else 0)
            + (cost.loss.forward_ns + cost.loss.backward_ns if i == count - 1 else 0)
            for i in range(count)
        ],
        stage_extra_bytes=[cost.stage_extra_bytes(i, count, num_replicas) for i in range(count)],
        stage_in_flight=[count - i for i in range(count)],
        memory_cap_bytes=cost.memory_cap_bytes,
        layer_move_bytes=cost.layer_move_bytes(num_replicas),
        current_stage=current,
        tolerance=tolerance,
    )
    partition = solve_partition(problem)
    if partition is None:
        return None
    return tuple(StageInstance(s.ranks, first, last) for s, (first, last) in zip(stages, partition.ranges))


def keep_lockstep(old: Layout, survivors: dict[int, tuple[StageInstance, ...]]
                  ) -> dict[int, tuple[StageInstance, ...]]:
    """The surviving stages each replica keeps so that the replicas of a lockstep set
    (:meth:`~megatron_elaswave.layout.Layout.lockstep_set`) keep as many: the fewest any of them
    has left. A replica keeps first the stage positions every member still has, then its
    lowest others; the rest of its stages become spares. A set with a replica left without a
    stage leaves the job whole."""
    size = old.lockstep_size
    if size == 1:
        return survivors
    kept = dict(survivors)
    by_set: dict[int, list] = {}
    for replica in old.replicas:
        by_set.setdefault(old.lockstep_set(replica.index), []).append(replica)
    for members in by_set.values():
        positions = {r.index: [s for s, stage in enumerate(r.stages) if stage in survivors[r.index]]
                     for r in members}
        count = min(len(p) for p in positions.values())
        common = set.intersection(*(set(p) for p in positions.values()))
        for replica in members:
            own = positions[replica.index]
            chosen = sorted(common)[:count]
            chosen += [s for s in own if s not in common][:count - len(chosen)]
            kept[replica.index] = tuple(replica.stages[s] for s in sorted(chosen))
    return kept


def expand_lockstep(counts: dict[int, int], size: int) -> dict[int, int]:
    """Micro-batch counts per replica from counts per lockstep set, keyed by the set's first
    replica (``size`` replicas from it each run that many)."""
    return {leader + k: count for leader, count in counts.items() for k in range(size)}


def plan_recovery(
    old: Layout, failed_ranks: Iterable[int], cost: CostModel, options: PlanOptions = PlanOptions()
) -> RecoveryPlan:
    """Plan the layout that follows the failure of ``failed_ranks`` (module docstring)."""
    failed = frozenset(failed_ranks)
    unknown = sorted(failed - old.known_ranks())
    if unknown:
        raise ValueError(f"ranks {unknown} are not part of the job")
    spares = set(old.spares) - failed
    survivors: dict[int, tuple[StageInstance, ...]] = {}
    for replica in old.replicas:
        intact = []
        for stage in replica.stages:
            if failed.isdisjoint(stage.ranks):
                intact.append(stage)
            else:
                spares.update(set(stage.ranks) - failed)
        survivors[replica.index] = tuple(intact)

    alive = survivors
    survivors = keep_lockstep(old, alive)
    fit_cache: dict = {}
    live = [r for r in old.replicas if survivors[r.index]]
    size = old.lockstep_size
    while True:
        if not live:
            raise PlanError(
                f"failing ranks {sorted(failed)} leaves no replica that can hold the model "
                f"(memory cap {cost.memory_cap_bytes} bytes per device)"
            )
        n = len(live)
        placed: dict[int, tuple[StageInstance, ...]] = {}
        for replica in live:
            kept = survivors[replica.index]
            leader = replica.index - replica.index % size
            if leader != replica.index:  # a lockstep set runs its first replica's partition
                if leader in placed:
                    placed[replica.index] = tuple(
                        StageInstance(stage.ranks, ranges.first_layer, ranges.last_layer)
                        for stage, ranges in zip(kept, placed[leader]))
            elif kept == replica.stages and _fits(cost, kept, n, fit_cache):
                placed[replica.index] = kept
            else:
                stages = repartition(cost, replica.stages, kept, n, options.tolerance)
                if stages is not None:
                    placed[replica.index] = stages
        if len(placed) == n:
            break
        live = [r for r in live if r.index in placed]

    dissolved = tuple(sorted(r.index for r in old.replicas if r.index not in placed))
    for replica in old.replicas:
        held = {rank for s in placed.get(replica.index, ()) for rank in s.ranks}
        spares.update({rank for s in alive[replica.index] for rank in s.ranks} - held)

    # Replicas in lockstep run as many micro-batches each: the global batch is dealt over the
    # sets, in units of one micro-batch per member.
    speeds = [
        pipeline_speed(index, stage_times_ns(cost, stages), cost.send_ns)
        for index, stages in sorted(placed.items()) if index % size == 0
    ]
    total = old.global_num_microbatches
    counts = expand_lockstep(balance_microbatches(speeds, total // size), size)
    ids = assign_microbatch_ids(counts, {r.index: r.microbatch_ids for r in old.replicas}, total)
    layout = old.with_replicas(
        tuple(old.replica_by_index()[index].keeping_chunks(placed[index], ids[index])
              for index in sorted(placed)),
        tuple(sorted(spares)),
    )
    migration = interleaved_migration(old, layout, failed, cost) if options.migration else None
    return RecoveryPlan(layout, failed, dissolved, migration, choose_clocks(cost, layout, options))


def choose_clocks(cost: CostModel, layout: Layout, options: PlanOptions) -> ClockPlan:
    """The DVFS clock plan when the discrete-event simulator confirms that it is faster, or as
    fast and cheaper in energy, than nominal clocks (the clock planner's 1F1B model is an upper
    bound that can misjudge pipelines with uneven stages); nominal clocks otherwise."""
    idle = len(layout.spares)
    nominal = nominal_clock_plan(cost, layout, idle, options.power)
    if not options.dvfs:
        return nominal
    scaled = plan_clocks(
        replica_loads(cost, layout), sync_ns=sync_ns(cost, layout), idle_devices=idle, power=options.power
    )

    def simulated(plan: ClockPlan) -> tuple[float, float]:
        step = layout_prediction(cost, layout, plan.clocks, idle, options.power)
        return step.step_time_s, step.energy_j

    return scaled if simulated(scaled) < simulated(nominal) else nominal


def plan_replica_drop(old: Layout, failed_ranks: Iterable[int], *, keep_global_batch: bool) -> Layout:
    """The executable baselines: every replica with a failed rank stops, no layer moves.

    Its surviving ranks become spares. With ``keep_global_batch`` (``reroute``, ReCycle-style at
    replica granularity) its micro-batches are dealt round-robin over the remaining replicas, so
    the global batch and its samples stay those of the failure-free run; without it
    (``drop-replica``, TorchFT-style) they are dropped: the global batch shrinks and the kept
    micro-batches are renumbered in order. Replicas in lockstep stop together, and get the lost
    micro-batches one per member at a time.
    """
    failed = frozenset(failed_ranks)
    broken = {old.lockstep_set(r.index) for r in old.replicas
              if any(not failed.isdisjoint(stage.ranks) for stage in r.stages)}
    kept = [r for r in old.replicas if old.lockstep_set(r.index) not in broken]
    if not kept:
        raise PlanError(f"failing ranks {sorted(failed)} leaves no intact replica")
    lost = sorted(i for r in old.replicas if r not in kept for i in r.microbatch_ids)
    ids = {r.index: list(r.microbatch_ids) for r in kept}
    if keep_global_batch:
        size = old.lockstep_size
        for n, microbatch in enumerate(lost):
            ids[kept[(n // size * size) % len(kept) + n % size].index].append(microbatch)
        ids = {index: sorted(values) for index, values in ids.items()}
    else:
        order = sorted(i for values in ids.values() for i in values)
        renumber = {old_id: new_id for new_id, old_id in enumerate(order)}
        ids = {index: [renumber[i] for i in values] for index, values in ids.items()}
    spares = set(old.spares) | {
        rank for r in old.replicas if r not in kept for s in r.stages for rank in s.ranks
    }
    return old.with_replicas(
        tuple(r.keeping_chunks(r.stages, tuple(ids[r.index])) for r in kept),
        tuple(sorted(spares - failed)),
    )
