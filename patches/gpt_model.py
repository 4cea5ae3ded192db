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

import functools
import re
from collections.abc import Iterable

import torch
from megatron.core.models.gpt import GPTModel

WORD_EMBEDDING = "embedding.word_embeddings.weight"
RESIDUAL_OUTPUT_WEIGHTS = ("linear_proj.weight", "linear_fc2.weight")
"""The two projections that feed the residual stream (Megatron scales their initialisation)."""

_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")
_TIED_OUTPUT_WEIGHT = "output_layer.weight"
_LOCAL_EXPERT = (re.compile(r"^(experts\.local_experts\.)(\d+)(\..*)$"),
                 re.compile(r"^(experts\.linear_fc[12]\.(?:weight|bias))(\d+)()$"))
"""A local expert's parameter names within its MoE layer (``SequentialMLP``, ``TEGroupedMLP``):
prefix, local index, rest."""


def _moe_layers(chunk: GPTModel) -> dict[str, list[int]]:
    """The MoE layers of ``chunk``, the decoder's and the multi-token prediction layers', by
    module path with a trailing dot: the global indices of their local experts."""
    return {f"{path}.": list(module.local_expert_indices)
            for path, module in chunk.named_modules() if hasattr(module, "local_expert_indices")}


def _global_name(name: str, layer_numbers: dict[str, int], moe_layers: dict[str, list[int]]) -> str:
    for prefix, indices in moe_layers.items():
        if name.startswith(prefix):
            rest = name[len(prefix):]
            for pattern in _LOCAL_EXPERT:
                rest = pattern.sub(lambda m: f"{m.group(1)}{indices[int(m.group(2))]}{m.group(3)}",
                                   rest)
            name = prefix + rest
            break
    return _LAYER_PREFIX.sub(lambda m: f"decoder.layers.{layer_numbers[m.group(1)]}.", name)


def global_parameter_names(chunk: GPTModel) -> dict[str, str]:
    """Map stage-local parameter names to global ones (decoder layers counted over the model,
    experts by global index, in the decoder's and the multi-token prediction layers' MoE layers
    alike; the multi-token prediction layers, all in one chunk, keep their names). The last
    stage's copy of a tied embedding is named as the embedding: it holds the same values, and
    either copy can stand in for the other; so is the copy the multi-token prediction layers use
    (its own ``embedding.word_embeddings.weight``; such a model's embeddings are untied,
    :func:`~.multi_token_prediction.unsupported_mtp_model`)."""
    layer_numbers = {str(i): layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}
    moe_layers = _moe_layers(chunk)
    tied = getattr(chunk, "share_embeddings_and_output_weights", False)
    return {name: WORD_EMBEDDING if tied and name == _TIED_OUTPUT_WEIGHT
            else _global_name(name, layer_numbers, moe_layers)
            for name, _ in chunk.named_parameters()}


def expert_biases(chunk: GPTModel) -> dict[str, torch.Tensor]:
    """The routers' expert biases of ``chunk`` by global name
    (``decoder.layers.{l}.mlp.router.expert_bias``, ``mtp.layers.{k}.<layer>.mlp.router.expert_bias``);
    empty without aux-loss-free routing."""
    layer_numbers = {str(i): layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}
    return {_global_name(f"{path}.expert_bias", layer_numbers, {}): module.expert_bias
            for path, module in chunk.named_modules()
            if path.endswith(".router") and getattr(module, "expert_bias", None) is not None}


def transformer_layers(chunks: Iterable[GPTModel]) -> list[torch.nn.Module]:
    """The transformer layers of ``chunks``, in model order."""
    return [layer for chunk in chunks for layer in chunk.decoder.layers]


def routed_experts(layers: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """The routed experts of the MoE layers among ``layers``: the module an MoE layer runs
    between the all-to-all that dispatches its tokens and the one that combines them."""
    return [layer.mlp.experts for layer in layers
            if hasattr(getattr(layer, "mlp", None), "token_dispatcher")]


def compute_mtp_loss_as_built(chunk: GPTModel) -> None:
    """Have ``chunk`` normalise its multi-token prediction loss by the config's
    ``calculate_per_token_loss`` as it was when the chunk was built.

    ``GPTModel`` reads the flag in its forward (0.16.1: ``forward``; 0.19.2: ``process_mtp_loss``
    from ``_postprocess``): a micro-batch's mean, or its sum. The elastic job builds its chunks
    with the job's flag and runs the schedules per token (the global batch's count divides the
    gradients); within the chunk's forward the config holds the job's flag again, as Megatron's
    routers keep it from their construction. A chunk without those layers is left as it is."""
    if not getattr(chunk, "mtp_process", False):
        return
    config, per_token = chunk.config, chunk.config.calculate_per_token_loss
    forward = chunk.forward

    @functools.wraps(forward)
    def forward_with_built_normalisation(*args, **kwargs):
        running, config.calculate_per_token_loss = config.calculate_per_token_loss, per_token
        try:
            return forward(*args, **kwargs)
        finally:
            config.calculate_per_token_loss = running

    chunk.forward = forward_with_built_normalisation
