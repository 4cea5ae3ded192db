"""What the patches take from the code that registers them.

The patches import nothing from the runtime above them: what they need of it is passed to their
``register`` functions and described here as protocols, which the runtime's objects satisfy
structurally.
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import torch


class DeviceBackend(Protocol):
    """The device the patches redirect CUDA to, and its default generator."""

    @property
    def name(self) -> str:
        """``cpu``, ``cuda`` or ``npu``."""

    @property
    def module(self) -> ModuleType:
        """``torch.cpu``, ``torch.cuda`` or ``torch.npu``."""

    def device(self, local_rank: int | None = None) -> torch.device:
        """The device of a local rank (the current one when ``local_rank`` is None)."""

    def manual_seed(self, seed: int) -> None: ...

    def get_rng_state(self) -> torch.Tensor: ...

    def set_rng_state(self, state: torch.Tensor) -> None: ...


class StreamSeeds(Protocol):
    """The seeds of Megatron's random streams for one layer (or the embedding) on one rank."""

    @property
    def default(self) -> int:
        """For the default device generator."""

    @property
    def model_parallel(self) -> int:
        """For the RNG tracker's ``'model-parallel-rng'`` stream."""

    @property
    def expert(self) -> int:
        """For the RNG tracker's ``'expert-parallel-rng'`` stream (an MoE layer's)."""


class DropoutSeeds(Protocol):
    """Where the layout-invariant dropout patches take their seeds: the position the training
    loop has set (the runtime passes its ``dropout_rng`` module)."""

    EMBEDDING_LAYER: int
    """The layer number :meth:`stream_seeds` takes for the embedding."""

    def stream_seeds(self, layer: int, tp_rank: int, *, embedding: bool = False) -> StreamSeeds:
        """The seeds of global layer ``layer`` (0-based, or :attr:`EMBEDDING_LAYER`) on
        tensor-parallel rank ``tp_rank``; with ``embedding``, of the embedding lookup that layer
        makes (a multi-token prediction layer's)."""
