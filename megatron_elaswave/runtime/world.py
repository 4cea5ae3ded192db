"""Process groups that can be aborted from any thread, one world per generation.

A generation is one membership of the job: generation 0 is every launched rank, and each
:class:`~megatron_elaswave.launch.decisions.Decision` starts the next one with the survivors. Each
generation gets a fresh default process group on ``PrefixStore(f"gen{g}/", store)``, so a rebuilt
group never reads a key written by an older one. Before the rendezvous of that group, which can
only time out, the survivors meet in the store (the counter ``rt/gen<g>/ready``), a wait that a
detected failure interrupts: a survivor that dies just after a decision costs one more agreement,
not a rendezvous timeout.

Aborting gloo collectives
-------------------------
In torch 2.13, ``ProcessGroup.abort()``, ``ProcessGroup.shutdown()``, the gloo backend's
``abort()`` and ``distributed_c10d._abort_process_group()`` all return at once on gloo but leave a
thread that is blocked in a collective blocked: a survivor waiting in a ring all-reduce for a
peer that is alive (but has itself left the collective) waits for the full op timeout. What does
unblock it is closing the connections: once a rank shuts down its gloo TCP sockets, its own
pending operations and those of every peer that waits on it fail at once with "Connection closed
by peer". So this module records the sockets that gloo opens while a group is created (by
comparing ``/proc/self/fd`` before and after, Linux only) and :func:`abort_collectives` shuts
them down. The listening socket is left alone: gloo aborts the process if its ``accept`` fails.
A socket that another thread opens while a group is being created would be recorded too, which is
why the failure monitor opens its store connection when it is constructed, not from its thread.
An abort that runs while a group is being created (a failure detected in the middle of a
recovery) also shuts down that group's connections once they exist: otherwise the group would
escape the abort, and a survivor that went on to use it would wait in a collective for a peer
that had already left, until the op timeout.

Interrupting a group's rendezvous
---------------------------------
Gloo forms a group in two steps: every member publishes its address in the store and reads the
others' (a blocking read), then the members connect to one another. A member that dies before
publishing leaves the others in the read until the creation timeout. Groups are therefore
created on an :class:`InterruptibleStore`, whose blocking reads poll and give up as soon as a
failure is detected. The connections of the second step cannot be interrupted: a member that
dies or hangs after publishing keeps the others for about five times the creation timeout. Gloo
releases the GIL meanwhile, so a group formed in a recovery is created on a thread of its own and
the survivor stops waiting for it once the failure is detected
(``communicator._new_named_groups``).

Now and then a send of a ring all-reduce is not failed by the closed connections: gloo's
worker thread stays in ``UnboundBuffer::waitSend`` until its deadline. The training thread does
not wait for it: its wait for the collective is given up once the monitor detects the failure
(``patches.distributed_work``), and the groups destroyed afterwards stay referenced for their op
timeout (:func:`retire`), since dropping a group joins its worker threads.

Aborting device collectives
---------------------------
NCCL and HCCL collectives do not block the host thread that issued them: a collective waiting for
a dead peer holds its stream, and the host waits at the next synchronisation. Their groups are
aborted by their backend's own abort instead (``ProcessGroup.abort()``: ``ncclCommAbort`` on NCCL,
the backend's equivalent where torch_npu implements one), which ends the kernels still waiting.
The registry records every group of a device backend it creates
(:func:`recording_connections` yields the list to add them to) and :func:`abort_collectives`
aborts them beside shutting down the gloo connections: one call ends every pending operation,
host and device alike. Host-memory state never travels on a device group: it goes over gloo
groups of the same members (``communicator.GroupRegistry.host_group``).

The op timeout given to :func:`init_generation` remains the backstop for what cannot be
aborted: a group whose creation is still in progress, groups created with
``TORCH_GLOO_LAZY_INIT=1`` (their connections open after creation and are not recorded), and
point-to-point requests, whose gloo works have no future to wait on.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from megatron_elaswave.launch.keys import generation_prefix, ready_key
from megatron_elaswave.launch.store import wait_for_keys
from megatron_elaswave.patches.distributed_c10d import forget_unformed_default_group
from megatron_elaswave.patches.distributed_work import abandoned_work_pending
from megatron_elaswave.waiting import wait_until

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

    from megatron_elaswave.launch.decisions import Decision

_FD_DIR = "/proc/self/fd"


@dataclass(frozen=True)
class _Connection:
    """A socket opened by gloo, identified by descriptor and inode so that a descriptor number
    reused for something else after gloo closed it is never touched."""

    fd: int
    inode: str

    def shutdown(self) -> None:
        try:
            pinned = os.dup(self.fd)  # holds the socket open while we check it is still gloo's
        except OSError:
            return  # gloo already closed it
        if _inode(pinned) != self.inode:
            os.close(pinned)
            return
        with socket.socket(fileno=pinned) as sock, contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


_lock = threading.Lock()
_connections: list[_Connection] = []
_device_groups: weakref.WeakSet[ProcessGroup] = weakref.WeakSet()
"""Groups of a device backend (NCCL, HCCL) created here and not aborted yet."""
_aborts = 0
"""How many times :func:`abort_collectives` ran."""


def _abort_device_groups(groups: list[ProcessGroup]) -> None:
    for group in groups:
        # A group whose communicator never formed, or failed already, has nothing to end.
        with contextlib.suppress(RuntimeError):
            group.abort()


def _inode(fd: int) -> str | None:
    try:
        return os.readlink(f"{_FD_DIR}/{fd}")
    except OSError:
        return None


def _open_sockets() -> dict[int, str]:
    """``{fd: "socket:[inode]"}`` of this process; empty where ``/proc`` is unavailable."""
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return {}
    found = {}
    for name in names:
        target = _inode(int(name))
        if target is not None and target.startswith("socket:"):
            found[int(name)] = target
    return found


def _is_tcp_connection(fd: int) -> bool:
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            return (
                sock.family in (socket.AF_INET, socket.AF_INET6)
                and sock.type == socket.SOCK_STREAM
                and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            )
    except OSError:
        return False


@contextlib.contextmanager
def recording_connections() -> Iterator[list[ProcessGroup]]:
    """Record the TCP connections opened inside the block, and the device-backend groups added
    to the list it yields, for :func:`abort_collectives`.

    Only the calling thread should open sockets meanwhile: a socket another thread opens inside
    the block would be recorded too. If :func:`abort_collectives` runs while the block does, the
    connections are shut down and the groups aborted at its end instead: the abort covers a
    group still forming.
    """
    with _lock:
        aborts_before = _aborts
    before = _open_sockets()
    device_groups: list[ProcessGroup] = []
    yield device_groups
    opened = [
        _Connection(fd, inode)
        for fd, inode in _open_sockets().items()
        if before.get(fd) != inode and _is_tcp_connection(fd)
    ]
    with _lock:
        overlapped = _aborts != aborts_before
        if not overlapped:
            _connections.extend(opened)
            _device_groups.update(device_groups)
    if overlapped:
        for connection in opened:
            connection.shutdown()
        _abort_device_groups(device_groups)


def abort_collectives() -> None:
    """Make every pending and future collective of the groups created here fail at once,
    including a group whose creation is under way (see :func:`recording_connections`).

    Gloo groups fail once their connections are shut down; groups of a device backend are
    aborted by that backend (see "Aborting device collectives" above). Safe to call from any
    thread, any number of times. The groups stay registered with ``torch.distributed``; destroy
    them (:func:`init_generation` does) before forming new ones.
    """
    global _aborts
    with _lock:
        _aborts += 1
        aborted = list(_connections)
        _connections.clear()
        device_groups = list(_device_groups)
        _device_groups.clear()
    for connection in aborted:
        connection.shutdown()
    _abort_device_groups(device_groups)


_retired: list[tuple[float, ProcessGroup]] = []


def retire(groups: list[ProcessGroup], hold: timedelta) -> None:
    """Keep ``groups``, about to be destroyed, referenced while a collective abandoned after an
    abort may still be inside them, for ``hold`` (their op timeout) at the most, and release
    every group retired earlier that nothing holds any more.

    An abandoned operation (``patches.distributed_work``) may hold one of gloo's worker threads
    until its deadline, and dropping a group's last reference joins that thread: released too
    early, a group would block whoever dropped it for the rest of the op timeout. Released too
    late, every retired group keeps a gloo event loop waking a hundred times a second, which
    slowed each step after a dozen recoveries by a third on a loaded host.
    """
    with _lock:
        _retired.extend((time.monotonic() + hold.total_seconds(), group) for group in groups)
    release_retired()


def release_retired() -> None:
    """Release the retired groups that no abandoned operation can still be inside: all of them
    once every abandoned operation has ended, else those retired longer than their hold ago."""
    if not _retired:  # the usual step: nothing to look at
        return
    now, pending = time.monotonic(), abandoned_work_pending()
    with _lock:
        expired = [group for until, group in _retired if until <= now or not pending]
        _retired[:] = [(until, group) for until, group in _retired if until > now and pending]
    del expired  # released outside the lock: their threads are done


class InterruptibleStore(dist.Store):
    """A view of ``store`` whose blocking reads (``get`` and ``wait``) give up with
    :class:`~megatron_elaswave.launch.store.WaitInterrupted` as soon as ``failure`` is set, or after
    ``timeout``, whatever timeout the caller asks for: a group's rendezvous on it ends when a
    failure is detected instead of waiting for a member that is gone. Every other call goes
    straight to ``store``."""

    def __init__(self, store: Store, failure: threading.Event | None, timeout: timedelta) -> None:
        super().__init__()
        self._store = store
        self._failure = failure
        self._timeout = timeout

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        wait_for_keys(self._store, [key], self._timeout, self._failure)
        return self._store.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait_for_keys(self._store, list(keys), self._timeout, self._failure)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout


_generation_store: InterruptibleStore | None = None
"""The store of the current generation's default group."""


class GenerationAbandoned(RuntimeError):
    """The group of a generation could not form: a survivor failed first, or never came."""


def init_generation(
    decision: Decision,
    store: Store,
    rank: int,
    *,
    backend: str = "gloo",
    timeout: timedelta = timedelta(seconds=30),
    abort: threading.Event | None = None,
) -> ProcessGroup:
    """Replace the default process group with the one of ``decision``'s generation.

    ``rank`` is this process's launch rank (``RANK`` as set by the launcher), which must be one
    of ``decision.survivors``; its rank in the new group is ``decision.new_rank(rank)``. The old
    default group and all its subgroups are aborted and destroyed first. ``timeout`` bounds
    every collective of the new group, including the rendezvous that creates it. Returns the
    new default group.

    The survivors first meet in the store; that wait raises :class:`GenerationAbandoned` as
    soon as ``abort`` is set (pass the monitor's ``failure_detected``, after
    ``monitor.advance(decision)``), or after ``timeout``.
    """
    global _generation_store
    abort_collectives()
    if dist.is_initialized():
        retire([dist.group.WORLD], timeout)
        dist.destroy_process_group()
    forget_unformed_default_group()  # that of a generation abandoned while it formed
    _meet_survivors(decision, store, timeout, abort)
    # Held here: torch keeps only the C++ half of a store written in Python.
    _generation_store = InterruptibleStore(store, abort, timeout)
    with recording_connections() as device_groups:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(generation_prefix(decision.generation), _generation_store),
            rank=decision.new_rank(rank),
            world_size=len(decision.survivors),
            timeout=timeout,
        )
        if backend != "gloo":
            device_groups.append(dist.group.WORLD)
    return dist.group.WORLD


def _meet_survivors(
    decision: Decision,
    store: Store,
    timeout: timedelta,
    abort: threading.Event | None,
) -> None:
    # One counter, not a key per survivor: each poll reads one key, whatever the job's size.
    ready = ready_key(decision.generation)
    store.add(ready, 1)
    everyone = len(decision.survivors)
    if wait_until(lambda: store.add(ready, 0) >= everyone, timeout.total_seconds(),
                  abandon=abort):
        return
    if abort is not None and abort.is_set():
        raise GenerationAbandoned(
            f"generation {decision.generation} abandoned: a failure was detected before its "
            "process group formed"
        )
    raise GenerationAbandoned(
        f"generation {decision.generation} abandoned: {store.add(ready, 0)} of the "
        f"{everyone} survivors {list(decision.survivors)} arrived within "
        f"{timeout.total_seconds():g} s"
    )
