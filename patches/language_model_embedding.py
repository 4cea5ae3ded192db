"""Layout-invariant dropout in the GPT embedding: reseed Megatron's streams before it runs.

Checked against megatron-core 0.16.1 and 0.19.2
(``megatron/core/models/common/embeddings/language_model_embedding.py``).

Installed only when asked, with :mod:`.transformer_layer` (see there). Right before
``LanguageModelEmbedding.forward`` runs in training, the default device generator and the RNG
tracker's ``'model-parallel-rng'`` state are reseeded from ``dropout_seeds.stream_seeds`` of
``dropout_seeds.EMBEDDING_LAYER`` and the embedding's tensor-parallel rank (``self.tp_group``,
language_model_embedding.py:47), and put back when it returns. The embedding dropout draws from
the default generator, or, with sequence parallelism, from the model-parallel stream on this
rank's slice of the sequence (lines 133-148).

A multi-token prediction layer looks the shifted tokens up in the same module (or in the last
stage's copy of it); within its forward (:func:`looked_up_by`) the lookup is keyed by that
layer's number instead, so its mask is not the model's first lookup's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Iterator

from .interfaces import DeviceBackend, DropoutSeeds
from .registry import PatchRegistry
from .tensor_parallel_random import keyed_streams

FORWARD = ("megatron.core.models.common.embeddings.language_model_embedding."
           "LanguageModelEmbedding.forward")


_LOOKING_UP_LAYER: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "elaswave_embedding_lookup_layer", default=None)


@contextlib.contextmanager
def looked_up_by(layer: int) -> Iterator[None]:
    """Within: the embedding's lookups are those of global layer ``layer`` (0-based)."""
    token = _LOOKING_UP_LAYER.set(layer)
    try:
        yield
    finally:
        _LOOKING_UP_LAYER.reset(token)


def _keyed_forward(forward, backend: DeviceBackend, dropout_seeds: DropoutSeeds):
    @functools.wraps(forward)
    def forward_with_keyed_rng(self, *args, **kwargs):
        if not self.training or self.embedding_dropout.p == 0:
            return forward(self, *args, **kwargs)
        layer = _LOOKING_UP_LAYER.get()
        seeds = (dropout_seeds.stream_seeds(dropout_seeds.EMBEDDING_LAYER, self.tp_group.rank())
                 if layer is None else
                 dropout_seeds.stream_seeds(layer, self.tp_group.rank(), embedding=True))
        with keyed_streams(backend, seeds.default, seeds.model_parallel):
            return forward(self, *args, **kwargs)

    return forward_with_keyed_rng


def register(registry: PatchRegistry, backend: DeviceBackend, dropout_seeds: DropoutSeeds) -> None:
    registry.register_wrapper(FORWARD,
                              lambda forward: _keyed_forward(forward, backend, dropout_seeds))
