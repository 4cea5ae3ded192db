"""``pretrain_gpt.py --elastic`` against the failure-free trajectory (DESIGN section 7).

Every run below loses workers to real signals, from outside the job (the test SIGKILLs or
SIGSTOPs a worker once the metrics file shows a chosen iteration) or from inside
(``--elastic-inject-failure`` makes the worker signal itself in a chosen phase). The survivors
must finish every iteration on the samples of the failure-free run (identical
``samples_digest``) with a relative ``lm_loss`` difference of at most 1e-4.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from harness import free_port, is_gone, launch, launch_nodes, once
from megatron_elaswave.metrics import read_metrics
from megatron_elaswave.runtime.communicator import SEPARATE_HOST_GROUPS_ENV
from test_pretrain_gpt import PRETRAIN, model_flags, text_data  # noqa: F401  (fixture)

LOSS_TOLERANCE = 1e-4
TRAIN_ITERS = 16

pytestmark = pytest.mark.multiprocess


def elastic_flags(data_prefix: str, **overrides) -> list[str]:
    settings = {"num_layers": 8, "train_iters": TRAIN_ITERS, "global_batch_size": 16,
                "hidden_dropout": 0.1, "attention_dropout": 0.1, **overrides}
    return [*model_flags(data_prefix, **settings), "--elastic", "--use-distributed-optimizer",
            "--untie-embeddings-and-output-weights", "--elastic-rebalance-window", "0"]


FOLLOW_STRAGGLERS = ["--elastic-rebalance-window", "5"]
"""The default, which :func:`elastic_flags` turns off: on a busy test machine CPU contention makes
real stragglers, and the tests that compare layouts must not follow them."""


def run(tmp_path: Path, name: str, flags: list[str], nproc: int = 8, kills=(),
        stop: int | None = None, resume: bool = True, timeout: float = 240, resumed_at: int = 0,
        launcher_args: tuple[str, ...] = ()) -> tuple[list[dict], list[dict], str]:
    """Train; ``kills`` are ``(rank, after_iteration)``: SIGKILL ``rank`` once the metrics file
    holds that iteration. ``stop`` SIGSTOPs that rank after iteration 3 and, with ``resume``,
    wakes it once the survivors have recovered. ``resumed_at`` is the iteration a ``--load``
    starts from. Returns the iteration records, the recovery records and the log; the launcher
    must have exited with 0."""
    metrics = tmp_path / f"{name}.jsonl"

    def reached(iteration: int) -> bool:
        return metrics.exists() and any(
            r["iteration"] >= iteration for r in read_metrics(str(metrics), "iteration"))

    with launch([PRETRAIN, *flags, "--elastic-metrics-file", str(metrics)], nproc,
                master_port=free_port(), log_path=tmp_path / f"{name}.log",
                launcher_args=launcher_args) as job:
        for rank, after in kills:
            job.wait_for(lambda: reached(after), 120, f"iteration {after}")
            job.kill_worker(rank)
        if stop is not None:
            job.wait_for(lambda: reached(3), 120, "iteration 3")
            job.kill_worker(stop, signal.SIGSTOP)
            job.wait_for(lambda: bool(read_metrics(str(metrics), "recovery")), 120, "a recovery")
            if resume:
                job.kill_worker(stop, signal.SIGCONT)
        returncode, output = job.wait(timeout)
    assert returncode == 0, output[-4000:]
    iterations = read_metrics(str(metrics), "iteration")
    recoveries = read_metrics(str(metrics), "recovery")
    assert [r["iteration"] for r in iterations] == list(range(resumed_at + 1, TRAIN_ITERS + 1)), \
        output[-4000:]
    return iterations, recoveries, output


def assert_on_trajectory(reference: list[dict], run: list[dict]) -> float:
    """Same samples every iteration and losses within tolerance; returns the worst deviation."""
    worst = 0.0
    for ref, got in zip(reference, run, strict=True):
        assert got["samples_digest"] == ref["samples_digest"], got["iteration"]
        assert got["global_batch_size"] == ref["global_batch_size"]
        worst = max(worst, abs(got["lm_loss"] - ref["lm_loss"]) / abs(ref["lm_loss"]))
    assert worst <= LOSS_TOLERANCE, worst
    return worst


@pytest.fixture(scope="module")
def reference(text_data, tmp_path_factory):  # noqa: F811
    iterations, recoveries, _ = run(tmp_path_factory.mktemp("reference"), "reference",
                                    elastic_flags(text_data, tensor_model_parallel_size=2,
                                                  pipeline_model_parallel_size=2))
    assert not recoveries
    assert iterations[-1]["lm_loss"] < iterations[0]["lm_loss"] - 0.5  # it learns
    return iterations


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victims, overlap", [
    pytest.param([(7, 4)], "on", marks=pytest.mark.sweep), ([(0, 3)], "off"),
    ([(5, 3), (2, 8)], "on"), ([(1, 3), (5, 3)], "on")],
    ids=["last-stage-rank-7", "rank-0-snapshots-settled-in-their-step", "two-failures",
         "a-whole-replica"])
def test_sigkilled_workers_leave_the_trajectory_unchanged(text_data, reference, tmp_path,  # noqa: F811
                                                          victims, overlap):
    """``a-whole-replica``: both stages of replica 0 lose a TP rank together; their snapshots
    are kept by the other replica, which then carries the whole global batch. With ``overlap``
    on (the default), each snapshot's exchange with its buddy runs on a thread while the next
    step trains, and a kill lands whenever it lands relative to it; off, it is settled in its
    own step. One snapshot copy, so a failed rank's state is not held by whoever takes its
    place and must travel (``bytes_moved``)."""
    flags = [*elastic_flags(text_data, tensor_model_parallel_size=2,
                            pipeline_model_parallel_size=2),
             "--elastic-snapshot-overlap", overlap, "--elastic-snapshot-replicas", "1"]
    iterations, recoveries, output = run(tmp_path, "killed", flags, kills=victims)
    assert_on_trajectory(reference, iterations)
    assert sorted(r for rec in recoveries for r in rec["failed_ranks"]) == \
        sorted(v for v, _ in victims), output[-6000:]
    for record in recoveries:
        assert record["causes"] == {str(r): "killed by SIGKILL" for r in record["failed_ranks"]}
        survivors = {r for replica in record["layout"] for stage in replica["stages"]
                     for r in stage["ranks"]}
        assert survivors.isdisjoint(record["failed_ranks"])
        assert sum(replica["num_microbatches"] for replica in record["layout"]) == 8
        assert record["total_s"] > 0 and record["bytes_moved"] > 0
    # After the failure the job runs on fewer ranks, with the same global batch.
    assert iterations[-1]["world_size"] < 8


@pytest.mark.timeout(300)
def test_with_host_state_on_gloo_twins_of_the_device_groups_two_failures_stay_on_trajectory(
        text_data, reference, tmp_path, monkeypatch):  # noqa: F811
    """The groups of an NCCL job (snapshots and migrated state on gloo twins of the device
    groups), gloo for both: two ranks SIGKILLed one after the other. One snapshot copy, so the
    lost state travels over the twins."""
    monkeypatch.setenv(SEPARATE_HOST_GROUPS_ENV, "1")
    flags = [*elastic_flags(text_data, tensor_model_parallel_size=2,
                            pipeline_model_parallel_size=2), "--elastic-snapshot-replicas", "1"]
    iterations, recoveries, output = run(tmp_path, "twins", flags, kills=[(5, 3), (2, 8)])
    assert_on_trajectory(reference, iterations)
    assert [r["failed_ranks"] for r in recoveries] == [[5], [2]], output[-6000:]
    assert all(record["bytes_moved"] > 0 for record in recoveries)


def run_with_faults(tmp_path: Path, name: str, flags: list[str], inject, nproc: int = 8,
                    timeout: float = 240, launcher_args: Sequence[str] = ()
                    ) -> tuple[list[dict], list[dict], str]:
    """Train, calling ``inject(job, reached)`` to send faults from outside; ``reached(i)`` says
    whether the metrics file holds iteration ``i``. Returns what :func:`run` returns."""
    metrics = tmp_path / f"{name}.jsonl"

    def reached(iteration: int) -> bool:
        return metrics.exists() and any(
            r["iteration"] >= iteration for r in read_metrics(str(metrics), "iteration"))

    with launch([PRETRAIN, *flags, "--elastic-metrics-file", str(metrics)], nproc,
                master_port=free_port(), log_path=tmp_path / f"{name}.log",
                launcher_args=launcher_args) as job:
        inject(job, reached)
        returncode, output = job.wait(timeout)
    assert returncode == 0, output[-6000:]
    iterations = read_metrics(str(metrics), "iteration")
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1)), output[-6000:]
    return iterations, read_metrics(str(metrics), "recovery"), output


@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["death-recorded+0.15s", "restore-started",
                                  pytest.param("restore-committed", marks=pytest.mark.sweep)])
def test_a_rank_killed_during_the_recovery_of_another(text_data, reference, tmp_path, when):  # noqa: F811
    """Rank 5 is SIGKILLed after iteration 5; rank 2 is SIGKILLed in the middle of the
    survivors' recovery, chosen from what the job reports: 0.15 s after the launcher recorded
    the first death, as soon as a survivor starts restoring state (it has published which
    snapshots it holds), or as soon as every survivor has restored (each then snapshots the
    rolled-back state in the new layout, and rank 2 dies before its new snapshot is
    replicated: its older replicas must serve). The survivors recover from both and stay on the
    trajectory."""

    def inject(job, reached):
        job.wait_for(lambda: reached(5), 120, "iteration 5")
        job.kill_worker(5)
        if when == "restore-started":
            restore = "rt/gen1/restore/held/0"
            job.wait_for(lambda: job.store().check([restore]), 60, "the restore")
        elif when == "restore-committed":
            restored = "rt/gen1/restore/restored"  # a count of the survivors restored
            job.wait_for(lambda: job.store().check([restored])
                         and int(job.store().get(restored)) == 7, 60, "the restore's commit")
        else:
            job.wait_for_deaths(1, timeout=30)
            time.sleep(0.15)
        job.kill_worker(2)

    flags = elastic_flags(text_data, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    iterations, recoveries, output = run_with_faults(tmp_path, "during", flags, inject)
    assert_on_trajectory(reference, iterations)
    assert sorted(r for rec in recoveries for r in rec["failed_ranks"]) == [2, 5], output[-6000:]
    causes = {rank: cause for rec in recoveries for rank, cause in rec["causes"].items()}
    assert causes == {"2": "killed by SIGKILL", "5": "killed by SIGKILL"}, recoveries
    assert "Traceback" not in output
    assert iterations[-1]["world_size"] == 4  # the TP partners of 2 and 5 are spares


@pytest.mark.timeout(300)
def test_a_rank_stopped_during_the_recovery_of_another_is_excluded_by_its_silence(
        text_data, reference, tmp_path):  # noqa: F811
    """Rank 5 is SIGKILLed after iteration 5; rank 2 is SIGSTOPped for good as soon as a survivor
    starts restoring state. Its connections stay open, so only its silent heartbeat tells: the
    others exclude it, recover again without it and finish on the trajectory, and its launcher
    kills it after the exclusion grace so that the job ends."""

    def inject(job, reached):
        job.wait_for(lambda: reached(5), 120, "iteration 5")
        job.kill_worker(5)
        job.wait_for(lambda: job.store().check(["rt/gen1/restore/held/0"]), 60, "the restore")
        job.kill_worker(2, signal.SIGSTOP)

    flags = [*elastic_flags(text_data, tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
             "--elastic-heartbeat-timeout", "3"]
    iterations, recoveries, output = run_with_faults(tmp_path, "stopped", flags, inject,
                                                     launcher_args=("--exclusion-grace", "2"))
    assert_on_trajectory(reference, iterations)
    causes = {rank: cause for rec in recoveries for rank, cause in rec["causes"].items()}
    assert causes.keys() == {"2", "5"}, recoveries
    assert causes["5"] == "killed by SIGKILL" and causes["2"].startswith("no heartbeat for")
    assert re.search(r"worker rank 2 \(pid \d+\) was excluded by the job; killing it", output)
    assert "Traceback" not in output


@pytest.mark.timeout(300)
def test_a_middle_stage_rank_dies(text_data, tmp_path):  # noqa: F811
    flags = elastic_flags(text_data, tensor_model_parallel_size=1, pipeline_model_parallel_size=4)
    reference, _, _ = run(tmp_path, "reference", flags)
    # TP1 x PP4 x DP2 in Megatron's order: rank 2 is stage 1 of replica 0.
    iterations, recoveries, _ = run(tmp_path, "killed", flags, kills=[(2, 4)])
    assert_on_trajectory(reference, iterations)
    assert [r["failed_ranks"] for r in recoveries] == [[2]]
    stages = [len(replica["stages"]) for replica in recoveries[0]["layout"]]
    assert sorted(stages) == [3, 4]  # replica 0 re-partitioned its layers over three stages

    # The stage boundaries changed, so Megatron's contiguous shards of the layer groups shift
    # between the replicas; with interleaved ZeRO only the state of re-placed layers moves.
    interleaved, moved, _ = run(tmp_path, "interleaved", [*flags, "--elastic-zero", "interleaved"],
                                kills=[(2, 4)])
    assert_on_trajectory(reference, interleaved)
    assert moved[0]["layout"] == recoveries[0]["layout"]
    assert 0 < moved[0]["bytes_moved"] < recoveries[0]["bytes_moved"]


@pytest.mark.sweep  # the logger's stop below checks the same for rank 0
@pytest.mark.timeout(300)
def test_a_stopped_worker_is_excluded_and_the_rest_continue(text_data, reference, tmp_path):  # noqa: F811
    flags = elastic_flags(text_data, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    iterations, recoveries, output = run(tmp_path, "stopped",
                                         [*flags, "--elastic-heartbeat-timeout", "3"], stop=6)
    assert_on_trajectory(reference, iterations)
    assert [r["failed_ranks"] for r in recoveries] == [[6]], output[-6000:]
    assert recoveries[0]["causes"]["6"].startswith("no heartbeat for")
    assert recoveries[0]["detect_s"] >= 2.9  # found by the 3 s heartbeat timeout
    assert "rank 6 was excluded from the job" in output


@pytest.mark.timeout(300)
def test_the_logger_stopped_and_resumed_after_its_exclusion_writes_nothing(
        text_data, reference, tmp_path):  # noqa: F811
    """Rank 0 writes the metrics file; it is SIGSTOPped, found by its silence, excluded, and
    woken once the others have recovered under a new logger: it leaves without writing a
    record, so every iteration is recorded exactly once."""
    flags = elastic_flags(text_data, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    iterations, recoveries, output = run(tmp_path, "logger",
                                         [*flags, "--elastic-heartbeat-timeout", "3"], stop=0)
    assert_on_trajectory(reference, iterations)
    assert [r["failed_ranks"] for r in recoveries] == [[0]], output[-6000:]
    assert recoveries[0]["causes"]["0"].startswith("no heartbeat for")
    assert recoveries[0]["detect_s"] >= 2.9  # found by the 3 s heartbeat timeout
    assert "rank 0 was excluded from the job" in output


@pytest.mark.timeout(300)
def test_a_worker_stopped_for_good_is_fenced_by_its_launcher_and_the_job_ends(
        text_data, small_reference, tmp_path):  # noqa: F811
    """Rank 3 is SIGSTOPped and never resumed: the others exclude it and train on; its launcher
    kills it a grace period after the decision, so the job ends, with status 0."""
    iterations, recoveries, output = run(
        tmp_path, "fenced", [*small_flags(text_data), "--elastic-heartbeat-timeout", "3"], nproc=4,
        stop=3, resume=False, launcher_args=("--exclusion-grace", "2"))
    assert_on_trajectory(small_reference, iterations)
    assert [r["failed_ranks"] for r in recoveries] == [[3]], output[-6000:]
    assert re.search(r"worker rank 3 \(pid \d+\) was excluded by the job; killing it", output)
    assert "Traceback" not in output


def small_flags(data_prefix: str) -> list[str]:
    return elastic_flags(data_prefix, tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                         global_batch_size=8)


@pytest.fixture(scope="module")
def small_reference(text_data, tmp_path_factory):  # noqa: F811
    """TP1 x PP2 x DP2 on 4 ranks, without failures; run once for the session."""
    return once(("small_reference", text_data), lambda: run(
        tmp_path_factory.mktemp("small"), "reference", small_flags(text_data), nproc=4)[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase, rolled_back_to", [
    ("forward", (3, 4)), pytest.param("backward", (3, 4), marks=pytest.mark.sweep),
    pytest.param("allreduce", (3, 4), marks=pytest.mark.sweep),
    pytest.param("optimizer", (4,), marks=pytest.mark.quick), ("snapshot", (4, 5))])
def test_an_injected_kill_in_any_phase_is_survived(text_data, small_reference, tmp_path,  # noqa: F811
                                                   phase, rolled_back_to):
    """Iteration 4's snapshot is finished in iteration 5, just before its optimizer step, its
    exchange with the buddies running on a thread meanwhile (``--elastic-snapshot-overlap on``,
    the default). A kill before that point rolls back to iteration 3, or to 4 if the killed
    rank's copy had already reached its buddy; a kill after it to 4; a kill during iteration 5's
    own snapshot may find 5 complete on every survivor. Either way each iteration is recorded
    once and on the trajectory."""
    iterations, recoveries, output = run(
        tmp_path, "injected",
        [*small_flags(text_data), "--elastic-inject-failure", f"rank=1,iteration=5,phase={phase}"],
        nproc=4)
    assert f"rank 1 kill in the {phase} of iteration 5" in output
    assert_on_trajectory(small_reference, iterations)
    assert [r["failed_ranks"] for r in recoveries] == [[1]]
    assert recoveries[0]["rolled_back_to"] in rolled_back_to


@pytest.mark.timeout(300)
def test_a_snapshot_settled_in_its_own_step_is_never_rolled_back_past(
        text_data, small_reference, tmp_path):  # noqa: F811
    """``--elastic-snapshot-overlap off``: iteration 4's snapshot is held by rank 1's buddy
    before iteration 5 starts, so a kill at its start rolls back to 4."""
    iterations, recoveries, output = run(
        tmp_path, "settled",
        [*small_flags(text_data), "--elastic-snapshot-overlap", "off",
         "--elastic-inject-failure", "rank=1,iteration=5,phase=forward"],
        nproc=4)
    assert "rank 1 kill in the forward of iteration 5" in output
    assert_on_trajectory(small_reference, iterations)
    assert [r["failed_ranks"] for r in recoveries] == [[1]]
    assert recoveries[0]["rolled_back_to"] == 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec, message", [
    ("rank=1", "rank= and iteration= are required"),
    ("rank=1,iteration=2,phase=lunch", "phase must be one of"),
    ("rank=9,iteration=2", "is not a rank of this"),
])
def test_bad_failure_specs_are_refused_in_one_line(text_data, tmp_path, spec, message):  # noqa: F811
    flags = elastic_flags(text_data, tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    with launch([PRETRAIN, *flags, "--elastic-inject-failure", spec], 4,
                master_port=free_port()) as job:
        returncode, output = job.wait(120)
    assert returncode == 2
    assert message in output and "Traceback" not in output


@pytest.mark.timeout(400)
def test_megatrons_rng_strays_from_the_trajectory_and_the_invariant_one_does_not(
        text_data, small_reference, tmp_path):  # noqa: F811
    """The ablation: the same failure, with Megatron's stateful per-stage dropout streams."""
    kill = ["--elastic-inject-failure", "rank=1,iteration=5"]
    invariant, _, _ = run(tmp_path, "invariant", [*small_flags(text_data), *kill], nproc=4)
    megatron = [*small_flags(text_data), "--elastic-rng", "megatron"]
    megatron_reference, _, _ = run(tmp_path, "megatron-reference", megatron, nproc=4)
    megatron_failed, _, _ = run(tmp_path, "megatron-failed", [*megatron, *kill], nproc=4)
    invariant_deviation = assert_on_trajectory(small_reference, invariant)
    megatron_deviation = max(abs(a["lm_loss"] - b["lm_loss"]) / abs(a["lm_loss"])
                             for a, b in zip(megatron_reference, megatron_failed))
    assert megatron_deviation > 1e-4
    assert megatron_deviation > 100 * max(invariant_deviation, 1e-8)


@pytest.mark.timeout(300)
def test_reroute_keeps_the_batch_and_drop_replica_shrinks_it(text_data, small_reference,  # noqa: F811
                                                             tmp_path):
    kill = ["--elastic-inject-failure", "rank=1,iteration=5"]
    final = tmp_path / "final"
    rerouted, recoveries, _ = run(tmp_path, "reroute",
                                  [*small_flags(text_data), *kill, "--elastic-policy", "reroute",
                                   "--save", str(final)],
                                  nproc=4)
    assert_on_trajectory(small_reference, rerouted)
    # The final checkpoint is saved by the two ranks left, without the spare and the dead rank.
    assert (final / "latest_checkpointed_iteration.txt").read_text() == str(TRAIN_ITERS)
    # The damaged replica (ranks 1 and 3) stopped; no layer moved.
    assert recoveries[0]["layout"] == [
        {"replica": 0, "stages": [{"ranks": [0], "layers": [0, 3]}, {"ranks": [2], "layers": [4, 7]}],
         "num_microbatches": 4}]

    # Rank 0 this time: the replica left is replica 1, the only one. The iterations from the
    # rollback on (to 3 or 4: iteration 4's snapshot is settled in 5) run on half the batch.
    dropped, recoveries, _ = run(tmp_path, "drop",
                                 [*small_flags(text_data), "--elastic-inject-failure",
                                  "rank=0,iteration=5", "--elastic-policy", "drop-replica"],
                                 nproc=4)
    kept = recoveries[0]["rolled_back_to"]
    assert kept in (3, 4)
    assert [r["global_batch_size"] for r in dropped] == [8] * kept + [4] * (TRAIN_ITERS - kept)
    assert [r["samples_digest"] for r in dropped[:kept]] == \
        [r["samples_digest"] for r in small_reference[:kept]]
    assert dropped[kept]["samples_digest"] != small_reference[kept]["samples_digest"]


def layer_counts(layout: list[dict]) -> list[list[int]]:
    return [[stage["layers"][1] - stage["layers"][0] + 1 for stage in replica["stages"]]
            for replica in layout]


@pytest.mark.timeout(300)
def test_a_straggler_gets_fewer_microbatches_and_the_trajectory_stays(text_data, small_reference,  # noqa: F811
                                                                     tmp_path):
    """Rank 1 (stage 0 of replica 1) computes three times as slowly from iteration 3: replica 1
    gets one micro-batch of the four, without a failure, then (where it pays) layers move off
    rank 1's stage; the samples and losses stay those of the failure-free run."""
    flags = [*small_flags(text_data), *FOLLOW_STRAGGLERS,
             "--elastic-inject-slowdown", "rank=1,factor=3,iteration=3"]
    iterations, recoveries, output = run(tmp_path, "straggler", flags, nproc=4)
    assert not recoveries
    rebalances = read_metrics(str(tmp_path / "straggler.jsonl"), "rebalance")
    assert rebalances, output[-3000:]
    first = rebalances[0]
    assert "replica 1 takes" in first["reason"] and first["predicted_gain"] >= 1.2
    assert [r["num_microbatches"] for r in first["layout"]] == [3, 1]
    assert 5 <= first["iteration"] <= 12  # the median of five needs three slow iterations
    for later in rebalances[1:]:
        if "per layer" in later["reason"]:  # rank 1's stage gives layers away
            assert layer_counts(later["layout"])[1][0] < 4
    last = iterations[-1]["layout"]
    assert last[1]["num_microbatches"] <= last[0]["num_microbatches"]
    assert_on_trajectory(small_reference, iterations)
    assert "rebalanced after iteration" in output


@pytest.mark.timeout(300)
def test_layers_move_off_a_slow_stage_of_a_lone_replica(text_data, tmp_path):  # noqa: F811
    """TP1 x PP2 x DP1: re-dealing micro-batches cannot help one replica, so when rank 1 (its
    second stage) computes three times as slowly, layers move to the first stage at a step
    boundary, and samples and losses stay those of the failure-free run."""
    flags = [*small_flags(text_data), *FOLLOW_STRAGGLERS]
    reference, _, _ = run(tmp_path, "reference", flags, nproc=2)
    slow = [*flags, "--elastic-inject-slowdown", "rank=1,factor=3,iteration=3"]
    iterations, recoveries, output = run(tmp_path, "slow-stage", slow, nproc=2)
    assert not recoveries
    assert not read_metrics(str(tmp_path / "reference.jsonl"), "rebalance")  # even stages stay
    moves = read_metrics(str(tmp_path / "slow-stage.jsonl"), "rebalance")
    assert moves, output[-3000:]
    assert moves[0]["iteration"] >= 5  # the medians of a window: 3 of its 5 iterations slow
    for moved in moves:  # the first move may be followed by a finer one, measured again
        [(first, second)] = layer_counts(moved["layout"])
        assert first > second
        # The layers' state may cross no link: rank 0 holds rank 1's snapshot replica.
        assert moved["predicted_gain"] >= 1.2 and moved["bytes_moved"] >= 0
        assert "as long per layer" in moved["reason"]
    assert iterations[-1]["layout"] == moves[-1]["layout"]
    assert_on_trajectory(reference, iterations)
    assert "rebalanced after iteration" in output


@pytest.mark.timeout(300)
def test_a_worker_paused_from_outside_again_and_again_is_a_straggler(text_data, small_reference,  # noqa: F811
                                                                    tmp_path):
    """Rank 1 is SIGSTOPped for 0.2 s at a time and let run for a random 20 to 60 ms between
    pauses, far below the heartbeat timeout: the job sees a slow replica, not a failure, and
    re-deals the micro-batches (or moves layers off the paused stage). The run windows are
    shorter than its pipeline and not periodic, so its pauses cannot all fall into the gradient
    reduction, where every replica waits alike. Its snapshot buddy, on replica 0, waits for the
    paused rank's copy while it computes the next step: that wait must not slow its forward."""
    metrics = tmp_path / "paused.jsonl"

    def recorded(event: str) -> list[dict]:
        return read_metrics(str(metrics), event) if metrics.exists() else []

    with launch([PRETRAIN, *small_flags(text_data), *FOLLOW_STRAGGLERS,
                 "--elastic-metrics-file", str(metrics)], 4,
                master_port=free_port(), log_path=tmp_path / "paused.log") as job:
        job.wait_for(lambda: len(recorded("iteration")) >= 2, 120, "iteration 2")
        pid = job.worker_pids()[1]
        done = threading.Event()

        def pause_again_and_again() -> None:
            run_for = random.Random(0)
            try:
                while not done.is_set():
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(0.2)
                    os.kill(pid, signal.SIGCONT)
                    time.sleep(run_for.uniform(0.02, 0.06))
            except ProcessLookupError:  # the job ended before the rebalance the test waits for
                pass

        pauser = threading.Thread(target=pause_again_and_again, daemon=True)
        pauser.start()
        try:
            job.wait_for(lambda: bool(recorded("rebalance")), 150, "a rebalance")
        finally:
            done.set()
            pauser.join()
        returncode, output = job.wait(200)
    assert returncode == 0, output[-3000:]
    assert not recorded("recovery")
    first = recorded("rebalance")[0]
    assert "replica 1 takes" in first["reason"]
    # The slow replica gets fewer micro-batches or, where the time per layer of its paused stage
    # is what stands out (on a loaded machine), fewer layers on that stage.
    if first["reason"].startswith("a stage of replica 1"):
        before = recorded("iteration")[0]["layout"][1]["stages"]
        assert [s["layers"] for s in first["layout"][1]["stages"]] != [s["layers"] for s in before]
    else:
        assert [r["num_microbatches"] for r in first["layout"]] == [3, 1]
    assert_on_trajectory(small_reference, recorded("iteration"))


@pytest.mark.timeout(200)
def test_state_lost_with_its_only_copy_stops_with_a_message(text_data, tmp_path):  # noqa: F811
    flags = [*small_flags(text_data), "--elastic-snapshot-replicas", "0",
             "--elastic-inject-failure", "rank=1,iteration=3"]
    with launch([PRETRAIN, *flags], 4, master_port=free_port()) as job:
        returncode, output = job.wait(150)
    assert returncode != 0
    assert "cannot continue: no survivor holds a snapshot of ranks [1]" in output
    assert "Traceback" not in output


@pytest.mark.timeout(200)
def test_a_rank_and_its_snapshot_buddy_lost_together_stop_every_survivor_in_one_line(
        text_data, tmp_path):  # noqa: F811
    """TP1 x PP2 x DP2 with one copy of each snapshot: rank 0's is kept by rank 3 (the other
    replica's other stage); both are SIGKILLed from outside, so part of the optimizer state is
    gone with them."""
    metrics = tmp_path / "lost.jsonl"
    flags = [PRETRAIN, *small_flags(text_data), "--elastic-snapshot-replicas", "1",
             "--elastic-metrics-file", str(metrics)]
    with launch(flags, 4, master_port=free_port(), log_path=tmp_path / "lost.log") as job:
        job.wait_for(lambda: metrics.exists() and len(read_metrics(str(metrics), "iteration")) >= 3,
                     120, "iteration 3")
        job.kill_worker(0)
        job.kill_worker(3)
        returncode, output = job.wait(150)
    lines = [line for line in output.splitlines() if "cannot continue" in line]
    assert returncode != 0 and "Traceback" not in output, output[-4000:]
    for survivor in (1, 2):  # each says why, since rank 0 is gone, and exits 3
        assert re.search(rf"worker rank {survivor} \(pid \d+\) exited with code 3", output)
    assert len(lines) == 2, output[-4000:]
    assert all("no survivor holds a snapshot of ranks [0, 3]" in line for line in lines), lines


@pytest.mark.timeout(300)
def test_by_default_a_rank_and_its_first_buddy_lost_together_are_survived(
        text_data, small_reference, tmp_path):  # noqa: F811
    """The same pair as above, SIGKILLed together, with the default number of copies: two
    where host memory allows (as here), so rank 0's snapshot is also on a survivor, and the job
    ends on the failure-free trajectory."""
    metrics = tmp_path / "pair.jsonl"
    with launch([PRETRAIN, *small_flags(text_data), "--elastic-metrics-file", str(metrics)], 4,
                master_port=free_port(), log_path=tmp_path / "pair.log") as job:
        job.wait_for(lambda: metrics.exists() and len(read_metrics(str(metrics), "iteration")) >= 3,
                     120, "iteration 3")
        job.kill_worker(0)
        job.kill_worker(3)
        returncode, output = job.wait(200)
    assert returncode == 0, output[-4000:]
    assert "snapshots: 2 copies of each rank's state" in output
    assert "survives the loss of any one rank and of any two ranks" in output
    recoveries = read_metrics(str(metrics), "recovery")
    assert sorted(r for rec in recoveries for r in rec["failed_ranks"]) == [0, 3], output[-4000:]
    assert_on_trajectory(small_reference, read_metrics(str(metrics), "iteration"))


@pytest.mark.timeout(400)
def test_survivors_that_cannot_continue_save_a_checkpoint_that_resumes_the_trajectory(
        text_data, small_reference, tmp_path):  # noqa: F811
    """Under ``reroute`` a failure in each replica leaves no replica whole: the survivors save
    the last complete iteration with ``dist_checkpointing`` and stop; a new launch with
    ``--load`` (and the default policy) finishes the run on the failure-free trajectory."""
    checkpoint = tmp_path / "checkpoint"
    metrics = tmp_path / "stopped.jsonl"
    flags = [*small_flags(text_data), "--elastic-policy", "reroute", "--save", str(checkpoint),
             "--elastic-inject-failure", "rank=1,iteration=3",
             "--elastic-inject-failure", "rank=0,iteration=6", "--elastic-metrics-file", str(metrics)]
    with launch([PRETRAIN, *flags], 4, master_port=free_port(),
                log_path=tmp_path / "stopped.log") as job:
        returncode, output = job.wait(200)
    assert returncode != 0
    for survivor in (2, 3):  # the job's status is that of its first failure, 137 (SIGKILL)
        assert re.search(rf"worker rank {survivor} \(pid \d+\) exited with code 3", output), \
            output[-4000:]
    # Iteration 5's snapshot is settled in 6: the kill rolls back to 5, or to 4 if rank 0's
    # copy of 5 had not reached its buddy yet.
    at = re.escape(str(checkpoint))
    saved = re.search(r"cannot continue: failing ranks \[0\] leaves no intact replica\. The state "
                      rf"of iteration ([45]) is saved in {at}/iter_000000\1: resume with "
                      rf"--load {at}", output)
    assert saved, output[-4000:]
    saved = int(saved.group(1))
    assert "Traceback" not in output
    stopped = read_metrics(str(metrics), "iteration")
    assert [r["iteration"] for r in stopped] == list(range(1, saved + 1))
    resumed, recoveries, output = run(tmp_path, "resumed",
                                      [*small_flags(text_data), "--load", str(checkpoint)],
                                      nproc=4, resumed_at=saved)
    assert "loaded checkpoint from" in output and not recoveries
    assert_on_trajectory(small_reference, stopped + resumed)


@pytest.mark.sweep  # test_growth's lost node checks the same on four ranks; the soak at eight
@pytest.mark.timeout(300)
def test_a_lost_node_takes_half_the_job_and_the_other_half_continues(text_data, reference,  # noqa: F811
                                                                    tmp_path):
    """Two launchers of four workers each; node 1's launcher is SIGKILLed with its workers (the
    last stage of both replicas): node 0 finds its launcher's process gone by its connection,
    without waiting for the node timeout, and each replica re-partitions its layers onto its
    first stage."""
    metrics = tmp_path / "node.jsonl"
    flags = [PRETRAIN, *elastic_flags(text_data, tensor_model_parallel_size=2,
                                      pipeline_model_parallel_size=2),
             "--elastic-metrics-file", str(metrics)]
    with contextlib.ExitStack() as stack:
        node0, node1 = launch_nodes(stack, flags, 4, master_port=free_port(), log_dir=tmp_path,
                                    node_args=[["--node-timeout=60"]] * 2)
        node0.wait_for(lambda: metrics.exists() and len(read_metrics(str(metrics), "iteration")) >= 3,
                       120, "iteration 3")
        node1.send_signal(signal.SIGKILL)
        returncode, output = node0.wait(240)
    assert "node 1 lost: its launcher's process ended" in output, output[-4000:]
    iterations = read_metrics(str(metrics), "iteration")
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1)), output[-4000:]
    assert_on_trajectory(reference, iterations)
    [recovery] = read_metrics(str(metrics), "recovery")
    assert recovery["failed_ranks"] == [4, 5, 6, 7]
    assert [[stage["ranks"] for stage in replica["stages"]] for replica in recovery["layout"]] == [
        [[0, 1]], [[2, 3]]]


@pytest.mark.timeout(300)
def test_a_job_stopped_as_a_whole_and_resumed_rank_by_rank_excludes_no_one(text_data,  # noqa: F811
                                                                          small_reference,
                                                                          tmp_path):
    """Every worker is SIGSTOPped at once (a paused host) for longer than the heartbeat timeout,
    then resumed one by one, 0.3 s apart: the first to wake must not take the others' silence,
    which was its own, for a failure. The job goes on without a recovery, on the trajectory."""

    def inject(job, reached):
        job.wait_for(lambda: reached(3), 120, "iteration 3")
        for rank in job.ranks:
            job.kill_worker(rank, signal.SIGSTOP)
        time.sleep(5)
        for rank in job.ranks:
            job.kill_worker(rank, signal.SIGCONT)
            time.sleep(0.3)

    iterations, recoveries, output = run_with_faults(
        tmp_path, "paused", [*small_flags(text_data), "--elastic-heartbeat-timeout", "3"],
        inject, nproc=4)
    assert recoveries == [], output[-6000:]
    assert_on_trajectory(small_reference, iterations)


@pytest.mark.timeout(300)
def test_node_0_stalled_with_another_node_does_not_declare_it_lost(text_data,  # noqa: F811
                                                                  small_reference, tmp_path):
    """Node 1's launcher is SIGSTOPped, then, once node 0 has read its last heartbeat, node 0's
    launcher too (it hosts the job store, so every worker waits on it meanwhile), for longer than
    the node timeout and the workers' heartbeat timeout. Node 0 is resumed first: it must not
    count its own stall as node 1's silence, nor the workers theirs as each other's. No node is
    lost, no worker is excluded, and the job ends on the trajectory."""
    metrics = tmp_path / "stall.jsonl"
    flags = [PRETRAIN, *small_flags(text_data), "--elastic-metrics-file", str(metrics)]
    node_timeout_s = 8.0  # node 0 reads the heartbeats every second
    with contextlib.ExitStack() as stack:
        node0, node1 = launch_nodes(stack, flags, 2, master_port=free_port(), log_dir=tmp_path,
                                    node_args=[[f"--node-timeout={node_timeout_s:g}"]] * 2)
        node0.wait_for(lambda: metrics.exists() and len(read_metrics(str(metrics), "iteration")) >= 3,
                       120, "iteration 3")
        node1.send_signal(signal.SIGSTOP)
        time.sleep(1.3)
        node0.send_signal(signal.SIGSTOP)
        time.sleep(node_timeout_s + 2)
        node0.send_signal(signal.SIGCONT)
        time.sleep(0.3)
        node1.send_signal(signal.SIGCONT)
        returncode, output = node0.wait(240)
        node1_code, node1_output = node1.wait(60)
    assert (returncode, node1_code) == (0, 0), output[-4000:] + node1_output[-4000:]
    assert "lost" not in output + node1_output
    assert read_metrics(str(metrics), "recovery") == []
    iterations = read_metrics(str(metrics), "iteration")
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1)), output[-4000:]
    assert_on_trajectory(small_reference, iterations)


@pytest.mark.timeout(300)
def test_a_node_paused_past_its_timeout_is_fenced_when_it_wakes(text_data, small_reference,  # noqa: F811
                                                               tmp_path):
    """Node 1 as a whole (its launcher, fork server and workers) is SIGSTOPped for longer than
    the node timeout: node 0 declares it lost and the other half of the job recovers without it.
    When node 1 wakes, its launcher finds itself declared lost, says so in one line, kills its
    workers and exits with 1; nothing it does reaches the job, which ends on the trajectory."""
    metrics = tmp_path / "paused.jsonl"
    flags = [PRETRAIN, *small_flags(text_data), "--elastic-metrics-file", str(metrics)]

    def recorded(event: str) -> list[dict]:
        return read_metrics(str(metrics), event) if metrics.exists() else []

    with contextlib.ExitStack() as stack:
        node0, node1 = launch_nodes(stack, flags, 2, master_port=free_port(), log_dir=tmp_path,
                                    node_args=[["--node-timeout=2"]] * 2)
        paused = node1.worker_pids()
        node0.wait_for(lambda: len(recorded("iteration")) >= 3, 120, "iteration 3")
        os.killpg(node1.pid, signal.SIGSTOP)
        node0.wait_for(lambda: bool(recorded("recovery")), 120, "the recovery")
        os.killpg(node1.pid, signal.SIGCONT)
        node1_code, node1_output = node1.wait(60)
        returncode, output = node0.wait(240)
    assert returncode == 0, output[-4000:]
    assert node1_code == 1, node1_output[-4000:]
    assert node1_output.count("this node was declared lost by node rank 0; killing its workers") \
        == 1, node1_output[-4000:]
    assert all(is_gone(pid) for pid in paused.values())
    assert "node 1 lost: no heartbeat for" in output
    [recovery] = recorded("recovery")
    assert recovery["failed_ranks"] == [2, 3]
    assert recovery["causes"] == {"2": "its node was lost", "3": "its node was lost"}
    iterations = recorded("iteration")
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1)), output[-4000:]
    assert all(r["world_size"] == 2 for r in iterations if r["iteration"] > recovery["iteration"])
    assert_on_trajectory(small_reference, iterations)


@pytest.mark.timeout(200)
def test_losing_the_store_host_stops_every_other_node_in_one_line_each(text_data, tmp_path):  # noqa: F811
    """Node 0's launcher, which hosts the job store, is SIGKILLed with its workers: node 1's
    launcher and workers each say in one line that the job store is lost and exit non-zero,
    within a bound, leaving no process behind."""
    metrics = tmp_path / "store.jsonl"
    flags = [PRETRAIN, *small_flags(text_data), "--elastic-metrics-file", str(metrics)]
    port = free_port()
    with contextlib.ExitStack() as stack:
        node0, node1 = launch_nodes(stack, flags, 2, master_port=port, log_dir=tmp_path,
                                    node_args=[["--node-timeout=2", "--shutdown-grace=10"]] * 2)
        pids = node1.worker_pids()
        node0.wait_for(lambda: metrics.exists() and len(read_metrics(str(metrics), "iteration")) >= 3,
                       120, "iteration 3")
        node0.send_signal(signal.SIGKILL)
        started = time.monotonic()
        returncode, output = node1.wait(60)
        took = time.monotonic() - started
    assert returncode != 0, output[-4000:]
    assert took < 45, took
    # A worker's last words at exit (a library's, without a newline) may precede the agent's.
    agent_lines = re.findall(r"\[elaswave-run\] lost the job store[^\n]*", output)
    assert len(agent_lines) == 1 and f"127.0.0.1:{port}" in agent_lines[0], output[-4000:]
    assert output.count(f"pretrain_gpt.py: cannot continue: lost the job store at 127.0.0.1:{port}"
                        ) == 2, output[-4000:]  # one per worker
    assert "Traceback" not in output and "Broken pipe" not in output
    assert all(is_gone(pid) for pid in pids.values())


@pytest.mark.timeout(60)
def test_elastic_refuses_what_it_cannot_do_in_one_line(text_data, tmp_path):  # noqa: F811
    base = model_flags(text_data, num_layers=8)
    cases = [
        ([*base, "--elastic", "--untie-embeddings-and-output-weights"], "--use-distributed-optimizer"),
        ([*elastic_flags(text_data), "--save", str(tmp_path / "ckpt"),
          "--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be positive"),
        ([*base, "--elastic-zero", "interleaved"], "--elastic-zero interleaved needs --elastic"),
    ]
    for flags, message in cases:
        result = subprocess.run([sys.executable, PRETRAIN, *flags], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 2, result.stderr
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("pretrain_gpt.py: error: ") and message in line
