"""Where the survivors put the model when they cannot train it any more.

When no layout of the survivors can hold the model (the planner raises ``PlanError``), the job
stops, but its state is not lost as long as every piece of it survives somewhere (own snapshots
and replicas). The survivors then gather it, one last time, into the *checkpoint layout*: a
single replica whose stages are intact tensor-parallel groups, the layers split evenly over
them, every other survivor a spare. A replica with one data-parallel rank per layer owns every
parameter and optimizer element, which is the shape ``dist_checkpointing`` saves from, and the
checkpoint (the fully reshardable format) loads into any layout of a new launch.

The checkpoint layout only needs the memory of one replica spread over the intact stage
instances, with no room for activations: it exists for the save, not for training.

An MoE job whose expert-parallel groups span replicas needs one whole lockstep set to hold every
expert: the checkpoint layout then has that many replicas of equal depth, each rank taking the
experts of its new coordinates from the snapshots.
"""

from __future__ import annotations

from megatron_elaswave.layout import Layout, Replica, StageInstance


def checkpoint_layout(layout: Layout, failed: frozenset[int] | set[int]) -> Layout | None:
    """The single-replica layout the survivors of ``failed`` save from (module docstring), or
    ``None`` when no stage instance survived whole.

    At most as many stages as the deepest replica had; instances are taken in the order of the
    layers they held, one per distinct position first, so most layers stay where they were.
    Replicas in lockstep need as many stages each (``None`` when fewer than one per replica
    survived).
    """
    intact = [(stage.first_layer, replica.index, stage)
              for replica in layout.replicas for stage in replica.stages
              if failed.isdisjoint(stage.ranks)]
    if not intact:
        return None
    intact.sort(key=lambda item: item[:2])
    depth = max(len(replica.stages) for replica in layout.replicas)
    distinct, others, seen = [], [], set()
    for first_layer, _, stage in intact:
        (others if first_layer in seen else distinct).append(stage)
        seen.add(first_layer)
    size = layout.lockstep_size
    depth = min(depth, len(intact) // size)
    if depth == 0:
        return None
    ordered = distinct + others
    total = layout.global_num_microbatches
    replicas = []
    for index in range(size):
        chosen = sorted(ordered[index * depth:(index + 1) * depth], key=lambda s: s.first_layer)
        stages, first = [], 0
        for position, stage in enumerate(chosen):
            count = layout.num_layers // depth + (position < layout.num_layers % depth)
            stages.append(StageInstance(stage.ranks, first, first + count - 1))
            first += count
        replicas.append(Replica(index, tuple(stages), tuple(range(index, total, size))))
    used = {rank for replica in replicas for stage in replica.stages for rank in stage.ranks}
    survivors = layout.known_ranks() - set(failed)
    return layout.with_replicas(tuple(replicas), tuple(sorted(survivors - used)))
