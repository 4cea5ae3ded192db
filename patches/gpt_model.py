"""``GPTModel``'s parameter names and transformer layers, by which the runtime keys model state.

Checked against megatron-core 0.16.1 and 0.19.2 (``megatron/core/models/gpt/gpt_model.py`` with the
local layer spec).

A model chunk names its layers' parameters ``decoder.layers.{i}.*`` with ``i`` counted within the
chunk; each layer's ``layer_number`` (1-based) is its place in the whole model. With tied
embeddings the last stage's ``output_layer.weight`` is a copy of the first stage's word embedding.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from megatron.core.models.gpt import GPTModel

WORD_EMBEDDING = "embedding.word_embeddings.weight"
RESIDUAL_OUTPUT_WEIGHTS = ("linear_proj.weight", "linear_fc2.weight")
"""The two projections that feed the residual stream (Megatron scales their initialisation)."""

_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")
_TIED_OUTPUT_WEIGHT = "output_layer.weight"


def global_parameter_names(chunk: GPTModel) -> dict[str, str]:
    """Map stage-local parameter names to global ones (layer indices counted over the model).
    The last stage's copy of a tied embedding is named as the embedding: it holds the same
    values, and either copy can stand in for the other."""
    layer_numbers = {str(i): layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}
    tied = getattr(chunk, "share_embeddings_and_output_weights", False)
    names = {}
    for name, _ in chunk.named_parameters():
        if tied and name == _TIED_OUTPUT_WEIGHT:
            names[name] = WORD_EMBEDDING
            continue
        names[name] = _LAYER_PREFIX.sub(
            lambda m: f"decoder.layers.{layer_numbers[m.group(1)]}.", name
        )
    return names


def transformer_layers(chunks: Iterable[GPTModel]) -> list[torch.nn.Module]:
    """The transformer layers of ``chunks``, in model order."""
    return [layer for chunk in chunks for layer in chunk.decoder.layers]
