"""RNG state helpers of ``megatron.core.tensor_parallel.random`` bound to the device backend.

Checked against megatron-core 0.16.1. ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` reach for
``torch.cuda.default_generators``; off CUDA they read and write the backend's generator instead,
so ``CudaRNGStatesTracker.add`` seeds each named state for real (a no-op seed would give every
tensor-parallel rank the same dropout masks).
"""

from __future__ import annotations

from megatron_elaswave.device import DeviceBackend

from .registry import PatchRegistry

MODULE = "megatron.core.tensor_parallel.random"


def register(registry: PatchRegistry, backend: DeviceBackend) -> None:
    def get_rng_state(device=None, clone: bool = False, graph_safe: bool = False):
        return backend.get_rng_state()

    def set_rng_state(new_state, device=None, graph_safe: bool = False) -> None:
        backend.set_rng_state(new_state)

    registry.register(f"{MODULE}._get_cuda_rng_state", get_rng_state)
    registry.register(f"{MODULE}._set_cuda_rng_state", set_rng_state)
