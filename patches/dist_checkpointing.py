"""Megatron's ``torch_dist`` checkpoint, written rank by rank from flat optimizer shards, and the
distributed optimizer's state read back whatever optimizers a rank chains.

Checked against megatron-core 0.16.1 and 0.19.2 (``dist_checkpointing``: ``mapping.py``,
``serialization.py``, ``core.py``, ``strategies/common.py`` and ``strategies/torch.py``;
``optimizer/distrib_optimizer.py``: ``sharded_state_dict``, ``state_dict``, ``load_state_dict``
and ``sharded_param_state_fully_reshardable``; ``optimizer/optimizer.py``:
``ChainedOptimizer.sharded_state_dict``; ``transformer/mlp.py``: the gated linear unit's
``ShardedTensorFactory``), against Megatron-LM's ``megatron/training/checkpointing.py`` of
core_r0.19.0 (``save_checkpoint``, ``generate_state_dict``, ``load_checkpoint``), and against
torch 2.13's ``torch.distributed.checkpoint`` (DCP).

A checkpoint directory as ``dist_checkpointing.save`` writes it with the ``torch_dist`` backend
(Megatron-LM's ``--ckpt-format torch_dist``):

* ``metadata.json``: the backends (``torch_dist`` for the sharded part, ``torch`` for the rest);
* ``common.pt``: what is not sharded (``torch.save``): the iteration, the LR schedule, the
  optimizer's parameter groups and ``content_metadata``, the flags its ``sharded_state_dict`` was
  built with (:data:`SHARDED_METADATA`: the distributed optimizer's state in model space, ``fully
  reshardable``, with no ``chained_<i>.`` key prefix);
* ``.metadata``: DCP's index of every sharded tensor (its global shape and the chunks written)
  and of every ``ShardedObject`` (bytes, under ``<key>/shard_<offsets>_<shape>``);
* the data files the index points into.

Model weights are keyed by their ``ShardedTensor`` key (the decoder's layers stacked along a
first axis of global layer numbers); the optimizer's state by ``optimizer.state.<kind>.<key>``
for ``kind`` in ``param`` (the fp32 main parameter), ``exp_avg`` and ``exp_avg_sq``. Every key
is the same whatever layout saves or loads it. DCP reads any box of a tensor from whatever chunks
were written, so the elements of a tensor may be written as any set of boxes that covers it
exactly once: a rank writes the few boxes that the flat range of its optimizer shard covers
(:func:`flat_range_boxes`), each rank into a directory of its own (:func:`write_part`), and one
index is made of all (:func:`merge_parts`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

SHARDED_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}
"""What the model's and the optimizer's ``sharded_state_dict`` are built with, saved as the
checkpoint's ``content_metadata``: Megatron-LM's own flags with
``--dist-ckpt-optim-fully-reshardable``. Without ``chained_optim_avoid_prefix`` a
``ChainedOptimizer`` of several optimizers would prefix its keys with ``chained_<i>.``, the
rank-local index of each, which differs between layouts."""

CONTENT_METADATA_KEY = "content_metadata"
COMMON_FILE = "common.pt"
CONFIG_FILE = "metadata.json"
INDEX_FILE = ".metadata"
OPTIMIZER_KINDS = ("param", "exp_avg", "exp_avg_sq")

_DCP_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@dataclass(frozen=True)
class Placement:
    """Where one tensor of a rank goes in the checkpoint: a ``ShardedTensor`` without its data."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    """Of the tensor's first element, prepended axes included."""
    local_shape: tuple[int, ...]
    """The tensor's own shape (the prepended axes are of size 1 and not counted)."""
    dtype: torch.dtype
    """Of the model parameter: what the checkpoint holds its weights in."""


@dataclass(frozen=True)
class Segment:
    """The elements ``[start, end)`` of a flattened parameter, which the checkpoint holds as
    ``placement`` (a parameter that a ``ShardedTensorFactory`` splits has several)."""

    start: int
    end: int
    placement: Placement


@dataclass(frozen=True)
class ChunkPlacements:
    """What the checkpoint holds of one model chunk on this rank."""

    segments: dict[int, tuple[Segment, ...]]
    """By ``id`` of each parameter this rank writes: one that is neither a tensor-parallel
    replica of another rank's nor the second copy of a tied embedding."""
    objects: dict[str, Any]
    """``ShardedObject`` data by unique key, of the objects this rank is the main replica of
    within its data-parallel group (as for parameters, the data-parallel rank is not asked)."""


def _main_but_for_data_parallel(replica_id) -> bool:
    """Whether ``replica_id`` is a main replica once its data-parallel rank (Megatron puts it
    last) is left out: the data-parallel ranks split a parameter's optimizer shard instead."""
    if isinstance(replica_id, int):
        return True
    return all(part == 0 for part in tuple(replica_id)[:-1])


def _placement(sharded_tensor) -> Placement:
    prepend = sharded_tensor.prepend_axis_num
    if prepend + len(sharded_tensor.local_shape) != len(sharded_tensor.global_shape):
        raise ValueError(f"{sharded_tensor.key}: local shape {sharded_tensor.local_shape} and "
                         f"{prepend} prepended axes do not make its global shape "
                         f"{sharded_tensor.global_shape}")
    return Placement(key=sharded_tensor.key, global_shape=tuple(sharded_tensor.global_shape),
                     global_offset=tuple(sharded_tensor.global_offset),
                     local_shape=tuple(sharded_tensor.local_shape), dtype=sharded_tensor.dtype)


def chunk_placements(chunk: torch.nn.Module) -> ChunkPlacements:
    """What the checkpoint holds of ``chunk`` (a ``GPTModel``) from this rank, from its own
    ``sharded_state_dict()``."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    segments: dict[int, list[Segment]] = {}
    objects: dict[str, Any] = {}
    # The metadata is given as a dict that megatron-core fills in place: ``GPTModel`` reads its
    # data-parallel group for a multi-token prediction stage's embedding copy, which a ``None``
    # it only replaces in the parent's frame would leave it without.
    for item in nested_values(chunk.sharded_state_dict(metadata=dict(SHARDED_METADATA))):
        if isinstance(item, ShardedObject):
            if _main_but_for_data_parallel(item.replica_id):
                objects[item.unique_key] = item.data
            continue
        if not isinstance(item, (ShardedTensor, ShardedTensorFactory)):
            continue
        if not _main_but_for_data_parallel(item.replica_id):
            continue
        param = item.data
        built = item.build() if isinstance(item, ShardedTensorFactory) else [item]
        base = param.data_ptr()
        for sharded_tensor in built:
            view = sharded_tensor.data
            if not view.is_contiguous():
                raise ValueError(f"{sharded_tensor.key}: a non-contiguous part of a parameter")
            start = (view.data_ptr() - base) // view.element_size()
            segments.setdefault(id(param), []).append(
                Segment(start, start + view.numel(), _placement(sharded_tensor)))
    return ChunkPlacements({key: tuple(value) for key, value in segments.items()}, objects)


def flat_range_boxes(shape: tuple[int, ...], start: int,
                     end: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """The boxes ``(offsets, sizes, flat_start, flat_end)`` that cover the elements
    ``[start, end)`` of a C-contiguous tensor of ``shape``, each a contiguous run of them: at
    most ``2 * len(shape) - 1``."""
    if start >= end:
        return
    if len(shape) <= 1:
        yield (start,), (end - start,), start, end
        return
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    rest = tuple(0 for _ in shape[1:])
    if first == last:
        base = first * inner
        for offsets, sizes, s, e in flat_range_boxes(shape[1:], start - base, end - base):
            yield (first, *offsets), (1, *sizes), s + base, e + base
        return
    if start % inner:
        base = first * inner
        for offsets, sizes, s, e in flat_range_boxes(shape[1:], start - base, inner):
            yield (first, *offsets), (1, *sizes), s + base, e + base
        first += 1
    whole_end = end // inner
    if whole_end > first:
        yield (first, *rest), (whole_end - first, *shape[1:]), first * inner, whole_end * inner
    if end % inner:
        base = whole_end * inner
        for offsets, sizes, s, e in flat_range_boxes(shape[1:], 0, end - base):
            yield (whole_end, *offsets), (1, *sizes), s + base, e + base


@dataclass(frozen=True)
class Box:
    """A box of a checkpoint tensor: ``data`` at ``global_offset`` of ``key``."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    data: torch.Tensor


def segment_boxes(segment: Segment, start: int, values: torch.Tensor,
                  key_prefix: str = "", dtype: torch.dtype | None = None) -> Iterator[Box]:
    """The boxes of ``segment.placement`` that ``values`` fill: the elements ``[start, start +
    len(values))`` of the flattened parameter, those of them in ``segment``. With ``key_prefix``
    the key is ``key_prefix + key`` (the optimizer's state); ``dtype`` casts the data."""
    lo, hi = max(start, segment.start), min(start + values.numel(), segment.end)
    placement = segment.placement
    prepend = len(placement.global_shape) - len(placement.local_shape)
    for offsets, sizes, s, e in flat_range_boxes(placement.local_shape, lo - segment.start,
                                                 hi - segment.start):
        data = values[s + segment.start - start:e + segment.start - start].view(sizes)
        if dtype is not None and data.dtype != dtype:
            data = data.to(dtype)
        offset = placement.global_offset[:prepend] + tuple(
            base + local for base, local in zip(placement.global_offset[prepend:], offsets))
        yield Box(key_prefix + placement.key, placement.global_shape, offset,
                  data.view((1,) * prepend + tuple(sizes)))


def optimizer_state_prefix(kind: str) -> str:
    """The prefix of the key of ``kind`` (``param``, ``exp_avg``, ``exp_avg_sq``) of a parameter
    in the distributed optimizer's fully reshardable state."""
    return f"optimizer.state.{kind}."


def _box_name(box: Box) -> str:
    return json.dumps([box.key, list(box.global_shape), list(box.global_offset)])


def write_part(directory: str, part: str, boxes: Iterable[Box],
               objects: Mapping[str, Any]) -> None:
    """Write ``boxes`` and ``objects`` (unique key -> data) into ``directory/part`` (files
    synced to storage), for :func:`merge_parts`. Touches no process group."""
    state: dict[str, Any] = {_box_name(box): box.data for box in boxes}
    # As the torch_dist backend stores a ShardedObject: the pickled list of its local data.
    state.update({f"object:{key}": [data] for key, data in objects.items()})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=f".*{_DCP_NO_DIST_WARNING}")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(directory, part)),
                 planner=DefaultSavePlanner(flatten_state_dict=False,
                                            flatten_sharded_tensors=False),
                 no_dist=True)


EXPECTED_FILE = "expected.json"
"""Beside a part (:func:`write_part`): every tensor its writer's stage puts in the checkpoint,
whoever writes its elements, by key with its global shape (:func:`merge_parts` checks them)."""


def write_expected(directory: str, part: str, expected: Mapping[str, Sequence[int]]) -> None:
    """Write :data:`EXPECTED_FILE` of ``directory/part`` (synced)."""
    path = os.path.join(directory, part, EXPECTED_FILE)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({key: list(shape) for key, shape in expected.items()}, handle)
        handle.flush()
        os.fsync(handle.fileno())


@dataclass
class MergedIndex:
    """The index of every part of a checkpoint (:func:`merge_parts`)."""

    metadata: Metadata
    results: list[WriteResult]
    gaps: list[str]
    """What does not add up, one line per tensor: a tensor some part expects that no part wrote,
    one written in another shape, one whose chunks leave a hole or overlap."""


def merge_parts(directory: str, parts: Iterable[str]) -> MergedIndex:
    """One DCP index of the parts of ``directory`` (:func:`write_part`); where two parts wrote
    the same object, the first one's is kept. Every tensor the parts expect
    (:data:`EXPECTED_FILE`) and every tensor written must be covered by its chunks exactly once;
    linear in the chunks (and their sorting)."""
    tensors: dict[str, TensorStorageMetadata] = {}
    objects: dict[str, BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, Any] = {}
    expected: dict[str, tuple[int, ...]] = {}
    for part in parts:
        try:
            with open(os.path.join(directory, part, EXPECTED_FILE), encoding="utf-8") as handle:
                expected.update((key, tuple(shape)) for key, shape in json.load(handle).items())
        except FileNotFoundError:
            pass
        index = dcp.FileSystemReader(os.path.join(directory, part)).read_metadata()
        located = {item_index.fqn: info for item_index, info in index.storage_data.items()}
        for name, entry in index.state_dict_metadata.items():
            info = dataclasses.replace(located[name],
                                       relative_path=f"{part}/{located[name].relative_path}")
            if name.startswith("object:"):
                key = name[len("object:"):]
                if key not in objects:
                    objects[key] = BytesStorageMetadata()
                    storage[MetadataIndex(key)] = info
                continue
            key, shape, offset = json.loads(name)
            merged = tensors.setdefault(key, TensorStorageMetadata(
                properties=TensorProperties(dtype=entry.properties.dtype),
                size=torch.Size(shape), chunks=[]))
            merged.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offset),
                                                      sizes=entry.size))
            storage[MetadataIndex(key, torch.Size(offset))] = info
    gaps = [f"{key}: no part wrote it" for key in sorted(expected.keys() - tensors.keys())]
    for key, entry in sorted(tensors.items()):
        if key in expected and tuple(entry.size) != expected[key]:
            gaps.append(f"{key}: written as {tuple(entry.size)}, expected {expected[key]}")
        elif problem := _tiling_problem(tuple(entry.size), entry.chunks):
            gaps.append(f"{key}: {problem}")
    metadata = Metadata(state_dict_metadata={**tensors, **objects}, planner_data=None)
    results = [WriteResult(index=item, size_in_bytes=info.length, storage_data=info)
               for item, info in storage.items()]
    return MergedIndex(metadata, results, gaps)


def _tiling_problem(shape: tuple[int, ...], chunks: Sequence[ChunkStorageMetadata]) -> str | None:
    """Why ``chunks`` do not cover a tensor of ``shape`` exactly once (a hole, an overlap, a
    chunk outside it), or ``None``. Sweeps the chunks in order of their offset along the first
    axis, comparing each with those whose rows it shares only: near-linear for the boxes of
    flat ranges, which share rows with few others."""
    volume = 0
    active: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
    for chunk in sorted(chunks, key=lambda chunk: tuple(chunk.offsets)):
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(shape) or any(
                o < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
            return f"a chunk at {offsets} of size {sizes} lies outside {shape}"
        volume += math.prod(sizes)
        start = offsets[0] if offsets else 0
        active = [entry for entry in active if entry[0] > start]
        for _, other_offsets, other_sizes in active:
            if all(o < p + m and p < o + n for o, n, p, m in
                   zip(offsets, sizes, other_offsets, other_sizes)):
                return f"chunks at {other_offsets} and {offsets} overlap"
        active.append(((start + sizes[0]) if offsets else 1, offsets, sizes))
    if volume != math.prod(shape):
        return f"its chunks hold {volume} of its {math.prod(shape)} elements"
    return None


def write_index(directory: str, merged: MergedIndex) -> None:
    """Write ``merged`` as the checkpoint's DCP index (``.metadata``, synced, renamed into
    place), then read it back as a loader would; raises ``RuntimeError`` unless it names every
    tensor and object of ``merged`` in its shape, chunk for chunk."""
    dcp.FileSystemWriter(directory).finish(merged.metadata, [merged.results])
    written = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    for key, expected in merged.metadata.state_dict_metadata.items():
        if _described(written.get(key)) != _described(expected):
            raise RuntimeError(f"the index read back from {directory} does not describe {key} "
                               "as it was written")
    if written.keys() != merged.metadata.state_dict_metadata.keys():
        raise RuntimeError(f"the index read back from {directory} names other tensors than "
                           "those written")


def _described(entry) -> tuple | None:
    """What an index entry says of a tensor (its shape and chunks) or an object."""
    if isinstance(entry, TensorStorageMetadata):
        return tuple(entry.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
    return None if entry is None else type(entry).__name__


def write_common(directory: str, common: Mapping[str, Any]) -> None:
    """Write ``common`` (with :data:`SHARDED_METADATA` as its content metadata) and the backends
    file, as ``dist_checkpointing.save`` does; synced."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    state = {**common, CONTENT_METADATA_KEY: dict(SHARDED_METADATA)}
    path = os.path.join(directory, COMMON_FILE)
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    save_config(CheckpointingConfig("torch_dist", 1), directory)
    with open(os.path.join(directory, CONFIG_FILE), "rb+") as handle:
        os.fsync(handle.fileno())


def optimizer_common_state(chained_optimizer) -> dict:
    """The optimizer's part of ``common.pt`` as Megatron-LM's loop saves it: the parameter groups
    of every optimizer ``chained_optimizer`` chains, one per set of identifying keys, with the
    step, in a single ``DistributedOptimizer``'s form for a dense model; for an MoE model, whose
    optimizer in Megatron-LM's loop chains one over the dense parameters and one over the
    experts, one such form per optimizer, keyed 0 and 1."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    groups: dict[tuple, dict] = {}
    for optimizer in chained_optimizer.chained_optimizers:
        for group in optimizer.state_dict()["optimizer"]["param_groups"]:
            identity = tuple(group.get(key, group.get(f"pre_{key}"))
                             for key in param_group_identifier_keys)
            groups.setdefault(identity, group)

    def single(param_groups: list[dict]) -> dict:
        return {"optimizer": {"param_groups": param_groups},
                "param_state_sharding_type": SHARDED_METADATA["distrib_optim_sharding_type"]}

    dense = [group for group in groups.values() if not group.get("is_expert_parallel")]
    experts = [group for group in groups.values() if group.get("is_expert_parallel")]
    return single(dense) if not experts else {0: single(dense), 1: single(experts)}


def is_fully_reshardable(content_metadata: Mapping) -> bool:
    """Whether a checkpoint's distributed optimizer state is keyed by model parameter (loads
    into any layout) rather than by Megatron's gradient buckets (``dp_reshardable``: only into
    the tensor- and pipeline-parallel layout that saved it)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return (content_metadata.get("distrib_optim_sharding_type")
            in DistributedOptimizer.checkpoint_fully_reshardable_formats)


def name_buckets_as_megatron_lm(chained_optimizer, model_parallel_rank: int) -> None:
    """Key the bucket-space state of ``chained_optimizer``'s only optimizer as Megatron-LM's
    would be on this rank: by its rank in the tensor x pipeline-parallel group
    (``dp_group_idx_<rank>``), which a layer group's optimizer does not know by itself."""
    [optimizer] = chained_optimizer.chained_optimizers
    optimizer.data_parallel_group_idx = model_parallel_rank


def save_in_background(state: dict, directory: str, content_metadata: dict):
    """``dist_checkpointing.save`` of ``state`` whose writing is left to an ``AsyncRequest``
    (returned) for :func:`background_saves` to run, with megatron-core's own writer (0.19 names
    it ``mcore``; its default needs NVIDIA's resiliency extension)."""
    import inspect

    from megatron.core import dist_checkpointing

    options = {"async_sharded_save": True, "content_metadata": content_metadata}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        options["async_strategy"] = "mcore"
    return dist_checkpointing.save(state, directory, **options)


def background_saves():
    """megatron-core's queue of saves written in the background (``AsyncCallsQueue``:
    ``schedule_async_request``, ``maybe_finalize_async_calls``, ``close``)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    return AsyncCallsQueue()


def load_chained_optimizer(chained_optimizer, loaded: Mapping) -> None:
    """Load the optimizer part of a checkpoint loaded with a template of
    ``chained_optimizer.sharded_state_dict(..., metadata=SHARDED_METADATA)`` into each optimizer
    it chains: the parameter groups come from ``common.pt`` in a single optimizer's form, or per
    optimizer (an MoE model's dense and expert optimizers, or a checkpoint that chained several),
    every optimizer then given all of them; the state from the template's part of each."""
    optimizers = chained_optimizer.chained_optimizers
    if len(optimizers) == 1:
        optimizers[0].load_state_dict(loaded)
        return
    common = {key: value for key, value in loaded.items() if not isinstance(key, int)}
    if not common:
        saved = [value for key, value in sorted(loaded.items())
                 if isinstance(key, int) and "optimizer" in value]
        common = {key: value for key, value in saved[0].items() if key != "param_state"}
        common["optimizer"] = {**saved[0]["optimizer"], "param_groups": [
            group for entry in saved for group in entry["optimizer"]["param_groups"]]}
    for index, optimizer in enumerate(optimizers):
        state = {key: value for key, value in loaded[index].items() if key != "optimizer"}
        optimizer.load_state_dict({**common, **state})
