"""The one way this package waits for what other processes do: poll a condition with a backoff.

A poll is repeated after a pause that starts at :data:`FIRST_PAUSE_S` and doubles after each
poll up to a bound (:data:`STORE_POLL_S` by default): the peers of a barrier, the writer of a
key, a worker's exit usually answer within milliseconds, and a long wait then costs one store
request per bound. Every wait has a deadline, and may be given up earlier by an event (a failure
was detected: the peer it waits for may be dead) or by a check that raises (a signal arrived).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

FIRST_PAUSE_S = 0.001
"""The pause after the first poll of a wait."""
STORE_POLL_S = 0.02
"""The longest pause between two polls of the job store, unless a wait asks for another."""


def pauses(max_s: float = STORE_POLL_S, first_s: float = FIRST_PAUSE_S) -> Iterator[float]:
    """The pauses between the polls of one wait, without end: ``first_s``, then twice the last
    one, up to ``max_s``."""
    pause = min(first_s, max_s)
    while True:
        yield pause
        pause = min(2 * pause, max_s)


def wait_until(ready: Callable[[], object], timeout_s: float | None, *,
               abandon: threading.Event | None = None,
               check: Callable[[], None] | None = None,
               max_pause_s: float = STORE_POLL_S) -> bool:
    """Call ``ready()`` until it returns something true, pausing between calls as
    :func:`pauses` says. Returns ``True`` then; ``False`` as soon as ``abandon`` is set or
    ``timeout_s`` (``None``: no bound) has passed after a call that was not ready. ``check()``,
    when given, is called before every pause and may raise to end the wait. ``ready`` is called
    at least once."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for pause in pauses(max_pause_s):
        if ready():
            return True
        if abandon is not None and abandon.is_set():
            return False
        if deadline is not None and time.monotonic() >= deadline:
            return False
        if check is not None:
            check()
        if abandon is not None:
            abandon.wait(pause)
        else:
            time.sleep(pause)
    raise AssertionError("pauses() does not end")
