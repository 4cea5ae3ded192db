"""Run Megatron-LM's training loop (``megatron.training``) off CUDA.

Checked against Megatron-LM core_v0.16.1 to core_v0.19.0 (``megatron/training/initialize.py``,
``utils``, ``training.py``, ``checkpointing.py``; ``megatron/legacy/fused_kernels`` in
core_v0.16.1). On top of :mod:`.device_compat`, which covers megatron-core, Megatron-LM needs:

1. ``initialize_megatron`` asserts that CUDA is available unless called with
   ``allow_no_cuda=True``: it is called so. Distributed and model-parallel initialisation then
   take their usual path, since the ``torch.cuda`` facade reports the backend's devices.
2. A literal ``device='cuda'`` in the training modules' tensor factories (about 25 sites): those
   modules see the device-mapped ``torch`` of :mod:`.device_compat`. ``megatron.training.utils``
   is one module in core_v0.16.1 and a package in core_v0.19 (:func:`training_utils_modules`).
3. ``Module.cuda(...)`` on the model chunks (``get_model``) keeps them where they are.
4. The fused kernels (``megatron.legacy.fused_kernels.load``, core_v0.16.1) are CUDA code: nothing
   to build. core_v0.17 and later load no fused kernels (:func:`has_legacy_fused_kernels`).
5. ``get_device_arch_version`` reads the CUDA device's compute capability to decide whether
   ``CUDA_DEVICE_MAX_CONNECTIONS`` must be 1; there is no such stream ordering off CUDA, which is
   what an architecture of 10 (Blackwell and later) means to Megatron-LM.

On any device (:func:`register_prebuilt_dataset_helpers`): ``initialize_megatron`` compiles
megatron-core's dataset helpers on rank 0 with ``make`` in ``megatron/core/datasets``. A
megatron-core installed from its wheel (the one a preloading launcher's workers import) ships
them compiled and has no Makefile there, so ``make`` fails and rank 0 exits; helpers that are
importable already are not compiled again.
"""

from __future__ import annotations

import functools
import importlib.util
import types
from typing import Callable

from .device_compat import device_mapped_torch, stay_on_device
from .interfaces import DeviceBackend
from .registry import PatchRegistry

TRAINING_UTILS = "megatron.training.utils"


def training_utils_modules() -> tuple[str, ...]:
    """The modules of ``megatron.training.utils``'s functions: the module itself in core_v0.16.1;
    in core_v0.19 a package whose ``__init__`` only re-exports them, from ``common_utils``
    (tensor factories, default-group reductions, the barrier of autoresume) and ``log_utils``
    (the progress log's barriers)."""
    spec = importlib.util.find_spec(TRAINING_UTILS)
    if spec is not None and spec.submodule_search_locations is not None:
        return (f"{TRAINING_UTILS}.common_utils", f"{TRAINING_UTILS}.log_utils")
    return (TRAINING_UTILS,)


def has_legacy_fused_kernels() -> bool:
    """Whether Megatron-LM still has ``megatron.legacy.fused_kernels`` (core_v0.16.1), which
    ``initialize_megatron`` builds; core_v0.17 removed them and the call (its ``megatron.legacy``
    keeps other modules), core_v0.19 the whole package."""
    return (importlib.util.find_spec("megatron.legacy") is not None
            and importlib.util.find_spec("megatron.legacy.fused_kernels") is not None)


def literal_cuda_modules() -> tuple[str, ...]:
    """The Megatron-LM modules with a literal ``device='cuda'``."""
    return ("megatron.training.training", *training_utils_modules(),
            "megatron.training.initialize", "megatron.training.checkpointing")


DATASET_HELPERS = "megatron.core.datasets.helpers_cpp"
"""The compiled module of megatron-core's dataset helpers."""

NO_STREAM_ORDERING_ARCH = 10
"""What :func:`megatron.training.utils.get_device_arch_version` answers off CUDA."""


def _allowing_no_cuda(initialize_megatron: Callable) -> Callable:
    @functools.wraps(initialize_megatron)
    def initialize(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    return initialize


def _compiling_only_when_missing(compile_helpers: Callable) -> Callable:
    @functools.wraps(compile_helpers)
    def compile_if_missing():
        if importlib.util.find_spec(DATASET_HELPERS) is None:
            compile_helpers()

    return compile_if_missing


def register_prebuilt_dataset_helpers(registry: PatchRegistry) -> None:
    """Register the skip of the dataset helpers' compilation where they are importable."""
    registry.register_wrapper("megatron.core.datasets.utils.compile_helpers",
                              _compiling_only_when_missing)


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
    for module_name in literal_cuda_modules():
        registry.register(f"{module_name}.torch", mapped_torch)
    registry.register("torch.nn.Module.cuda", stay_on_device)
    registry.register_wrapper("megatron.training.initialize.initialize_megatron", _allowing_no_cuda)
    if has_legacy_fused_kernels():
        registry.register("megatron.legacy.fused_kernels.load", lambda args: None)
    # core_v0.19's package re-exports it (the registry re-binds the aliases of the function).
    registry.register(f"{TRAINING_UTILS}.get_device_arch_version", lambda: NO_STREAM_ORDERING_ARCH)
