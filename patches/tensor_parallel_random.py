"""RNG state helpers of ``megatron.core.tensor_parallel.random`` bound to the device backend.

Checked against megatron-core 0.16.1 and 0.19.2. ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``
reach for ``torch.cuda.default_generators``; off CUDA they read and write the backend's generator
instead, so ``CudaRNGStatesTracker.add`` seeds each named state for real (a no-op seed would give
every tensor-parallel rank the same dropout masks).

:func:`keyed_streams` (used by the layout-invariant RNG patches, on every device) reseeds the
default generator and the tracker's ``'model-parallel-rng'`` state for the span of one layer's
forward and puts both back afterwards. It relies on ``CudaRNGStatesTracker.states_`` (a dict of
state tensors) and ``_current_state_name`` as in megatron-core 0.16.1 (random.py:161-279).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .interfaces import DeviceBackend
from .registry import PatchRegistry

MODULE = "megatron.core.tensor_parallel.random"


def register(registry: PatchRegistry, backend: DeviceBackend) -> None:
    def get_rng_state(device=None, clone: bool = False, graph_safe: bool = False):
        return backend.get_rng_state()

    def set_rng_state(new_state, device=None, graph_safe: bool = False) -> None:
        backend.set_rng_state(new_state)

    registry.register(f"{MODULE}._get_cuda_rng_state", get_rng_state)
    registry.register(f"{MODULE}._set_cuda_rng_state", set_rng_state)


@contextlib.contextmanager
def keyed_streams(backend: DeviceBackend, default_seed: int, model_parallel_seed: int,
                  expert_seed: int | None = None) -> Iterator[None]:
    """Run the block with the default generator seeded by ``default_seed``, the tracker's
    model-parallel stream by ``model_parallel_seed`` and, given ``expert_seed``, its
    expert-parallel stream (MoE layers') by it; restore the streams afterwards, so code outside
    the block sees the generators as if the block had drawn nothing.

    Inside a ``tracker.fork()`` of the model-parallel stream (Megatron runs the transformer block
    that way with sequence parallelism) the live generator *is* that stream, so it gets
    ``model_parallel_seed``.
    """
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = megatron_random.get_cuda_rng_tracker()
    name = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME
    expert_name = megatron_random._EXPERT_PARALLEL_RNG_TRACKER_NAME
    saved_model_parallel = tracker.states_.get(name) if hasattr(tracker, "states_") else None
    if saved_model_parallel is None:
        raise RuntimeError(
            f"the RNG tracker has no {name!r} state: seed it with "
            "tensor_parallel.model_parallel_cuda_manual_seed before training")
    if not torch.is_tensor(saved_model_parallel):
        raise NotImplementedError(
            "layout-invariant dropout RNG supports Megatron's tensor-state RNG tracker only "
            "(not the CUDA-graph-safe or Transformer Engine trackers)")
    saved_live = backend.get_rng_state()
    saved_expert = tracker.states_.get(expert_name) if expert_seed is not None else None
    if saved_expert is not None:
        backend.manual_seed(expert_seed)
        tracker.states_[expert_name] = backend.get_rng_state()
    backend.manual_seed(model_parallel_seed)
    tracker.states_[name] = backend.get_rng_state()
    if getattr(tracker, "_current_state_name", None) != name:
        backend.manual_seed(default_seed)
    try:
        yield
    finally:
        tracker.states_[name] = saved_model_parallel
        if saved_expert is not None:
            tracker.states_[expert_name] = saved_expert
        backend.set_rng_state(saved_live)
