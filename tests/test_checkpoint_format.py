"""Megatron's ``torch_dist`` checkpoint written rank by rank from flat shards
(``patches/dist_checkpointing.py``), in one process: the boxes a flat range covers, and a stack
of layers written as flat shards by several "ranks", merged, and read back by megatron-core's
``dist_checkpointing.load`` in other pieces."""

from __future__ import annotations

import datetime
import math

import pytest
import torch
import torch.distributed as dist

from megatron_elaswave.device import DeviceBackend
from megatron_elaswave.patches import PatchRegistry, device_compat
from megatron_elaswave.patches.dist_checkpointing import (
    Box,
    Placement,
    Segment,
    flat_range_boxes,
    merge_parts,
    segment_boxes,
    write_common,
    write_expected,
    write_index,
    write_part,
)


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4, 5), (2, 1, 3, 4)])
def test_the_boxes_of_a_flat_range_cover_it_exactly_in_order(shape):
    total = math.prod(shape)
    reference = torch.arange(total).view(shape)
    for start in range(0, total, 3):
        for end in range(start, total + 1, 5):
            covered = []
            boxes = list(flat_range_boxes(shape, start, end))
            for offsets, sizes, flat_start, flat_end in boxes:
                box = reference[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                # Each box is the contiguous run of elements it claims.
                assert box.reshape(-1).tolist() == list(range(flat_start, flat_end))
                covered += box.reshape(-1).tolist()
            assert covered == list(range(start, end)), (shape, start, end)
            assert len(boxes) <= 2 * len(shape) - 1


@pytest.fixture
def one_rank():
    backend = DeviceBackend("cpu")
    compat = PatchRegistry()
    device_compat.register(compat, backend)
    compat.apply()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()
    compat.remove()


def test_layers_written_as_flat_shards_load_in_other_pieces(one_rank, tmp_path):
    """Two layers of (4, 6), stacked along a first axis as Megatron keys decoder layers, each
    split into flat shards the way a distributed optimizer splits a parameter (no shard a whole
    number of rows), written by one "rank" per shard as weights in bf16 and fp32 optimizer
    state. The merged index covers both tensors exactly; ``dist_checkpointing.load`` reads them
    back as column halves of each layer, as a tensor-parallel layout of 2 asks for them."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    layers = torch.randn(2, 4, 6)
    shards = {0: [(0, 7), (7, 24)], 1: [(0, 13), (13, 19), (19, 24)]}
    parts = []
    for layer, ranges in shards.items():
        segment = Segment(0, 24, Placement("decoder.layers.w", (2, 4, 6), (layer, 0, 0), (4, 6),
                                           torch.bfloat16))
        for start, end in ranges:
            values = layers[layer].reshape(-1)[start:end]
            part = f"rank{len(parts)}"
            write_part(str(tmp_path), part,
                       [*segment_boxes(segment, start, values, dtype=torch.bfloat16),
                        *segment_boxes(segment, start, values,
                                       key_prefix="optimizer.state.param.")],
                       {f"decoder.layers.w._extra_state/shard_{layer}_2": None})
            parts.append(part)
    merged = merge_parts(str(tmp_path), parts)
    assert merged.gaps == []
    write_index(str(tmp_path), merged)
    write_common(str(tmp_path), {"iteration": 3})
    partial = merge_parts(str(tmp_path), parts[1:])  # a writer missing: the index says so
    assert [gap.split(":")[0] for gap in partial.gaps] == [
        "decoder.layers.w", "optimizer.state.param.decoder.layers.w"]

    template = {}
    for key, dtype in (("decoder.layers.w", torch.bfloat16),
                       ("optimizer.state.param.decoder.layers.w", torch.float32)):
        for layer in range(2):
            for half in range(2):
                template[f"{key}/{layer}/{half}"] = ShardedTensor.from_rank_offsets(
                    key, torch.zeros(4, 3, dtype=dtype), (0, layer, 2), (2, half, 2),
                    prepend_axis_num=1)
    loaded = dist_checkpointing.load(template, str(tmp_path))
    assert loaded["iteration"] == 3
    for layer in range(2):
        for half in range(2):
            columns = layers[layer][:, 3 * half:3 * half + 3]
            assert torch.equal(loaded[f"optimizer.state.param.decoder.layers.w/{layer}/{half}"],
                               columns)
            assert torch.equal(loaded[f"decoder.layers.w/{layer}/{half}"],
                               columns.to(torch.bfloat16))


def _parts(directory, chunks_by_part, expected=None):
    """Write each part's boxes of one (4, 6) tensor ``w``: ``(row, rows)`` chunks of whole rows."""
    for part, chunks in chunks_by_part.items():
        boxes = [Box("w", (4, 6), (row, 0), torch.ones(rows, 6)) for row, rows in chunks]
        write_part(str(directory), part, boxes, {})
        write_expected(str(directory), part, expected or {"w": (4, 6)})
    return merge_parts(str(directory), list(chunks_by_part))


@pytest.mark.parametrize("chunks, problem", [
    ({"rank0": [(0, 2)], "rank1": [(2, 2)]}, None),
    ({"rank0": [(0, 2)], "rank1": [(3, 1)]}, "hold 18 of its 24 elements"),
    # an overlap and a hole of the same size: the element count alone adds up
    ({"rank0": [(0, 2)], "rank1": [(1, 2)]}, "overlap"),
])
def test_the_merge_finds_every_hole_and_overlap(tmp_path, chunks, problem):
    gaps = _parts(tmp_path, chunks).gaps
    if problem is None:
        assert gaps == []
    else:
        assert len(gaps) == 1 and gaps[0].startswith("w: ") and problem in gaps[0], gaps


def test_the_merge_finds_a_tensor_no_part_wrote(tmp_path):
    """The second rank's stage holds ``b`` (its expected list says so), but no part wrote it."""
    gaps = _parts(tmp_path, {"rank0": [(0, 2)], "rank1": [(2, 2)]},
                  expected={"w": (4, 6), "b": (6,)}).gaps
    assert gaps == ["b: no part wrote it"]



def test_an_index_that_does_not_read_back_as_written_fails_the_save(tmp_path, monkeypatch):
    """The index is read back as a loader reads it before the checkpoint can be named: one that
    storage returned short (here its last chunk lost) is an error, not a checkpoint."""
    from torch.distributed import checkpoint as dcp

    merged = _parts(tmp_path, {"rank0": [(0, 2)], "rank1": [(2, 2)]})
    read_metadata = dcp.FileSystemReader.read_metadata

    def short(reader):
        metadata = read_metadata(reader)
        metadata.state_dict_metadata["w"].chunks.pop()
        return metadata

    write_index(str(tmp_path), merged)  # as written
    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata", short)
    with pytest.raises(RuntimeError, match="does not describe w as it was written"):
        write_index(str(tmp_path), merged)
