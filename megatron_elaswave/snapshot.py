"""Per-step in-memory snapshots of a rank's training state, checksummed and replicated.

After every optimizer step a rank captures what it alone holds (its optimizer shard: fp32 master
parameters, Adam moments and steps) plus small picklable state (RNG states, data cursor) into
host memory, and sends a copy to ``replicas`` buddy ranks in other failure domains.

Guarantees:

* **Double buffering.** The two most recent iterations are kept, own and replicated alike: while
  the snapshot of step ``t`` is being taken, the complete one of step ``t-1`` is still there, so a
  failure in the middle of step ``t`` rolls back to the end of ``t-1``.
* **Checksums.** Every tensor is checksummed per chunk of ``chunk_bytes`` when captured; each read
  (:meth:`SnapshotStore.restore`) and each received replica is verified. A snapshot that does not
  match is reported (:class:`SnapshotCorrupted`) and never returned.
* **Accounting.** :attr:`SnapshotStore.bytes_held` is the host memory the store holds, own
  snapshots and buddies' replicas together.
* Capture copies device tensors to host memory; on CUDA the copy runs on a side stream so it
  overlaps the next step, and :meth:`SnapshotStore.wait` (called before the copy is used or
  sent) waits for it. On CPU it is a plain copy.
"""

from __future__ import annotations

import pickle
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist


class SnapshotCorrupted(RuntimeError):
    """A snapshot whose bytes no longer match the checksums taken when it was captured."""


class SnapshotMissing(KeyError):
    """No snapshot of that rank and iteration is held here."""


@dataclass(frozen=True)
class SnapshotConfig:
    """How snapshots are kept."""

    replicas: int = 1
    """Buddy ranks (in other failure domains) that hold a copy of each rank's snapshot."""
    chunk_bytes: int = 4 << 20
    """Granularity of the checksums."""

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {self.chunk_bytes}")


def _byte_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def chunk_checksums(data: memoryview, chunk_bytes: int) -> tuple[int, ...]:
    """CRC-32 of each ``chunk_bytes`` piece of ``data``."""
    return tuple(zlib.crc32(data[start:start + chunk_bytes])
                 for start in range(0, len(data), chunk_bytes)) or (zlib.crc32(b""),)


TensorLayout = tuple[tuple[str, tuple[int, ...], torch.dtype, int], ...]
"""``(name, shape, dtype, byte offset)`` of each tensor in a snapshot's flat payload."""


def tensor_layout(tensors: Mapping[str, torch.Tensor]) -> TensorLayout:
    layout, offset = [], 0
    for name, tensor in tensors.items():
        layout.append((name, tuple(tensor.shape), tensor.dtype, offset))
        offset += tensor.numel() * tensor.element_size()
    return tuple(layout)


def _payload_bytes(layout: TensorLayout) -> int:
    if not layout:
        return 0
    name, shape, dtype, offset = layout[-1]
    return offset + torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


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

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        views = {}
        for name, shape, dtype, offset in self.layout:
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            views[name] = self.payload[offset:offset + size].view(dtype).reshape(shape)
        return views

    @property
    def nbytes(self) -> int:
        return self.payload.numel() + len(self.state)

    def _compute_checksums(self) -> dict[str, tuple[int, ...]]:
        checksums = {name: chunk_checksums(_byte_view(t), self.chunk_bytes)
                     for name, t in self.tensors.items()}
        checksums["__state__"] = chunk_checksums(memoryview(self.state), self.chunk_bytes)
        return checksums

    def seal(self) -> None:
        """Record the checksums of the current contents."""
        self.checksums = self._compute_checksums()

    def verify(self) -> None:
        """Raise :class:`SnapshotCorrupted` naming the first part that changed."""
        for name, checksum in self._compute_checksums().items():
            if checksum != self.checksums.get(name):
                what = "the small state" if name == "__state__" else repr(name)
                raise SnapshotCorrupted(f"snapshot of rank {self.rank} at iteration "
                                        f"{self.iteration}: {what} does not match its checksum")

    def header(self) -> bytes:
        """Everything but the payload: identity, layout, checksums and the small state."""
        return pickle.dumps({
            "rank": self.rank, "iteration": self.iteration, "layout": self.layout,
            "state": self.state, "checksums": self.checksums, "chunk_bytes": self.chunk_bytes,
        })

    @classmethod
    def from_header(cls, header: bytes, payload: torch.Tensor) -> "Snapshot":
        meta = pickle.loads(header)
        return cls(meta["rank"], meta["iteration"], meta["layout"], payload, meta["state"],
                   meta["checksums"], meta["chunk_bytes"])


class SnapshotStore:
    """One rank's own snapshots and the replicas it holds for its buddies."""

    def __init__(self, rank: int, config: SnapshotConfig = SnapshotConfig()) -> None:
        self.rank = rank
        self.config = config
        self._held: dict[tuple[int, int], Snapshot] = {}
        self._copy_stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def _payload_buffer(self, rank: int, iteration: int, nbytes: int) -> torch.Tensor:
        """The payload of ``rank``'s snapshot two iterations back (about to be dropped) when it
        has the right size, else a new buffer: steady-state steps allocate nothing."""
        previous = self._held.get((rank, iteration - 2))
        if previous is not None and previous.payload.numel() == nbytes:
            return previous.payload
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._copy_stream is not None)

    # -- capture and restore -------------------------------------------------------------------

    def capture(self, iteration: int, tensors: Mapping[str, torch.Tensor],
                state: Mapping[str, Any]) -> Snapshot:
        """Copy ``tensors`` and ``state`` into host memory as the snapshot of ``iteration``."""
        layout = tensor_layout(tensors)
        payload = self._payload_buffer(self.rank, iteration, _payload_bytes(layout))
        snapshot = Snapshot(self.rank, iteration, layout, payload, pickle.dumps(dict(state)),
                            chunk_bytes=self.config.chunk_bytes)
        stream = self._copy_stream
        for (name, tensor), target in zip(tensors.items(), snapshot.tensors.values()):
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    target.copy_(tensor.detach(), non_blocking=True)
            else:
                target.copy_(tensor.detach())
        self.wait()
        snapshot.seal()
        self._keep(snapshot)
        return snapshot

    def wait(self) -> None:
        """Wait for the device-to-host copies of the last capture."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def restore(self, rank: int, iteration: int) -> tuple[dict[str, torch.Tensor], dict]:
        """The verified tensors and state of ``rank`` at ``iteration``."""
        snapshot = self._held.get((rank, iteration))
        if snapshot is None:
            raise SnapshotMissing(f"no snapshot of rank {rank} at iteration {iteration} here "
                                  f"(held: {sorted(self._held)})")
        snapshot.verify()
        return snapshot.tensors, pickle.loads(snapshot.state)

    def held(self) -> list[tuple[int, int]]:
        """``(rank, iteration)`` of every snapshot held, own and replicated."""
        return sorted(self._held)

    @property
    def bytes_held(self) -> int:
        return sum(s.nbytes for s in self._held.values())

    def _keep(self, snapshot: Snapshot) -> None:
        self._held[(snapshot.rank, snapshot.iteration)] = snapshot
        # Double buffering: per rank, only the two most recent iterations stay.
        iterations = sorted(i for r, i in self._held if r == snapshot.rank)
        for stale in iterations[:-2]:
            del self._held[(snapshot.rank, stale)]

    # -- replication ---------------------------------------------------------------------------

    def replicate(self, snapshot: Snapshot, send_to: list[int], receive_from: list[int],
                  group: dist.ProcessGroup | None = None) -> None:
        """Send ``snapshot`` to ``send_to`` and keep verified copies from ``receive_from``.

        Collective among the ranks named: every rank passes the ranks it sends to and those that
        send to it (global ranks). Messages go sizes first, then header, then payload.
        """
        header = snapshot.header()
        header_tensor = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        sizes = torch.tensor([len(header), snapshot.payload.numel()], dtype=torch.int64)
        requests = []
        for peer in send_to:
            requests.append(dist.isend(sizes, peer, group=group))
            requests.append(dist.isend(header_tensor, peer, group=group))
            requests.append(dist.isend(snapshot.payload, peer, group=group))
        for peer in receive_from:
            peer_sizes = torch.empty(2, dtype=torch.int64)
            dist.recv(peer_sizes, peer, group=group)
            peer_header = torch.empty(int(peer_sizes[0]), dtype=torch.uint8)
            dist.recv(peer_header, peer, group=group)
            peer_payload = self._payload_buffer(peer, snapshot.iteration, int(peer_sizes[1]))
            dist.recv(peer_payload, peer, group=group)
            received = Snapshot.from_header(peer_header.numpy().tobytes(), peer_payload)
            received.verify()
            self._keep(received)
        for request in requests:
            request.wait()
