"""Per-step in-memory snapshots of a rank's training state, checksummed and replicated.

After every optimizer step a rank captures what it alone holds (its optimizer shard: fp32 master
parameters, Adam moments and steps) plus small picklable state (RNG states, data cursor) into
host memory, and sends a copy to ``replicas`` buddy ranks in other failure domains.

Guarantees:

* **Double buffering.** The two most recent iterations are kept, own and replicated alike: while
  the snapshot of step ``t`` is being taken, the complete one of step ``t-1`` is still there, so a
  failure in the middle of step ``t`` rolls back to the end of ``t-1``.
* **Versions never overwrite each other.** Every snapshot carries the *version* of the layout it
  was taken in (:class:`SnapshotTag`). After a layout change the ranks snapshot the same
  iteration again in the new layout; that set is kept beside the old one, not over it, so that a
  failure while the new set is only partly taken or replicated still finds the old set whole.
  The state of an iteration is the same in every layout, so any whole set restores it
  (:func:`newest_whole_iteration`). An older version of an iteration is dropped once a snapshot of
  the next iteration is kept: a rank takes one only after every rank of its layout has settled
  the newest version of the iteration before (the step's reduction over the world comes first).
* **Complete when held.** A snapshot is listed by :meth:`SnapshotStore.held` only once it is
  copied and checksummed: :meth:`SnapshotStore.capture` returns a complete one, and
  :meth:`SnapshotStore.start_capture` one that :meth:`SnapshotStore.complete` finishes later (on
  CUDA the copies run meanwhile). When :meth:`SnapshotStore.replicate` returns, every buddy's copy
  has arrived and every send has completed; :meth:`SnapshotStore.replicate_when_captured` runs it
  on a thread of the store, and every copy that arrives there is held as it arrives.
* **Checksums.** Every tensor is checksummed (CRC-32) per chunk of ``chunk_bytes`` when captured,
  and replicas carry their sender's checksums. Each read (:meth:`SnapshotStore.restore`), of an
  own snapshot or of a replica, verifies them: a snapshot that does not match, whether it was
  damaged in memory or in transit, is reported (:class:`SnapshotCorrupted`) and never returned.
  Replicas are not verified on receipt: that would checksum every replica each step while only
  the ones restored after a failure are ever read.
* **Accounting.** :attr:`SnapshotStore.bytes_held` is the host memory the store holds, own
  snapshots and buddies' replicas together, and those pinned.
* **Pinned snapshots are not reused.** While a durable checkpoint is written from a snapshot
  (:meth:`SnapshotStore.pin` until :meth:`SnapshotStore.unpin`), its payload is never taken for
  a later snapshot, even once the snapshot is no longer held.

Capture copies tensors to host memory. From host memory it copies and checksums a block at a time,
so each block is checksummed while still in cache. From CUDA the device-to-host copies run on a side
stream into pinned memory, and a thread of the store checksums each tensor as soon as its copy is
done, its chunks on a pool of threads (zlib releases the GIL): neither blocks the training thread,
which waits only in :meth:`SnapshotStore.complete`.
"""

from __future__ import annotations

import math
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

import torch
import torch.distributed as dist

from megatron_elaswave.patches.p2p_communication import wait as p2p_wait

from . import wire
from .shared_payloads import SharedHandle, SharedPayloads


class SnapshotCorrupted(RuntimeError):
    """A snapshot whose bytes no longer match the checksums taken when it was captured."""


class SnapshotMissing(KeyError):
    """No snapshot of that rank and iteration is held here."""


class SnapshotTag(NamedTuple):
    """Which snapshot a store holds: whose state, after which iteration, in which layout."""

    rank: int
    iteration: int
    version: int = 0
    """The layout it was taken in (the generation that formed the layout). The snapshots of one
    iteration taken in one layout form a *set* that holds the whole state of that iteration."""
    owners: int = 1
    """How many ranks' snapshots make up that set: every rank that held a stage."""


def newest_whole_iteration(tags: Iterable[SnapshotTag]) -> int | None:
    """The newest iteration of which some set (one version) is whole among ``tags``, the
    snapshots that the ranks still alive hold together: a snapshot of every one of the set's
    owners is among them. ``None`` when no set is whole.

    Sets of different versions may mix in a restore (the state of an iteration is the same in
    every layout); a whole one guarantees that every element of the state is covered.
    """
    owners: dict[tuple[int, int], set[int]] = defaultdict(set)
    expected: dict[tuple[int, int], int] = {}
    for tag in tags:
        owners[tag.iteration, tag.version].add(tag.rank)
        expected[tag.iteration, tag.version] = tag.owners
    whole = [iteration for (iteration, version), ranks in owners.items()
             if len(ranks) >= expected[iteration, version]]
    return max(whole, default=None)


@dataclass(frozen=True)
class SnapshotConfig:
    """How snapshots are kept."""

    replicas: int = 1
    """Buddy ranks (in other failure domains) that hold a copy of each rank's snapshot."""
    ranks_per_node: int | None = None
    """Launch ranks per node: buddies go to other nodes first (``None``: one node)."""
    chunk_bytes: int = 4 << 20
    """Granularity of the checksums."""
    overlap: bool = False
    """Finish each step's snapshot (wait for its copies, checksum, replicate) just before the
    next optimizer step instead of at once, so that the device-to-host copies run beside the
    next forward and backward. A failure before then rolls back one iteration further."""
    shared_memory: bool = True
    """Capture host snapshots into shared memory, which buddies on the same host map instead of
    receiving a copy (:mod:`~megatron_elaswave.runtime.shared_payloads`); buddies elsewhere, and
    snapshots captured from a device (pinned for its copies), are sent through the group."""

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {self.chunk_bytes}")


_BLOCK_BYTES = 256 << 10
"""Bytes :func:`copy_checksummed` copies then checksums at a time: small enough to stay in the
core's cache in between (larger blocks measured slower on tensors of tens of MB)."""

SNAPSHOT_TAG = 3
"""Point-to-point tag of the exchange of replicas: on the thread of
:meth:`SnapshotStore.replicate_when_captured` it may share its group with a pipeline's sends and
receives (tag 0, when the group's ranks are one pipeline) and never meets them; migrations use
tags 1 and 2."""

MAPPED_TAG = 4
"""Tag of a buddy's answer to a payload offered in shared memory: mapped, or send it."""

_STATE = "__state__"
"""Key of the small state's checksums, beside the tensors' names."""


def _memory(flat_bytes: torch.Tensor) -> memoryview:
    return memoryview(flat_bytes.numpy())


def chunk_checksums(data: memoryview, chunk_bytes: int) -> tuple[int, ...]:
    """CRC-32 of each ``chunk_bytes`` piece of ``data``."""
    return tuple(zlib.crc32(data[start:start + chunk_bytes])
                 for start in range(0, len(data), chunk_bytes)) or (zlib.crc32(b""),)


def copy_checksummed(tensor: torch.Tensor, target: torch.Tensor,
                     chunk_bytes: int) -> tuple[int, ...]:
    """Copy the bytes of ``tensor`` into ``target`` (flat host bytes of the same size) and
    return :func:`chunk_checksums` of the copy.

    From host memory the copy goes a block at a time, each block checksummed while it is still
    in cache: one pass over memory instead of two.
    """
    source = tensor.detach().reshape(-1).view(torch.uint8)
    data = _memory(target)
    if source.device.type != "cpu":
        target.copy_(source)
        return chunk_checksums(data, chunk_bytes)
    source_data = _memory(source)
    checksums = []
    for chunk in range(0, len(data), chunk_bytes):
        chunk_end = min(chunk + chunk_bytes, len(data))
        crc = 0
        for start in range(chunk, chunk_end, _BLOCK_BYTES):
            end = min(start + _BLOCK_BYTES, chunk_end)
            data[start:end] = source_data[start:end]
            crc = zlib.crc32(data[start:end], crc)
        checksums.append(crc)
    return tuple(checksums) or (zlib.crc32(b""),)


TensorLayout = tuple[tuple[str, tuple[int, ...], torch.dtype, int], ...]
"""``(name, shape, dtype, byte offset)`` of each tensor in a snapshot's flat payload."""


def tensor_layout(tensors: Mapping[str, torch.Tensor]) -> TensorLayout:
    layout, offset = [], 0
    for name, tensor in tensors.items():
        layout.append((name, tuple(tensor.shape), tensor.dtype, offset))
        offset += tensor.nbytes
    return tuple(layout)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _payload_bytes(layout: TensorLayout) -> int:
    if not layout:
        return 0
    name, shape, dtype, offset = layout[-1]
    return offset + _nbytes(shape, dtype)


@dataclass
class Snapshot:
    """One rank's state at the end of one iteration, in host memory.

    All tensors live in one flat byte ``payload`` (they are views of it), so a snapshot is sent,
    received and reused as a single buffer.
    """

    rank: int
    iteration: int
    layout: TensorLayout
    payload: torch.Tensor
    state: bytes
    """Pickled small state (RNG states, data cursor)."""
    checksums: dict[str, tuple[int, ...]] = field(default_factory=dict)
    chunk_bytes: int = 4 << 20
    version: int = 0
    """:attr:`SnapshotTag.version`."""
    owners: int = 1
    """:attr:`SnapshotTag.owners`."""
    readers: int = 0
    """Durable checkpoints being written from it (:meth:`SnapshotStore.pin`): while any is, its
    payload is not reused for a later snapshot."""
    mapped: bool = False
    """Its payload is its owner's, in shared memory mapped here: never reused here, and its
    memory counted by its owner."""

    @property
    def tag(self) -> SnapshotTag:
        return SnapshotTag(self.rank, self.iteration, self.version, self.owners)

    @property
    def key(self) -> tuple[int, int, int]:
        return self.rank, self.iteration, self.version

    def extents(self) -> Iterator[tuple[str, int, int]]:
        """``(name, start, end)`` of each tensor's bytes in the payload."""
        for name, shape, dtype, offset in self.layout:
            yield name, offset, offset + _nbytes(shape, dtype)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: self._view(shape, dtype, offset) for name, shape, dtype, offset in self.layout}

    @property
    def nbytes(self) -> int:
        return self.payload.numel() + len(self.state)

    def view(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (a view of the payload)."""
        for tensor_name, shape, dtype, offset in self.layout:
            if tensor_name == name:
                return self._view(shape, dtype, offset)
        raise KeyError(name)

    def _view(self, shape: tuple[int, ...], dtype: torch.dtype, offset: int) -> torch.Tensor:
        return self.payload[offset:offset + _nbytes(shape, dtype)].view(dtype).reshape(shape)

    def seal_as_copied(self, copied: list[Any], pool: ThreadPoolExecutor) -> None:
        """Record the checksums :meth:`verify` checks while the copies into the payload are
        still arriving: ``copied`` holds one event per tensor (anything with a blocking
        ``synchronize()``), in layout order, and each tensor's chunks go to ``pool`` as soon as
        its event has passed, so that checksumming overlaps the copies still in flight."""
        data = _memory(self.payload)
        pending = {}
        for (name, start, end), event in zip(self.extents(), copied, strict=True):
            event.synchronize()
            pending[name] = [
                pool.submit(zlib.crc32, data[offset:min(offset + self.chunk_bytes, end)])
                for offset in range(start, end, self.chunk_bytes)]
        checksums = {name: tuple(f.result() for f in futures) or (zlib.crc32(b""),)
                     for name, futures in pending.items()}
        checksums[_STATE] = chunk_checksums(memoryview(self.state), self.chunk_bytes)
        self.checksums = checksums

    def verify(self, names: Iterable[str] | None = None) -> None:
        """Raise :class:`SnapshotCorrupted` naming the first part that changed, of the tensors
        ``names`` (default: every tensor and the small state)."""
        data = _memory(self.payload)
        extents = {name: (start, end) for name, start, end in self.extents()}
        for name in [*extents, _STATE] if names is None else names:
            part = memoryview(self.state) if name == _STATE else data[slice(*extents[name])]
            if chunk_checksums(part, self.chunk_bytes) != self.checksums.get(name):
                what = "the small state" if name == _STATE else repr(name)
                raise SnapshotCorrupted(f"snapshot of rank {self.rank} at iteration "
                                        f"{self.iteration} (layout version {self.version}): "
                                        f"{what} does not match its checksum")

    def header(self, shared: SharedHandle | None = None) -> bytes:
        """Everything but the payload: identity, layout, checksums and the small state, and
        where the payload is ``shared``."""
        return wire.dumps({
            "rank": self.rank, "iteration": self.iteration, "layout": self.layout,
            "state": self.state, "checksums": self.checksums, "chunk_bytes": self.chunk_bytes,
            "version": self.version, "owners": self.owners,
            "shared": tuple(shared) if shared is not None else None,
        })

    @classmethod
    def from_header(cls, meta: dict, payload: torch.Tensor, mapped: bool = False) -> "Snapshot":
        """The snapshot of a :meth:`header` (loaded) and its payload."""
        return cls(meta["rank"], meta["iteration"], meta["layout"], payload, meta["state"],
                   meta["checksums"], meta["chunk_bytes"], meta["version"], meta["owners"],
                   mapped=mapped)


class VerifiedOnRead(Mapping[str, torch.Tensor]):
    """The tensors of some snapshots by name (a later snapshot's over an earlier's of the same
    name), each verified against its checksums the first time it is read: raises
    :class:`SnapshotCorrupted` then."""

    def __init__(self, snapshots: Iterable[Snapshot]) -> None:
        self._sources = {name: snapshot for snapshot in snapshots
                         for name, _, _ in snapshot.extents()}
        self._verified: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        snapshot = self._sources[name]
        if name not in self._verified:
            snapshot.verify([name])
            self._verified.add(name)
        return snapshot.view(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)


@dataclass
class PendingSnapshot:
    """A snapshot whose copies may still be in flight (:meth:`SnapshotStore.start_capture`)."""

    snapshot: Snapshot
    sealed: Future | None = None
    """Done once the device-to-host copies have ended and the checksums are taken; ``None``
    when they were taken at capture."""

    def wait(self) -> None:
        """Return once the copies are done and checksummed; raises what checksumming raised."""
        sealed = self.sealed  # read once: completing the snapshot clears it on another thread
        if sealed is not None:
            sealed.result()


_CHECKSUM_THREADS = min(8, os.cpu_count() or 1)
"""Threads that checksum the chunks of a snapshot copied from a device."""


class SnapshotStore:
    """One rank's own snapshots and the replicas it holds for its buddies."""

    def __init__(self, rank: int, config: SnapshotConfig = SnapshotConfig()) -> None:
        self.rank = rank
        self.config = config
        self._held: dict[tuple[int, int, int], Snapshot] = {}
        """By :attr:`Snapshot.key`."""
        self._held_lock = threading.Lock()
        """Replicas arrive on the exchange thread (:meth:`replicate_when_captured`)."""
        self._copy_stream = None
        """The side stream of device-to-host copies, made at the first capture from CUDA."""
        self._sealer: ThreadPoolExecutor | None = None
        """Waits for each capture's copies and checksums them, one capture after the other."""
        self._checksum_pool: ThreadPoolExecutor | None = None
        self._exchanger: ThreadPoolExecutor | None = None
        """Runs :meth:`replicate_when_captured`."""
        self._pinned: dict[int, Snapshot] = {}
        """By ``id``: the snapshots :meth:`pin` keeps, held or not."""
        self._shared = SharedPayloads() if config.shared_memory else None

    def _payload_buffer(self, rank: int, iteration: int, nbytes: int, pinned: bool = False,
                        shareable: bool = False) -> torch.Tensor:
        """The payload of a snapshot of ``rank`` two or more iterations back (about to be
        dropped) when it fits, else a new buffer (in shared memory when ``shareable`` and the
        store shares): steady-state steps allocate nothing. A snapshot whose buffer is taken is
        no longer held."""
        with self._held_lock:
            for key, previous in self._held.items():
                if (key[0] == rank and key[1] <= iteration - 2 and not previous.readers
                        and not previous.mapped and previous.payload.numel() == nbytes
                        and previous.payload.is_pinned() == pinned):
                    del self._held[key]
                    return previous.payload
        if shareable and not pinned and self._shared is not None:
            shared = self._shared.allocate(nbytes)
            if shared is not None:
                return shared
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    # -- capture and restore -------------------------------------------------------------------

    def capture(self, iteration: int, tensors: Mapping[str, torch.Tensor],
                state: Mapping[str, Any], version: int = 0, owners: int = 1) -> Snapshot:
        """Copy ``tensors`` and ``state`` into host memory as the snapshot of ``iteration`` (in
        layout ``version``, whose set has ``owners`` snapshots) and checksum the copy."""
        return self.complete(self.start_capture(iteration, tensors, state, version, owners))

    def start_capture(self, iteration: int, tensors: Mapping[str, torch.Tensor],
                      state: Mapping[str, Any], version: int = 0,
                      owners: int = 1) -> PendingSnapshot:
        """Start :meth:`capture`; :meth:`complete` finishes it. Host tensors are copied and
        checksummed at once; CUDA tensors are copied on a side stream that first waits for the
        work queued so far, then checksummed on the store's threads, and must not be written
        before :meth:`complete` returns."""
        layout = tensor_layout(tensors)
        from_device = any(tensor.is_cuda for tensor in tensors.values())
        payload = self._payload_buffer(self.rank, iteration, _payload_bytes(layout),
                                       pinned=from_device, shareable=True)
        snapshot = Snapshot(self.rank, iteration, layout, payload, wire.dumps(dict(state)),
                            chunk_bytes=self.config.chunk_bytes, version=version, owners=owners)
        if not from_device:
            chunk_bytes = self.config.chunk_bytes
            snapshot.checksums = {
                name: copy_checksummed(tensor, payload[start:end], chunk_bytes)
                for (name, start, end), tensor in zip(snapshot.extents(), tensors.values())}
            snapshot.checksums[_STATE] = chunk_checksums(memoryview(snapshot.state), chunk_bytes)
            return PendingSnapshot(snapshot)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        self._copy_stream.wait_stream(torch.cuda.current_stream())
        copied = []
        with torch.cuda.stream(self._copy_stream):
            for tensor, target in zip(tensors.values(), snapshot.tensors.values()):
                target.copy_(tensor.detach(), non_blocking=True)
                if tensor.is_cuda:  # its memory is not reused before the copy is done
                    tensor.record_stream(self._copy_stream)
                copied.append(torch.cuda.Event())
                copied[-1].record()
        if self._sealer is None:
            self._sealer = ThreadPoolExecutor(1, thread_name_prefix="elaswave-snapshot-seal")
            self._checksum_pool = ThreadPoolExecutor(_CHECKSUM_THREADS,
                                                     thread_name_prefix="elaswave-checksum")
        return PendingSnapshot(snapshot, self._sealer.submit(snapshot.seal_as_copied, copied,
                                                             self._checksum_pool))

    def complete(self, pending: PendingSnapshot) -> Snapshot:
        """Wait for the copies of ``pending`` and their checksums, and hold the snapshot."""
        pending.wait()
        pending.sealed = None
        self._keep(pending.snapshot)
        return pending.snapshot

    def restore(self, rank: int, iteration: int,
                version: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        """The verified tensors and state of ``rank`` at ``iteration``, as taken in layout
        ``version`` (default: the newest held)."""
        with self._held_lock:
            versions = [key[2] for key in self._held if key[:2] == (rank, iteration)]
            if version is None and versions:
                version = max(versions)
            snapshot = self._held.get((rank, iteration, version))
        if snapshot is None:
            raise SnapshotMissing(f"no snapshot of rank {rank} at iteration {iteration} here "
                                  f"(held: {[tuple(tag[:3]) for tag in self.held()]})")
        snapshot.verify()
        return snapshot.tensors, wire.loads(snapshot.state)

    def restore_iteration(self, iteration: int,
                          rank: int) -> tuple["VerifiedOnRead", dict | None]:
        """Every tensor held of ``iteration``, own and replicated, of every layout version (the
        state of an iteration is the same in each), by name, each verified when first read (a
        restore reads the pieces it moves or loads, not every replica it holds); and the
        verified small state of ``rank``'s snapshot, or of any held where ``rank``'s is not
        (``None`` where none is)."""
        with self._held_lock:
            snapshots = [self._held[key] for key in sorted(self._held) if key[1] == iteration]
        with_state = [s for s in snapshots if s.rank == rank] or snapshots[:1]
        for snapshot in with_state:
            snapshot.verify([_STATE])
        return (VerifiedOnRead(snapshots),
                wire.loads(with_state[-1].state) if with_state else None)

    def own(self, iteration: int, version: int) -> Snapshot | None:
        """This rank's snapshot of ``iteration`` taken in layout ``version``, if held."""
        with self._held_lock:
            return self._held.get((self.rank, iteration, version))

    def pin(self, snapshot: Snapshot) -> None:
        """Keep ``snapshot``'s payload from being reused until :meth:`unpin`, held or not: a
        durable checkpoint is being written from it. Its bytes count in :attr:`bytes_held` until
        then."""
        with self._held_lock:
            snapshot.readers += 1
            self._pinned[id(snapshot)] = snapshot

    def unpin(self, snapshot: Snapshot) -> None:
        """Undo one :meth:`pin`."""
        with self._held_lock:
            snapshot.readers -= 1
            if not snapshot.readers:
                del self._pinned[id(snapshot)]

    def forget_after(self, iteration: int) -> None:
        """Drop every snapshot, own or replicated, of an iteration after ``iteration``: after a
        rollback to ``iteration`` they belong to steps that are run again, and possibly to a
        layout gone since, and a later rollback must not take them for state that survives."""
        with self._held_lock:
            for key in [key for key in self._held if key[1] > iteration]:
                del self._held[key]

    def held(self) -> list[SnapshotTag]:
        """Every snapshot held, own and replicated, sorted."""
        with self._held_lock:
            return sorted(snapshot.tag for snapshot in self._held.values())

    @property
    def bytes_held(self) -> int:
        """Host bytes of the snapshots held and of those pinned for a checkpoint; a snapshot
        mapped from its owner's shared memory counts its small state only."""
        with self._held_lock:
            held = {id(s): s for s in self._held.values()}
            return sum(len(s.state) if s.mapped else s.nbytes
                       for s in {**held, **self._pinned}.values())

    def _keep(self, snapshot: Snapshot) -> None:
        """Hold ``snapshot``, and drop what no rollback can need any more (module docstring):
        a snapshot of iteration ``i`` exists only once every rank of its layout has settled the
        newest version of ``i - 1``, so earlier iterations, and older versions of ``i - 1``, go."""
        with self._held_lock:
            self._held[snapshot.key] = snapshot
            previous = snapshot.iteration - 1
            newest_of_previous: dict[int, int] = {}
            for rank, iteration, version in self._held:
                if iteration == previous:
                    newest_of_previous[rank] = max(version, newest_of_previous.get(rank, version))
            for key in list(self._held):
                rank, iteration, version = key
                if iteration < previous or (iteration == previous
                                            and version < newest_of_previous[rank]):
                    del self._held[key]

    # -- replication ---------------------------------------------------------------------------

    def replicate_when_captured(self, pending: PendingSnapshot, send_to: list[int],
                                receive_from: list[int],
                                group: dist.ProcessGroup | None = None) -> Future:
        """:meth:`replicate` the snapshot of ``pending`` once its copies are checksummed, on a
        thread of the store; the future ends with the exchange. Meanwhile the group may carry
        anything but other messages tagged :data:`SNAPSHOT_TAG` or :data:`MAPPED_TAG`."""
        if self._exchanger is None:
            self._exchanger = ThreadPoolExecutor(1, thread_name_prefix="elaswave-snapshot-exchange")

        def exchange() -> None:
            pending.wait()
            self.replicate(pending.snapshot, send_to, receive_from, group=group)

        return self._exchanger.submit(exchange)

    def replicate(self, snapshot: Snapshot, send_to: list[int], receive_from: list[int],
                  group: dist.ProcessGroup | None = None) -> None:
        """Send ``snapshot`` to ``send_to`` and keep the copies ``receive_from`` send here.

        Collective among the ranks named: every rank passes the ranks it sends to and those that
        send to it, numbered as in ``group`` (the default group when ``None``). A copy goes as
        sizes, header and payload; a payload in shared memory (``config.shared_memory``) is
        offered instead, and sent only to the buddies that cannot map it (on another host), once
        they have answered.
        Returns once every copy has arrived (or is mapped) and every send has completed. Each
        copy is kept as soon as it has arrived, before the sends are waited for, so the copy of
        a peer that dies right after sending it is not lost. Copies keep their sender's
        checksums and are verified when read.
        """
        shared = self._shared.handle(snapshot.payload) if self._shared is not None else None
        header = snapshot.header(shared)
        header_tensor = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        sizes = torch.tensor([len(header), snapshot.payload.numel(), shared is not None,
                              snapshot.rank], dtype=torch.int64)
        # Header and payload receives are posted together once the sizes are in, so the payload
        # streams in without this rank waking up after the header: on a busy host every
        # wake-up waits for a core.
        peer_sizes = {peer: torch.empty(4, dtype=torch.int64) for peer in receive_from}
        size_requests = [dist.irecv(size, group=group, tag=SNAPSHOT_TAG, group_src=peer)
                         for peer, size in peer_sizes.items()]
        messages = (sizes, header_tensor) if shared else (sizes, header_tensor, snapshot.payload)
        sends = [dist.isend(message, group=group, tag=SNAPSHOT_TAG, group_dst=peer)
                 for peer in send_to for message in messages]
        # An offered payload goes to each buddy that cannot map it once it has said so, on a
        # thread of its own: a buddy that never answers holds up neither the others nor the
        # copies arriving here.
        offers = [_on_a_thread(_send_unless_mapped, snapshot.payload, peer, group)
                  for peer in send_to] if shared else []
        for request in size_requests:
            p2p_wait(request, group)
        headers = {peer: torch.empty(int(size[0]), dtype=torch.uint8)
                   for peer, size in peer_sizes.items()}
        header_requests = {peer: dist.irecv(header, group=group, tag=SNAPSHOT_TAG, group_src=peer)
                           for peer, header in headers.items()}
        payloads = {peer: self._payload_buffer(int(size[3]), snapshot.iteration, int(size[1]))
                    for peer, size in peer_sizes.items() if not size[2]}
        payload_requests = {peer: dist.irecv(payload, group=group, tag=SNAPSHOT_TAG,
                                              group_src=peer)
                            for peer, payload in payloads.items()}
        metas = {}
        for peer, peer_header in headers.items():
            p2p_wait(header_requests[peer], group)
            metas[peer] = meta = wire.loads(peer_header.numpy().tobytes())
            if peer in payloads:
                continue
            nbytes = int(peer_sizes[peer][1])
            mapped = (self._shared.attach(SharedHandle(*meta["shared"]), nbytes)
                      if self._shared is not None else None)
            if mapped is not None:
                self._keep(Snapshot.from_header(meta, mapped, mapped=True))
            sends.append(dist.isend(torch.tensor([mapped is not None], dtype=torch.int64),
                                    group=group, tag=MAPPED_TAG, group_dst=peer))
            if mapped is None:  # its next message of this tag is the payload
                payloads[peer] = self._payload_buffer(meta["rank"], snapshot.iteration, nbytes)
                payload_requests[peer] = dist.irecv(payloads[peer], group=group,
                                                    tag=SNAPSHOT_TAG, group_src=peer)
        for peer, payload in payloads.items():
            p2p_wait(payload_requests[peer], group)
            self._keep(Snapshot.from_header(metas[peer], payload))
        for offer in offers:
            offer.result()
        for request in sends:
            p2p_wait(request, group)


def _send_unless_mapped(payload: torch.Tensor, peer: int,
                        group: dist.ProcessGroup | None) -> None:
    """Wait for ``peer``'s answer to a payload offered in shared memory, and send the payload
    when it could not map it."""
    answer = torch.empty(1, dtype=torch.int64)
    p2p_wait(dist.irecv(answer, group=group, tag=MAPPED_TAG, group_src=peer), group)
    if not answer.item():
        p2p_wait(dist.isend(payload, group=group, tag=SNAPSHOT_TAG, group_dst=peer), group)


def _on_a_thread(function: Callable[..., None], *args: Any) -> Future:
    """``function(*args)`` on a new daemon thread; the future ends with it."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as error:  # handed to whoever waits for the future
            future.set_exception(error)

    threading.Thread(target=run, daemon=True, name="elaswave-snapshot-offer").start()
    return future
