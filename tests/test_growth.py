"""Replacement ranks rejoin a running ``--elastic`` job at a step boundary.

A worker SIGKILLed from outside is started again in its slot by ``elaswave-run --rejoin``; a node
whose launcher was SIGKILLed with its workers is replaced by a new launcher. A surviving rank is
held (SIGSTOP) while the replacements start, so that the job cannot end before they ask to join.
Either way the
survivors recover, take the replacements in at a step boundary, run at the failure-free layout
again, and the whole run stays on the failure-free trajectory (same samples, losses within
1e-4).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from harness import free_port, launch, launch_nodes
from megatron_elaswave.launch.decisions import Decision
from megatron_elaswave.launch.keys import FINISHED_KEY, accepted_key, decision_key, join_key
from megatron_elaswave.launch.config import REJOIN_ENV
from megatron_elaswave.launch.store import WorkerDeath, record_death
from megatron_elaswave.layout import Layout, Replica
from megatron_elaswave.metrics import read_metrics
from megatron_elaswave.planner.frequency import ClockPlan
from megatron_elaswave.runtime.agreement import agree
from megatron_elaswave.runtime.monitor import FailureMonitor, MonitorConfig
from megatron_elaswave.training.recovery.protocol import relayout
from test_elastic import (
    PRETRAIN,
    TRAIN_ITERS,
    assert_on_trajectory,
    small_flags,
    small_reference,
)
from test_pretrain_gpt import BASE, run_single, text_data  # noqa: F401  (fixture)

__all__ = ["small_reference", "text_data"]  # fixtures


JOIN_READ_S = 2 * MonitorConfig.heartbeat_interval_s
"""Time enough for a running member's monitor to read a join request (it does with each beat)."""
HELD = ["--elastic-heartbeat-timeout", "60"]
"""Flags of a job whose rank 0 is held while replacements start (:func:`hold_while_joining`): its peers
must not take the pause for a hang."""


def hold_while_joining(job, joiners: list[int], held: int = 0) -> None:
    """SIGSTOP rank ``held`` of ``job`` until every rank of ``joiners`` has asked to join and the
    members still running have read the requests (with their heartbeats, every
    ``JOIN_READ_S``), then SIGCONT it: a replacement takes seconds of imports to start, and the
    job must not finish first. At most 25 s, within the 30 s op timeout of the job's collectives.
    Pausing changes nothing that is computed."""
    job.kill_worker(held, signal.SIGSTOP)
    try:
        job.wait_for(lambda: job.store().check([join_key(rank) for rank in joiners]), 25,
                     f"ranks {joiners} to ask to join")
        time.sleep(JOIN_READ_S)
    finally:
        job.kill_worker(held, signal.SIGCONT)


def replace_rank_3_until_accepted(job, recorded: Callable[[str], list[dict]]) -> None:
    """SIGKILL rank 3 of ``job`` after iteration 3 and return once the job, recovered, has
    accepted its replacement (``--rejoin``), which is then forming the grown generation's
    groups. ``recorded(event)`` reads the job's metrics records."""
    job.wait_for(lambda: len(recorded("iteration")) >= 3, 120, "iteration 3")
    first = job.kill_worker(3)
    job.wait_for(lambda: bool(recorded("recovery")), 120, "the recovery")
    job.wait_for(lambda: job.worker_pids()[3] != first, 60, "the replacement of rank 3")
    hold_while_joining(job, [3])
    job.wait_for(lambda: job.store().check([accepted_key(3)]), 60, "the acceptance")


def stage_ranks(layout: list[dict]) -> list[list[list[int]]]:
    return [[stage["ranks"] for stage in replica["stages"]] for replica in layout]


def stages(layout: list[dict]) -> list[list[dict]]:
    """Ranks and layers of each stage: a failure-free run may re-deal micro-batches or move layers
    to follow a straggler (a busy machine makes some); its first iteration runs the planned layout."""
    return [replica["stages"] for replica in layout]


def grow_plan(generation: int = 2) -> relayout.LayoutChange:
    complete = Layout.megatron(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=4)
    degraded = Layout(4, (Replica(0, complete.replicas[0].stages, (0, 1, 2, 3)),), spares=(1,))
    clocks = ClockPlan(((1.0, 1.0), (1.0, 0.9)), 10, 2.0, 11, 2.5)
    decision = Decision(generation, (0, 1, 2, 3), (), joined=(3,))
    return relayout.LayoutChange(decision, complete, degraded, 7, clocks, 123.5)


def test_a_grow_plan_round_trips_through_json():
    plan = grow_plan()
    assert relayout.LayoutChange.from_json(plan.to_json()) == plan


def test_a_grow_loses_to_a_failure_decision_committed_first(store):
    plan = grow_plan()
    failure = Decision(2, (0, 1, 2), (3,))
    store.compare_set(decision_key(1), "", failure.to_json())
    store.set(join_key(3), "{}")
    assert not relayout.commit(store, plan)
    assert relayout.published_plan(store, 2) is None and store.check([join_key(3)])


def test_a_committed_grow_accepts_its_joiners(store):
    plan = grow_plan()
    relayout.request_join(store, 3)
    assert relayout.commit(store, plan)
    assert Decision.from_json(store.get(decision_key(1))) == plan.decision
    assert not store.check([join_key(3)])
    assert relayout.wait_for_acceptance(store, 3) == plan
    relayout.request_join(store, 3)  # a later incarnation of rank 3 is not accepted by this one
    assert not store.check([accepted_key(3)])


def test_a_replacement_leaves_when_the_job_has_finished(store):
    relayout.request_join(store, 3)
    threading.Timer(0.2, lambda: store.set(FINISHED_KEY, "")).start()
    with pytest.raises(relayout.JobFinished, match="finished before rank 3 could rejoin"):
        relayout.wait_for_acceptance(store, 3)


def test_the_monitor_sees_join_requests_and_forgets_the_deaths_of_ranks_taken_back(store):
    config = MonitorConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=5.0)
    detected = []
    with FailureMonitor(store, 0, Decision.initial(2), config, job_size=3,
                        on_failure=lambda: detected.append(time.time())) as monitor:
        record_death(store, WorkerDeath(rank=1, local_rank=1, node_rank=0, pid=11, exit_code=None,
                                        signal="SIGKILL", cause="signal", time=time.time()))
        deadline = time.monotonic() + 5
        while monitor.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(monitor.suspects()) == [1]
        monitor.advance(Decision(1, (0,), (1,)))
        relayout.request_join(store, 1)
        while monitor.waiting_to_join() != {1} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert monitor.waiting_to_join() == {1}  # rank 2 never asked
        monitor.advance(Decision(2, (0, 1), (), joined=(1,)))
        store.add("rt/heartbeat/1", 1)
        time.sleep(0.3)  # several beats, each reading the death records
        assert monitor.failure is None and len(detected) == 1


def test_a_rank_taken_back_and_lost_again_is_not_blamed_on_its_first_death(store):
    """Rank 1 was SIGKILLed long ago and taken back; now its heartbeat stops, with no death
    recorded (its whole node hangs). The decision names the hang and dates it from the last
    heartbeat, not from the death of the process it replaced."""
    config = MonitorConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5)
    first_death = time.time() - 100
    record_death(store, WorkerDeath(rank=1, local_rank=1, node_rank=0, pid=11, exit_code=None,
                                    signal="SIGKILL", cause="signal", time=first_death))
    with FailureMonitor(store, 0, Decision(1, (0,), (1,)), config, job_size=2) as monitor:
        time.sleep(0.2)  # the monitor has read the death record
        monitor.advance(Decision(2, (0, 1), (), joined=(1,)))
        store.add("rt/heartbeat/1", 1)
        deadline = time.monotonic() + 5
        while monitor.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        decision = agree(store, monitor)
    assert decision.failed == (1,)
    assert "killed by SIGKILL" not in decision.cause(1), decision.cause(1)
    assert decision.failed_at > first_death + 90


def kill_once_and_rejoin(text_data: str, tmp_path: Path, victim: int, held: int = 0):
    """Four ranks under ``--rejoin``: ``victim`` is SIGKILLed after iteration 3 and started again;
    rank ``held`` waits for it to ask to join. Returns the exit status, the output and a reader
    of the metrics records by event."""
    metrics = tmp_path / "rejoin.jsonl"

    def recorded(event: str) -> list[dict]:
        return read_metrics(str(metrics), event) if metrics.exists() else []

    with launch([PRETRAIN, *small_flags(text_data), *HELD, "--elastic-metrics-file", str(metrics)],
                4, master_port=free_port(), log_path=tmp_path / "rejoin.log",
                launcher_args=["--rejoin", "--rejoin-delay=0.5"]) as job:
        job.wait_for(lambda: len(recorded("iteration")) >= 3, 120, "iteration 3")
        job.kill_worker(victim)
        job.wait_for(lambda: bool(recorded("recovery")), 120, "the recovery")
        hold_while_joining(job, [victim], held=held)
        returncode, output = job.wait(240)
    return returncode, output, recorded


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_killed_worker_is_started_again_and_rejoins(text_data, small_reference, tmp_path):  # noqa: F811
    returncode, output, recorded = kill_once_and_rejoin(text_data, tmp_path, victim=3)
    assert returncode == 0, output[-4000:]
    iterations, recoveries = recorded("iteration"), recorded("recovery")
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1)), output[-4000:]
    assert_on_trajectory(small_reference, iterations)
    assert [r["failed_ranks"] for r in recoveries] == [[3]]
    [grow] = recorded("grow")
    assert grow["joined_ranks"] == [3]
    assert grow["iteration"] >= recoveries[0]["iteration"]
    assert grow["bytes_moved"] > 0 and grow["total_s"] > 0
    # Back at the failure-free layout.
    assert stages(grow["layout"]) == stages(small_reference[0]["layout"])
    after = [r for r in iterations if r["iteration"] > grow["iteration"]]
    assert after and all(r["world_size"] == 4 and r["layout"] == grow["layout"] for r in after)
    degraded = [r for r in iterations
                if recoveries[0]["iteration"] <= r["iteration"] <= grow["iteration"]]
    assert degraded and all(r["world_size"] == 3 for r in degraded)
    assert "restarting worker rank 3" in output and "ranks [3] joined after iteration" in output


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_replacement_for_the_logger_writes_every_record_held_back(text_data, small_reference,  # noqa: F811
                                                                  tmp_path):
    """Rank 0, which writes the metrics, is SIGKILLed and started again; rank 1 logs meanwhile.
    Back in, rank 0 is the lowest active rank and logs again: the iteration records the others
    still held back at the grow (each waits for its snapshots to settle) reach it, so none is
    missing."""
    returncode, output, recorded = kill_once_and_rejoin(text_data, tmp_path, victim=0, held=1)
    assert returncode == 0, output[-4000:]
    [grow] = recorded("grow")
    assert grow["joined_ranks"] == [0]
    iterations = recorded("iteration")
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1)), output[-4000:]
    assert_on_trajectory(small_reference, iterations)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_new_launcher_replaces_a_lost_node(text_data, small_reference, tmp_path):  # noqa: F811
    """Two launchers of two workers (node 1 holds the last stage of both replicas). Node 1's
    launcher is SIGKILLed with its workers: node 0 finds its launcher's process gone by its
    connection, without waiting for the node timeout, and each replica re-partitions onto its
    first stage. A new launcher for node rank 1 with ``--rejoin`` takes the node's place: its
    workers join and the job runs on two stages again."""
    metrics = tmp_path / "node.jsonl"
    flags = [PRETRAIN, *small_flags(text_data), *HELD, "--elastic-metrics-file", str(metrics)]
    port = free_port()

    def node(rank: int, name: str, *extra: str):
        return launch(flags, 2, nnodes=2, node_rank=rank, master_port=port,
                      launcher_args=["--node-timeout=60", *extra], log_path=tmp_path / name)

    def recorded(event: str) -> list[dict]:
        return read_metrics(str(metrics), event) if metrics.exists() else []

    with contextlib.ExitStack() as stack:
        node0 = stack.enter_context(node(0, "node0.log"))
        node1 = stack.enter_context(node(1, "node1.log"))
        node0.wait_for(lambda: len(recorded("iteration")) >= 3, 120, "iteration 3")
        node1.send_signal(signal.SIGKILL)
        node0.wait_for(lambda: bool(recorded("recovery")), 120, "the recovery")
        replacement = stack.enter_context(node(1, "replacement.log", "--rejoin"))
        hold_while_joining(node0, [2, 3])
        returncode, output = node0.wait(240)
        replacement_code, replacement_output = replacement.wait(60)
    assert returncode == 0 and replacement_code == 0, output[-3000:] + replacement_output[-3000:]
    iterations = recorded("iteration")
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1)), output[-4000:]
    assert_on_trajectory(small_reference, iterations)
    [recovery], [grow] = recorded("recovery"), recorded("grow")
    assert recovery["failed_ranks"] == [2, 3]
    assert stage_ranks(recovery["layout"]) == [[[0]], [[1]]]
    assert grow["joined_ranks"] == [2, 3]  # both had asked when rank 0 went on
    assert stage_ranks(grow["layout"]) == [[[0], [2]], [[1], [3]]]
    assert stages(iterations[-1]["layout"]) == stages(small_reference[0]["layout"])
    assert "node 1 lost: its launcher's process ended" in output
    assert "replacing lost node rank 1" in replacement_output
    assert "node 1 rejoined the job" in output


def test_a_replacement_for_a_job_without_elastic_is_refused_in_one_line():
    result = run_single([*BASE, "--mock-data", "--vocab-size", "64", "--global-batch-size", "2"],
                        env={REJOIN_ENV: "1"})
    assert result.returncode == 2, result.stderr
    [line] = [ln for ln in result.stderr.splitlines() if ln.startswith("pretrain_gpt.py")]
    assert "does not run with --elastic" in line


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_replacement_joins_while_a_lower_rank_is_still_missing(text_data, small_reference,  # noqa: F811
                                                                 tmp_path):
    """Node 0 (ranks 0 and 1) runs without ``--rejoin``, node 1 (ranks 2 and 3) with it. Rank 1
    is SIGKILLed and stays dead; then rank 3 is SIGKILLed, started again, and joins while rank 1
    is still missing. The default group rebuilt for the grow numbers launch rank 3 as 2: the
    snapshots and state sent to it must still reach it, and the run stays on the trajectory."""
    metrics = tmp_path / "gap.jsonl"
    flags = [PRETRAIN, *small_flags(text_data), *HELD, "--elastic-metrics-file", str(metrics)]

    def recorded(event: str) -> list[dict]:
        return read_metrics(str(metrics), event) if metrics.exists() else []

    with contextlib.ExitStack() as stack:
        node0, node1 = launch_nodes(stack, flags, 2, master_port=free_port(), log_dir=tmp_path,
                                    node_args=[[], ["--rejoin", "--rejoin-delay=0.5"]])
        node0.wait_for(lambda: len(recorded("iteration")) >= 3, 120, "iteration 3")
        node0.kill_worker(1)
        node0.wait_for(lambda: len(recorded("recovery")) >= 1, 120, "the first recovery")
        node1.kill_worker(3)
        node0.wait_for(lambda: len(recorded("recovery")) >= 2, 120, "the second recovery")
        hold_while_joining(node0, [3])
        returncode, output = node0.wait(240)
        node1_code, node1_output = node1.wait(60)
    assert node1_code == 0, node1_output[-4000:]
    iterations = recorded("iteration")
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1)), output[-4000:]
    assert_on_trajectory(small_reference, iterations)
    assert [r["failed_ranks"] for r in recorded("recovery")] == [[1], [3]]
    [grow] = recorded("grow")
    assert grow["joined_ranks"] == [3] and grow["bytes_moved"] > 0
    assert 3 in {rank for stage in stage_ranks(grow["layout"]) for ranks in stage for rank in ranks}
    assert all(r["world_size"] == 3 for r in iterations if r["iteration"] > grow["iteration"])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_replacement_that_dies_while_joining_is_recovered_from(text_data, small_reference,  # noqa: F811
                                                                 tmp_path):
    """Rank 3 is SIGKILLed and started again; its replacement is SIGKILLed from outside as soon
    as the job accepts it, in the middle of the grow. The members recover from that failure as
    from any other and finish on the trajectory without it (``--max-rejoins 1``)."""
    metrics = tmp_path / "join.jsonl"

    def recorded(event: str) -> list[dict]:
        return read_metrics(str(metrics), event) if metrics.exists() else []

    with launch([PRETRAIN, *small_flags(text_data), *HELD, "--elastic-metrics-file", str(metrics)],
                4, master_port=free_port(), log_path=tmp_path / "join.log",
                launcher_args=["--rejoin", "--rejoin-delay=0.5", "--max-rejoins=1"]) as job:
        replace_rank_3_until_accepted(job, recorded)
        job.kill_worker(3)
        returncode, output = job.wait(240)
    assert returncode == 0, output[-4000:]
    iterations = recorded("iteration")
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1)), output[-4000:]
    assert_on_trajectory(small_reference, iterations)
    assert [r["failed_ranks"] for r in recorded("recovery")] == [[3], [3]], output[-4000:]
    assert iterations[-1]["world_size"] == 3
    assert "not restarting it" in output


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_replacement_whose_join_a_failure_interrupts_leaves_in_one_line(  # noqa: F811
        text_data, small_reference, tmp_path):
    """Rank 3 is SIGKILLed and started again; once the job accepts the replacement it is
    SIGSTOPped, rank 2 is SIGKILLed, and the replacement resumes inside its join, which the
    failure has broken: it says so in one line and leaves with status 1 (no traceback), and the
    members recover from both and finish on the trajectory (``--max-rejoins 1``: rank 2 comes
    back, rank 3 does not)."""
    metrics = tmp_path / "interrupted.jsonl"

    def recorded(event: str) -> list[dict]:
        return read_metrics(str(metrics), event) if metrics.exists() else []

    with launch([PRETRAIN, *small_flags(text_data), *HELD, "--elastic-metrics-file", str(metrics)],
                4, master_port=free_port(), log_path=tmp_path / "interrupted.log",
                launcher_args=["--rejoin", "--rejoin-delay=0.5", "--max-rejoins=1"]) as job:
        replace_rank_3_until_accepted(job, recorded)
        job.kill_worker(3, signal.SIGSTOP)
        job.kill_worker(2)
        time.sleep(1.0)  # within the heartbeat timeout: the replacement is not silent for long
        job.kill_worker(3, signal.SIGCONT)
        returncode, output = job.wait(240)
    assert returncode == 0, output[-4000:]
    assert "a failure interrupted rank 3's join (" in output, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    iterations = recorded("iteration")
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1)), output[-4000:]
    assert_on_trajectory(small_reference, iterations)
