"""Stopping a job before ``--train-iters``, as Megatron-LM does: ``--exit-signal-handler`` (on
SIGTERM the job saves a checkpoint and exits with 0, as on a preemption) and
``--exit-duration-in-mins`` (the same once the job has trained that long).

Each rank notices its own conditions; the job stops after the first iteration at the end of
which any rank has (the ranks agree on it through a reduction), so every rank stops at the same
iteration.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field


@dataclass
class StopConditions:
    """This rank's reasons to stop early."""

    on_signal: bool = False
    """``--exit-signal-handler``: SIGTERM asks the job to stop instead of killing this process."""
    duration_mins: float | None = None
    """``--exit-duration-in-mins``."""
    started_at: float = field(default_factory=time.monotonic)
    """When training started (the duration counts from here)."""
    _signalled: bool = False

    @property
    def armed(self) -> bool:
        """Whether any condition can stop the job."""
        return self.on_signal or self.duration_mins is not None

    def install(self) -> None:
        """Catch SIGTERM (from the main thread) if ``--exit-signal-handler`` asks for it."""
        if self.on_signal:
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self._signalled = True

    def code(self) -> int:
        """Why this rank asks to stop: 0 (it does not), :data:`SIGNALLED` or :data:`TIMED_OUT`."""
        if self._signalled:
            return SIGNALLED
        minutes = (time.monotonic() - self.started_at) / 60
        if self.duration_mins is not None and minutes > self.duration_mins:
            return TIMED_OUT
        return 0


SIGNALLED = 1
TIMED_OUT = 2
SAVE_FAILED = 3
"""A checkpoint this rank wrote could not be written (``--elastic-save-failures stop``): the job
stops in one line, with a non-zero status (:mod:`.durable`)."""


def describe(code: int, duration_mins: float | None) -> str:
    """Why the job stops, from the :meth:`StopConditions.code` of the lowest rank that asked."""
    if code == SIGNALLED:
        return "received SIGTERM (--exit-signal-handler)"
    return f"trained for {duration_mins:g} minutes (--exit-duration-in-mins)"
