"""Sequence parallelism with torch's own norms: ``megatron.core.transformer.torch_norm``.

Checked against megatron-core 0.16.1 and 0.19.2.

Without Transformer Engine or Apex, megatron-core's local layer specs build their norms with
``WrappedTorchNorm``, which refuses sequence parallelism (``assert not config.sequence_parallel``).
Yet a norm needs nothing of it: under sequence parallelism each tensor-parallel rank normalises
its own positions of the sequence with the same weights, and only the weights' gradients must be
summed over the tensor-parallel group, which ``finalize_model_grads`` does for every parameter
marked ``sequence_parallel`` (as Transformer Engine's norms are). The patched norm is torch's,
marked so. megatron-core requires sequence parallelism for MoE layers with tensor parallelism,
so this is what lets an MoE model run tensor-parallel on CPU.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable

from .registry import PatchRegistry

CLASS = "megatron.core.transformer.torch_norm.WrappedTorchNorm"


def _sequence_parallel_norm(new: Callable) -> Callable:
    @functools.wraps(new)
    def norm(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return new(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        module = new(cls, plain, hidden_size, *args, **kwargs)
        for param in module.parameters():
            param.sequence_parallel = True
        return module

    return norm


def register(registry: PatchRegistry) -> None:
    """Let torch's norms run under sequence parallelism."""
    registry.register_wrapper(f"{CLASS}.__new__", _sequence_parallel_norm)
