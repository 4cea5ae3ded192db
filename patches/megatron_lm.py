"""Run Megatron-LM's training loop (``megatron.training``) off CUDA.

Checked against Megatron-LM ``core_v0.16.1`` (``megatron/training/initialize.py``, ``utils.py``,
``training.py``, ``checkpointing.py``; ``megatron/legacy/fused_kernels``). On top of
:mod:`.device_compat`, which covers megatron-core, Megatron-LM needs:

1. ``initialize_megatron`` asserts that CUDA is available unless called with
   ``allow_no_cuda=True``: it is called so. Distributed and model-parallel initialisation then
   take their usual path, since the ``torch.cuda`` facade reports the backend's devices.
2. A literal ``device='cuda'`` in the training modules' tensor factories (about 25 sites): those
   modules see the device-mapped ``torch`` of :mod:`.device_compat`.
3. ``Module.cuda(...)`` on the model chunks (``get_model``) keeps them where they are.
4. The fused kernels (``megatron.legacy.fused_kernels.load``) are CUDA code: nothing to build.
5. ``get_device_arch_version`` reads the CUDA device's compute capability to decide whether
   ``CUDA_DEVICE_MAX_CONNECTIONS`` must be 1; there is no such stream ordering off CUDA, which is
   what an architecture of 10 (Blackwell and later) means to Megatron-LM.
"""

from __future__ import annotations

import functools
import types
from typing import Callable

from .device_compat import device_mapped_torch, stay_on_device
from .interfaces import DeviceBackend
from .registry import PatchRegistry

LITERAL_CUDA_MODULES = (
    "megatron.training.training",
    "megatron.training.utils",
    "megatron.training.initialize",
    "megatron.training.checkpointing",
)

NO_STREAM_ORDERING_ARCH = 10
"""What :func:`megatron.training.utils.get_device_arch_version` answers off CUDA."""


def _allowing_no_cuda(initialize_megatron: Callable) -> Callable:
    @functools.wraps(initialize_megatron)
    def initialize(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    return initialize


def register(registry: PatchRegistry, backend: DeviceBackend,
             distributed: types.ModuleType | None = None) -> None:
    """Register the redirections Megatron-LM's training loop needs on a non-CUDA ``backend``;
    ``distributed``, if given, is the ``torch.distributed`` its modules see
    (:class:`.megatron_lm_elastic.DefaultGroupRedirect`)."""
    if backend.name == "cuda":
        raise ValueError("CUDA needs no device compatibility patches")
    mapped_torch = device_mapped_torch(backend.device())
    if distributed is not None:
        mapped_torch.distributed = distributed
    for module_name in LITERAL_CUDA_MODULES:
        registry.register(f"{module_name}.torch", mapped_torch)
    registry.register("torch.nn.Module.cuda", stay_on_device)
    registry.register_wrapper("megatron.training.initialize.initialize_megatron", _allowing_no_cuda)
    registry.register("megatron.legacy.fused_kernels.load", lambda args: None)
    registry.register("megatron.training.utils.get_device_arch_version",
                      lambda: NO_STREAM_ORDERING_ARCH)
