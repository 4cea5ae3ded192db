"""Layout-invariant dropout in ``TransformerLayer.forward``: reseed Megatron's streams per layer.

Checked against megatron-core 0.16.1 and 0.19.2 (``megatron/core/transformer/transformer_layer.py``;
line numbers of 0.16.1).

Installed only when asked (``patches.install(backend, dropout_seeds=...)``; the training script
does so for ``--elastic-rng invariant``, with ``megatron_elaswave.runtime.dropout_rng``). Right before a
layer's forward runs in training, the default device generator and the RNG tracker's
``'model-parallel-rng'`` state are reseeded from ``dropout_seeds.stream_seeds`` of

* the global layer number, ``self.layer_number - 1`` (Megatron sets ``layer_number`` to the
  1-based local index plus ``get_transformer_layer_offset``, transformer_layer.py:280); a
  multi-token prediction layer's is counted after the decoder's ``num_layers`` (0.16.1 numbers
  it so, 0.19.2 numbers it from 1 and marks it ``is_mtp_layer``), and
* the layer's tensor-parallel rank, ``self.tp_group.rank()`` (transformer_layer.py:278),

plus the iteration and micro-batch the training loop has set. Both streams are put back when the
layer returns. Megatron's consumers inside a layer are: attention dropout under
``tracker.fork()`` (dot_product_attention.py:217) and the two hidden dropouts in
``bias_dropout_add`` on the default generator; with sequence parallelism the block runs every
layer inside the fork (transformer_block.py:707), so all three draw from the model-parallel
stream, which is keyed by TP rank as the sharded activations require.

In an MoE layer the router draws too: its input jitter (``--moe-input-jitter-eps``) from the
default generator, the random logits of ``--moe-router-force-load-balancing`` from the tracker's
``'expert-parallel-rng'`` stream, which is keyed as well (by layer and TP rank: the router sees
this rank's tokens, whichever experts it holds).

Not supported: full activation recompute (``recompute_granularity='full'``) re-runs the layer's
forward during backward, when the loop has moved on to another micro-batch, so it is refused.
Selective recompute re-runs sub-modules under ``tensor_parallel.checkpoint``, which restores the
RNG states captured inside the layer, so it keeps the keyed masks (not exercised by our tests).
Eval (``self.training`` false) and layers that draw nothing run unchanged.
"""

from __future__ import annotations

import functools

from .interfaces import DeviceBackend, DropoutSeeds
from .registry import PatchRegistry
from .tensor_parallel_random import keyed_streams

FORWARD = "megatron.core.transformer.transformer_layer.TransformerLayer.forward"


def _keyed_forward(forward, backend: DeviceBackend, dropout_seeds: DropoutSeeds):
    @functools.wraps(forward)
    def forward_with_keyed_rng(self, *args, **kwargs):
        config = self.config
        if not self.training or not draws_randomly(config):
            return forward(self, *args, **kwargs)
        if config.recompute_granularity == "full":
            raise NotImplementedError(
                "layout-invariant dropout RNG does not support full activation recompute "
                "(the recomputed forward would draw other masks); use --elastic-rng megatron")
        seeds = dropout_seeds.stream_seeds(model_layer_index(self), self.tp_group.rank())
        with keyed_streams(backend, seeds.default, seeds.model_parallel, seeds.expert):
            return forward(self, *args, **kwargs)

    return forward_with_keyed_rng


def model_layer_index(layer) -> int:
    """``layer``'s 0-based place in the whole model: a multi-token prediction layer's after the
    decoder's layers."""
    index = layer.layer_number - 1
    if getattr(layer, "is_mtp_layer", False):
        index += layer.config.num_layers
    return index


def draws_randomly(config) -> bool:
    """Whether a transformer layer of ``config`` draws random numbers when it trains: dropout,
    or an MoE router's input jitter or forced load balancing."""
    return bool(config.hidden_dropout or config.attention_dropout
                or getattr(config, "moe_input_jitter_eps", None)
                or getattr(config, "moe_router_force_load_balancing", False))


def register(registry: PatchRegistry, backend: DeviceBackend, dropout_seeds: DropoutSeeds) -> None:
    registry.register_wrapper(FORWARD,
                              lambda forward: _keyed_forward(forward, backend, dropout_seeds))
