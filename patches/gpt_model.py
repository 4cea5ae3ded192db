"""``GPTModel``'s parameter names and transformer layers, by which the runtime keys model state.

Checked against megatron-core 0.16.1 and 0.19.2 (``megatron/core/models/gpt/gpt_model.py`` with the
local layer spec).

A model chunk names its layers' parameters ``decoder.layers.{i}.*`` with ``i`` counted within the
chunk; each layer's ``layer_number`` (1-based) is its place in the whole model. With tied
embeddings the last stage's ``output_layer.weight`` is a copy of the first stage's word embedding.
An MoE layer numbers its experts within the rank (``mlp.experts.local_experts.{j}`` of
``SequentialMLP``, ``mlp.experts.linear_fc{1,2}.weight{j}`` of Transformer Engine's
``TEGroupedMLP``); ``mlp.local_expert_indices`` gives their global indices. Its router's
``expert_bias`` (aux-loss-free routing) is a buffer, the same on every holder of the layer.
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
_LOCAL_EXPERT = (re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$"),
                 re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.linear_fc[12]\.(?:weight|bias))"
                            r"(\d+)()$"))
"""A local expert's parameter names (``SequentialMLP``, ``TEGroupedMLP``): prefix, local index,
rest."""


def global_parameter_names(chunk: GPTModel) -> dict[str, str]:
    """Map stage-local parameter names to global ones (layer indices counted over the model).
    The last stage's copy of a tied embedding is named as the embedding: it holds the same
    values, and either copy can stand in for the other."""
    layers = chunk.decoder.layers
    layer_numbers = {str(i): layer.layer_number - 1 for i, layer in enumerate(layers)}
    experts = {str(i): layer.mlp.local_expert_indices for i, layer in enumerate(layers)
               if hasattr(layer.mlp, "local_expert_indices")}
    tied = getattr(chunk, "share_embeddings_and_output_weights", False)
    names = {}
    for name, _ in chunk.named_parameters():
        if tied and name == _TIED_OUTPUT_WEIGHT:
            names[name] = WORD_EMBEDDING
            continue
        global_name = name
        layer = _LAYER_PREFIX.match(name)
        if layer is not None and layer.group(1) in experts:
            indices = experts[layer.group(1)]
            for pattern in _LOCAL_EXPERT:
                global_name = pattern.sub(
                    lambda m: f"{m.group(1)}{indices[int(m.group(2))]}{m.group(3)}", global_name)
        names[name] = _LAYER_PREFIX.sub(
            lambda m: f"decoder.layers.{layer_numbers[m.group(1)]}.", global_name)
    return names


def expert_biases(chunk: GPTModel) -> dict[str, torch.Tensor]:
    """The routers' expert biases of ``chunk`` by global name
    (``decoder.layers.{l}.mlp.router.expert_bias``); empty without aux-loss-free routing."""
    biases = {}
    for layer in chunk.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        bias = getattr(router, "expert_bias", None)
        if bias is not None:
            biases[f"decoder.layers.{layer.layer_number - 1}.mlp.router.expert_bias"] = bias
    return biases


def transformer_layers(chunks: Iterable[GPTModel]) -> list[torch.nn.Module]:
    """The transformer layers of ``chunks``, in model order."""
    return [layer for chunk in chunks for layer in chunk.decoder.layers]


def routed_experts(layers: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """The routed experts of the MoE layers among ``layers``: the module an MoE layer runs
    between the all-to-all that dispatches its tokens and the one that combines them."""
    return [layer.mlp.experts for layer in layers
            if hasattr(getattr(layer, "mlp", None), "token_dispatcher")]
