"""The router's expert-bias update over the model chunk's own groups:
``megatron.core.distributed.finalize_model_grads``.

Checked against megatron-core 0.16.1 and 0.19.2.

Aux-loss-free routing (``--moe-router-enable-expert-bias``) sums every router's token counts over
the ranks that hold its layer (tensor, data and context parallel) before it updates the bias.
megatron-core 0.19 takes that group from the ``pg_collection`` given to ``finalize_model_grads``;
0.16.1 reads ``parallel_state``'s, which holds one data-parallel group per rank. A rank whose
chunks reduce over different groups (one chunk per layer group, each with its own holders) would
sum the counts of one chunk over another chunk's holders, and the ranks would pair different
all-reduces. On 0.16.1 the update reduces over the ``tp_dp_cp`` group of the collection the
chunk's ``finalize_model_grads`` was given, as 0.19 does; without a collection it is unchanged.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

from .registry import PatchRegistry

MODULE = "megatron.core.distributed.finalize_model_grads"

_reduction = threading.local()


def _reducing_over_collection(finalize: Callable) -> Callable:
    @functools.wraps(finalize)
    def finalize_over_collection(model, num_tokens=None, pg_collection=None, *args, **kwargs):
        previous = getattr(_reduction, "group", None)
        _reduction.group = getattr(pg_collection, "tp_dp_cp", None)
        try:
            return finalize(model, num_tokens, pg_collection, *args, **kwargs)
        finally:
            _reduction.group = previous

    return finalize_over_collection


def _updating_over_collection(get_updated_expert_bias: Callable) -> Callable:
    @functools.wraps(get_updated_expert_bias)
    def updated_expert_bias(tokens_per_expert, expert_bias, expert_bias_update_rate, *args,
                            **kwargs):
        from megatron.core import parallel_state

        group = getattr(_reduction, "group", None)
        if group is None or any(g is not None for g in (*args, *kwargs.values())):
            # 0.19 passes the collection's group itself.
            return get_updated_expert_bias(tokens_per_expert, expert_bias,
                                           expert_bias_update_rate, *args, **kwargs)
        getter = parallel_state.get_tensor_and_data_parallel_group
        parallel_state.get_tensor_and_data_parallel_group = lambda *_, **__: group
        try:
            return get_updated_expert_bias(tokens_per_expert, expert_bias,
                                           expert_bias_update_rate, *args, **kwargs)
        finally:
            parallel_state.get_tensor_and_data_parallel_group = getter

    return updated_expert_bias


def register(registry: PatchRegistry) -> None:
    """Reduce the expert-bias token counts over the chunk's collection where the release reads
    ``parallel_state`` instead (0.16.1; 0.19 passes the group, and the patch calls through)."""
    registry.register_wrapper(f"{MODULE}.finalize_model_grads", _reducing_over_collection)
    registry.register_wrapper(f"{MODULE}.get_updated_expert_bias", _updating_over_collection)
