"""Waits for collectives that a detected failure ends, even when gloo does not.

Checked against torch 2.13 (``torch.distributed.Work.wait``, gloo's ``AsyncWork`` futures) and
gloo at its newest commit (``gloo/transport/tcp/pair.cc``).

The elastic runtime aborts the collectives of a failed generation by shutting down their gloo
connections: every pending operation then fails with "Connection closed by peer". One does not:
a send of a ring all-reduce whose ``writev`` meets ``EPIPE`` or ``ECONNRESET`` before gloo's
event loop has seen the connection close is queued without an error, and when the pair closes,
``Pair::signalException`` fails the other pending operations but not an unbound buffer in that
queue. Gloo's worker thread then waits in ``UnboundBuffer::waitSend`` until the op timeout, and
the training thread with it, in ``Work.wait``: a survivor held 30 s, and the whole recovery with
it (about one recovery in five on a loaded 2-core machine). Nothing outside gloo can reach that
buffer, and gloo's own ``abort()`` does not wake it.

Point-to-point sends wait in the same ``waitSend`` (megatron-core's pipeline sending to a stage
that just died), and their requests have no future.

What can be changed is the wait. Wrapped here, ``Work.wait`` waits for the work or for the event
given to :func:`abandon_waits_when`, whichever comes first, and raises
:class:`CollectiveAbandoned` in the second case: on the work's future where it has one (gloo's
collectives; torch's collectives called without ``async_op`` wait through the same method, so
megatron-core's all-reduces are covered too), otherwise on a thread of a pool that waits for it:
point-to-point requests, and the one work of collectives coalesced by ``_coalescing_manager``
(megatron-core's bucket groups), which has no future in gloo. A collective with a future is
first waited for in torch alone, for at most ``_TORCH_WAIT_S``: most end within it (the
tensor-parallel all-reduces of every layer), and torch's wait wakes its thread directly, where
the future's callback and the event take the GIL on two threads; a gloo collective's wait that
times out raises and leaves the work as it was. A point-to-point request's wait cannot be
shortened so: a send or receive that times out fails every connection of its group. The
abandoned operation stays with a gloo thread until its deadline; its group must stay referenced
until then (destroying the last reference joins that thread). :func:`abandoned_work_pending`
tells whether any abandoned operation is still there, so that its groups are released once none
is. Inert until an event is given.

A device backend's work is left to torch: NCCL completes a work's future when the operation is
enqueued (its ``wait`` makes the current stream wait, and blocks no host thread), so the wrapped
wait finds it done and calls torch's at once. A device collective that waits for a dead peer is
ended by the backend's abort instead (``megatron_elaswave.runtime.world``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from .registry import PatchRegistry

TARGET = "torch.distributed.Work.wait"

_TORCH_WAIT_S = 0.05
"""How long a collective's wait is left to torch before the event may end it: at most this is
added to the time a failure takes to end a wait."""
_TORCH_TIMED_OUT = "Operation timed out"
"""How torch's ``Work.wait`` says that its timeout passed (``c10d::Work::wait``)."""
_WATCH_S = 1.0
"""How often the watcher of an event looks whether it is still needed."""
_SET_WAKE_S = 0.02
"""While the event is set, how often its watcher wakes the waits that started since."""

_WAIT_THREADS = 256
"""Point-to-point waits in progress at once, abandoned ones included (each keeps its thread
until its deadline); the pool starts a thread only when none is idle."""

_abandon: threading.Event | None = None
_wait_threads: ThreadPoolExecutor | None = None
_wait_threads_lock = threading.Lock()
_pending: list[Callable[[], bool]] = []
"""For every wait given up and not yet known to be over: whether its operation has ended."""
_pending_lock = threading.Lock()
_wakers: dict[threading.Event, threading.Event] = {}
"""For every wait in progress: the event that wakes it, and the abandon event it was armed with."""
_watched: set[threading.Event] = set()
"""Abandon events that have a watcher thread."""
_wakers_lock = threading.Lock()


class CollectiveAbandoned(RuntimeError):
    """A wait for a collective was given up because a failure was detected meanwhile."""


def abandon_waits_when(event: threading.Event | None) -> None:
    """From now on, waits for collectives end with :class:`CollectiveAbandoned` while ``event``
    is set (the failure monitor's ``failure_detected``); ``None``: they wait as torch does.

    A wait sleeps until its work ends or ``event`` is set, without polling: a thread blocked on
    ``event`` wakes the waits in progress (a wait keeps the event it started with). A wait that
    polled woke its process dozens of times a second, each time taking the GIL from the training
    thread (an exchange of snapshots waits on a thread of its own while the step computes)."""
    global _abandon
    _abandon = event
    if event is not None:
        _watch(event)


def abandoned_work_pending() -> bool:
    """Whether an operation whose wait was abandoned may still hold a gloo thread or buffer of
    its group. Its groups can be released (and their threads joined at once) when not."""
    with _pending_lock:
        _pending[:] = [ended for ended in _pending if not ended()]
        return bool(_pending)


def _abandoned(ended: Callable[[], bool]) -> None:
    with _pending_lock:
        _pending.append(ended)


def _watch(event: threading.Event) -> None:
    """Start a watcher of ``event`` unless it has one."""
    with _wakers_lock:
        if event in _watched:
            return
        _watched.add(event)
    threading.Thread(target=_wake_waits_when_set, args=(event,), daemon=True,
                     name="elaswave-abandon-watch").start()


def _still_watched(event: threading.Event) -> bool:
    """Whether ``event`` is the abandon event or armed a wait still in progress; if not, it is
    no longer watched."""
    with _wakers_lock:
        if _abandon is event or any(armed is event for armed in _wakers.values()):
            return True
        _watched.discard(event)
        return False


def _wake_waits_when_set(event: threading.Event) -> None:
    """Wake the waits armed with ``event`` when it is set, and every ``_SET_WAKE_S`` while it
    stays set (a wait may start between a clear and the next set); ends once ``event`` is
    neither the abandon event nor that of a wait in progress."""
    while _still_watched(event):
        if event.wait(_WATCH_S):
            with _wakers_lock:
                for waker, armed in _wakers.items():
                    if armed is event:
                        waker.set()
            time.sleep(_SET_WAKE_S)


@contextlib.contextmanager
def _woken_on_abandon(waker: threading.Event, abandon: threading.Event) -> Iterator[None]:
    with _wakers_lock:
        _wakers[waker] = abandon
    _watch(abandon)  # armed since with another event, or none: this wait keeps the old one's
    try:
        yield
    finally:
        with _wakers_lock:
            del _wakers[waker]


def _abandoned_first(finished: Callable[[], bool], waker: threading.Event,
                     abandon: threading.Event, deadline: float | None) -> bool:
    """Sleep until ``finished()``, ``abandon`` is set or the ``deadline`` (monotonic) passes,
    whichever comes first; whoever ends the work sets ``waker``. True if ``abandon`` came first."""
    with _woken_on_abandon(waker, abandon):
        while not finished():
            if abandon.is_set():
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            waker.wait(remaining)
            waker.clear()  # the conditions are read again before the next sleep
    return False


def _abandonable(wait):
    @functools.wraps(wait)
    def wait_unless_abandoned(work: Any, timeout: timedelta = timedelta(0)) -> bool:
        abandon = _abandon
        if abandon is None or work.is_completed():
            return wait(work, timeout)
        try:
            future = work.get_future()
        except RuntimeError:  # no future: a point-to-point request or coalesced collectives
            return _wait_on_a_thread(wait, work, timeout, abandon)
        if future.done() or (timeout and timeout.total_seconds() <= _TORCH_WAIT_S):
            return wait(work, timeout)
        if not abandon.is_set():
            started = time.monotonic()
            try:
                return wait(work, timedelta(seconds=_TORCH_WAIT_S))
            except RuntimeError as error:
                if not str(error).startswith(_TORCH_TIMED_OUT):
                    raise
            if timeout:
                timeout -= timedelta(seconds=time.monotonic() - started)
        waker = threading.Event()
        future.add_done_callback(lambda _: waker.set())
        deadline = time.monotonic() + timeout.total_seconds() if timeout else None
        if _abandoned_first(future.done, waker, abandon, deadline):
            _abandoned(work.is_completed)
            raise CollectiveAbandoned("collective abandoned: a failure was detected")
        remaining = timedelta(seconds=max(deadline - time.monotonic(), 0.001)) if deadline else None
        return wait(work) if remaining is None else wait(work, remaining)

    return wait_unless_abandoned


def _waiting_threads() -> ThreadPoolExecutor:
    """The pool, started in the process that waits (not in a parent it may be forked from).
    Its threads are joined at interpreter shutdown, like threads that are not daemons: one
    still in gloo then would abort the process; it ends at its work's deadline at the latest."""
    global _wait_threads
    with _wait_threads_lock:
        if _wait_threads is None:
            _wait_threads = ThreadPoolExecutor(_WAIT_THREADS,
                                               thread_name_prefix="elaswave-p2p-wait")
        return _wait_threads


def _wait_on_a_thread(wait, work: Any, timeout: timedelta, abandon: threading.Event) -> bool:
    """``wait(work, timeout)`` on a thread of a pool (starting one costs more than the wait's
    hand-over), given up once ``abandon`` is set."""
    outcome: dict[str, Any] = {}
    done, waker = threading.Event(), threading.Event()

    def run() -> None:
        nonlocal work
        try:
            outcome["completed"] = wait(work, timeout)
        except BaseException as error:  # re-raised on the waiting thread
            # Without its traceback, which would hold this frame, ``work`` and so its group's
            # gloo context in a reference cycle after the wait was abandoned.
            outcome["error"] = error.with_traceback(None)
        # Dropped before ``done`` says the operation ended: an abandoned wait's group may be
        # released (its gloo threads joined) at once, while this thread has yet to return.
        work = None
        done.set()
        waker.set()

    _waiting_threads().submit(run)
    if _abandoned_first(done.is_set, waker, abandon, None):
        _abandoned(done.is_set)
        raise CollectiveAbandoned("wait abandoned: a failure was detected")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["completed"]


def register(registry: PatchRegistry) -> None:
    registry.register_wrapper(TARGET, _abandonable)
