"""``DistributedOptimizer``'s shard of each parameter, and fixes of its state loading on the
torch-Adam path (no TE or Apex).

Checked against megatron-core 0.16.1 and 0.19.2.

* :func:`shard_range`, :func:`shard_state` and :func:`set_shard_state` read and write the main
  parameter and optimizer state this rank holds of one model parameter, through the optimizer's
  private accessors (the names and return values are those of both releases).

Both bugs below are in both releases (line numbers of 0.16.1; 0.19.2's lines 1024-1032 and
1193-1225):

* ``load_state_dict`` (distrib_optimizer.py:818-826) puts one **shared** ``step`` tensor into the
  state of every parameter. ``torch.optim.Adam``'s foreach path then increments that one tensor
  once per parameter, so after any load the bias correction is wrong from the second step on.
  Each parameter gets its own copy.
* ``_set_main_param_and_optimizer_states`` (distrib_optimizer.py:936-940) copies every key of the
  destination state, ``step`` included, from source tensors that carry only ``param``,
  ``exp_avg`` and ``exp_avg_sq``: loading a fully reshardable checkpoint raises ``KeyError``.
  Only the keys the source has are copied; ``step`` comes from ``load_state_dict``.
"""

from __future__ import annotations

import functools

import torch

from .registry import PatchRegistry

CLASS = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"


def shard_range(optimizer, param: torch.nn.Parameter) -> range | None:
    """The elements of ``param`` (flattened) whose main copy and state ``optimizer``'s shard holds;
    ``None`` where ``param`` is not in its shard."""
    if param not in optimizer.model_param_group_index_map:
        return None
    span = optimizer._get_model_param_range_map(param)["param"]
    return range(span.start, span.end)


def shard_state(optimizer, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """``param``'s shard: ``{"param": main parameter, "exp_avg": ..., "exp_avg_sq": ...}``, views
    of the optimizer's own tensors. ``param`` must be in ``optimizer``'s shard."""
    return optimizer._get_main_param_and_optimizer_states(param)


def set_shard_state(optimizer, param: torch.nn.Parameter, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (keys as :func:`shard_state`'s, any subset) into ``param``'s shard."""
    optimizer._set_main_param_and_optimizer_states(param, tensors)


def _unshare_adam_step(load_state_dict):
    @functools.wraps(load_state_dict)
    def load_state_dict_with_own_steps(self, state_dict):
        result = load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()
        return result

    return load_state_dict_with_own_steps


def _copy_present_keys_only(set_states):
    @functools.wraps(set_states)
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return set_states(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destination = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            destination[key].copy_(value)

    return set_main_param_and_optimizer_states


def register(registry: PatchRegistry) -> None:
    registry.register_wrapper(f"{CLASS}.load_state_dict", _unshare_adam_step)
    registry.register_wrapper(f"{CLASS}._set_main_param_and_optimizer_states",
                              _copy_present_keys_only)
