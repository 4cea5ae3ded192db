"""How training ends short of ``--train-iters`` after a failure: the errors the survivors stop
with, and the line each says."""

from __future__ import annotations

from ..checkpointing.checkpoint import resume_hint


class CannotContinue(RuntimeError):
    """The survivors cannot hold the model any more."""


def cannot_continue_line(error: BaseException, save: str | None) -> str:
    """The line every survivor stops with: why, and what it can resume from (the checkpoint
    the survivors saved, else the last complete one under ``save``)."""
    reason = str(error).rstrip(".")
    if "resume with --load" in reason:
        return f"cannot continue: {reason}"
    return f"cannot continue: {reason}; {resume_hint(save)}"


class StepFailed(RuntimeError):
    """An iteration failed again when re-run from its snapshot while no rank failed: its data,
    its hyper-parameters or the code are at fault, not the job's ranks. Every member raises it;
    the one with ``announce`` set says it."""

    def __init__(self, message: str, announce: bool) -> None:
        super().__init__(message)
        self.announce = announce


class NonFiniteLoss(FloatingPointError):
    """The reduced loss of an iteration is not finite (every rank sees the same value)."""
