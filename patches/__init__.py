"""Everything that touches Megatron-Core internals, as patches applied through one registry.

Each module patches one Megatron-Core module (or, for :mod:`.device_compat`, one concern that
spans several) and says which versions it was checked against. :func:`install` refuses a
megatron-core outside :data:`SUPPORTED_MEGATRON_CORE`, and a torch that lacks an API the project
uses (:mod:`.torch_version`), each with a one-line message.
"""

from __future__ import annotations

from packaging.version import Version

from megatron_elaswave.device import DeviceBackend

from . import (
    device_compat,
    distrib_optimizer,
    distributed_work,
    language_model_embedding,
    optimizer,
    p2p_communication,
    tensor_parallel_random,
    transformer_block,
    transformer_layer,
)
from .registry import PatchRegistry, PatchTargetError
from .torch_version import MINIMUM_TORCH, UnsupportedTorch, check_torch
from .version import SUPPORTED_MEGATRON_CORE, UnsupportedMegatronVersion, check_megatron_core_version

__all__ = [
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


def compatibility_registry(backend: DeviceBackend, *, layout_invariant_rng: bool = False,
                           megatron_core_version: Version | None = None) -> PatchRegistry:
    """The patches any run on ``backend`` needs: device compatibility (off CUDA) and fixes.

    ``layout_invariant_rng`` adds the layout-invariant dropout RNG (:mod:`.transformer_layer`,
    :mod:`.language_model_embedding`; see ``megatron_elaswave.dropout_rng``). Off by default.
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
    distributed_work.register(registry)  # inert until the elastic runtime arms it
    # Inert unless a heterogeneous layout asks for them (see each module).
    optimizer.register(registry)
    transformer_block.register(registry)
    if layout_invariant_rng:
        register_layout_invariant_rng(registry, backend)
    return registry


def register_layout_invariant_rng(registry: PatchRegistry, backend: DeviceBackend) -> None:
    """Register the layout-invariant dropout RNG (:mod:`.transformer_layer`,
    :mod:`.language_model_embedding`; see ``megatron_elaswave.dropout_rng``)."""
    transformer_layer.register(registry, backend)
    language_model_embedding.register(registry, backend)


def install(backend: DeviceBackend, *, layout_invariant_rng: bool = False) -> PatchRegistry:
    """Apply :func:`compatibility_registry` and return it (``remove()`` undoes it)."""
    registry = compatibility_registry(backend, layout_invariant_rng=layout_invariant_rng)
    registry.apply()
    return registry
