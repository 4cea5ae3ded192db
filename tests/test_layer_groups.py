"""Model chunks of a layout: per layer group (Megatron's contiguous ZeRO) or per layer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_elaswave.layout import Layout, Replica, StageInstance
from megatron_elaswave.training.step.layer_groups import ChunkRange, chunk_ranges


def heterogeneous_layout() -> Layout:
    """Replica 0 on one stage, replica 1 on stages of 1 and 3 layers: layer groups [0], [1-3]."""
    return Layout(num_layers=4, replicas=(
        Replica(0, (StageInstance((0,), 0, 3),), (0, 1)),
        Replica(1, (StageInstance((1,), 0, 0), StageInstance((2,), 1, 3)), (2, 3)),
    ))


def test_contiguous_chunks_are_the_layer_groups():
    assert chunk_ranges(heterogeneous_layout(), "contiguous") == [
        ChunkRange(0, 0, layer_group=0), ChunkRange(1, 3, layer_group=1)]


def test_interleaved_chunks_are_the_layers_each_in_its_layer_groups_data_parallel_group():
    assert chunk_ranges(heterogeneous_layout(), "interleaved") == [
        ChunkRange(0, 0, 0), ChunkRange(1, 1, 1), ChunkRange(2, 2, 1), ChunkRange(3, 3, 1)]


def test_an_unknown_sharding_is_refused():
    with pytest.raises(ValueError, match="interleaved or contiguous"):
        chunk_ranges(heterogeneous_layout(), "striped")


def test_separate_grad_norm_groups_are_agreed_on_once_for_all_of_a_ranks_optimizers(monkeypatch):
    """megatron-core 0.19 asks each optimizer once, with one reduction each: a rank with more
    layer groups would issue more. One reduction answers for all (stand-ins for the optimizers;
    the tagged parameter belongs to the second)."""
    from megatron_elaswave.patches import optimizer as optimizer_patch

    monkeypatch.setattr(optimizer_patch, "_separate_grad_norm_groups",
                        lambda: (("mtp", "other"), "grad_norm_group"))
    tagged = torch.nn.Parameter(torch.zeros(1))
    tagged.grad_norm_group = "mtp"
    first = SimpleNamespace(get_parameters=lambda: [torch.nn.Parameter(torch.zeros(1))])
    second = SimpleNamespace(get_parameters=lambda: [tagged])
    chained = SimpleNamespace(chained_optimizers=[first, second])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        optimizer_patch.agree_grad_norm_groups(chained, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    for optimizer in (chained, first, second):
        assert optimizer._has_grad_norm_group_cache == {"mtp": True, "other": False}
