"""Snapshot payloads in shared memory, mapped by the ranks on the same host instead of copied.

A rank's snapshot copy for a buddy on its own host need not cross a socket: the owner captures
into a buffer in shared memory (an anonymous ``memfd``), and the buddy maps the same pages. What
protects the state against the owner's death is that the pages outlive the owner's process for as
long as any buddy maps them; the kernel frees them when the last mapping goes, so nothing is left
behind by a process killed at any moment.

Guarantees:

* **Nothing to clean up.** Buffers have no name in any file system: a buffer's memory is freed
  when its owner has dropped it and no other process maps it, whichever processes were killed.
* **A buddy never writes the owner's bytes.** It maps them copy-on-write: a write there stays in
  its own pages. A buffer's size is sealed, so no process can shrink it under its mappings.
* **Only the owner's user.** A request from a process of another user is refused (the
  peer's credentials, ``SO_PEERCRED``).
* **Same host or nothing.** The owner hands a buffer's descriptor over a Unix socket in the
  abstract namespace of its host (and network namespace), at an address unique to the process:
  :meth:`SharedPayloads.attach` from anywhere else finds no owner and returns ``None``, and the
  caller sends the bytes another way.
* **Bounded waits.** A request to an owner that does not answer (stopped, or busy past
  :data:`ANSWER_TIMEOUT_S`) returns ``None`` rather than wait on it.

An owner answers requests on a thread of its own (started by the first :meth:`allocate`), so a
buddy maps a buffer while the owner trains. A buffer is requested once per buddy: later snapshots
reuse it (:class:`~megatron_elaswave.runtime.snapshot.SnapshotStore`) and the buddy keeps its
mapping while it holds a snapshot in it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import struct
import threading
import weakref
from typing import NamedTuple

import torch

ANSWER_TIMEOUT_S = 5.0
"""The longest :meth:`SharedPayloads.attach` waits for an owner's answer."""

_REQUEST = struct.Struct("<q")
"""A buddy's request: the buffer's id."""
_ANSWER = struct.Struct("<q")
"""The owner's answer: the buffer's size in bytes, or -1 (no such buffer); the descriptor rides
with it."""
_CREDENTIALS = struct.Struct("3i")
"""``SO_PEERCRED``: the peer's pid, uid and gid."""


class SharedHandle(NamedTuple):
    """Where another process on this host finds a payload."""

    address: bytes
    """The owner's socket, in the abstract namespace."""
    buffer_id: int


class SharedPayloads:
    """One process's payload buffers in shared memory, and the buffers of others it maps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._address: bytes | None = None
        self._next_id = 0
        self._buffers: dict[int, tuple[int, int]] = {}
        """By buffer id: the memfd and the size of each buffer this process owns and still uses."""
        self._ids: dict[int, int] = {}
        """Buffer id by the address of the buffer's first byte."""
        self._released: list[tuple[int, int]] = []
        """Buffers dropped by the owner, ``(id, address)``, whose descriptors are still to close:
        a buffer is dropped wherever garbage is collected, perhaps on a thread that holds
        ``_lock``, so the lock is taken to close them later (:meth:`_close_released`)."""
        self._attached: weakref.WeakValueDictionary[SharedHandle, torch.Tensor] = \
            weakref.WeakValueDictionary()
        self._connections: dict[bytes, socket.socket | None] = {}
        """By owner address; ``None`` for an owner that is not on this host (or did not answer)."""

    # -- the owner's side ----------------------------------------------------------------------

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        """A new buffer of ``nbytes`` bytes that processes on this host can map, its memory
        reserved now (so that a host short of memory fails here, not with a fault on first
        write); ``None`` where shared memory cannot be had (no ``memfd``, no memory)."""
        if nbytes <= 0:
            return None
        try:
            fd = os.memfd_create("elaswave-snapshot", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (AttributeError, OSError):
            return None
        try:
            os.posix_fallocate(fd, 0, nbytes)
            mapping = mmap.mmap(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        except OSError:
            os.close(fd)
            return None
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
        with self._lock:
            self._close_released()
            self._ensure_serving()
            buffer_id, self._next_id = self._next_id, self._next_id + 1
            self._buffers[buffer_id] = (fd, nbytes)
            self._ids[buffer.data_ptr()] = buffer_id
        weakref.finalize(buffer, self._release, buffer_id, buffer.data_ptr())
        return buffer

    def handle(self, payload: torch.Tensor) -> SharedHandle | None:
        """Where other processes find ``payload``, a buffer of :meth:`allocate`; ``None`` for
        any other tensor."""
        with self._lock:
            self._close_released()
            buffer_id = self._ids.get(payload.data_ptr())
            if buffer_id is None or self._buffers.get(buffer_id, (0, -1))[1] != payload.numel():
                return None
            return SharedHandle(self._address, buffer_id)

    def _release(self, buffer_id: int, data_ptr: int) -> None:
        """The owner dropped the buffer: its descriptor goes (buddies keep their mappings)."""
        self._released.append((buffer_id, data_ptr))  # atomic: takes no lock (``_released``)

    def _close_released(self) -> None:
        """Under ``_lock``: forget the buffers released so far and close their descriptors."""
        while self._released:
            buffer_id, data_ptr = self._released.pop()
            fd, _ = self._buffers.pop(buffer_id)
            if self._ids.get(data_ptr) == buffer_id:
                del self._ids[data_ptr]
            os.close(fd)

    def _ensure_serving(self) -> None:
        if self._address is not None:
            return
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        address = b"\0elaswave-snapshots-" + os.urandom(12).hex().encode()
        listener.bind(address)
        listener.listen()
        self._address = address
        threading.Thread(target=self._serve, args=(listener,), daemon=True,
                         name="elaswave-shared-payloads").start()

    def _serve(self, listener: socket.socket) -> None:
        while True:
            connection, _ = listener.accept()
            threading.Thread(target=self._answer, args=(connection,), daemon=True,
                             name="elaswave-shared-payloads").start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            _, uid, _ = _CREDENTIALS.unpack(connection.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
            if uid != os.getuid():
                return
            while (request := _receive_exactly(connection, _REQUEST.size)) is not None:
                (buffer_id,) = _REQUEST.unpack(request)
                with self._lock:
                    self._close_released()
                    fd, nbytes = self._buffers.get(buffer_id, (None, -1))
                    try:  # under the lock: the descriptor cannot be closed meanwhile
                        socket.send_fds(connection, [_ANSWER.pack(nbytes)],
                                        [fd] if fd is not None else [])
                    except OSError:  # the buddy is gone, or gave up waiting
                        return

    # -- a buddy's side ------------------------------------------------------------------------

    def attach(self, handle: SharedHandle, nbytes: int) -> torch.Tensor | None:
        """The ``nbytes`` of another process's buffer, mapped copy-on-write here; ``None`` when
        its owner is not on this host, does not answer within :data:`ANSWER_TIMEOUT_S` or no
        longer has the buffer. A buffer already mapped here is not requested again."""
        mapped = self._attached.get(handle)
        if mapped is not None and mapped.numel() == nbytes:
            return mapped
        connection = self._connection(handle.address)
        if connection is None:
            return None
        try:
            connection.sendall(_REQUEST.pack(handle.buffer_id))
            message, fds, _, _ = socket.recv_fds(connection, _ANSWER.size, 1)
        except OSError:
            self._forget(handle.address)
            return None
        try:
            if len(message) != _ANSWER.size or _ANSWER.unpack(message)[0] != nbytes or not fds:
                return None
            mapping = mmap.mmap(fds[0], nbytes, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):
            return None
        finally:
            for fd in fds:
                os.close(fd)
        mapped = torch.frombuffer(mapping, dtype=torch.uint8)
        self._attached[handle] = mapped
        return mapped

    def _connection(self, address: bytes) -> socket.socket | None:
        if address in self._connections:
            return self._connections[address]
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        connection.settimeout(ANSWER_TIMEOUT_S)
        try:
            connection.connect(address)
        except OSError:
            connection.close()
            connection = None
        self._connections[address] = connection
        return connection

    def _forget(self, address: bytes) -> None:
        """An owner whose connection failed (gone, or too slow) is not asked again."""
        connection = self._connections.get(address)
        if connection is not None:
            connection.close()
        self._connections[address] = None


def _receive_exactly(connection: socket.socket, size: int) -> bytes | None:
    """``size`` bytes, or ``None`` once the peer has closed."""
    data = b""
    while len(data) < size:
        try:
            chunk = connection.recv(size - len(data))
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return data
