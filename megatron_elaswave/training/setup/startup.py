"""Ending the job in one line when a rank dies before there is anything to recover.

An ``--elastic`` job recovers from a failure by rolling back to a snapshot; until every rank
holds its first one (the default group's rendezvous, building the model, the first snapshot)
there is nothing to roll back to, and without this the survivors would wait for the dead rank
in a rendezvous or a collective until its timeout (ten minutes for the default group). A job
run without ``--elastic`` cannot recover at all: its survivors stop with the first death, as
torchrun stops them.

The workers of a job must all reach the same verdict: either every rank goes on to training
(its failure monitor handles every later death, including one recorded before the monitor
started) or every rank stops. One store key, written once with ``compare_set``, holds that
verdict: ``started`` by the rank that first sees every rank ready, or the stop line by the
first rank that sees a death before that.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed
from torch.distributed import Store

from megatron_elaswave.launch.alerts import AlertListener
from megatron_elaswave.launch.keys import FINISHED_KEY, START_VERDICT_KEY, started_key
from megatron_elaswave.launch.store import WorkerDeath, read_deaths
from megatron_elaswave.waiting import wait_until

from ..recovery.outcomes import CannotContinue

STARTED = "started"
_POLL_S = 0.05
_STOP_TIMEOUT_S = 5.0
"""How long closing the watch waits for its thread when the store does not answer."""


def _default_stop(line: str, status: int) -> None:
    # The main thread may sit in a rendezvous or a collective that nothing else ends.
    sys.stderr.write(f"pretrain_gpt.py: {line}\n")
    sys.stderr.flush()
    os._exit(status)


class StartupWatch:
    """While open, stops this worker (one line on stderr, ``exit_status``) as soon as the
    launcher records the death of any rank of the job, unless the job has started.

    Guarantees: every worker of the job reaches the same verdict (see the module docstring), and
    a death recorded before the verdict is either the reason for the stop or seen by the failure
    monitors that start afterwards (they read every death recorded since the job began). A job
    without ``--elastic`` never calls :meth:`wait_until_started`: the watch stays open for the
    whole run.
    """

    def __init__(self, store: Store, rank: int, world_size: int, *, exit_status: int,
                 reason: Callable[[WorkerDeath], str],
                 stop: Callable[[str, int], None] = _default_stop) -> None:
        self._store = store
        self._watch_store = store.clone()  # the alert listener's thread reads deaths with it
        self._rank = rank
        self._world_size = world_size
        self._exit_status = exit_status
        self._reason = reason
        self._stop = stop
        self._closed = threading.Event()
        self._deaths_read = threading.Lock()
        self._alerts = AlertListener(store, on_alert=self._check_deaths,
                                     on_lost=lambda error: None, stop_timeout_s=_STOP_TIMEOUT_S,
                                     name="elaswave-startup-watch")

    def __enter__(self) -> StartupWatch:
        self._alerts.start()
        self._check_deaths()  # recorded before the listener started
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._close()

    def _close(self) -> None:
        self._closed.set()
        self._alerts.stop()

    def stop_if_a_rank_died(self, error: BaseException, wait_s: float = 2.0) -> None:
        """Called with ``error`` in hand: if it is a collective's (a peer's death fails gloo's
        operations with a plain ``RuntimeError``), give the watch ``wait_s`` seconds to read a
        death the launcher records, and stop with it. Returns at once if the job has started or
        the error is of another kind, and after ``wait_s`` if no death comes."""
        collective = type(error) is RuntimeError or isinstance(error, torch.distributed.DistError)
        if collective:
            self._closed.wait(wait_s)

    def wait_until_started(self, timeout: timedelta) -> None:
        """Mark this rank ready, wait until every rank is, then stop watching: from here the
        failure monitor handles deaths. Stops the worker instead if a rank dies first; raises
        :class:`~megatron_elaswave.training.recovery.outcomes.CannotContinue` if the others are not all ready within ``timeout``."""
        self._store.set(started_key(self._rank), "")
        everyone = [started_key(rank) for rank in range(self._world_size)]
        verdict: str | None = None

        def decided() -> bool:
            nonlocal verdict
            verdict = self._verdict()
            return verdict is not None or self._store.check(everyone)

        if not wait_until(decided, timeout.total_seconds(), max_pause_s=_POLL_S):
            missing = [r for r in range(self._world_size)
                       if not self._store.check([started_key(r)])]
            raise CannotContinue(f"ranks {missing} did not start within "
                                 f"{timeout.total_seconds():g} s")
        if verdict is None:
            verdict = self._store.compare_set(START_VERDICT_KEY, "", STARTED).decode()
        if verdict != STARTED:
            self._stop(verdict, self._exit_status)
        self._close()

    def _verdict(self) -> str | None:
        if not self._store.check([START_VERDICT_KEY]):
            return None
        return self._store.get(START_VERDICT_KEY).decode()

    def _check_deaths(self) -> None:
        with self._deaths_read:
            if self._closed.is_set() or not (deaths := read_deaths(self._watch_store)):
                return
            verdict = self._watch_store.compare_set(START_VERDICT_KEY, "",
                                                    self._reason(deaths[0])).decode()
            if verdict != STARTED:
                self._watch_store.set(FINISHED_KEY, verdict)  # a replacement waiting to join leaves
                self._stop(verdict, self._exit_status)
            self._closed.set()  # or the job started first: the monitors handle the death
