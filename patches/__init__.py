"""Everything that touches Megatron-Core internals, as patches applied through one registry.

Each module patches one Megatron-Core module (or, for :mod:`.device_compat`, one concern that
spans several) and says which versions it was checked against. :func:`install` refuses a
megatron-core outside :data:`SUPPORTED_MEGATRON_CORE`, and a torch that lacks an API the project
uses (:mod:`.torch_version`), each with a one-line message.
"""

from __future__ import annotations

from packaging.version import Version

from . import (
    device_compat,
    distrib_optimizer,
    distributed_work,
    finalize_model_grads,
    language_model_embedding,
    moe_utils,
    multi_token_prediction,
    optimizer,
    p2p_communication,
    tensor_parallel_random,
    torch_norm,
    transformer_block,
    transformer_layer,
)
from .interfaces import DeviceBackend, DropoutSeeds
from .registry import PatchRegistry, PatchTargetError
from .torch_version import MINIMUM_TORCH, UnsupportedTorch, check_torch
from .version import SUPPORTED_MEGATRON_CORE, UnsupportedMegatronVersion, check_megatron_core_version

__all__ = [
    "DeviceBackend",
    "DropoutSeeds",
    "PatchRegistry",
    "MINIMUM_TORCH",
    "PatchTargetError",
    "SUPPORTED_MEGATRON_CORE",
    "UnsupportedMegatronVersion",
    "UnsupportedTorch",
    "check_megatron_core_version",
    "check_torch",
    "compatibility_registry",
    "install",
    "register_layout_invariant_rng",
]


def compatibility_registry(backend: DeviceBackend, *, dropout_seeds: DropoutSeeds | None = None,
                           megatron_core_version: Version | None = None) -> PatchRegistry:
    """The patches any run on ``backend`` needs: device compatibility (off CUDA) and fixes.

    ``dropout_seeds`` adds the layout-invariant dropout RNG (:mod:`.transformer_layer`,
    :mod:`.language_model_embedding`), seeded from it (see ``megatron_elaswave.runtime.dropout_rng``).
    Off by default.
    ``megatron_core_version``: the version of the megatron-core that will be patched, when it is
    not the installed package (a Megatron-LM checkout); checked like the installed one. Raises
    :class:`UnsupportedTorch` where torch lacks an API the project uses.
    """
    check_torch()
    check_megatron_core_version(megatron_core_version)
    registry = PatchRegistry()
    if backend.name != "cuda":
        device_compat.register(registry, backend)
        tensor_parallel_random.register(registry, backend)
    distrib_optimizer.register(registry)
    p2p_communication.register(registry)
    moe_utils.register(registry, backend)
    finalize_model_grads.register(registry)
    torch_norm.register(registry)
    distributed_work.register(registry)  # inert until the elastic runtime arms it
    # Inert unless a heterogeneous layout asks for them (see each module).
    optimizer.register(registry)
    transformer_block.register(registry)
    if dropout_seeds is not None:
        register_layout_invariant_rng(registry, backend, dropout_seeds)
    return registry


def register_layout_invariant_rng(registry: PatchRegistry, backend: DeviceBackend,
                                  dropout_seeds: DropoutSeeds) -> None:
    """Register the layout-invariant dropout RNG (:mod:`.transformer_layer`,
    :mod:`.language_model_embedding`, :mod:`.multi_token_prediction`), seeded from
    ``dropout_seeds``."""
    transformer_layer.register(registry, backend, dropout_seeds)
    language_model_embedding.register(registry, backend, dropout_seeds)
    multi_token_prediction.register_keyed_lookups(registry)


def install(backend: DeviceBackend, *, dropout_seeds: DropoutSeeds | None = None) -> PatchRegistry:
    """Apply :func:`compatibility_registry` and return it (``remove()`` undoes it)."""
    registry = compatibility_registry(backend, dropout_seeds=dropout_seeds)
    registry.apply()
    return registry
