"""What a rank snapshots after each optimizer step, and with whom it exchanges copies.

The tensors are the rank's optimizer shard as Megatron's optimizers hold it: for every parameter
the inner torch optimizer updates (with the distributed optimizer, this rank's fp32 shard), the
main parameter and its Adam state. The small state is the data cursor, the LR schedule and the
RNG states, so a rollback resumes the same trajectory.
"""

from __future__ import annotations

import argparse
import os
import random
from concurrent.futures import Future

import numpy
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.optimizer import MegatronOptimizer

from megatron_elaswave.layout import Layout
from megatron_elaswave.patches.optimizer import main_params_and_states
from megatron_elaswave.planner.zero import buddy_ranks
from megatron_elaswave.runtime.snapshot import PendingSnapshot, SnapshotConfig, SnapshotStore


def rng_states() -> dict:
    """The RNG states, generator state tensors as bytes: a tensor takes about 35 us to pickle,
    its bytes 1 us, and the state is pickled every step."""
    return {
        "python": random.getstate(),
        "numpy": numpy.random.get_state(),
        "torch": _state_bytes(torch.get_rng_state()),
        "tracker": {name: _state_bytes(state)
                    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }


def restore_rng_states(states: dict) -> None:
    """Inverse of :func:`rng_states`."""
    random.setstate(states["python"])
    numpy.random.set_state(states["numpy"])
    torch.set_rng_state(_state_tensor(states["torch"]))
    tensor_parallel.get_cuda_rng_tracker().set_states(
        {name: _state_tensor(state) for name, state in states["tracker"].items()})


def _state_bytes(state):
    """A generator state tensor (uint8 on the host) as bytes; other states (graph-safe
    ``torch.Generator`` objects) as they are."""
    return state.numpy().tobytes() if torch.is_tensor(state) else state


def _state_tensor(state):
    """Inverse of :func:`_state_bytes`."""
    if isinstance(state, bytes):
        return torch.frombuffer(bytearray(state), dtype=torch.uint8)
    return state


def ranks_per_node() -> int | None:
    """Launch ranks per node, as the launcher (or torchrun) tells every worker."""
    local_world_size = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local_world_size) if local_world_size else None


AUTOMATIC_COPIES = 2
"""Copies of each snapshot that ``--elastic-snapshot-replicas`` gives by default where they fit:
any two ranks may then fail together."""

SNAPSHOT_MEMORY_SHARE = 0.5
"""The share of a node's available host memory the automatic number of copies may fill."""


def affordable_copies(shard_bytes: int, available_bytes: int, ranks_on_node: int) -> int:
    """The most copies, up to :data:`AUTOMATIC_COPIES` and at least 1, whose snapshots fit in
    :data:`SNAPSHOT_MEMORY_SHARE` of ``available_bytes``: every one of ``ranks_on_node`` ranks
    holds two iterations of its own snapshot of ``shard_bytes`` and, as many as it has copies,
    of its peers'."""
    for copies in range(AUTOMATIC_COPIES, 1, -1):
        if ranks_on_node * 2 * (1 + copies) * shard_bytes <= SNAPSHOT_MEMORY_SHARE * available_bytes:
            return copies
    return 1


def snapshot_config(args: argparse.Namespace, copies: int | None = None) -> SnapshotConfig:
    """The snapshots the flags ask for; ``copies`` decides an automatic number of replicas
    (``--elastic-snapshot-replicas`` not given: one without it)."""
    replicas = args.elastic_snapshot_replicas
    if replicas is None:
        replicas = copies if copies is not None else 1
    return SnapshotConfig(replicas=replicas, ranks_per_node=ranks_per_node(),
                          overlap=args.elastic_snapshot_overlap == "on",
                          shared_memory=args.elastic_snapshot_shared_memory == "on")


class StepSnapshots:
    """Snapshots of one rank after every step, replicated to its buddies in the layout.

    With ``config.overlap`` a step's snapshot is finished (:meth:`settle`) in the next step, just
    before its optimizer step, which is the first to write the snapshotted tensors again; until
    then it is :attr:`pending`, and its exchange with the buddies runs on a thread of the store
    beside the next step's forward and backward.
    """

    def __init__(self, layout: Layout, rank: int, config: SnapshotConfig,
                 group: dist.ProcessGroup | None = None,
                 store: SnapshotStore | None = None, version: int = 0) -> None:
        """``group`` carries the replicas: the group of the layout's stage holders in launch-rank
        order, or the default group (``None``) while it still numbers ranks as launched.
        ``store`` keeps the snapshots held so far (those of an earlier layout); default: none.
        ``version`` tells this layout's snapshots from those of the others
        (:class:`~megatron_elaswave.runtime.snapshot.SnapshotTag`): the generation that formed it."""
        self.store = SnapshotStore(rank, config) if store is None else store
        self.group = group
        self.version = version
        self.owners = len(layout.active_ranks())
        members = [r for replica in layout.replicas for stage in replica.stages for r in stage.ranks]
        holds_stage = layout.position(rank) is not None
        copies, per_node = config.replicas, config.ranks_per_node
        self.send_to = buddy_ranks(layout, rank, copies, per_node) if copies and holds_stage else []
        self.receive_from = [r for r in members
                             if copies and rank in buddy_ranks(layout, r, copies, per_node)]
        self._pending: PendingSnapshot | None = None
        self._exchanged: Future | None = None
        """The pending snapshot's exchange with the buddies, when it runs on a thread."""
        holders = sorted(layout.active_ranks())
        self._in_group = (lambda r: r) if group is None else holders.index

    def after_step(self, iteration: int, optimizer: MegatronOptimizer, scheduler,
                   consumed_samples: int, tensors: dict[str, torch.Tensor] | None = None,
                   **extra_state) -> None:
        """Snapshot ``tensors`` (by default the optimizer shard by optimizer-local names) and the
        small state, and exchange replicas with the buddies: now, or (with ``config.overlap``)
        on a thread, settled at :meth:`settle`."""
        state = {"iteration": iteration, "consumed_samples": consumed_samples,
                 "scheduler": scheduler.state_dict(), "rng": rng_states(), **extra_state}
        tensors = main_params_and_states(optimizer) if tensors is None else tensors
        assert self._pending is None, "the previous snapshot was neither settled nor discarded"
        self._pending = self.store.start_capture(iteration, tensors, state, self.version,
                                                 self.owners)
        if not self.store.config.overlap:
            self.settle()
        elif self.send_to or self.receive_from:
            self._exchanged = self.store.replicate_when_captured(
                self._pending, *self._peers_in_group(), group=self.group)

    def _peers_in_group(self) -> tuple[list[int], list[int]]:
        return ([self._in_group(r) for r in self.send_to],
                [self._in_group(r) for r in self.receive_from])

    def own_snapshot(self, iteration: int) -> PendingSnapshot | None:
        """This rank's snapshot of ``iteration`` in this layout: pending (its copies may still be
        in flight) or settled; ``None`` if it holds none."""
        if self._pending is not None and self._pending.snapshot.iteration == iteration:
            return self._pending
        snapshot = self.store.own(iteration, self.version)
        return PendingSnapshot(snapshot) if snapshot is not None else None

    @property
    def pending(self) -> bool:
        """Whether the last snapshot is still to be settled."""
        return self._pending is not None

    def settle(self) -> None:
        """Finish the pending snapshot and its exchange of replicas with the buddies (collective
        among them, like :meth:`after_step`); nothing if none is pending. Raises what the
        exchange raised (a failure that ended it)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        exchanged, self._exchanged = self._exchanged, None
        snapshot = self.store.complete(pending)
        if exchanged is not None:
            exchanged.result()
        elif self.send_to or self.receive_from:
            self.store.replicate(snapshot, *self._peers_in_group(), group=self.group)

    def discard(self) -> None:
        """A failure came before :meth:`settle`: hold the pending snapshot anyway, once its
        copies are checksummed (it is the state after its step, whatever failed since), and end
        its exchange with the buddies: the replicas that arrived are held, the failure ends the
        rest."""
        if self._exchanged is not None:
            self._exchanged.exception()  # completed, or ended by the failure: either is fine
            self._exchanged = None
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.store.complete(pending)

    @property
    def bytes_held(self) -> int:
        """Host bytes of the snapshots held and of the one pending, whose buffers are taken."""
        pending = self._pending
        return self.store.bytes_held + (pending.snapshot.nbytes if pending is not None else 0)

