"""``DistributedOptimizer``'s shard of each parameter, and fixes of its state loading on the
torch-Adam path (no TE or Apex).

Checked against megatron-core 0.16.1 and 0.19.2.

* :func:`shard_range`, :func:`shard_state` and :func:`set_shard_state` read and write the main
  parameter and optimizer state this rank holds of one model parameter, through the optimizer's
  private accessors (the names and return values are those of both releases); :func:`owns`
  tells which optimizer a parameter's buffer belongs to.

Both bugs below are in both releases (line numbers of 0.16.1; 0.19.2's lines 1024-1032 and
1193-1225):

* ``load_state_dict`` (distrib_optimizer.py:818-826) puts one **shared** ``step`` tensor into the
  state of every parameter. ``torch.optim.Adam``'s foreach path then increments that one tensor
  once per parameter, so after any load the bias correction is wrong from the second step on.
  Each parameter gets its own copy.
* ``_set_main_param_and_optimizer_states`` (distrib_optimizer.py:936-940) copies every key of the
  destination state, ``step`` included, from source tensors that carry only ``param``,
  ``exp_avg`` and ``exp_avg_sq``: loading a fully reshardable checkpoint raises ``KeyError``.
  Only the tensors the source has are copied, ``step`` excepted: a ``dp_reshardable``
  checkpoint's entries carry a ``padding`` flag and, as their ``step``, the value the optimizer
  had before the load (a ``LocalNonpersistentObject``), which would restart Adam's bias
  correction; ``step`` comes from ``load_state_dict``.
* ``load_parameter_state_from_dp_reshardable`` (0.19.2's distrib_optimizer.py:2061) copies into
  the main parameters without ``torch.no_grad()``; in fp32 they are views of the model's leaf
  parameters, so Megatron-LM's ``load_checkpoint`` of its own default checkpoint raises. It runs
  under ``torch.no_grad()``.
* ``state_dict`` (distrib_optimizer.py:636-642; 0.19.2's 836-840) asserts that the torch Adam's
  state holds exactly one ``step``, which a fresh optimizer, before its first step, does not:
  ``sharded_state_dict`` calls it first thing, so Megatron-LM's ``load_checkpoint`` cannot load a
  checkpoint into its new optimizer on this path. The state is allocated first (zero moments at
  step 0, which update exactly as no state), as megatron-core's TE and Apex optimizers hold it.
"""

from __future__ import annotations

import functools

import torch

from .registry import PatchRegistry

CLASS = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"


def owns(optimizer, param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is in one of ``optimizer``'s gradient buffers (an MoE chunk has two
    optimizers: one over its dense buffers, one over its experts')."""
    return any(param in buffer.param_index_map for buffer in optimizer.buffers)


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
            # Not the ``padding`` flag of a dp_reshardable checkpoint's entries, nor their
            # ``step``: it is this optimizer's own from before the load.
            if torch.is_tensor(value) and key != "step":
                destination[key].copy_(value)

    return set_main_param_and_optimizer_states


def allocate_adam_state(optimizer) -> None:
    """Give every parameter of a torch Adam that has no state yet its zero state at step 0."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)


def _allocating_fresh_adam_state(state_dict):
    @functools.wraps(state_dict)
    def state_dict_of_allocated_state(self):
        if isinstance(self.optimizer, torch.optim.Adam):
            allocate_adam_state(self.optimizer)
        return state_dict(self)

    return state_dict_of_allocated_state


def _without_grad(load):
    @functools.wraps(load)
    def load_without_grad(self, *args, **kwargs):
        with torch.no_grad():
            return load(self, *args, **kwargs)

    return load_without_grad


def register(registry: PatchRegistry) -> None:
    registry.register_wrapper(f"{CLASS}.state_dict", _allocating_fresh_adam_state)
    registry.register_wrapper(f"{CLASS}.load_parameter_state_from_dp_reshardable", _without_grad)
    registry.register_wrapper(f"{CLASS}.load_state_dict", _unshare_adam_step)
    registry.register_wrapper(f"{CLASS}._set_main_param_and_optimizer_states",
                              _copy_present_keys_only)
