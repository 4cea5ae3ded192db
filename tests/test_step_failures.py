"""Iterations that fail while no rank does: ``--elastic`` re-runs them from the in-memory
snapshot a bounded number of times, then stops the job with one line and the state saved.

Errors come from ``--elastic-inject-failure`` kinds ``raise`` (once, a transient fault),
``poison`` (every time the iteration runs, a bad sample or a bug) and ``nan`` (one NaN output);
a reproducible non-finite loss comes from a learning rate that diverges. Runs that go on must
end on the failure-free trajectory.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness import free_port, launch
from megatron_elaswave.metrics import read_metrics
from test_pretrain_gpt import PRETRAIN, model_flags, text_data  # noqa: F401  (fixture)

LOSS_TOLERANCE = 1e-4
TRAIN_ITERS = 8
NPROC = 4

pytestmark = pytest.mark.multiprocess


def flags(data_prefix: str, *extra: str, **overrides) -> list[str]:
    """TP1 x PP2 x DP2 on four ranks, with dropout, without ``--elastic``."""
    settings = {"num_layers": 4, "train_iters": TRAIN_ITERS, "global_batch_size": 8,
                "pipeline_model_parallel_size": 2, "hidden_dropout": 0.1,
                "attention_dropout": 0.1, **overrides}
    return [*model_flags(data_prefix, **settings), "--use-distributed-optimizer",
            "--untie-embeddings-and-output-weights", *extra]


def elastic(data_prefix: str, *extra: str, **overrides) -> list[str]:
    return [*flags(data_prefix, **overrides), "--elastic", "--elastic-rebalance-window", "0",
            *extra]


def run(tmp_path: Path, name: str, job_flags: list[str]) -> tuple[int, str, list[dict], list[dict]]:
    """Train to the end or to a stop: exit status, output, iteration and recovery records."""
    metrics = tmp_path / f"{name}.jsonl"
    with launch([PRETRAIN, *job_flags, "--elastic-metrics-file", str(metrics)], NPROC,
                master_port=free_port(), log_path=tmp_path / f"{name}.log") as job:
        returncode, output = job.wait(240)
    records = lambda kind: read_metrics(str(metrics), kind) if metrics.exists() else []  # noqa: E731
    return returncode, output, records("iteration"), records("recovery")


def assert_on_trajectory(reference: list[dict], iterations: list[dict]) -> None:
    assert [r["iteration"] for r in iterations] == [r["iteration"] for r in reference]
    for ref, got in zip(reference, iterations):
        assert got["samples_digest"] == ref["samples_digest"], got["iteration"]
        assert abs(got["lm_loss"] - ref["lm_loss"]) / abs(ref["lm_loss"]) <= LOSS_TOLERANCE


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("pretrain_gpt.py: error:")]


@pytest.fixture(scope="module")
def reference(text_data, tmp_path_factory) -> list[dict]:  # noqa: F811
    returncode, output, iterations, recoveries = run(
        tmp_path_factory.mktemp("reference"), "reference", elastic(text_data))
    assert returncode == 0 and not recoveries, output[-4000:]
    return iterations


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["raise", "nan"])
def test_a_transient_fault_of_one_rank_is_run_again_on_the_trajectory(text_data, reference,  # noqa: F811
                                                                       tmp_path, kind):
    """Rank 3 (the last stage of replica 1) raises once, or outputs NaN once, in iteration 4:
    nobody failed, so the iteration runs again from the snapshot of iteration 3 and the job
    ends as the failure-free run does."""
    injected = f"rank=3,iteration=4,phase=forward,kind={kind}"
    returncode, output, iterations, recoveries = run(
        tmp_path, kind, elastic(text_data, "--elastic-inject-failure", injected))
    assert returncode == 0, output[-6000:]
    assert_on_trajectory(reference, iterations)
    assert [r["failed_ranks"] for r in recoveries] == [[]], output[-6000:]
    assert recoveries[0]["rolled_back_to"] == 3
    if kind == "raise":
        assert "injected raise failure of rank 3" in recoveries[0]["rerun_cause"]
        assert "no rank failed, so the iteration runs again" in output
    else:
        where = "the loss of rank 3, last stage of the pipeline of ranks [1, 3]"
        assert (f"NonFiniteLoss: lm loss is nan at iteration 4 (not finite: {where})"
                in recoveries[0]["rerun_cause"]), recoveries
        assert re.search(r"iteration 4 had lm loss nan; run again from its snapshot it has "
                         r"\S+: the non-finite loss did not reproduce \(a transient fault or a "
                         rf"faulty device; not finite then: {re.escape(where)}\)", output), \
            output[-6000:]
    assert "Traceback" not in output


@pytest.mark.timeout(300)
def test_a_poison_step_stops_the_job_in_one_line_with_the_state_saved(text_data, tmp_path):  # noqa: F811
    """Iteration 4 raises on rank 1 however often it runs: after one re-run the job stops with
    the original error in one line and exit status 1, the state of iteration 3 saved."""
    checkpoint = tmp_path / "checkpoint"
    returncode, output, iterations, recoveries = run(tmp_path, "poison", elastic(
        text_data, "--elastic-inject-failure", "rank=1,iteration=4,phase=backward,kind=poison",
        "--elastic-max-step-retries", "1", "--save", str(checkpoint)))
    assert returncode == 1, output[-6000:]
    lines = error_lines(output)
    assert len(lines) == 1, output[-6000:]
    assert lines[0].startswith("pretrain_gpt.py: error: iteration 4 failed 2 times with no rank "
                               "failing (rank 1: InjectedError: injected poison failure of rank 1 "
                               "in the backward of iteration 4)")
    assert f"The state of iteration 3 is saved in {checkpoint}" in lines[0]
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert [r["iteration"] for r in iterations] == [1, 2, 3]
    assert "Traceback" not in output


@pytest.mark.timeout(300)
def test_a_loss_that_is_not_finite_again_stops_like_megatron(text_data, tmp_path):  # noqa: F811
    """A learning rate that makes the loss NaN stops the plain path with Megatron's error; the
    elastic path first re-runs the iteration from its snapshot, then stops with exit status 1
    and one line saying the NaN reproduced."""
    diverging = dict(lr=1e8, lr_warmup_iters=0, hidden_dropout=0.0, attention_dropout=0.0)
    returncode, output, iterations, _ = run(tmp_path, "plain", flags(text_data, **diverging))
    assert returncode == 1, output[-4000:]
    diverged = re.search(r"FloatingPointError: lm loss is nan at iteration (\d+)", output)
    assert diverged, output[-4000:]
    nan_at = int(diverged.group(1))

    returncode, output, iterations, recoveries = run(
        tmp_path, "elastic", elastic(text_data, "--save", str(tmp_path / "ckpt"), **diverging))
    assert returncode == 1, output[-6000:]
    lines = error_lines(output)
    assert len(lines) == 1, output[-6000:]
    assert lines[0].startswith(
        f"pretrain_gpt.py: error: lm loss is nan at iteration {nan_at}, again when re-run from "
        f"the snapshot of iteration {nan_at - 1}: it reproduces"), lines
    assert [r["iteration"] for r in iterations] == list(range(1, nan_at))
    assert "Traceback" not in output


@pytest.mark.quick
@pytest.mark.timeout(300)
def test_a_bad_sample_stops_the_job_in_one_line_whatever_the_error(text_data, tmp_path):  # noqa: F811
    """A corpus whose token ids lie beyond the vocabulary: embedding them raises ``IndexError``
    on the first stages, not a ``RuntimeError``. It is bounded like any step error: one re-run,
    then one line and exit status 1, the state of the last good iteration saved, and no rank
    dies of it."""
    bad = tmp_path / "bad_text_document"
    for suffix in (".idx", ".bin"):
        Path(f"{bad}{suffix}").write_bytes(Path(f"{text_data}{suffix}").read_bytes())
    tokens = bytearray(Path(f"{bad}.bin").read_bytes())
    tokens[:] = b"\xff" * len(tokens)  # uint16 ids 65535: far beyond the 512 of the vocabulary
    Path(f"{bad}.bin").write_bytes(bytes(tokens))
    checkpoint = tmp_path / "checkpoint"
    returncode, output, iterations, _ = run(tmp_path, "bad", elastic(
        str(bad), "--elastic-max-step-retries", "1", "--save", str(checkpoint)))
    assert returncode == 1, output[-6000:]
    lines = error_lines(output)
    assert len(lines) == 1, output[-6000:]
    assert re.match(r"pretrain_gpt.py: error: iteration 1 failed 2 times with no rank failing "
                    r"\(rank [01]: IndexError: index out of range", lines[0]), lines
    assert f"The state of iteration 0 is saved in {checkpoint}" in lines[0]
    assert not re.search(r"worker rank \d \(pid \d+\) exited with code [^1]", output), output[-4000:]
    assert iterations == [] and "Traceback" not in output
