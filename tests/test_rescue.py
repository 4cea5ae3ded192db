"""The checkpoint layout the survivors save from when they cannot continue."""

from __future__ import annotations

from megatron_elaswave.layout import Layout
from megatron_elaswave.training.recovery.rescue import checkpoint_layout


def grid(tp: int, pp: int, dp: int, num_layers: int = 8) -> Layout:
    return Layout.megatron(tp=tp, pp=pp, dp=dp, num_layers=num_layers, num_microbatches=2 * dp)


def stages(layout: Layout) -> list[tuple[tuple[int, ...], int, int]]:
    [replica] = layout.replicas
    return [(s.ranks, s.first_layer, s.last_layer) for s in replica.stages]


def test_the_first_stage_lost_everywhere_is_rebuilt_from_intact_later_stages():
    # TP2 x PP2 x DP2: ranks 0 and 2 are TP rank 0 of stage 0 in replicas 0 and 1.
    layout = checkpoint_layout(grid(2, 2, 2), {0, 2})
    assert stages(layout) == [((4, 5), 0, 3), ((6, 7), 4, 7)]
    assert layout.spares == (1, 3)
    assert layout.replicas[0].microbatch_ids == (0, 1, 2, 3)
    layout.validate()


def test_instances_at_distinct_positions_come_first_so_fewer_layers_move():
    # TP1 x PP4 x DP2: replica 0 lost stage 1 (rank 2), replica 1 lost stage 3 (rank 7).
    layout = checkpoint_layout(grid(1, 4, 2), {2, 7})
    assert stages(layout) == [((0,), 0, 1), ((3,), 2, 3), ((4,), 4, 5), ((6,), 6, 7)]
    assert layout.spares == (1, 5)


def test_fewer_intact_instances_than_stages_split_the_layers_unevenly():
    # TP1 x PP4 x DP2: three instances survive (ranks 5, 6, 7) for eight layers.
    layout = checkpoint_layout(grid(1, 4, 2), {0, 1, 2, 3, 4})
    assert stages(layout) == [((5,), 0, 2), ((6,), 3, 5), ((7,), 6, 7)]
    assert checkpoint_layout(grid(1, 2, 1), {1}).spares == ()


def test_nothing_to_save_from_when_every_stage_lost_a_tensor_parallel_rank():
    assert checkpoint_layout(grid(2, 2, 1), {0, 3}) is None
