"""The dynamic communicator: one registry owns every process group of the job.

A :class:`GroupRegistry` creates the process groups a :class:`~megatron_elaswave.layout.Layout`
needs and, after a failure, edits them into the groups of the next layout. It guarantees:

* **Groups are data first.** :func:`group_specs` is a pure function of the layout: every group as
  a :class:`GroupSpec` (role, key, member ranks). It needs no process and is what the tests check
  against Megatron's own ``RankGenerator``.
* **One communicator per member list.** Roles with the same ordered member list share one
  ``ProcessGroup``: with context parallelism 1 the DP-CP group *is* the DP group, a two-stage
  pipeline's embedding group *is* its pipeline group, a one-stage pipeline *is* its rank's
  context-parallel singleton. Sharing is safe because every member issues the operations of a
  group in the same program order, whichever role it calls it by.
* **An edit touches only what changed.** ``edit(failed_ranks, new_layout)`` keeps every group whose
  member list the new layout still uses, creates the member lists it lacks and destroys the ones
  it no longer uses (every list with a failed rank among them). In the default ``inplace`` mode
  only the members of a created group take part in creating it: dead ranks never participate
  and bystanders do nothing. ``partial`` and ``full`` exist for comparison (:class:`EditMode`).
* **Host state travels on gloo.** The groups that move host-memory state (snapshot replicas,
  migrated optimizer shards: :data:`HOST_ROLES`) have a gloo twin with the same members wherever
  the device backend is not gloo, as Megatron keeps gloo groups beside its NCCL ones for its
  CPU-side work (:meth:`GroupRegistry.host_group`); NCCL refuses host tensors. Twins are created,
  kept and destroyed with their device group. On gloo the device group serves both, unless
  ``ELASWAVE_SEPARATE_HOST_GROUPS=1`` asks for twins there too, which runs the code path of an
  NCCL job on a CPU-only machine.
* **Ranks are launch ranks.** Specs, keys and lookups use the ranks the launcher gave; the
  registry translates to the default group's numbering, which differs only after a ``full``
  rebuild (:meth:`GroupRegistry.world_rank`).

The default group after a death
-------------------------------
``inplace`` and ``partial`` keep the default group (``torch.distributed.group.WORLD``) that the job
started with, dead ranks included, because replacing it destroys every other group (torch's
``destroy_process_group()``; NCCL's ``shrink_group`` of the default group does the same). What
the stale default group still provides, measured on gloo after a SIGKILL
(``tests/test_communicator.py``): its store and rank numbering, from which the registry creates
the new groups; and point-to-point send/recv between two survivors, which megatron-core's P2P
code uses when a pipeline group has two ranks and ``batch_p2p_comm=False``. What it cannot
provide: any *collective* on the default group (``barrier()``, ``all_gather_object()`` without a
group, ...), which would wait on the dead rank. The runtime therefore passes the registry's
groups to every collective; the survivors' group is :attr:`Role.WORLD`. Code that must use the
default group for collectives needs ``full`` mode, which re-creates it over the survivors on
``PrefixStore(f"gen{generation}/", store)``.
"""

from __future__ import annotations

import enum
import hashlib
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import torch.distributed as dist

from megatron_elaswave.launch.keys import communicator_key, generation_prefix
from megatron_elaswave.launch.store import WaitInterrupted, wait_for_keys
from megatron_elaswave.layout import Layout, Replica
from megatron_elaswave.patches.distributed_c10d import (
    forget_unformed_default_group,
    new_named_group,
)
from megatron_elaswave.runtime.generation_store import KEPT_GENERATIONS, GenerationStores
from megatron_elaswave.runtime.world import InterruptibleStore, recording_connections, retire

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch.distributed import ProcessGroup, Store

K = TypeVar("K")


class Role(str, enum.Enum):
    """What a group is for, in Megatron's vocabulary (its ``ProcessGroupCollection`` names)."""

    WORLD = "world"
    """Every rank that holds a stage, in rank order: the grad-norm and token-count group."""
    MEMBERS = "members"
    """Every rank of the layout, spares included: the group that moves state after a change."""
    TP = "tp"
    """One stage instance, in TP-rank order. Key ``(replica, stage)``."""
    PP = "pp"
    """One replica's stages at one TP rank, in pipeline order. Key ``(replica, tp_rank)``."""
    MP = "mp"
    """All ranks of one replica, TP rank fastest (Megatron's ``tp-pp``). Key ``(replica,)``."""
    EMBEDDING = "embd"
    """First and last stage of a pipeline (one rank if it has one stage). Key as :attr:`PP`."""
    POSITION_EMBEDDING = "pos_embd"
    """First stage of a pipeline. Key as :attr:`PP`."""
    DP = "dp"
    """The holders of one layer group at one TP rank, one per replica, in replica order.
    Key ``(layer_group, tp_rank)``. With equal stages everywhere, Megatron's DP group."""
    DP_CP = "dp_cp"
    """:attr:`DP` with context parallelism, which is 1: the same members."""
    TP_DP = "tp_dp"
    """The holders of one layer group at every TP rank (Megatron's ``tp-dp``). Key
    ``(layer_group,)``."""
    CP = "cp"
    """A rank alone: context parallelism is 1. Key ``(rank,)``."""
    EP = "ep"
    """An MoE job's holders of one layer group that split its experts, in expert-parallel rank
    order. Key ``(layer_group, expert TP rank, expert data-parallel rank)``."""
    EXPT_TP = "expt_tp"
    """The holders of one layer group that split each of the same experts' weights, in expert
    TP rank order. Key ``(layer_group, expert-parallel rank, expert data-parallel rank)``."""
    TP_EP = "tp_ep"
    """The holders of one layer group that hold one copy of every expert between them, expert
    TP rank fastest (Megatron's ``tp-ep``). Key ``(layer_group, expert data-parallel rank)``."""
    EXPT_DP = "expt_dp"
    """The holders of one layer group that hold the same expert shards, in expert data-parallel
    rank order: the reduction group of the experts' gradients. Key ``(layer_group, expert TP
    rank, expert-parallel rank)``."""


_ONE_PER_RANK = frozenset(
    {Role.WORLD, Role.MEMBERS, Role.TP, Role.PP, Role.MP, Role.EMBEDDING, Role.POSITION_EMBEDDING, Role.CP}
)
"""Roles of which a rank holds at most one group (DP and TP-DP are one per layer group)."""

HOST_ROLES = frozenset({Role.WORLD, Role.MEMBERS})
"""Roles whose groups also carry host-memory tensors: snapshot replicas (:attr:`Role.WORLD`) and
the state a recovery migrates (:attr:`Role.MEMBERS`)."""

SEPARATE_HOST_GROUPS_ENV = "ELASWAVE_SEPARATE_HOST_GROUPS"
"""Set to ``1`` to give the :data:`HOST_ROLES` groups gloo twins on a gloo job too."""

HOST_BACKEND = "gloo"
"""The backend of the twins, as of Megatron's own groups for CPU-side work."""


class EditMode(str, enum.Enum):
    """How :meth:`GroupRegistry.edit` re-creates groups."""

    INPLACE = "inplace"
    """Only the groups that change, each created by its members alone."""
    PARTIAL = "partial"
    """Only the groups that change, but every survivor takes part in creating each of them
    (``new_group`` without local synchronisation) and waits for all survivors after each one,
    as ``initialize_model_parallel`` with ``TORCH_DIST_INIT_BARRIER=1`` would."""
    FULL = "full"
    """Destroy every group, form a new default group over the survivors, then create every
    group the ``partial`` way."""


@dataclass(frozen=True)
class GroupSpec:
    """One process group of a layout, as data."""

    role: Role
    key: tuple[int, ...]
    """Which group of its role (see :class:`Role`)."""
    ranks: tuple[int, ...]
    """Member launch ranks; a member's rank in the group is its index here."""

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError(f"{self.role.value} group {self.key} has no member")
        if len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ValueError(f"{self.role.value} group {self.key}: bad ranks {self.ranks}")


def _tp_size(layout: Layout) -> int:
    sizes = {len(stage.ranks) for replica in layout.replicas for stage in replica.stages}
    if len(sizes) != 1:
        raise ValueError(f"stages differ in tensor-parallel size: {sorted(sizes)}")
    return sizes.pop()


def _holders(replica: Replica, first_layer: int) -> tuple[int, ...]:
    """Ranks (in TP order) of the stage of ``replica`` that holds ``first_layer``."""
    return replica.stages[replica.stage_index_of_layer(first_layer)].ranks


def group_specs(layout: Layout) -> tuple[GroupSpec, ...]:
    """Every group ``layout`` needs, in a canonical order that all ranks agree on."""
    layout.validate()
    tp = _tp_size(layout)
    specs = [GroupSpec(Role.WORLD, (), tuple(sorted(layout.active_ranks())))]
    specs.append(GroupSpec(Role.MEMBERS, (), tuple(sorted(layout.known_ranks()))))
    for replica in layout.replicas:
        for s, stage in enumerate(replica.stages):
            specs.append(GroupSpec(Role.TP, (replica.index, s), stage.ranks))
        for t in range(tp):
            pipeline = tuple(stage.ranks[t] for stage in replica.stages)
            key = (replica.index, t)
            specs.append(GroupSpec(Role.PP, key, pipeline))
            ends = tuple(dict.fromkeys((pipeline[0], pipeline[-1])))
            specs.append(GroupSpec(Role.EMBEDDING, key, ends))
            specs.append(GroupSpec(Role.POSITION_EMBEDDING, key, pipeline[:1]))
        replica_ranks = tuple(r for stage in replica.stages for r in stage.ranks)
        specs.append(GroupSpec(Role.MP, (replica.index,), replica_ranks))
    for g, (first_layer, _) in enumerate(layout.layer_groups()):
        holders = [_holders(replica, first_layer) for replica in layout.replicas]
        for t in range(tp):
            members = tuple(ranks[t] for ranks in holders)
            specs.append(GroupSpec(Role.DP, (g, t), members))
            specs.append(GroupSpec(Role.DP_CP, (g, t), members))
        specs.append(GroupSpec(Role.TP_DP, (g,), tuple(r for ranks in holders for r in ranks)))
        if layout.experts is not None:
            specs.extend(_expert_specs(layout, g, holders))
    specs.extend(GroupSpec(Role.CP, (rank,), (rank,)) for rank in sorted(layout.active_ranks()))
    return tuple(specs)


def _expert_specs(layout: Layout, layer_group: int,
                  holders: list[tuple[int, ...]]) -> list[GroupSpec]:
    """The expert groups of one layer group of an MoE layout, from its holders' expert
    coordinates (:meth:`~megatron_elaswave.layout.Layout.expert_coordinates`)."""
    experts, tp = layout.experts, layout.tensor_parallel_size
    members: dict[tuple, list[tuple[int, int]]] = {}
    for replica, ranks in zip(layout.replicas, holders):
        for t, rank in enumerate(ranks):
            etp, ep, edp = experts.coordinates(replica.index, t, tp)
            for role, key, order in ((Role.EP, (etp, edp), ep), (Role.EXPT_TP, (ep, edp), etp),
                                     (Role.TP_EP, (edp,), etp + experts.expert_tensor_parallel_size * ep),
                                     (Role.EXPT_DP, (etp, ep), edp)):
                members.setdefault((role, (layer_group, *key)), []).append((order, rank))
    return [GroupSpec(role, key, tuple(rank for _, rank in sorted(ranks)))
            for (role, key), ranks in members.items()]


def member_lists(specs: Iterable[GroupSpec]) -> tuple[tuple[int, ...], ...]:
    """The distinct member lists of ``specs``, in first-seen order: one communicator each."""
    return tuple(dict.fromkeys(spec.ranks for spec in specs))


def host_member_lists(layout: Layout) -> tuple[tuple[int, ...], ...]:
    """The member lists of ``layout``'s :data:`HOST_ROLES` groups, in canonical order."""
    return member_lists(spec for spec in group_specs(layout) if spec.role in HOST_ROLES)


@dataclass(frozen=True)
class EditPlan:
    """What an in-place edit does to the communicators (member lists), job-wide."""

    keep: tuple[tuple[int, ...], ...]
    """Used by both layouts: left as they are."""
    create: tuple[tuple[int, ...], ...]
    """Used by the new layout and new, or broken: created, in canonical order."""
    drop: tuple[tuple[int, ...], ...]
    """Used by the old layout and not kept: destroyed by their surviving members."""
    host_create: tuple[tuple[int, ...], ...] = ()
    """Lists of the new layout's :data:`HOST_ROLES` groups whose gloo twin is created: all but
    those of kept groups that had a twin already."""
    host_drop: tuple[tuple[int, ...], ...] = ()
    """Lists of the old layout's host twins that are not kept."""


def plan_edit(old: Layout, new: Layout, failed_ranks: Iterable[int],
              broken: Iterable[Sequence[int]] = ()) -> EditPlan:
    """The communicators that change between ``old`` and ``new`` after ``failed_ranks`` died.

    ``broken`` lists member lists of groups that must be re-created although no member failed:
    groups whose in-flight operation was aborted (an abort leaves a gloo group unusable).
    """
    failed = frozenset(failed_ranks)
    if not failed <= old.known_ranks():
        unknown = sorted(failed - old.known_ranks())
        raise ValueError(f"failed ranks {unknown} are not part of the job")
    if not new.known_ranks() <= old.known_ranks() - failed:
        raise ValueError("the new layout uses ranks that failed or were never part of the job")
    before, after = member_lists(group_specs(old)), member_lists(group_specs(new))
    reusable = set(before) - {tuple(members) for members in broken}
    keep = tuple(m for m in after if m in reusable)
    host_before, host_after = host_member_lists(old), host_member_lists(new)
    host_keep = set(keep) & set(host_before)
    return EditPlan(
        keep=keep,
        create=tuple(m for m in after if m not in reusable),
        drop=tuple(m for m in before if m not in set(keep)),
        host_create=tuple(m for m in host_after if m not in host_keep),
        host_drop=tuple(m for m in host_before if m not in host_keep),
    )


@dataclass(frozen=True)
class EditReport:
    """What :meth:`GroupRegistry.edit` did on this rank."""

    mode: EditMode
    generation: int
    """Generation of the groups after the edit."""
    created: int
    """Communicators this rank created (host twins included)."""
    kept: int
    """Communicators this rank kept."""
    destroyed: int
    """Communicators this rank destroyed."""
    seconds: float
    """Wall time of the edit on this rank."""


def _group_name(generation: int, world_ranks: Sequence[int]) -> str:
    digest = hashlib.sha1("_".join(map(str, world_ranks)).encode(), usedforsecurity=False)
    return f"elaswave-gen{generation}-{digest.hexdigest()[:20]}"


def _new_named_groups(groups: dict[K, tuple[Sequence[int], str, str]],
                      timeout: timedelta, store: Store, creation_timeout: timedelta,
                      abort: threading.Event | None) -> dict[K, ProcessGroup]:
    """Groups created by their members only, under names they all derive the same way
    (:func:`~megatron_elaswave.patches.distributed_c10d.new_named_group`): ``groups`` maps a key
    to the group's ranks in the default group, its name and its backend. The members
    rendezvous on ``store``, bounded by ``creation_timeout``. Every group connects on a thread
    of its own; the call returns once all have formed. A failure aborts them
    (:func:`~megatron_elaswave.runtime.world.abort_collectives`) from the moment they begin to form.

    Raises the first error a group's creation raised. With ``abort``, raises
    :class:`~megatron_elaswave.launch.store.WaitInterrupted` as soon as it is set, even while the
    members connect: gloo's connection step cannot be interrupted, but it releases the GIL, so
    the caller can stop waiting for it. The threads are left to gloo: they end when gloo gives up
    on the dead member (:data:`CREATION_TIMEOUT`). A group formed after all (every member alive,
    the failure elsewhere) is never used: every survivor re-creates its groups in the recovery
    that follows, under the next generation's names. The threads are not daemons: a job that
    ends while one still connects waits for gloo to give up before the interpreter shuts down,
    which would otherwise abort the process ("terminate called without an active exception").
    """
    outcomes: dict[K, ProcessGroup | BaseException] = {}
    finished = threading.Semaphore(0)

    def create(key: K, world_ranks: Sequence[int], name: str, backend: str) -> None:
        try:
            outcomes[key] = new_named_group(world_ranks, backend, store, name, creation_timeout)
        except BaseException as error:  # handed to the caller, or dropped once it gave up
            outcomes[key] = error
        finished.release()

    with recording_connections() as device_groups:  # so that a failure can abort them
        for key, (world_ranks, name, backend) in groups.items():
            threading.Thread(target=create, args=(key, world_ranks, name, backend),
                             name=f"elaswave-connect-{name}", daemon=False).start()
        for _ in groups:
            while not finished.acquire(timeout=_ABORT_POLL_S):
                if abort is not None and abort.is_set():
                    raise WaitInterrupted(f"a failure was detected while {len(groups)} groups "
                                          "connected")
        device_groups.extend(outcome for key, outcome in outcomes.items()
                             if groups[key][2] != HOST_BACKEND
                             and not isinstance(outcome, BaseException))
    errors = [o for o in outcomes.values() if isinstance(o, BaseException)]
    if errors:
        raise errors[0]
    for key in groups:
        outcomes[key].set_timeout(timeout)
    return {key: outcomes[key] for key in groups}  # type: ignore[misc]


_ABORT_POLL_S = 0.01


CREATION_TIMEOUT = timedelta(seconds=2)
"""Bound on connecting the members of a group formed while a failure monitor watches (a recovery,
a grow), once they have met in the store and read one another's addresses (a read that a
detected failure interrupts, see :class:`~megatron_elaswave.runtime.world.InterruptibleStore`). Gloo
keeps connecting to a member that died after publishing its address, and waiting for one that
gave up, for about five times this (measured with torch 2.13), and the abort cannot reach
connections still being made. A group of a recovery stops being waited for when the failure is
detected (:func:`_new_named_groups`); the global groups of a grow's rebuild wait it out. Groups
take their op timeout once formed."""


def _store_barrier(store: Store, key: str, count: int, timeout: timedelta,
                   abort: threading.Event | None = None) -> None:
    """Return once ``count`` processes have reached ``key``: the last one releases the others.
    Raises :class:`~megatron_elaswave.launch.store.WaitInterrupted` as soon as ``abort`` is set."""
    _store_barriers(store, {key: count}, timeout, abort)


def _store_barriers(store: Store, counts: dict[str, int], timeout: timedelta,
                    abort: threading.Event | None = None) -> None:
    """:func:`_store_barrier` for every key of ``counts`` at once."""
    for key, count in counts.items():
        if store.add(key, 1) == count:
            store.set(f"{key}/released", "")
    wait_for_keys(store, [f"{key}/released" for key in counts], timeout, abort)


class GroupRegistry:
    """Every process group of one rank, created from a layout and edited on failures.

    ``rank`` is this process's launch rank and, when the registry is created, its rank in the
    default group (which must already exist). ``store`` is the job store, not a prefixed view.
    Each generation's groups meet and rendezvous in the generation's store from ``stores``
    (default: the job store for every generation); a ``full`` edit forms generation ``g``'s
    default group on ``PrefixStore(f"gen{g}/", <that store>)``. ``timeout`` bounds the creation
    of every group and every operation on it. ``backend`` is the device backend; the
    :data:`HOST_ROLES` groups get gloo twins where it is not gloo (:meth:`host_group`).
    """

    def __init__(self, layout: Layout, rank: int, *, store: Store, backend: str = "gloo",
                 timeout: timedelta = timedelta(seconds=30), generation: int = 0,
                 stores: GenerationStores | None = None) -> None:
        if dist.get_rank() != rank:
            raise ValueError(f"rank {rank} is rank {dist.get_rank()} of the default group")
        self._configure(layout, rank, store, backend, timeout, generation, stores)
        self._open_generation(layout, abort=None)
        self._world_ranks = {r: r for r in layout.known_ranks()}
        groups, twins = self._create_local(self._own(member_lists(self._specs)),
                                           self._own(self._host_lists(layout)), abort=None)
        self._groups.update(groups)
        self._host_groups.update(twins)

    @classmethod
    def joining(cls, layout: Layout, rank: int, *, store: Store, backend: str = "gloo",
                timeout: timedelta = timedelta(seconds=30), generation: int,
                abort: threading.Event | None = None,
                stores: GenerationStores | None = None) -> GroupRegistry:
        """The registry of a process that joins a running job in ``generation``, whose members
        call :meth:`grow` with the same ``layout``. No default group may exist yet. Raises
        :class:`~megatron_elaswave.launch.store.WaitInterrupted` as soon as ``abort`` is set before the
        default group forms."""
        registry = cls.__new__(cls)
        registry._configure(layout, rank, store, backend, timeout, generation, stores)
        registry._open_generation(layout, abort)
        registry._rebuild(layout, abort)
        return registry

    def _configure(self, layout: Layout, rank: int, store: Store, backend: str,
                   timeout: timedelta, generation: int,
                   stores: GenerationStores | None) -> None:
        if rank not in layout.known_ranks():
            raise ValueError(f"rank {rank} is not part of the layout")
        self._rank = rank
        self._stores = stores or GenerationStores(store, rank, host_address=None, timeout=timeout)
        self._backend = backend
        self._separate_host_groups = (backend != HOST_BACKEND
                                      or os.environ.get(SEPARATE_HOST_GROUPS_ENV) == "1")
        self._timeout = timeout
        self._generation = generation
        self._layout = layout
        self._specs = group_specs(layout)
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}
        self._host_groups: dict[tuple[int, ...], ProcessGroup] = {}
        """The gloo twins of the :data:`HOST_ROLES` groups, where they are separate."""
        self._interruptible: dict[tuple[int, threading.Event | None], InterruptibleStore] = {}
        self._world_generation: int | None = None
        """The generation whose store the default group formed on, after a ``full`` rebuild:
        ``new_group`` without a store of its own rendezvous there for as long as the group
        lives, so that store is kept open."""
        self._intact = True
        """False while a ``full`` rebuild is under way, and after one was interrupted."""

    # ---- lookups ----------------------------------------------------------------------------

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def generation(self) -> int:
        return self._generation

    def world_rank(self, rank: int) -> int:
        """``rank``'s rank in the current default group."""
        return self._world_ranks[rank]

    @property
    def world_members(self) -> frozenset[int]:
        """The ranks of the current default group, failed ones included until a ``full`` edit."""
        return frozenset(self._world_ranks)

    def specs(self) -> tuple[GroupSpec, ...]:
        """The specs of the groups this rank belongs to, in canonical order."""
        return tuple(spec for spec in self._specs if self._rank in spec.ranks)

    def spec(self, role: Role, key: tuple[int, ...] | None = None) -> GroupSpec:
        """This rank's group of ``role``; ``key`` picks one where it has several (DP groups of a
        rank that holds several layer groups)."""
        found = [s for s in self.specs() if s.role == role and (key is None or s.key == key)]
        if len(found) != 1:
            raise LookupError(
                f"rank {self._rank} has {len(found)} {role.value} groups"
                + ("" if key is None else f" with key {key}")
                + ("" if len(found) < 2 else f": pass one of the keys {[s.key for s in found]}")
            )
        return found[0]

    def group(self, role: Role, key: tuple[int, ...] | None = None) -> ProcessGroup:
        """This rank's process group of ``role`` (see :meth:`spec`)."""
        return self._groups[self.spec(role, key).ranks]

    def group_of(self, spec: GroupSpec) -> ProcessGroup:
        return self._groups[spec.ranks]

    def host_group(self, role: Role, key: tuple[int, ...] | None = None) -> ProcessGroup:
        """The gloo group for host-memory tensors of this rank's group of ``role``, one of
        :data:`HOST_ROLES`: its twin where the device backend is not gloo, else the group
        itself. Same members, same order as :meth:`group`."""
        if role not in HOST_ROLES:
            raise ValueError(f"{role.value} groups carry no host-memory state")
        ranks = self.spec(role, key).ranks
        return self._host_groups[ranks] if self._separate_host_groups else self._groups[ranks]

    def layer_groups(self) -> tuple[int, ...]:
        """Indices (into ``layout.layer_groups()``) of the layer groups this rank holds."""
        return tuple(s.key[0] for s in self.specs() if s.role == Role.DP)

    def process_group_collection(self, layer_group: int | None = None) -> ProcessGroupCollection:
        """Megatron's groups for one of this rank's layer groups (its only one by default).

        The model-parallel groups are those of Megatron with the same sizes; data-parallel groups
        are the layer group's; the distributed-optimizer instance group (the grad-norm group) is
        :attr:`Role.WORLD`. Embedding groups are ``None`` on ranks outside them, as in Megatron.
        Expert groups are the layer group's in an MoE layout, and those of expert parallelism 1
        in a dense one.
        """
        # Imported here: megatron.core takes seconds to import and the registry needs none of it.
        from megatron_elaswave.patches.process_groups_config import process_group_collection

        if layer_group is None:
            held = self.layer_groups()
            if len(held) != 1:
                raise LookupError(f"rank {self._rank} holds layer groups {list(held)}: pick one")
            layer_group = held[0]
        tp_rank = self.spec(Role.TP).ranks.index(self._rank)
        member = {s.role: self._groups[s.ranks] for s in self.specs() if s.role in _ONE_PER_RANK}
        tp, cp, mp = member[Role.TP], member[Role.CP], member[Role.MP]
        dp = self.group(Role.DP, (layer_group, tp_rank))
        tp_dp = self.group(Role.TP_DP, (layer_group,))
        return process_group_collection(
            tp=tp, pp=member[Role.PP], mp=mp, cp=cp, tp_cp=tp,
            embd=member.get(Role.EMBEDDING), pos_embd=member.get(Role.POSITION_EMBEDDING),
            dp=dp, dp_cp=dp, intra_dp_cp=dp, tp_dp_cp=tp_dp, tp_ep_pp=mp,
            intra_dist_opt=member[Role.WORLD], **self.expert_groups(layer_group),
        )

    def expert_groups(self, layer_group: int) -> dict[str, ProcessGroup]:
        """This rank's expert groups of one of its layer groups, by ``ProcessGroupCollection``
        field: the layout's in an MoE job; in a dense one those of expert parallelism 1 (this rank
        alone, the tensor-parallel group and the data-parallel group), as Megatron builds them."""
        if self._layout.experts is None:
            tp_rank = self.spec(Role.TP).ranks.index(self._rank)
            dp = self.group(Role.DP, (layer_group, tp_rank))
            tp = self.group(Role.TP)
            return dict(ep=self.group(Role.CP), expt_tp=tp, tp_ep=tp, expt_dp=dp,
                        intra_expt_dp=dp)
        mine = {s.role: self._groups[s.ranks] for s in self.specs() if s.key[:1] == (layer_group,)
                and s.role in (Role.EP, Role.EXPT_TP, Role.TP_EP, Role.EXPT_DP)}
        return dict(ep=mine[Role.EP], expt_tp=mine[Role.EXPT_TP], tp_ep=mine[Role.TP_EP],
                    expt_dp=mine[Role.EXPT_DP], intra_expt_dp=mine[Role.EXPT_DP])

    # ---- edits ------------------------------------------------------------------------------

    def edit(
        self,
        failed_ranks: Iterable[int],
        new_layout: Layout,
        mode: EditMode | str = EditMode.INPLACE,
        *,
        broken: Iterable[Sequence[int]] = (),
        generation: int | None = None,
        abort: threading.Event | None = None,
    ) -> EditReport:
        """Turn the groups of the current layout into those of ``new_layout``.

        Every survivor (every rank of ``new_layout``, spares included) calls this with the same
        arguments; failed ranks must not. Operations in flight must have been aborted first,
        and the groups they were on listed in ``broken`` (member lists, see :func:`plan_edit`).
        ``generation`` (default: the current one plus one) names the new groups. After an
        interrupted ``full`` rebuild (a grow that a failure cut short) the default group may be
        gone: the edit is then ``full`` whatever ``mode`` says, which every survivor of that
        rebuild sees alike. ``abort`` interrupts a ``full`` rebuild as in :meth:`grow`.
        """
        mode = EditMode(mode) if self._intact else EditMode.FULL
        started = time.perf_counter()
        failed = frozenset(failed_ranks)
        plan = plan_edit(self._layout, new_layout, failed, broken)
        if self._rank not in new_layout.known_ranks():
            raise ValueError(f"rank {self._rank} is not part of the new layout")
        self._generation = self._generation + 1 if generation is None else generation
        self._open_generation(new_layout, abort)
        survivors = tuple(sorted(new_layout.known_ranks()))
        if mode == EditMode.FULL:
            counts = self._rebuild(new_layout, abort)
        else:
            counts = self._edit(plan, survivors, mode, abort)
        self._layout, self._specs = new_layout, group_specs(new_layout)
        return EditReport(mode, self._generation, *counts, time.perf_counter() - started)

    def grow(self, new_layout: Layout, generation: int,
             abort: threading.Event | None = None) -> EditReport:
        """Turn the groups into those of ``new_layout``, which adds ranks to the job: a ``full``
        rebuild, since a process cannot enter groups formed without it. The new ranks call
        :meth:`joining` meanwhile. Raises :class:`~megatron_elaswave.launch.store.WaitInterrupted` as
        soon as ``abort`` is set while the ranks meet (a joiner died, say); the next edit then
        rebuilds everything."""
        if not self._layout.known_ranks() <= new_layout.known_ranks():
            raise ValueError("a grown layout must keep every rank of the job")
        started = time.perf_counter()
        self._generation = generation
        self._open_generation(new_layout, abort)
        counts = self._rebuild(new_layout, abort)
        self._layout, self._specs = new_layout, group_specs(new_layout)
        return EditReport(EditMode.FULL, generation, *counts, time.perf_counter() - started)

    def _edit(self, plan: EditPlan, survivors: tuple[int, ...],
              mode: EditMode, abort: threading.Event | None) -> tuple[int, int, int]:
        host_create = plan.host_create if self._separate_host_groups else ()
        if mode == EditMode.PARTIAL:
            created = self._create_all_global(plan.create, self._backend, 0, survivors, abort)
            twins = self._create_all_global(host_create, HOST_BACKEND, len(plan.create),
                                            survivors, abort)
        else:
            created, twins = self._create_local(self._own(plan.create), self._own(host_create),
                                                abort)
        destroyed = self._destroy(self._groups, plan.drop) + self._destroy(self._host_groups,
                                                                          plan.host_drop)
        self._groups.update(created)
        self._host_groups.update(twins)
        return len(created) + len(twins), len(self._own(plan.keep)), destroyed

    def _create_all_global(self, lists: Sequence[tuple[int, ...]], backend: str, first: int,
                           survivors: tuple[int, ...],
                           abort: threading.Event | None) -> dict[tuple[int, ...], ProcessGroup]:
        """Every group of ``lists``, each created by every survivor and followed by a store
        barrier (numbered from ``first``); this rank's groups."""
        created = {}
        for number, members in enumerate(lists, start=first):
            group = self._create_global(members, backend, abort)
            self._wait_for_survivors(number, len(survivors), abort)
            if group is not None:
                created[members] = group
        return created

    def _destroy(self, groups: dict[tuple[int, ...], ProcessGroup],
                 lists: Iterable[tuple[int, ...]]) -> int:
        """Destroy this rank's groups of ``lists`` held in ``groups``; how many."""
        dropped = [group for members in lists if (group := groups.pop(members, None)) is not None]
        retire(dropped, self._timeout)
        for group in dropped:
            dist.destroy_process_group(group)
        return len(dropped)

    def _rebuild(self, layout: Layout, abort: threading.Event | None) -> tuple[int, int, int]:
        """A new default group over ``layout``'s ranks, then all its groups, the ``partial`` way.
        The ranks first meet in the store, where ``abort`` interrupts the wait: torch's
        rendezvous would wait for a dead rank until the timeout."""
        survivors, lists = tuple(sorted(layout.known_ranks())), member_lists(group_specs(layout))
        destroyed = len(self._groups) + len(self._host_groups)
        self._intact = False
        retire([*self._groups.values(), *self._host_groups.values(),
                *([dist.group.WORLD] if dist.is_initialized() else [])], self._timeout)
        self._groups.clear()
        self._host_groups.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_unformed_default_group()  # that of an interrupted rebuild
        _store_barrier(self._generation_store, communicator_key(self._generation, "meet"),
                       len(survivors), self._timeout, abort)
        self._world_generation = self._generation
        with recording_connections() as device_groups:
            dist.init_process_group(
                self._backend,
                store=self._rendezvous_store(abort),
                rank=survivors.index(self._rank),
                world_size=len(survivors),
                timeout=self._creation_timeout(abort),
            )
            if self._backend != HOST_BACKEND:
                device_groups.append(dist.group.WORLD)
        dist.group.WORLD.set_timeout(self._timeout)
        self._world_ranks = {r: i for i, r in enumerate(survivors)}
        self._groups.update(self._create_all_global(lists, self._backend, 0, survivors, abort))
        self._host_groups.update(self._create_all_global(
            self._host_lists(layout), HOST_BACKEND, len(lists), survivors, abort))
        self._intact = True
        return len(self._groups) + len(self._host_groups), 0, destroyed

    def destroy(self) -> None:
        """Destroy every group of this registry (not the default group)."""
        self._destroy(self._groups, list(self._groups))
        self._destroy(self._host_groups, list(self._host_groups))

    # ---- creation ---------------------------------------------------------------------------

    def _own(self, lists: Iterable[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
        return tuple(members for members in lists if self._rank in members)

    def _host_lists(self, layout: Layout) -> tuple[tuple[int, ...], ...]:
        """The lists whose gloo twins ``layout`` needs: none where the device groups serve."""
        return host_member_lists(layout) if self._separate_host_groups else ()

    def _create_local(self, lists: Sequence[tuple[int, ...]], host_lists: Sequence[tuple[int, ...]],
                      abort: threading.Event | None
                      ) -> tuple[dict[tuple[int, ...], ProcessGroup],
                                 dict[tuple[int, ...], ProcessGroup]]:
        """Groups created by their members only, all at once. The members of each first meet in
        the store, where ``abort`` interrupts the wait: gloo's rendezvous would wait for a dead
        member (until :data:`CREATION_TIMEOUT`). ``abort`` also ends the wait while they
        connect.

        The groups connect concurrently, each on a thread of its own: one after the other, a
        recovery's dozen groups took most of its group-edit time waiting on store round trips.
        Members need no common order, since no group waits for another. Returns the device
        groups of ``lists`` and the gloo twins of ``host_lists``."""
        specs = {}
        for host, members in [(False, m) for m in lists] + [(True, m) for m in host_lists]:
            world = [self._world_ranks[r] for r in members]
            name = _group_name(self._generation, world) + ("-host" if host else "")
            specs[(host, members)] = (world, name, HOST_BACKEND if host else self._backend)
        if not specs:
            return {}, {}
        meetings = {communicator_key(self._generation, name): len(world)
                    for world, name, _ in specs.values()}
        _store_barriers(self._generation_store, meetings, self._timeout, abort)
        created = _new_named_groups(specs, self._timeout, self._rendezvous_store(abort),
                                    self._creation_timeout(abort), abort)
        return ({m: g for (host, m), g in created.items() if not host},
                {m: g for (host, m), g in created.items() if host})

    def _creation_timeout(self, abort: threading.Event | None) -> timedelta:
        """:data:`CREATION_TIMEOUT` where a monitor tells of failures; at start-up, when the
        processes are still busy importing and building, the op timeout."""
        return self._timeout if abort is None else min(self._timeout, CREATION_TIMEOUT)

    @property
    def generation_store(self) -> Store:
        """The store of the current generation's bulk traffic (:mod:`~.generation_store`):
        what its members exchange while it forms."""
        return self._generation_store

    def _open_generation(self, layout: Layout, abort: threading.Event | None) -> None:
        """Open the store of ``self._generation``, whose members are ``layout``'s ranks; every
        member opens it, since one of them hosts it. Forget the rendezvous views of the
        generations whose stores are closed: a gloo group uses its store only while it forms."""
        kept = {self._world_generation} - {None}
        self._generation_store = self._stores.open(self._generation, layout.known_ranks(), abort,
                                                   keep=kept)
        oldest = self._generation - KEPT_GENERATIONS
        self._interruptible = {key: view for key, view in self._interruptible.items()
                               if key[0] > oldest or key[0] in kept}

    def _rendezvous_store(self, abort: threading.Event | None) -> Store:
        """Where this generation's groups meet: reads there end as soon as ``abort`` is set."""
        # torch keeps only the C++ half of a store written in Python: the Python object must
        # live as long as a group may use it, so there is one per generation and ``abort``.
        key = (self._generation, abort)
        if key not in self._interruptible:
            self._interruptible[key] = InterruptibleStore(self._generation_store, abort,
                                                          self._timeout)
        return dist.PrefixStore(generation_prefix(self._generation), self._interruptible[key])

    def _create_global(self, members: tuple[int, ...], backend: str,
                       abort: threading.Event | None) -> ProcessGroup | None:
        """``new_group`` without local synchronisation: every rank of the default group that is
        alive calls it for every group, in the same order; ``None`` on non-members."""
        with recording_connections() as device_groups:
            group = dist.new_group([self._world_ranks[r] for r in members], backend=backend,
                                   timeout=self._creation_timeout(abort), sort_ranks=False)
            if group is dist.GroupMember.NON_GROUP_MEMBER:
                return None
            if backend != HOST_BACKEND:
                device_groups.append(group)
        group.set_timeout(self._timeout)
        return group

    def _wait_for_survivors(self, number: int, count: int,
                            abort: threading.Event | None) -> None:
        """The global synchronisation of partial and full modes, after creating group ``number``."""
        key = communicator_key(self._generation, f"created/{number}")
        _store_barrier(self._generation_store, key, count, self._timeout, abort)
