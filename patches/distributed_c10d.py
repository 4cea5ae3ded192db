"""Process groups created by their members only, under a name they all derive the same way.

Checked against torch 2.13 (``torch/distributed/distributed_c10d.py``); ``new_named_group`` also
ran on torch 2.11 with NCCL.

``new_group(ranks, use_local_synchronization=True)`` cannot be used as is: torch 2.13 names such a
group by hashing its ranks *together with the number of groups the calling process holds*, so
members that hold different numbers of groups (the normal case after a group edit, and between
the ranks of a heterogeneous layout) rendezvous under different store prefixes and time out.
:func:`new_named_group` is that function's body with the name and the store given.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from torch.distributed import distributed_c10d

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store


def new_named_group(world_ranks: Sequence[int], backend: str, store: Store, name: str,
                    timeout: timedelta) -> ProcessGroup:
    """The group of ``world_ranks`` (ranks of the default group, which must include this
    process) named ``name``; its members rendezvous on ``store``, each waiting at most
    ``timeout``. Only the members call it; it may run on any thread. Raises what the backend
    raises when a member does not come."""
    world_ranks = list(world_ranks)
    group, _ = distributed_c10d._new_process_group_helper(
        len(world_ranks),
        world_ranks.index(distributed_c10d._get_default_group().rank()),
        world_ranks,
        backend,
        store,
        distributed_c10d.GroupName(name),
        timeout=timeout,
        group_desc=name,
    )
    # What new_group records besides, so that get_group_rank and the collectives' rank
    # translation know the group.
    distributed_c10d._world.pg_group_ranks[group] = {r: i for i, r in enumerate(world_ranks)}
    return group


def forget_unformed_default_group() -> None:
    """Name the next default group as a first one, where no default group exists.

    ``init_process_group`` names the default group after the number of groups created so far,
    and takes that number before its rendezvous: one whose rendezvous raised (a member died
    while the group formed) leaves no group but the number taken, so this process would name its
    next default group ``"1"`` where the others say ``"0"``, and their rendezvous would wait
    under different store prefixes until the timeout. ``destroy_process_group()`` resets the
    number the same way after a group that formed."""
    if not distributed_c10d.is_initialized():
        distributed_c10d._world.group_count = 0
