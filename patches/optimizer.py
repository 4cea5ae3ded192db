"""Optimizer parameter groups aligned over a given group instead of the whole default world,
the separate gradient-norm groups agreed on once for all the optimizers of a rank, and a rank's
optimizer state by names that do not depend on the release.

Checked against megatron-core 0.16.1 and 0.19.2.

``_get_param_groups`` (optimizer/__init__.py:108) aligns parameter-group keys across ranks with
``all_gather_object`` on the default group, sized by the default group's world size
(lines 180-181), twice per ``get_megatron_optimizer`` call. A rank holding several layer groups
builds one optimizer per layer group, so ranks would issue different numbers of these world
collectives and hang; after a failure the default group also still counts the dead ranks. Inside
:func:`param_groups_aligned_on`, the gather runs on the group given (the layer group's
data-parallel group, whose members build the same parameter groups).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .registry import PatchRegistry

TARGET = "megatron.core.optimizer._get_param_groups"

_alignment = threading.local()


@contextlib.contextmanager
def param_groups_aligned_on(group: dist.ProcessGroup) -> Iterator[None]:
    """Align ``get_megatron_optimizer``'s parameter groups over ``group`` inside the block."""
    previous = getattr(_alignment, "group", None)
    _alignment.group = group
    try:
        yield
    finally:
        _alignment.group = previous


def _gathering_on_alignment_group(get_param_groups):
    @functools.wraps(get_param_groups)
    def get_param_groups_on_group(*args, **kwargs):
        alignment = getattr(_alignment, "group", None)
        if alignment is None:
            return get_param_groups(*args, **kwargs)
        world_size, gather = dist.get_world_size, dist.all_gather_object

        def size_of(group=None):
            return world_size(alignment if group is None else group)

        def gather_on(object_list, obj, group=None):
            return gather(object_list, obj, group=alignment if group is None else group)

        dist.get_world_size, dist.all_gather_object = size_of, gather_on
        try:
            return get_param_groups(*args, **kwargs)
        finally:
            dist.get_world_size, dist.all_gather_object = world_size, gather

    return get_param_groups_on_group


def _separate_grad_norm_groups() -> tuple[tuple[str, ...], str]:
    """The gradient-norm groups clipped apart from the rest (megatron-core 0.19: ``('mtp',)``;
    none before) and the parameter attribute that names a parameter's group."""
    # Imported here: importing megatron-core's optimizer warns about TE and Apex on stderr, and
    # the patches are imported by scripts whose errors must stay one line.
    from megatron.core.optimizer import optimizer

    return (getattr(optimizer, "SEPARATE_GRAD_NORM_GROUPS", ()),
            getattr(optimizer, "GRAD_NORM_GROUP_ATTR", "grad_norm_group"))


def agree_grad_norm_groups(chained, group: dist.ProcessGroup) -> None:
    """Answer ``has_grad_norm_group`` for ``chained`` and each of its optimizers with one
    reduction over ``group`` (the ranks that step together; a group that reduces host tensors).

    megatron-core 0.19 answers it, the first time a step clips, with one reduction per
    optimizer over its grad-stats group (the world): a rank that holds more layer groups, and so
    more optimizers, issues more of them, and the job hangs in its first step after a re-plan.
    Nothing to do before 0.19."""
    names, attribute = _separate_grad_norm_groups()
    if not names:
        return
    owned = torch.tensor([
        any(getattr(param, attribute, None) == name
            for optimizer in chained.chained_optimizers for param in optimizer.get_parameters())
        for name in names], dtype=torch.int)
    dist.all_reduce(owned, op=dist.ReduceOp.MAX, group=group)
    answers = dict(zip(names, (bool(flag) for flag in owned.tolist())))
    for optimizer in (chained, *chained.chained_optimizers):
        optimizer._has_grad_norm_group_cache = dict(answers)


def main_params_and_states(optimizer) -> dict[str, torch.Tensor]:
    """This rank's main parameters and optimizer state of a ``ChainedOptimizer``, by stable names:
    ``optimizer{o}.group{g}.param{p}.main`` and ``.{state key}``, the tensors themselves."""
    tensors = {}
    for o, chained in enumerate(optimizer.chained_optimizers):
        inner = chained.optimizer
        for g, group in enumerate(inner.param_groups):
            for p, param in enumerate(group["params"]):
                prefix = f"optimizer{o}.group{g}.param{p}"
                tensors[f"{prefix}.main"] = param.detach()
                for key, value in inner.state.get(param, {}).items():
                    if torch.is_tensor(value):
                        tensors[f"{prefix}.{key}"] = value
    return tensors


def register(registry: PatchRegistry) -> None:
    registry.register_wrapper(TARGET, _gathering_on_alignment_group)
