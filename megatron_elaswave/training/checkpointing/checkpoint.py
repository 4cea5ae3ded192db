"""``--save`` / ``--load`` in Megatron-LM's ``torch_dist`` format, with megatron-core's
``dist_checkpointing``.

A checkpoint is a directory ``<save>/iter_XXXXXXX`` plus ``<save>/latest_checkpointed_iteration.txt``
(Megatron-LM's layout). It holds the model chunks, the optimizer (the distributed optimizer in
its fully reshardable form, keyed by model parameter, so a job may resume on any layout), the LR
schedule, the iteration, the consumed-sample count, and the arguments Megatron-LM's
``load_checkpoint`` checks (:func:`checkpoint_args`), so that Megatron-LM's own loop loads it too.
This module saves from the live objects (the job without ``--elastic``) and loads into them (any
job); :mod:`.durable` writes the same format from snapshots.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
from megatron.core import dist_checkpointing

from megatron_elaswave.patches.dist_checkpointing import (
    SHARDED_METADATA,
    is_fully_reshardable,
    load_chained_optimizer,
    name_buckets_as_megatron_lm,
    optimizer_common_state,
    save_in_background,
)

from ..step.model import TrainingObjects, allocate_optimizer_state

TRACKER_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
"""Megatron-LM's ``checkpoint_version`` of checkpoints with query/key/value in its own order."""

_LEGACY_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""What checkpoints without content metadata (this project's older ones) were built with."""


class CheckpointError(RuntimeError):
    """A ``--load`` directory that holds no usable checkpoint, or a ``--save`` directory the job
    cannot save in."""


@dataclass(frozen=True)
class MegatronLayout:
    """How a rank's objects correspond to Megatron-LM's own, for checkpoints whose optimizer
    state is in Megatron's bucket space (``dp_reshardable``, Megatron-LM's default), which loads
    only into the tensor- and pipeline-parallel sizes that saved it, one optimizer per rank."""

    tensor_parallel: int
    pipeline_parallel: int
    model_parallel_rank: int | None = None
    """This rank's rank in Megatron-LM's tensor x pipeline-parallel group, where the optimizer
    does not know it (a layer group's); ``None``: it does."""


@dataclass(frozen=True)
class TrainingProgress:
    iteration: int
    consumed_samples: int
    floating_point_operations: float = 0.0
    """Megatron-LM's ``num_floating_point_operations_so_far``."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_complete(root: str) -> tuple[int, str] | None:
    """The iteration and directory the tracker under ``root`` names, if it names one that
    exists; ``None`` otherwise."""
    try:
        with open(os.path.join(root, TRACKER_FILE), encoding="utf-8") as handle:
            text = handle.read().strip()
    except OSError:
        return None
    if not text.isdigit() or not os.path.isdir(checkpoint_dir(root, int(text))):
        return None
    return int(text), checkpoint_dir(root, int(text))


def write_tracker(root: str, iteration: int) -> None:
    """Name ``iteration`` in the tracker, atomically (a new file renamed over the old one)."""
    path = os.path.join(root, TRACKER_FILE)
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(str(iteration))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    descriptor = os.open(root, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def resume_hint(root: str | None) -> str:
    """What a user can resume from under ``root`` (``--save``): the last complete checkpoint
    and the ``--load`` that resumes it."""
    if root is None:
        return "no checkpoint was saved (no --save)"
    latest = latest_complete(root)
    if latest is None:
        return f"no complete checkpoint in {root} yet"
    return (f"the last complete checkpoint is iteration {latest[0]} in {latest[1]}: resume with "
            f"--load {root}")


def checkpoint_args(args: argparse.Namespace, *, world_size: int,
                    consumed_samples: int) -> argparse.Namespace:
    """The arguments stored with a checkpoint: ``args`` (without the ``--elastic*`` flags, whose
    values are this package's objects) and what Megatron-LM's ``load_checkpoint`` reads of them,
    the exact consumed samples and the size of the job that saved included. The RNG states are
    not saved (``no_save_rng``): Megatron's streams belong to a layout; the layout-invariant
    dropout of ``--elastic`` needs none."""
    saved = argparse.Namespace(**{name: value for name, value in vars(args).items()
                                  if not name.startswith("elastic")})
    saved.consumed_train_samples = consumed_samples
    saved.skipped_train_samples = getattr(args, "skipped_train_samples", 0)
    saved.consumed_valid_samples = getattr(args, "consumed_valid_samples", 0)
    saved.world_size = world_size
    saved.async_save = False  # a loader would read it with the async strategy it names
    saved.no_save_rng = True
    saved.no_save_optim = bool(getattr(args, "no_save_optim", False))
    saved.use_distributed_optimizer = True
    saved.ckpt_format = "torch_dist"
    saved.add_position_embedding = getattr(
        args, "add_position_embedding",
        getattr(args, "position_embedding_type", "learned_absolute") == "learned_absolute")
    return saved


def checkpoint_common(args: argparse.Namespace, objects: TrainingObjects,
                      progress: TrainingProgress, world_size: int) -> dict:
    """What a checkpoint holds besides the sharded tensors (``common.pt``): with
    ``--no-save-optim``, as in Megatron-LM, neither the optimizer nor the LR schedule."""
    common = {
        "args": checkpoint_args(args, world_size=world_size,
                                consumed_samples=progress.consumed_samples),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": progress.iteration,
        "consumed_samples": progress.consumed_samples,
        "num_floating_point_operations_so_far": progress.floating_point_operations,
    }
    if not getattr(args, "no_save_optim", False):
        common["optimizer"] = optimizer_common_state(objects.optimizer)
        common["opt_param_scheduler"] = objects.scheduler.state_dict()
    return common


def _model_keys(objects: TrainingObjects) -> list[str]:
    # Megatron-LM's names: "model", or "model0", "model1", ... for virtual pipeline stages.
    return ["model"] if len(objects.model) == 1 else [f"model{i}" for i in range(len(objects.model))]


def _model_state(objects: TrainingObjects, metadata: dict) -> dict:
    return {key: ddp.module.sharded_state_dict(metadata=metadata)
            for key, ddp in zip(_model_keys(objects), objects.model)}


def save_checkpoint(root: str, objects: TrainingObjects, progress: TrainingProgress,
                    args: argparse.Namespace, background=None) -> str:
    """Save from the live objects, collectively over the default group (every rank calls this);
    returns the checkpoint directory. The tracker names it once every rank has written. With
    ``background`` (megatron-core's queue of saves: ``--async-save``) the files are written by
    a process of its own and the tracker once the queue finalises the save, every rank calling
    ``maybe_finalize_async_calls``."""
    import torch.distributed as dist

    directory = checkpoint_dir(root, progress.iteration)
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    state = _model_state(objects, SHARDED_METADATA)
    if not getattr(args, "no_save_optim", False):
        state["optimizer"] = objects.optimizer.sharded_state_dict(
            state, is_loading=False, metadata=SHARDED_METADATA)
    common = checkpoint_common(args, objects, progress, dist.get_world_size())
    state.update({key: value for key, value in common.items() if key != "optimizer"})

    def name_in_tracker() -> None:
        if dist.get_rank() == 0:
            write_tracker(root, progress.iteration)

    if background is not None:
        request = save_in_background(state, directory, dict(SHARDED_METADATA))
        request.add_finalize_fn(name_in_tracker)
        background.schedule_async_request(request)
        return directory
    dist_checkpointing.save(state, directory, content_metadata=dict(SHARDED_METADATA))
    dist.barrier()
    name_in_tracker()
    return directory


def latest_iteration(root: str) -> int:
    tracker = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"--load {root}: no {TRACKER_FILE} (not a checkpoint directory)")
    latest = latest_complete(root)
    if latest is None:
        raise CheckpointError(f"--load {root}: {TRACKER_FILE} names a missing checkpoint")
    return latest[0]


def load_checkpoint(root: str, objects: TrainingObjects,
                    megatron_layout: MegatronLayout | None = None, *, load_optimizer: bool = True,
                    finetune: bool = False) -> TrainingProgress:
    """Load the latest checkpoint under ``root`` into ``objects`` (collective), whatever layout
    saved it: this project's jobs, with or without ``--elastic``, or Megatron-LM's loop with its
    distributed optimizer's state in a fully reshardable form. Megatron-LM's default form
    (``dp_reshardable``) loads where ``megatron_layout`` says the objects are laid out as
    Megatron-LM's of the same sizes; otherwise, and where the buckets differ, it raises
    :class:`CheckpointError`.

    As Megatron-LM's ``load_checkpoint``: without ``load_optimizer`` (``--no-load-optim``) or
    with ``finetune`` (``--finetune``) only the model weights are loaded (any form, into any
    layout), the optimizer's main parameters taken from them and its state and the schedule
    left new; ``finetune`` starts from iteration 0 and sample 0. So is a checkpoint saved with
    ``--no-save-optim`` loaded."""
    iteration = latest_iteration(root)
    directory = checkpoint_dir(root, iteration)
    metadata = dist_checkpointing.load_content_metadata(directory) or _LEGACY_METADATA
    saved_args = dist_checkpointing.load_common_state_dict(directory).get("args")
    if getattr(saved_args, "no_save_optim", False):
        load_optimizer = False
    if finetune or not load_optimizer:
        loaded = dist_checkpointing.load(_model_state(objects, metadata), directory)
        for key, ddp in zip(_model_keys(objects), objects.model):
            ddp.module.load_state_dict(loaded[key])
        objects.optimizer.reload_model_params()
        if finetune:
            return TrainingProgress(0, 0)
        return TrainingProgress(int(loaded["iteration"]), _consumed_samples(loaded),
                                float(loaded.get("num_floating_point_operations_so_far", 0)))
    allocate_optimizer_state(objects.optimizer.chained_optimizers)
    if is_fully_reshardable(metadata):
        metadata = {**metadata, "chained_optim_avoid_prefix": True}
        loaded = _load(directory, objects, metadata)
    else:
        loaded = _load_bucket_space(root, directory, objects, metadata, megatron_layout)
    for key, ddp in zip(_model_keys(objects), objects.model):
        ddp.module.load_state_dict(loaded[key])
    with torch.no_grad():
        load_chained_optimizer(objects.optimizer, loaded["optimizer"])
    objects.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    return TrainingProgress(int(loaded["iteration"]), _consumed_samples(loaded),
                            float(loaded.get("num_floating_point_operations_so_far", 0)))


def _consumed_samples(loaded: dict) -> int:
    consumed = loaded.get("consumed_samples")
    if consumed is None:  # saved by Megatron-LM's loop
        consumed = getattr(loaded.get("args"), "consumed_train_samples", 0)
    return int(consumed)


def _load(directory: str, objects: TrainingObjects, metadata: dict) -> dict:
    template = _model_state(objects, metadata)
    template["optimizer"] = objects.optimizer.sharded_state_dict(
        template, is_loading=True, metadata=metadata)
    return dist_checkpointing.load(template, directory)


def _load_bucket_space(root: str, directory: str, objects: TrainingObjects, metadata: dict,
                       layout: MegatronLayout | None) -> dict:
    """Load a checkpoint whose optimizer state is in Megatron's bucket space: only into the
    sizes that saved it, with one optimizer per rank, and buckets alike."""
    sharding = metadata.get("distrib_optim_sharding_type")
    saved = dist_checkpointing.load_common_state_dict(directory).get("args")
    sizes = (getattr(saved, "tensor_model_parallel_size", None),
             getattr(saved, "pipeline_model_parallel_size", None))
    refusal = (f"--load {root}: the optimizer state of {directory} is in Megatron's {sharding} "
               f"form, which loads only into the tensor- and pipeline-parallel layout that saved "
               f"it (TP{sizes[0]} x PP{sizes[1]})")
    advice = "save it with --dist-ckpt-optim-fully-reshardable to load it in any layout"
    if layout is None or (layout.tensor_parallel, layout.pipeline_parallel) != sizes:
        here = (f"TP{layout.tensor_parallel} x PP{layout.pipeline_parallel}" if layout
                else "heterogeneous or interleaved layer groups")
        raise CheckpointError(f"{refusal}; this job has {here}: {advice}")
    if layout.model_parallel_rank is not None:
        name_buckets_as_megatron_lm(objects.optimizer, layout.model_parallel_rank)
    try:
        return _load(directory, objects, metadata)
    except Exception as error:  # megatron-core asserts on buckets that differ
        raise CheckpointError(f"{refusal}, with its buckets; this job's differ "
                              f"({type(error).__name__}: {str(error)[:200]}): {advice}") from None
