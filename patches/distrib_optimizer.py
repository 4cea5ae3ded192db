"""Fix of ``DistributedOptimizer.load_state_dict`` sharing one Adam ``step`` tensor.

Checked against megatron-core 0.16.1 (distrib_optimizer.py:818-826). Without TE or Apex, the
loader puts a single ``step`` tensor into the state of every parameter. ``torch.optim.Adam``'s
foreach path then increments that one tensor once per parameter, so after any load the bias
correction is wrong from the second step on. Each parameter gets its own copy here.
"""

from __future__ import annotations

import functools

from .registry import PatchRegistry

TARGET = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict"


def _unshare_adam_step(load_state_dict):
    @functools.wraps(load_state_dict)
    def load_state_dict_with_own_steps(self, state_dict):
        result = load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()
        return result

    return load_state_dict_with_own_steps


def register(registry: PatchRegistry) -> None:
    registry.register_wrapper(TARGET, _unshare_adam_step)
