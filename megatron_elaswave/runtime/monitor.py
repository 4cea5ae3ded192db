"""Failure detection: one :class:`FailureMonitor` per rank, watching the members of its generation.

The monitor is a background thread with its own connection to the job store, and a second one
that polls the job's alert count as its launcher relays it (:mod:`megatron_elaswave.launch.alerts`), so
that a quiet job costs the store two requests per rank and heartbeat, whatever its size. It
notices a failure in any of three ways:

* **Death records.** The launcher records a worker that exits with a non-zero code or is killed
  by a signal within 50 ms (:mod:`megatron_elaswave.launch.store`) and raises an alert; the monitor
  reads the records at its next poll of the alert count (``poll_interval_s``), so every survivor
  knows the dead rank well within a second.
* **Heartbeats.** Every rank bumps a counter in the store every ``heartbeat_interval_s`` and
  reads the counters of the :data:`WATCHED_NEIGHBOURS` members that follow it in the
  generation's order (:func:`~megatron_elaswave.launch.silence.ring_neighbours`); a neighbour whose
  counter has not moved for ``heartbeat_timeout_s`` (a stopped or hung process) is reported
  (``rt/gen<g>/silent/<i>``, and an alert), and every monitor suspects it from the report. A
  neighbour found failed is passed over for the next member, so a run of stopped ranks is
  found one after the other. Counters are compared on the watcher's own clock, so clocks need
  not agree, and a pause of the watcher itself is not counted
  (:mod:`megatron_elaswave.launch.silence`): a job stopped and resumed as a whole goes on without
  excluding anyone.
* **Collective errors.** The training code passes the errors of its collectives (including
  their timeouts) to :meth:`FailureMonitor.report_error`.

The first sign of a failure in a generation sets :attr:`FailureMonitor.failure_detected`, aborts
the collectives of this rank (by default :func:`megatron_elaswave.runtime.world.abort_collectives`, which
also fails the pending collectives of every peer waiting on this rank), and announces the failure
in the store. Every other member's monitor reads the announcement at its alert and does the
same, so no survivor stays blocked in a collective: they all reach
:func:`megatron_elaswave.runtime.agreement.agree`, which decides who failed.

A rank that the decision excludes (it was stopped or too slow, not dead) normally leaves through
:class:`~megatron_elaswave.launch.decisions.Excluded` from its own loop. Its pending collective can
outlive the abort, though (gloo sometimes keeps a resumed rank's all-reduce waiting for the op
timeout although every pair is closed), so the monitor ends the process itself, with the same
message and status, once the committed decision has excluded it for ``exclusion_grace_s``.

Its keys are ``rt/heartbeat/<rank>`` (a counter), ``rt/gen<g>/silent/*`` (silences its
neighbours' watchers reported), ``rt/gen<g>/round`` (the first :class:`FailureNotice` of
generation ``g``; its presence starts the agreement), ``rt/join/<rank>`` (a replacement asks to
join) and ``rt/alerts`` (a count bumped after every death record, silence, announcement and
request to join), named in :mod:`megatron_elaswave.launch.keys`. It reads what every member reads alike
(the deaths, the silences, the announcement, the decision, the requests to join) at an alert,
after a pause of its own, during a failure, and at one beat in :data:`BACKSTOP_BEATS` whatever
the alerts say, in case a writer died before raising its alert.

The lowest survivor of each generation deletes the keys of the generation two before
(:func:`~megatron_elaswave.launch.store.collect_generations`), on a thread of its own, so that a job
that recovers many times does not fill its store.

Ranks are launch ranks (``RANK`` as set by the launcher) throughout: they identify a process for
the whole job, whatever its rank in the process group of the current generation.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from megatron_elaswave.launch.alerts import AlertListener
from megatron_elaswave.launch.decisions import Decision, Excluded
from megatron_elaswave.launch.keys import (
    decision_key,
    heartbeat_key,
    join_key,
    round_key,
)
from megatron_elaswave.launch.silence import Heartbeat, HeartbeatSilence, ring_neighbours
from megatron_elaswave.launch.store import (
    Silence,
    WorkerDeath,
    collect_generations,
    raise_alert,
    read_deaths,
    read_if_set,
    read_silences,
    report_silence,
)
from megatron_elaswave.runtime.world import abort_collectives

if TYPE_CHECKING:
    from torch.distributed import Store

# Causes of a Suspicion or a FailureNotice.
DEATH = "death"
"""The launcher recorded the rank's death."""
HEARTBEAT = "heartbeat"
"""The rank's heartbeat stopped for ``heartbeat_timeout_s``."""
COLLECTIVE_ERROR = "collective_error"
"""A collective of this rank failed or timed out (:meth:`FailureMonitor.report_error`)."""
ANNOUNCED = "announced"
"""Another member announced a failure in the store."""
STORE_ERROR = "store_error"
"""The monitor lost the job store; it stops watching."""

BACKSTOP_BEATS = 10
"""Every this many beats a monitor reads the deaths, silences and announcement even without an
alert, in case their writer died before raising it."""

WATCHED_NEIGHBOURS = 2
"""How many members each monitor watches the heartbeat of, and so how many watch each member:
a member goes unnoticed only if it and every one of its watchers stop at once (it is then
found when its watchers' failure passes the watch on, or in the agreement)."""


@dataclass(frozen=True)
class MonitorConfig:
    """Timing of failure detection and agreement. Every value is in seconds."""

    heartbeat_interval_s: float = 0.5
    """How often each rank bumps its heartbeat, and how often it checks the others'."""
    heartbeat_timeout_s: float = 5.0
    """Heartbeat silence after which a member is declared failed. This bounds how fast a
    stopped or hung process is detected; too small, and a rank starved of CPU is excluded."""
    poll_interval_s: float = 0.05
    """How often the monitor reads the job's alert count (the bound on how late it learns of a
    death record), and how often the agreement looks for its members and its decision."""
    agreement_timeout_s: float = 45.0
    """How long the agreement waits for a member to take part (or for the rank that proposes
    to commit) before treating it as failed. Longer than ``collective_timeout_s``: a survivor
    whose pending collective the abort does not interrupt (gloo sometimes leaves one waiting)
    reaches the agreement at the op timeout, and must still be taken in."""
    collective_timeout_s: float = 30.0
    """Op timeout of the process groups: the backstop for a blocked collective that nothing
    else unblocks (see :mod:`megatron_elaswave.runtime.world`)."""
    exclusion_grace_s: float = 5.0
    """How long a rank that the committed decision excludes has to leave by itself (its loop
    raising :class:`~megatron_elaswave.launch.decisions.Excluded`), from when its monitor reads the
    decision, before the monitor ends the process."""

    @property
    def evidence_timeout_s(self) -> float:
        """How long a rank whose collective failed waits for evidence that a member failed
        before it takes the error for its own: the ranks of a lost node are noticed by their
        silence alone."""
        return self.heartbeat_timeout_s + 2 * self.heartbeat_interval_s

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"{field.name} must be a positive number of seconds, not {value!r}"
                )
        if self.agreement_timeout_s <= self.collective_timeout_s:
            raise ValueError(
                f"agreement_timeout_s ({self.agreement_timeout_s:g}) must exceed "
                f"collective_timeout_s ({self.collective_timeout_s:g}), or a survivor held in a "
                "collective until its op timeout is excluded as failed"
            )
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s:g}) must be at least twice "
                f"heartbeat_interval_s ({self.heartbeat_interval_s:g}), or one late beat "
                "declares a healthy rank failed"
            )


@dataclass(frozen=True)
class Suspicion:
    """Why this process believes a member failed."""

    rank: int
    """Launch rank of the member."""
    cause: str
    """:data:`DEATH` or :data:`HEARTBEAT`."""
    time: float
    """Unix time at which this process concluded it."""
    detail: str
    """What was seen, for the log."""


@dataclass(frozen=True)
class FailureNotice:
    """The first sign of a failure in a generation, as seen by one rank."""

    generation: int
    """Generation in which the failure happened."""
    rank: int
    """Launch rank that noticed it."""
    cause: str
    """:data:`DEATH`, :data:`HEARTBEAT`, :data:`COLLECTIVE_ERROR`, :data:`ANNOUNCED` or
    :data:`STORE_ERROR`."""
    detail: str
    """What was seen, for the log."""
    time: float
    """Unix time at which it was noticed."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


class FailureDetected(RuntimeError):
    """Raised by :meth:`FailureMonitor.raise_if_failed` once a failure has been noticed."""

    def __init__(self, notice: FailureNotice) -> None:
        super().__init__(
            f"failure in generation {notice.generation}: {notice.cause}: {notice.detail}"
        )
        self.notice = notice


class FailureMonitor:
    """Watches the members of the current generation from a background thread.

    Watch generation 0 with ``FailureMonitor(store, rank, Decision.initial(world_size))``;
    after each failure, :func:`~megatron_elaswave.runtime.agreement.agree` on a decision and
    :meth:`advance` to it. ``docs/runtime.md`` shows the whole training loop.

    ``on_failure`` runs once per generation, on whichever thread notices the failure first; it
    must be quick and thread-safe. ``on_excluded`` runs on the monitor's thread if this rank is
    still running ``exclusion_grace_s`` after a decision excluded it (default: :func:`leave_job`).
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        decision: Decision,
        config: MonitorConfig = MonitorConfig(),
        *,
        on_failure: Callable[[], None] = abort_collectives,
        on_excluded: Callable[[Excluded], None] | None = None,
        job_size: int | None = None,
        skip_recorded_deaths: bool = False,
    ) -> None:
        """Watch the survivors of ``decision`` (the members of its generation) from
        :meth:`start` on; ``rank`` is this process's launch rank.

        ``job_size`` (default: one more than the highest member) bounds the launch ranks whose
        requests to join are watched. A rank that joins a running job passes
        ``skip_recorded_deaths``: deaths recorded before it started were the members' business.
        """
        self.rank = rank
        self.config = config
        self.failure_detected = threading.Event()
        """Set from the first sign of a failure until :meth:`advance`."""
        # A connection of its own, so that a blocking store call elsewhere never delays detection.
        self._store = store.clone()
        self._heartbeat = Heartbeat(heartbeat_key(rank))
        self._on_failure = on_failure
        self._on_excluded = on_excluded or leave_job
        self._committed: tuple[int, Decision, float] | None = None
        """``(generation, decision that ends it, monotonic time it was first read)``."""
        self._left = False
        self._store_lost: str | None = None
        self._lock = threading.Lock()
        self._generation = decision.generation
        self._members = decision.survivors
        self._failure: FailureNotice | None = None
        self._suspects: dict[int, Suspicion] = {}
        self._dead: dict[int, tuple[WorkerDeath, float]] = {}
        """The recorded death of each rank's current process, as read so far, and when it was
        read."""
        self._death_cursor = len(read_deaths(self._store)) if skip_recorded_deaths else 0
        self._silence_cursor = 0
        """The silences of the current generation read so far."""
        self._collector: threading.Thread | None = None
        self._wake = threading.Event()
        """Set by an alert, a new generation or :meth:`stop`: the loop reads deaths and the
        announcement at once instead of at the next beat."""
        self._job_size = max(decision.survivors) + 1 if job_size is None else job_size
        self._waiting: frozenset[int] = frozenset()
        self._beats = self._fresh_beats()
        self._beat_keys_made: set[int] = set()
        """Neighbours whose heartbeat counter exists in the store (one ``multi_get`` reads
        them)."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"elaswave-monitor-{rank}", daemon=True
        )
        self._alerts = AlertListener(store, on_alert=self._wake.set, on_lost=self._lose_store,
                                     stop_timeout_s=config.heartbeat_timeout_s,
                                     name=f"elaswave-alerts-{rank}",
                                     poll_interval_s=config.poll_interval_s)

    # --- what the training loop calls ---------------------------------------------------------

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    @property
    def members(self) -> tuple[int, ...]:
        """Launch ranks of the current generation, in their group-rank order."""
        with self._lock:
            return self._members

    @property
    def failure(self) -> FailureNotice | None:
        """The first sign of a failure in the current generation, if any."""
        with self._lock:
            return self._failure

    def suspects(self) -> dict[int, Suspicion]:
        """Members of the current generation this process believes failed."""
        with self._lock:
            return dict(self._suspects)

    @property
    def job_size(self) -> int:
        """Launch ranks are ``0 .. job_size - 1``."""
        return self._job_size

    def recorded_deaths(self) -> tuple[dict[int, WorkerDeath], int]:
        """The death recorded for each rank's current process, as read so far, and the index of
        the first death record not read yet. A rank's records from before it last joined are
        not among them: they belong to a process that is gone."""
        with self._lock:
            return {rank: death for rank, (death, _) in self._dead.items()}, self._death_cursor

    def waiting_to_join(self) -> frozenset[int]:
        """Launch ranks, not members, that asked to join the job (as of the last heartbeat
        check)."""
        with self._lock:
            return self._waiting

    def raise_if_failed(self) -> None:
        """Raise :class:`FailureDetected` once a failure has been noticed in this generation."""
        notice = self.failure
        if notice is not None:
            raise FailureDetected(notice)

    def explains(self, error: BaseException) -> bool:
        """Whether a failure in this generation accounts for ``error``: waits up to
        :attr:`MonitorConfig.evidence_timeout_s` for one to be noticed (a collective that a
        dying peer breaks often fails before the launcher's death record arrives). ``False``:
        nobody failed, the error is this rank's own."""
        return self.failure_detected.wait(self.config.evidence_timeout_s)

    @property
    def store_lost(self) -> str | None:
        """Why the monitor lost the job store (its host is gone), if it did; it watches no more."""
        return self._store_lost

    def report_error(self, error: BaseException) -> None:
        """Report a failed or timed-out collective: aborts and announces like any failure."""
        self._trigger(COLLECTIVE_ERROR, f"{type(error).__name__}: {error}")

    def advance(self, decision: Decision) -> None:
        """Watch the survivors of ``decision`` from now on, as its generation. The deaths
        recorded for ranks that ``decision`` takes back in are forgotten."""
        if self.rank not in decision.survivors:
            raise ValueError(f"rank {self.rank} is not a survivor of {decision}")
        with self._lock:
            if decision.generation <= self._generation:
                raise ValueError(
                    f"generation {decision.generation} does not follow {self._generation}"
                )
            self._generation = decision.generation
            self._members = decision.survivors
            self._failure = None
            self._suspects = {}
            self._beats = self._fresh_beats()
            self._silence_cursor = 0
            self._waiting = frozenset()
            for rank in decision.joined:
                self._dead.pop(rank, None)
        self.failure_detected.clear()
        self._wake.set()  # the new generation's round may be announced already
        if decision.survivors[0] == self.rank and decision.generation >= 2:
            self._collect(below=decision.generation - 1)

    def _collect(self, below: int) -> None:
        """Delete the keys of the generations below ``below``, on a thread (one at a time): a
        collection left undone, by a rank that died, is done by the next one."""
        if self._collector is not None and self._collector.is_alive():
            return
        store = self._store.clone()

        def collect() -> None:
            try:
                collect_generations(store, below)
            except RuntimeError:
                pass  # the store is lost: the monitor says so

        self._collector = threading.Thread(target=collect, name=f"elaswave-collect-{self.rank}",
                                           daemon=True)
        self._collector.start()

    def start(self) -> None:
        """Start watching (once; later calls do nothing)."""
        if self._thread.is_alive() or self._stopping.is_set():
            return
        self._beat()  # visible before the first check of any peer
        self._alerts.start()
        self._thread.start()

    def stop(self) -> None:
        """Stop watching; returns once the monitor's threads have ended (the one that waits
        for alerts within ``heartbeat_timeout_s`` if the store does not answer)."""
        self._stopping.set()
        self._wake.set()
        self._alerts.stop()
        if self._thread.is_alive():
            self._thread.join()
        if self._collector is not None:
            self._collector.join(self.config.heartbeat_timeout_s)

    def __enter__(self) -> FailureMonitor:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- the watching thread -------------------------------------------------------------------

    def _run(self) -> None:
        next_beat, last_pass, beats = 0.0, time.monotonic(), 0
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                paused = now - last_pass > 2 * self.config.heartbeat_interval_s
                last_pass = now
                beating = now >= next_beat
                if beating:
                    next_beat, beats = now + self.config.heartbeat_interval_s, beats + 1
                # Cleared before reading, so that an alert raised meanwhile wakes the next pass.
                alerted = self._wake.is_set()
                self._wake.clear()
                excluded = False
                if (alerted or paused or self.failure is not None
                        or (beating and beats % BACKSTOP_BEATS == 1)):
                    self._read_shared_state()
                    # Only a decision can exclude this rank, and one comes after an alert or
                    # while this rank was paused: read it then, before writing anything.
                    excluded = self.excluded()
                    if not excluded:
                        self._check_join_requests()
                if beating and not excluded:
                    self._beat()
                    self._check_heartbeats()
                self._suspect_dead_members()
                self._check_exclusion()
                self._wake.wait(max(0.0, next_beat - time.monotonic()))
        except RuntimeError as error:  # torch's store errors
            self._lose_store(error)

    def _read_shared_state(self) -> None:
        """What every member reads alike: the deaths, the silences, the announcement."""
        self._read_deaths()
        self._read_silences()
        self._check_announcement()

    def _lose_store(self, error: RuntimeError) -> None:
        self._store_lost = str(error).splitlines()[0] if str(error) else type(error).__name__
        self._trigger(STORE_ERROR, str(error), announce=False)

    def _beat(self) -> None:
        self._heartbeat.beat(self._store)

    def _fresh_beats(self) -> HeartbeatSilence:
        """The heartbeat silence of this rank's neighbours, from now on."""
        return HeartbeatSilence(ring_neighbours(self._members, self.rank, WATCHED_NEIGHBOURS),
                                interval_s=self.config.heartbeat_interval_s,
                                timeout_s=self.config.heartbeat_timeout_s, now=time.monotonic())

    def _check_heartbeats(self) -> None:
        with self._lock:
            generation, beats = self._generation, self._beats
            # A neighbour found failed is watched no more: the next member is, from now on.
            wanted = ring_neighbours(self._members, self.rank, WATCHED_NEIGHBOURS,
                                     skip=self._suspects)
            for rank in set(beats.peers) - set(wanted):
                beats.forget(rank)
            for rank in wanted:
                if rank not in beats.peers:
                    beats.add(rank)
            peers = beats.peers
        for rank in set(peers) - self._beat_keys_made:  # a multi_get waits for missing keys
            self._store.add(heartbeat_key(rank), 0)
            self._beat_keys_made.add(rank)
        values = self._store.multi_get([heartbeat_key(rank) for rank in peers]) if peers else []
        with self._lock:
            if beats is not self._beats:
                return  # the generation changed meanwhile
            silent = beats.read(dict(zip(peers, map(int, values))), time.monotonic())
        for rank, silent_s in silent.items():
            silence = Silence(generation, rank, self.rank, silent_s, time.time())
            with self._lock:
                reported = rank in self._suspects
            if not reported:  # before the announcement: the others read both at one alert
                report_silence(self._store, silence)
            self._suspect(self._suspicion(silence), generation=generation)

    @staticmethod
    def _suspicion(silence: Silence) -> Suspicion:
        return Suspicion(silence.rank, HEARTBEAT, silence.time,
                         f"no heartbeat for {silence.silent_s:.1f} s")

    def _read_silences(self) -> None:
        """Suspect the members that their watchers reported silent in this generation."""
        generation = self.generation
        silences = read_silences(self._store, generation, start=self._silence_cursor)
        with self._lock:
            if generation != self._generation:
                return
            self._silence_cursor += len(silences)
        for silence in silences:
            self._suspect(self._suspicion(silence), generation=generation)

    def _check_join_requests(self) -> None:
        """Look for ranks that ask to join (a request raises an alert): one key per missing
        rank."""
        members = self.members
        waiting = frozenset(rank for rank in range(self._job_size)
                            if rank not in members and self._store.check([join_key(rank)]))
        with self._lock:
            if self._members == members:  # not a generation behind
                self._waiting = waiting

    def _read_deaths(self) -> None:
        deaths, read_at = read_deaths(self._store, start=self._death_cursor), time.time()
        with self._lock:
            self._death_cursor += len(deaths)
            for death in deaths:
                self._dead.setdefault(death.rank, (death, read_at))

    def _suspect_dead_members(self) -> None:
        """Suspect every member whose death was read, this generation's or an earlier one's (a
        death read during an agreement that kept its rank)."""
        with self._lock:
            dead = [self._dead[rank] for rank in self._members if rank in self._dead]
        for death, read_at in dead:
            self._suspect(Suspicion(death.rank, DEATH, read_at, death.describe()))

    def _check_announcement(self) -> None:
        generation = self.generation
        if self.failure is not None:
            return
        notice = read_if_set(self._store, round_key(generation))
        if notice is not None:
            self._trigger(ANNOUNCED, notice.decode(), generation=generation)

    def _decision(self) -> tuple[Decision, float] | None:
        """The committed decision that ends the current generation and when this monitor first
        read it, if there is one."""
        generation = self.generation
        if self._committed is None or self._committed[0] != generation:
            raw = read_if_set(self._store, decision_key(generation))
            if raw is None:
                return None
            self._committed = (generation, Decision.from_json(raw), time.monotonic())
        return self._committed[1:]

    def excluded(self) -> bool:
        """Whether the others decided this rank failed: it then writes nothing more to the
        store (no heartbeat, no announcement), whatever its loop is still doing."""
        committed = self._decision()
        return committed is not None and self.rank not in committed[0].survivors

    def _check_exclusion(self) -> None:
        """Once a failure is noticed: end this rank if the committed decision has excluded it
        for ``exclusion_grace_s`` (a survivor's loop advances the monitor well before that)."""
        if self.failure is None or self._left or not self.excluded():
            return
        decision, read_at = self._decision()
        if time.monotonic() - read_at > self.config.exclusion_grace_s:
            self._left = True
            self._on_excluded(Excluded(self.rank, decision))

    # --- reacting ------------------------------------------------------------------------------

    def _suspect(self, suspicion: Suspicion, *, generation: int | None = None) -> None:
        """Record ``suspicion`` if its rank is a member not suspected yet; ``generation``, when
        given, is the one the evidence belongs to: evidence about a generation that has since
        ended is dropped."""
        with self._lock:
            if (
                generation not in (None, self._generation)
                or suspicion.rank not in self._members
                or suspicion.rank in self._suspects
                or suspicion.rank == self.rank  # a launcher that lost our node kills us anyway
            ):
                return
            self._suspects[suspicion.rank] = suspicion
        self._trigger(suspicion.cause, f"rank {suspicion.rank}: {suspicion.detail}")

    def _trigger(
        self, cause: str, detail: str, *, announce: bool = True, generation: int | None = None
    ) -> None:
        """Abort and announce, once per generation (``generation`` as in :meth:`_suspect`)."""
        with self._lock:
            if self._failure is not None or generation not in (None, self._generation):
                return
            notice = FailureNotice(self._generation, self.rank, cause, detail, time.time())
            self._failure = notice
        self.failure_detected.set()
        self._on_failure()
        if announce and not self.excluded():
            announced = notice.to_json().encode()
            # Only the first announcer alerts: a later notice changes nothing anyone reads, and
            # an alert makes every monitor read the shared state again.
            if self._store.compare_set(round_key(notice.generation), "", announced) == announced:
                raise_alert(self._store)


def leave_job(excluded: Excluded) -> None:
    """End the process with ``excluded``'s message and status 1, as its loop would have."""
    sys.stdout.flush()
    sys.stderr.write(f"{excluded} (its training loop had not left)\n")
    sys.stderr.flush()
    os._exit(1)
