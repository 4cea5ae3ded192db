"""Fault injection: fail rank ``r`` at iteration ``i`` in a given phase, with a real signal.

``--elastic-inject-failure rank=R,iteration=I[,phase=P][,kind=K]`` (repeatable). The process
signals itself, so the job sees exactly what an outside ``kill`` would produce:

* ``kind=kill`` (default): ``SIGKILL``; the launcher reports the death.
* ``kind=hang``: ``SIGSTOP``; only the heartbeat timeout reveals it. A detached helper sends
  ``SIGCONT`` after ``hang_s`` seconds, so the stopped rank wakes up, finds itself excluded by
  the survivors and leaves, and the job can end.
* ``kind=raise``: :class:`InjectedError` (a ``RuntimeError``) once, as a transient fault of the
  rank's own would (nobody fails; the iteration is re-run from its snapshot).
* ``kind=poison``: :class:`InjectedError` every time iteration ``I`` runs, as a bad sample or a
  bug would: re-running it does not help.
* ``kind=nan``: the rank's last model chunk outputs NaN once in iteration ``I`` (phase
  ``forward``), as a transient fault of a device would.
* ``kind=delay,seconds=S``: the rank's thread sleeps ``S`` seconds there once, as slow storage
  would in the ``checkpoint`` phase (nobody fails: the heartbeat goes on).

Phases, within iteration ``I`` (counted from 1 like Megatron's log lines): ``forward`` (the
first micro-batch's forward), ``backward`` (the first micro-batch's backward), ``allreduce``
(as the gradient reduction over the data-parallel groups starts), ``optimizer`` (before the
optimizer step), ``snapshot`` (between capturing the snapshot and replicating it),
``recovery`` (on entering a recovery during iteration ``I``), ``relayout`` (when the layout has
just changed before iteration ``I``, by a recovery, a layer move or a grow: once every rank has
restored its state into the new layout, before this rank snapshots it there), ``evaluation``
(as the evaluation after iteration ``I`` starts, the others already in it), ``alltoall`` (in
the first MoE layer of the first micro-batch of iteration ``I`` to reach its experts: between
the all-to-all that dispatched the tokens and the one that combines the experts' outputs, in
which its expert-parallel peers then wait for it), ``checkpoint``
(on the rank's checkpoint writer thread, once it has written its part of the durable checkpoint
of iteration ``I`` and before it reports it: the save is left incomplete), ``commit`` (on the
finaliser's writer thread, once every part of that checkpoint is indexed and it is marked
``committing``, before its directory is renamed into place: a survivor completes the commit).

``--elastic-inject-slowdown rank=R,factor=F[,iteration=I]`` makes rank ``R`` a straggler from
iteration ``I`` on: after each transformer layer's forward it sleeps ``(F - 1)`` times that
forward's compute, and as the layer's backward starts ``(F - 1)`` times twice that (the backward
taken as twice the forward), so its layers take about ``F`` times as long, as on a throttled or
shared device.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

PHASES = ("forward", "backward", "allreduce", "optimizer", "snapshot", "recovery", "relayout",
          "evaluation", "alltoall", "checkpoint", "commit")
KINDS = ("kill", "hang", "raise", "poison", "nan", "delay")


class InjectedError(RuntimeError):
    """The error of an injected ``raise`` or ``poison`` failure."""


class FailureSpecError(ValueError):
    """A ``--elastic-inject-failure`` value that cannot be parsed."""


@dataclass(frozen=True)
class InjectedFailure:
    """One failure to inject."""

    rank: int
    """Launch rank that fails."""
    iteration: int
    """Iteration (from 1) during which it fails."""
    phase: str = "forward"
    """Where in the iteration: one of :data:`PHASES`."""
    kind: str = "kill"
    """``kill`` (SIGKILL), ``hang`` (SIGSTOP, woken later to leave), ``raise`` (an error once),
    ``poison`` (an error every time the iteration runs), ``nan`` (a NaN output once) or
    ``delay`` (a sleep of :attr:`seconds` once)."""
    seconds: float | None = None
    """How long a ``delay`` sleeps (only with it)."""

    def __post_init__(self) -> None:
        if self.rank < 0 or self.iteration < 1:
            raise FailureSpecError("rank must be >= 0 and iteration >= 1")
        if self.phase not in PHASES:
            raise FailureSpecError(f"phase must be one of {', '.join(PHASES)}, not {self.phase!r}")
        if self.kind not in KINDS:
            raise FailureSpecError(f"kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if (self.kind == "delay") != (self.seconds is not None) or (self.seconds or 0) < 0:
            raise FailureSpecError("kind=delay takes seconds=S (S >= 0), and only it does")

    @classmethod
    def parse(cls, text: str) -> InjectedFailure:
        """Parse ``rank=R,iteration=I[,phase=P][,kind=K][,seconds=S]``."""
        usage = "rank=R,iteration=I[,phase=P][,kind=K][,seconds=S]"
        fields = _spec_fields(text, ("rank", "iteration"), ("phase", "kind", "seconds"), usage)
        try:
            rank, iteration = int(fields.pop("rank")), int(fields.pop("iteration"))
            seconds = float(fields.pop("seconds")) if "seconds" in fields else None
        except ValueError:
            raise FailureSpecError(f"bad spec {text!r}: rank and iteration are integers, "
                                   "seconds a number") from None
        return cls(rank, iteration, seconds=seconds, **fields)


def _spec_fields(text: str, required: tuple[str, ...], optional: tuple[str, ...],
                 usage: str) -> dict[str, str]:
    fields = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in required + optional:
            raise FailureSpecError(f"bad spec {text!r}: expected {usage}")
        fields[key.strip()] = value.strip()
    if any(key not in fields for key in required):
        raise FailureSpecError(
            f"bad spec {text!r}: {' and '.join(key + '=' for key in required)} are required")
    return fields


@dataclass(frozen=True)
class InjectedSlowdown:
    """One rank made slow (module docstring)."""

    rank: int
    """Launch rank that slows down."""
    factor: float
    """How many times as long its compute takes (> 1)."""
    iteration: int = 1
    """First slow iteration (from 1)."""

    def __post_init__(self) -> None:
        if self.rank < 0 or self.iteration < 1:
            raise FailureSpecError("rank must be >= 0 and iteration >= 1")
        if not self.factor > 1:
            raise FailureSpecError(f"factor must be greater than 1, not {self.factor}")

    @classmethod
    def parse(cls, text: str) -> InjectedSlowdown:
        """Parse ``rank=R,factor=F[,iteration=I]``."""
        fields = _spec_fields(text, ("rank", "factor"), ("iteration",),
                              "rank=R,factor=F[,iteration=I]")
        try:
            rank, factor = int(fields["rank"]), float(fields["factor"])
            iteration = int(fields.get("iteration", 1))
        except ValueError:
            raise FailureSpecError(f"bad spec {text!r}: rank and iteration are integers, "
                                   "factor a number") from None
        return cls(rank, factor, iteration)


def slow_down(layers: Iterable[torch.nn.Module], slowdown: InjectedSlowdown,
              iteration: Callable[[], int]) -> None:
    """Hook ``layers`` so that their compute takes ``slowdown.factor`` times as long from
    ``slowdown.iteration`` on; ``iteration()`` is the iteration running."""
    started: list[float] = []

    def before(module, inputs) -> None:
        started.append(time.perf_counter())

    def after(module, inputs, output) -> None:
        forward_s = time.perf_counter() - started.pop()
        if iteration() < slowdown.iteration:
            return
        time.sleep((slowdown.factor - 1) * forward_s)
        hidden = output[0] if isinstance(output, tuple) else output
        if torch.is_tensor(hidden) and hidden.requires_grad:
            hidden.register_hook(lambda grad: time.sleep((slowdown.factor - 1) * 2 * forward_s))

    for layer in layers:
        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)


class FaultInjector:
    """The failures of one rank; :meth:`at` fires the one due now, if any."""

    def __init__(self, failures: Iterable[InjectedFailure], rank: int, hang_s: float) -> None:
        self.rank = rank
        self.hang_s = hang_s
        self._due = {(f.iteration, f.phase): f for f in failures if f.rank == rank}

    @property
    def armed(self) -> bool:
        """Whether a failure of this rank is still due."""
        return bool(self._due)

    def at(self, phase: str, iteration: int) -> bool:
        """Fail now if a failure is due in ``phase`` of ``iteration``; ``True`` when the failure
        is a NaN output, which the caller produces."""
        failure = self._due.get((iteration, phase))
        if failure is None:
            return False
        if failure.kind != "poison":
            del self._due[iteration, phase]
        print(f" injected failure: rank {self.rank} {failure.kind} in the {phase} of iteration "
              f"{iteration}", flush=True)
        if failure.kind == "nan":
            return True
        if failure.kind == "delay":
            time.sleep(failure.seconds)
            return False
        if failure.kind in ("raise", "poison"):
            raise InjectedError(f"injected {failure.kind} failure of rank {self.rank} in the "
                                f"{phase} of iteration {iteration}")
        if failure.kind == "hang":
            subprocess.Popen(["sh", "-c", f"sleep {self.hang_s}; kill -CONT {os.getpid()}"],
                             start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            os.kill(os.getpid(), signal.SIGKILL)
        return False
