"""Model chunks of a layout: per layer group (Megatron's contiguous ZeRO) or per layer."""

from __future__ import annotations

import pytest

from megatron_elaswave.layout import Layout, Replica, StageInstance
from megatron_elaswave.training.layer_groups import ChunkRange, chunk_ranges


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
