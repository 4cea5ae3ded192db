"""``--save`` / ``--load`` with megatron-core's ``dist_checkpointing``.

A checkpoint is a directory ``<save>/iter_XXXXXXX`` plus ``<save>/latest_checkpointed_iteration.txt``
(Megatron-LM's layout). It holds the model chunks, the optimizer (the distributed optimizer in
its fully reshardable form, so a job may resume on a different data-parallel size), the LR
schedule, the iteration and the consumed-sample count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from .model import TrainingObjects, allocate_optimizer_state

TRACKER_FILE = "latest_checkpointed_iteration.txt"
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class CheckpointError(RuntimeError):
    """A ``--load`` directory that holds no usable checkpoint."""


@dataclass(frozen=True)
class TrainingProgress:
    iteration: int
    consumed_samples: int


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _model_keys(objects: TrainingObjects) -> list[str]:
    # Megatron-LM's names: "model", or "model0", "model1", ... for virtual pipeline stages.
    return ["model"] if len(objects.model) == 1 else [f"model{i}" for i in range(len(objects.model))]


def _model_state(objects: TrainingObjects) -> dict:
    return {key: ddp.module.sharded_state_dict()
            for key, ddp in zip(_model_keys(objects), objects.model)}


def save_checkpoint(root: str, objects: TrainingObjects, progress: TrainingProgress) -> str:
    """Save collectively (every rank calls this); returns the checkpoint directory."""
    directory = checkpoint_dir(root, progress.iteration)
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    state = _model_state(objects)
    state["optimizer"] = objects.optimizer.sharded_state_dict(
        state, is_loading=False, metadata=_OPTIMIZER_METADATA)
    state["opt_param_scheduler"] = objects.scheduler.state_dict()
    state["iteration"] = progress.iteration
    state["consumed_samples"] = progress.consumed_samples
    dist_checkpointing.save(state, directory)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, TRACKER_FILE), "w", encoding="utf-8") as tracker:
            tracker.write(str(progress.iteration))
    return directory


def latest_iteration(root: str) -> int:
    tracker = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"--load {root}: no {TRACKER_FILE} (not a checkpoint directory)")
    with open(tracker, encoding="utf-8") as handle:
        text = handle.read().strip()
    if not text.isdigit() or not os.path.isdir(checkpoint_dir(root, int(text))):
        raise CheckpointError(f"--load {root}: {TRACKER_FILE} names a missing checkpoint")
    return int(text)


def load_checkpoint(root: str, objects: TrainingObjects) -> TrainingProgress:
    """Load the latest checkpoint under ``root`` into ``objects`` (collective)."""
    iteration = latest_iteration(root)
    directory = checkpoint_dir(root, iteration)
    allocate_optimizer_state(objects.optimizer.chained_optimizers)
    template = _model_state(objects)
    template["optimizer"] = objects.optimizer.sharded_state_dict(
        template, is_loading=True, metadata=_OPTIMIZER_METADATA)
    loaded = dist_checkpointing.load(template, directory)
    for key, ddp in zip(_model_keys(objects), objects.model):
        ddp.module.load_state_dict(loaded[key])
    with torch.no_grad():
        objects.optimizer.load_state_dict(loaded["optimizer"])
    objects.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    return TrainingProgress(int(loaded["iteration"]), int(loaded["consumed_samples"]))
