"""The failure monitor and the agreement: detection, abort, one decision, the next generation.

The multi-process tests run four workers of ``tests/workers/monitor_train.py`` (a loop of
compute and a gloo all-reduce) under ``elaswave-run``, fail some of them from the test, and
compare what the survivors wrote.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from harness import free_port, launch, wait_until, worker_script
from hypothesis import given
from hypothesis import strategies as st

from megatron_elaswave.launch.decisions import Decision
from megatron_elaswave.launch.keys import (
    ALERT_COUNT_KEY,
    decision_key,
    heartbeat_key,
    joined_key,
    round_key,
)
from megatron_elaswave.launch.silence import HeartbeatSilence, ring_neighbours
from megatron_elaswave.launch.store import (
    Silence,
    WorkerDeath,
    collect_generations,
    raise_alert,
    read_silences,
    record_death,
    report_silence,
)
from megatron_elaswave.runtime.agreement import AGREEMENT_DELAY_ENV
from megatron_elaswave.runtime.monitor import (
    ANNOUNCED,
    HEARTBEAT,
    FailureMonitor,
    FailureNotice,
    MonitorConfig,
)

multiprocess = pytest.mark.multiprocess

WORLD_SIZE = 4
DETECTION_BOUND_S = 1.0
"""A recorded death must be noticed, and the loop unblocked, within this many seconds."""
OP_TIMEOUT_S = 15.0
"""The op timeout of the worker's groups (``TIMEOUT`` in ``workers/monitor_train.py``)."""


# --- pure parts -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"heartbeat_interval_s": 0}, "heartbeat_interval_s must be a positive"),
        ({"poll_interval_s": -1.0}, "poll_interval_s must be a positive"),
        ({"agreement_timeout_s": float("inf")}, "agreement_timeout_s must be a positive"),
        ({"collective_timeout_s": "30"}, "collective_timeout_s must be a positive"),
        ({"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 1.5}, "at least twice"),
        ({"agreement_timeout_s": 30.0, "collective_timeout_s": 30.0}, "must exceed collective"),
    ],
)
def test_monitor_config_rejects_bad_timing(fields, message):
    with pytest.raises(ValueError, match=message):
        MonitorConfig(**fields)


def test_heartbeat_silence_reports_a_stopped_peer_after_the_timeout_of_regular_reads():
    silence = HeartbeatSilence([1, 2], interval_s=0.5, timeout_s=2.0, now=0.0)
    reports = [silence.read({1: 0, 2: step}, now=0.5 * step) for step in range(1, 8)]
    # Rank 1's counter was first read at 0.5 s; from there 2 s of reads is four more, the fifth
    # exceeds the timeout.
    assert [report for report in reports if report] == [{1: 2.5}, {1: 3.0}]
    assert reports[5] == {1: 2.5}


def test_heartbeat_silence_does_not_count_the_watchers_own_pause():
    silence = HeartbeatSilence([1], interval_s=0.5, timeout_s=2.0, now=0.0)
    assert silence.read({1: 7}, now=0.5) == {}
    # The watcher was stopped for 60 s: the peer's unchanged counter counts for two intervals.
    assert silence.read({1: 7}, now=60.5) == {}
    assert silence.read({1: 7}, now=61.0) == {}
    assert silence.read({1: 8}, now=61.5) == {}  # it beat: its silence starts again
    assert silence.read({1: 8}, now=62.0) == {}
    # A peer that really stopped is still reported, by reads at the interval.
    assert [silence.read({1: 8}, now=62.0 + 0.5 * step) for step in range(1, 5)] == [
        {}, {}, {}, {1: 2.5}]


def test_heartbeat_silence_watches_peers_added_and_forgets_those_settled():
    silence = HeartbeatSilence([], interval_s=0.25, timeout_s=1.0, now=0.0)
    silence.add(3)
    silence.add(1)
    assert silence.peers == [3, 1]
    silence.forget(3)
    silence.forget(5)  # not watched: nothing to do
    assert silence.peers == [1]
    # A watched peer whose counter was not read counts as silent; an unknown one is ignored.
    reports = [silence.read({9: step}, now=0.25 * step) for step in range(1, 6)]
    assert reports[-1] == {1: 1.25} and not any(reports[:-1])
    with pytest.raises(ValueError, match="at least twice"):
        HeartbeatSilence([1], interval_s=1.0, timeout_s=1.5, now=0.0)


@given(
    st.lists(st.integers(0, 1000), min_size=1, max_size=20, unique=True),
    st.integers(0, 5),
)
def test_decision_numbers_survivors_in_order_and_round_trips(survivors, generation):
    decision = Decision(generation, tuple(survivors), failed=(1001,))
    assert [decision.new_rank(rank) for rank in survivors] == list(range(len(survivors)))
    assert decision.new_ranks == {rank: i for i, rank in enumerate(survivors)}
    assert Decision.from_json(decision.to_json()) == decision


EXCLUSION_GRACE_S = 0.5
STUCK_EXCLUDED_RANK = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
from megatron_elaswave.launch.decisions import Decision
from megatron_elaswave.runtime.monitor import FailureMonitor, MonitorConfig
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=10))
config = MonitorConfig(heartbeat_timeout_s=5.0, exclusion_grace_s=float(sys.argv[2]))
with FailureMonitor(store, 2, Decision.initial(3), config, on_failure=lambda: None) as monitor:
    monitor.report_error(RuntimeError("all-reduce: connection closed by peer"))
    store.set("test/noticed", "")
    time.sleep(60)  # a loop stuck in a collective of the old generation
"""


@pytest.mark.parametrize("rank, excluded", [(2, True), (0, False)], ids=["excluded", "survivor"])
def test_the_monitor_ends_an_excluded_rank_whose_loop_does_not_leave(store, rank, excluded):
    config = MonitorConfig(heartbeat_timeout_s=5.0, exclusion_grace_s=EXCLUSION_GRACE_S)
    ended = []
    with FailureMonitor(store, rank, Decision.initial(3), config, on_failure=lambda: None,
                        on_excluded=lambda exclusion: ended.append((time.monotonic(), exclusion))
                        ) as monitor:
        monitor.report_error(RuntimeError("all-reduce: connection closed by peer"))
        decision = Decision(1, (0, 1), (2,))
        store.set(decision_key(0), decision.to_json())
        committed_at = time.monotonic()
        if excluded:
            wait_until(lambda: ended, EXCLUSION_GRACE_S + 5, "the monitor to end the rank")
        else:
            time.sleep(4 * EXCLUSION_GRACE_S)
    if not excluded:
        assert ended == []
        return
    ((ended_at, exclusion),) = ended
    assert ended_at - committed_at >= EXCLUSION_GRACE_S  # its loop had the grace to leave first
    assert exclusion.decision == decision
    assert str(exclusion).startswith("rank 2 was excluded from the job")


@multiprocess
def test_an_excluded_process_stuck_in_its_loop_exits_with_the_exclusion_message(store):
    port = store.port
    process = subprocess.Popen([sys.executable, "-c", STUCK_EXCLUDED_RANK, str(port),
                                str(EXCLUSION_GRACE_S)], stderr=subprocess.PIPE, text=True)
    try:
        store.wait(["test/noticed"], timedelta(seconds=30))
        store.set(decision_key(0), Decision(1, (0, 1), (2,)).to_json())
        _, stderr = process.communicate(timeout=10)
    finally:
        process.kill()
    assert process.returncode == 1, stderr
    assert "rank 2 was excluded from the job" in stderr and "Traceback" not in stderr, stderr


class RecordingStore:
    """A store whose clones log every call (the monitor watches through a clone)."""

    def __init__(self, store, calls: list | None = None) -> None:
        self._store, self.calls = store, [] if calls is None else calls

    def clone(self) -> RecordingStore:
        return RecordingStore(self._store.clone(), self.calls)

    def __getattr__(self, name: str):
        method = getattr(self._store, name)

        def call(*args):
            self.calls.append((time.monotonic(), name, args))
            return method(*args)
        return call


def test_a_quiet_monitor_only_polls_the_alert_count_between_beats_and_reads_a_death_at_once(
        store):
    beat_s = 2.0
    config = MonitorConfig(heartbeat_interval_s=beat_s, heartbeat_timeout_s=10.0)
    recording = RecordingStore(store)
    with FailureMonitor(recording, 0, Decision.initial(3), config,
                        on_failure=lambda: None) as monitor:
        started = time.monotonic()
        time.sleep(beat_s / 2)  # the one beat at the start, then nothing until the next
        quiet = {(name, args) for at, name, args in recording.calls if at > started + 0.2}
        assert quiet == {("add", (ALERT_COUNT_KEY, 0))}  # one key, however large the job
        died_at = time.monotonic()
        record_death(store, WorkerDeath(rank=2, local_rank=2, node_rank=0, pid=12, exit_code=None,
                                        signal="SIGKILL", cause="signal", time=time.time()))
        wait_until(lambda: monitor.failure is not None, 5, "the death to be noticed")
        assert time.monotonic() - died_at < 0.2  # at its alert, not at the next beat
        assert list(monitor.suspects()) == [2]
        stopping_at = time.monotonic()
    assert time.monotonic() - stopping_at < 1.0
    assert not [t for t in threading.enumerate()
                if t.name in ("elaswave-monitor-0", "elaswave-alerts-0")]


def test_an_alert_writes_one_key_whatever_the_size_of_the_job(store):
    before = store.num_keys()
    raise_alert(store)
    raise_alert(store)
    assert store.num_keys() - before <= 1 and store.add(ALERT_COUNT_KEY, 0) == 2


def test_each_member_watches_the_next_ones_and_passes_over_those_found_failed():
    members = (0, 2, 3, 5, 7)
    assert ring_neighbours(members, 0, 2) == [2, 3]
    assert ring_neighbours(members, 5, 2) == [7, 0]
    assert ring_neighbours(members, 7, 2, skip={0, 2}) == [3, 5]
    assert ring_neighbours((4, 9), 9, 2) == [4]
    watchers = {rank: ring_neighbours(members, rank, 2) for rank in members}
    assert all(sum(rank in watched for watched in watchers.values()) == 2 for rank in members)


def test_a_monitor_reads_its_neighbours_heartbeats_and_reports_a_silent_one(store):
    """Rank 0 of six watches ranks 1 and 2 only; rank 2 falls silent: rank 0 reports it for
    every monitor, and watches rank 3 in its place."""
    config = MonitorConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)
    recording = RecordingStore(store)
    with FailureMonitor(recording, 0, Decision.initial(6), config,
                        on_failure=lambda: None) as monitor:
        deadline = time.monotonic() + 5
        while monitor.failure is None and time.monotonic() < deadline:
            store.add(heartbeat_key(1), 1)
            time.sleep(0.05)
        assert list(monitor.suspects()) == [2]
        assert monitor.suspects()[2].cause == HEARTBEAT
        [silence] = read_silences(store, 0)
        assert (silence.rank, silence.watcher) == (2, 0) and silence.silent_s > 0.5
        time.sleep(0.3)  # a few beats more, watching rank 3 in rank 2's place
    read = {key for _, name, args in recording.calls if name == "multi_get" for key in args[0]}
    assert read == {heartbeat_key(rank) for rank in (1, 2, 3)}


def test_a_silence_its_watcher_reported_is_suspected_by_every_monitor(store):
    config = MonitorConfig(heartbeat_interval_s=2.0, heartbeat_timeout_s=10.0)
    with FailureMonitor(store, 3, Decision.initial(6), config, on_failure=lambda: None) as monitor:
        time.sleep(0.2)
        reported_at = time.monotonic()
        report_silence(store, Silence(0, 1, 0, 2.5, time.time()))
        wait_until(lambda: monitor.failure is not None, 5, "the silence to be read")
        assert time.monotonic() - reported_at < 0.5  # at its alert, not at the next beat
        suspicion = monitor.suspects()[1]
        assert (suspicion.cause, suspicion.detail) == (HEARTBEAT, "no heartbeat for 2.5 s")
        report_silence(store, Silence(1, 4, 0, 2.5, time.time()))  # a later generation's
        time.sleep(0.3)
        assert list(monitor.suspects()) == [1]


def test_the_keys_of_generations_two_behind_are_deleted_but_their_decisions(store):
    for generation in range(4):
        store.set(round_key(generation), "notice")
        store.set(joined_key(generation, 1), "")
        store.set(decision_key(generation), "decision")
        store.set(f"gen{generation}//0", "torch's rendezvous")
    store.set("elaswave/nodes/0", "node")
    assert collect_generations(store, below=2) == 6
    left = set(store.list_keys())
    assert {decision_key(0), decision_key(1), "elaswave/nodes/0"} <= left
    assert not any(key.startswith(("rt/gen0/", "rt/gen1/", "gen0/", "gen1/"))
                   for key in left - {decision_key(0), decision_key(1)})
    assert {round_key(3), joined_key(2, 1), "gen3//0"} <= left
    assert collect_generations(store, below=2) == 0  # done already


def test_only_the_first_announcer_of_a_failure_raises_an_alert(store):
    # Every alert makes every monitor read the shared state again: a notice per survivor, each
    # with its alert, made an agreement's store traffic grow with the square of the survivors.
    config = MonitorConfig(heartbeat_interval_s=2.0, heartbeat_timeout_s=10.0)
    monitors = [FailureMonitor(store, rank, Decision.initial(3), config, on_failure=lambda: None)
                for rank in (0, 1)]
    for monitor in monitors:
        monitor.start()
    try:
        before = store.add(ALERT_COUNT_KEY, 0)
        monitors[0].report_error(RuntimeError("Connection closed by peer"))
        wait_until(lambda: monitors[1].failure is not None, 5, "the announcement to be read")
        monitors[1].report_error(RuntimeError("Connection reset by peer"))
        assert monitors[1].failure.cause == ANNOUNCED
        assert store.add(ALERT_COUNT_KEY, 0) - before == 1
        assert FailureNotice(**json.loads(store.get(round_key(0)))).rank == 0
    finally:
        for monitor in monitors:
            monitor.stop()


def test_an_announcement_whose_writer_died_before_bumping_the_alerts_is_read_at_a_beat(store):
    config = MonitorConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=10.0)
    with FailureMonitor(store, 0, Decision.initial(3), config, on_failure=lambda: None) as monitor:
        time.sleep(0.3)
        notice = FailureNotice(0, 1, HEARTBEAT, "rank 2: no heartbeat for 9.0 s", time.time())
        store.set(round_key(0), notice.to_json())  # and no bump of the alert count
        wait_until(lambda: monitor.failure is not None, 5, "the announcement to be read")
        assert monitor.failure.cause == ANNOUNCED and "rank 2: no heartbeat" in monitor.failure.detail


# --- helpers for the multi-process tests ----------------------------------------------------


def start_job(out_dir: Path, victims: set[int], *extra: str, env: dict | None = None):
    script = [worker_script("monitor_train.py"), str(out_dir), ",".join(map(str, victims))]
    return launch([*script, *extra], nproc_per_node=WORLD_SIZE, master_port=free_port(), env=env)


def wait_until_training(job) -> None:
    store = job.store()
    keys = [f"test/training/{rank}" for rank in range(WORLD_SIZE)]
    job.wait_for(lambda: store.check(keys), 40, "all workers to train")


def fail(job, rank: int, sig: int = signal.SIGKILL) -> float:
    """Send ``sig`` to ``rank``'s worker; returns the time it was sent."""
    sent_at = time.time()
    job.kill_worker(rank, sig)
    return sent_at


def survivor_reports(job, out_dir: Path, victims: set[int]) -> dict[int, dict]:
    survivors = set(range(WORLD_SIZE)) - victims
    paths = {rank: out_dir / f"rank{rank}.json" for rank in survivors}
    job.wait_for(lambda: all(p.exists() for p in paths.values()), 40, "the survivors' reports")
    return {rank: json.loads(path.read_text()) for rank, path in paths.items()}


def death_of(job, rank: int, timeout: float = 10) -> WorkerDeath:
    job.wait_for(lambda: rank in {d.rank for d in job.deaths()}, timeout,
                 f"the death of rank {rank}")
    return next(death for death in job.deaths() if death.rank == rank)


def check_outcome(reports: dict[int, dict], victims: set[int],
                  cause: str = "killed by SIGKILL") -> list[dict]:
    """Every survivor went through the same decisions, each gives a reason starting with
    ``cause`` for every rank it excludes, the last one excludes exactly the victims, and its group all-reduced over exactly
    the survivors. Returns the decisions' memberships."""
    decisions = {
        rank: [r["decision"] for r in report["rounds"]] for rank, report in reports.items()
    }
    first = next(iter(decisions.values()))
    assert all(d == first for d in decisions.values()), decisions
    for decision in first:
        causes = dict(decision["causes"])
        assert set(causes) == set(decision["failed"]), decision
        assert all(reason.startswith(cause) for reason in causes.values()), decision
        assert 0 < decision["failed_at"] <= time.time(), decision
    survivors = sorted(set(range(WORLD_SIZE)) - victims)
    assert {rank for d in first for rank in d["failed"]} == victims
    assert first[-1]["survivors"] == survivors
    for rank, report in reports.items():
        check = report["rounds"][-1]["check"]
        assert check == {
            "world_size": len(survivors),
            "rank": survivors.index(rank),
            "sum": sum(survivors),
        }
    membership = ("generation", "survivors", "failed", "joined")
    return [{field: decision[field] for field in membership} for decision in first]


def identified_at(report: dict, rank: int) -> float:
    """When this survivor first held ``rank`` failed: its monitor's suspicion, or the decision
    that named it, if that came first (another survivor proposed before this monitor looked)."""
    return min(
        [r["suspects"][str(rank)]["time"] for r in report["rounds"] if str(rank) in r["suspects"]]
        + [r["decided_at"] for r in report["rounds"] if rank in r["decision"]["failed"]]
    )


def log_latencies(what: str, latencies: list[float]) -> None:
    print(f"{what}: " + ", ".join(f"{latency * 1000:.0f} ms" for latency in sorted(latencies)))


# --- multi-process tests --------------------------------------------------------------------


@multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [2, 0], ids=["rank2", "world_rank0"])
def test_sigkill_during_training_is_survived(tmp_path, victim):
    """A worker killed during compute or inside the all-reduce (the loop does both): every
    survivor notices within a second of the death record, none stays blocked, all reach the
    same decision and all-reduce on the new group. Rank 0 of the world is no special case."""
    with start_job(tmp_path, {victim}) as job:
        wait_until_training(job)
        killed_at = fail(job, victim)
        reports = survivor_reports(job, tmp_path, {victim})
        death = death_of(job, victim)
        returncode, output = job.wait(timeout=30)
    assert returncode == 0, output
    assert check_outcome(reports, {victim}) == [
        {
            "generation": 1,
            "survivors": sorted(set(range(WORLD_SIZE)) - {victim}),
            "failed": [victim],
            "joined": [],
        }
    ]
    for rank, report in reports.items():
        (round_,) = report["rounds"]
        assert round_["notice"]["time"] - death.time < DETECTION_BOUND_S, (rank, round_)
        assert round_["unblocked_at"] - death.time < DETECTION_BOUND_S, (rank, round_)
        assert identified_at(report, victim) - death.time < DETECTION_BOUND_S, (rank, round_)
    log_latencies(
        "kill -> noticed", [r["rounds"][0]["notice"]["time"] - killed_at for r in reports.values()]
    )
    log_latencies(
        "death record -> identified",
        [identified_at(r, victim) - death.time for r in reports.values()],
    )


@multiprocess
@pytest.mark.timeout(60)
def test_two_simultaneous_sigkills_are_survived(tmp_path):
    victims = {1, 2}
    with start_job(tmp_path, victims) as job:
        wait_until_training(job)
        for victim in sorted(victims):
            fail(job, victim)
        reports = survivor_reports(job, tmp_path, victims)
        deaths = {victim: death_of(job, victim) for victim in victims}
        returncode, output = job.wait(timeout=30)
    assert returncode == 0, output
    decisions = check_outcome(reports, victims)
    assert len(decisions) <= 2  # at most one extra round if the second death was recorded late
    for report in reports.values():
        for victim, death in deaths.items():
            assert identified_at(report, victim) - death.time < DETECTION_BOUND_S, report


@multiprocess
@pytest.mark.timeout(60)
def test_stopped_rank_is_detected_by_heartbeat_and_leaves_when_resumed(tmp_path):
    """SIGSTOP leaves the victim's connections open, so only the heartbeat timeout detects it
    and only the abort unblocks the survivors that wait on it in the all-reduce."""
    victim, heartbeat_timeout_s = 2, 2.0
    with start_job(
        tmp_path, {victim}, f"--heartbeat-timeout={heartbeat_timeout_s}", "--hold"
    ) as job:
        wait_until_training(job)
        stopped_at = fail(job, victim, signal.SIGSTOP)
        reports = survivor_reports(job, tmp_path, {victim})
        store = job.store()
        beats = store.add(heartbeat_key(victim), 0)
        job.kill_worker(victim, signal.SIGCONT)
        # A resumed rank usually leaves at once; about one resume in thirteen finds its gloo pairs
        # closed by the survivors and its all-reduce waiting for the op timeout: then its monitor
        # ends it after the exclusion grace (5 s), well before that timeout.
        death = death_of(job, victim, timeout=OP_TIMEOUT_S - 2)
        # Excluded, it wrote nothing after it resumed: no heartbeat, no place in the agreement.
        assert store.add(heartbeat_key(victim), 0) == beats
        assert not store.check([joined_key(0, victim)])
        job.store().set("test/release", "")
        returncode, output = job.wait(timeout=30)
    assert returncode == 0, output
    assert check_outcome(reports, {victim}, "no heartbeat for ")[0]["generation"] == 1
    latencies = []
    for rank, report in reports.items():
        (round_,) = report["rounds"]
        notice = round_["notice"]
        latencies.append(notice["time"] - stopped_at)
        # Detected by the heartbeat path: not before its timeout, and long before the op timeout
        # (the slack absorbs a loaded 2-core machine).
        assert heartbeat_timeout_s - 0.5 < latencies[-1] < heartbeat_timeout_s + 5.0, (rank, notice)
        assert round_["unblocked_at"] - notice["time"] < DETECTION_BOUND_S, (rank, round_)
        # A survivor told by another (announcement, or its pairs closed by that one's abort) may
        # get the decision before its own heartbeat check fires; whoever suspected, suspected this.
        suspicion = round_["suspects"].get(str(victim))
        assert suspicion is None or suspicion["cause"] == HEARTBEAT, (rank, round_)
        assert round_["suspects"].keys() <= {str(victim)}, (rank, round_)
    notices = [report["rounds"][0]["notice"] for report in reports.values()]
    assert any(
        n["cause"] == HEARTBEAT and n["detail"].startswith(f"rank {victim}: no heartbeat")
        for n in notices
    ), notices
    log_latencies("stop -> noticed", latencies)
    assert (death.exit_code, death.signal) == (1, None)
    assert f"rank {victim} was excluded from the job" in output


@multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("second", [1, 0], ids=["follower", "proposer"])
def test_failure_during_agreement_enlarges_the_decision(tmp_path, second):
    """The proposer pauses before committing (``ELASWAVE_AGREEMENT_DELAY_S``) and the test
    kills a second rank meanwhile: a follower, or the proposer itself (the world's rank 0).
    The survivors still commit a single decision, excluding both."""
    first, pause_s = 3, 3.0
    victims = {first, second}
    with start_job(tmp_path, victims, env={AGREEMENT_DELAY_ENV: str(pause_s)}) as job:
        wait_until_training(job)
        fail(job, first)
        store, members = job.store(), [rank for rank in range(WORLD_SIZE) if rank != first]
        job.wait_for(lambda: store.check([joined_key(0, r) for r in members]), 10, "the agreement")
        fail(job, second)
        reports = survivor_reports(job, tmp_path, victims)
        returncode, output = job.wait(timeout=30)
    assert returncode == 0, output
    survivors = sorted(set(range(WORLD_SIZE)) - victims)
    expected = {"generation": 1, "survivors": survivors, "failed": sorted(victims), "joined": []}
    assert check_outcome(reports, victims) == [expected]


@multiprocess
@pytest.mark.timeout(60)
def test_failure_after_the_decision_starts_the_next_agreement(tmp_path):
    """A survivor dies after the decision, before the next group forms (every rank pauses
    there): the others leave the formation as soon as they notice and agree again."""
    first, second, pause_s = 3, 1, 2.0
    victims = {first, second}
    with start_job(tmp_path, victims, f"--pause-after-decision={pause_s}") as job:
        wait_until_training(job)
        fail(job, first)
        store = job.store()
        job.wait_for(lambda: store.check([decision_key(0)]), 10, "the first decision")
        fail(job, second)
        reports = survivor_reports(job, tmp_path, victims)
        death = death_of(job, second)
        returncode, output = job.wait(timeout=30)
    assert returncode == 0, output
    assert check_outcome(reports, victims) == [
        {"generation": 1, "survivors": [0, 1, 2], "failed": [first], "joined": []},
        {"generation": 2, "survivors": [0, 2], "failed": [second], "joined": []},
    ]
    for rank, report in reports.items():
        second_round = report["rounds"][1]
        assert second_round["notice"]["time"] - death.time < DETECTION_BOUND_S, (rank, second_round)
        # it left the formation when its pause ended, not at the rendezvous timeout
        assert second_round["unblocked_at"] - death.time < pause_s + DETECTION_BOUND_S, (
            rank,
            second_round,
        )
