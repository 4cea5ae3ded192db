"""Layer counts and offsets of an uneven pipeline layout, from the rank the caller passes.

Checked against megatron-core 0.16.1 and 0.19.2 (line numbers of 0.16.1).

``get_num_layers_to_build`` (transformer_block.py:75) and ``get_transformer_layer_offset``
(transformer_layer.py:39) receive ``pp_rank`` from the model's explicit ``pg_collection`` but do
not forward it to ``config.pipeline_model_parallel_layout`` (transformer_block.py:91-93,
transformer_layer.py:50-52), which then reads the global ``parallel_state`` pipeline rank. A model
chunk built for one layer group of a heterogeneous layout is placed by its ``pg_collection.pp``
rank, not by the rank of its process in any real pipeline, so the rank given must win. The
wrappers forward it; without a layout, or without a rank, Megatron's code runs unchanged.
"""

from __future__ import annotations

import functools

from .registry import PatchRegistry

NUM_LAYERS = "megatron.core.transformer.transformer_block.get_num_layers_to_build"
LAYER_OFFSET = "megatron.core.transformer.transformer_layer.get_transformer_layer_offset"


def _decoder():
    from megatron.core.transformer.enums import LayerType

    return LayerType.decoder


def _layout_num_layers(get_num_layers_to_build):
    @functools.wraps(get_num_layers_to_build)
    def num_layers_for_rank(config, vp_stage=None, pp_rank=None):
        layout = config.pipeline_model_parallel_layout
        if layout is None or pp_rank is None:
            return get_num_layers_to_build(config, vp_stage, pp_rank)
        return layout.get_num_layers_to_build(layer_type=_decoder(), vp_stage=vp_stage, pp_rank=pp_rank)

    return num_layers_for_rank


def _layout_offset(get_transformer_layer_offset):
    @functools.wraps(get_transformer_layer_offset)
    def offset_for_rank(config, vp_stage=None, pp_rank=None):
        layout = config.pipeline_model_parallel_layout
        if layout is None or pp_rank is None or config.pipeline_model_parallel_size == 1:
            return get_transformer_layer_offset(config, vp_stage, pp_rank)
        return layout.get_layer_offset(layer_type=_decoder(), vp_stage=vp_stage, pp_rank=pp_rank)

    return offset_for_rank


def register(registry: PatchRegistry) -> None:
    registry.register_wrapper(NUM_LAYERS, _layout_num_layers)
    registry.register_wrapper(LAYER_OFFSET, _layout_offset)
