"""Optimizer parameter groups aligned over a given group instead of the whole default world.

Checked against megatron-core 0.16.1.

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


def register(registry: PatchRegistry) -> None:
    registry.register_wrapper(TARGET, _gathering_on_alignment_group)
