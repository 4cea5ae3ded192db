"""The benchmarks' time slicing (``scripts/bench/common.py``): every arm gets its windows of
measured iterations, and no measured iteration is one that a pause cut in two, whether a run
writes an iteration's record at its end or, like ``pretrain_gpt.py --elastic``, one step later.
The interval given for a median ratio covers the median as often as it says."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

from common import RESUME_DROPPED, SlicedJob, median_interval, time_sliced  # noqa: E402

STEP_S = 0.1
WINDOW = 3

TRAINER = """
import argparse, json, time

parser = argparse.ArgumentParser()
parser.add_argument("--train-iters", type=int)
parser.add_argument("--record-lag", type=int)
args = parser.parse_args()
held = []
for iteration in range(1, args.train_iters + 1):
    start = time.perf_counter()
    time.sleep({step_s})
    held.append({{"iteration": iteration, "step_time_s": time.perf_counter() - start,
                  "cpu_time_s": 0.0}})
    while len(held) > args.record_lag:
        print(json.dumps(held.pop(0)), flush=True)
"""


@pytest.mark.parametrize("record_lag", [0, 1])
def test_measured_windows_hold_no_iteration_cut_by_a_pause(tmp_path, record_lag):
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER.format(step_s=STEP_S))
    assert record_lag < RESUME_DROPPED

    def arm(train_iters: int) -> SlicedJob:
        # Executed, not forked from a server that imports torch and megatron-core: the trainer
        # needs neither.
        return SlicedJob(trainer, ["--train-iters", str(train_iters),
                                   "--record-lag", str(record_lag)], nproc=1,
                         launcher_args=["--preload", "none"])

    rounds = 3
    times = time_sliced({"first": arm, "second": arm}, rounds=rounds, window=WINDOW, warmup=2,
                        sets=2, report=lambda line: None)

    for name, runs in times.runs.items():
        assert len(runs) == 2 * rounds, name
        for run in runs:
            assert len(run) >= WINDOW
            iterations = [record["iteration"] for record in run]
            assert iterations == list(range(iterations[0], iterations[0] + len(run)))
            # Each pause lasts the other arm's whole window: an iteration it cut in two would
            # have taken several steps' time.
            assert max(record["step_time_s"] for record in run) < 3 * STEP_S, (name, run)


@pytest.mark.parametrize("count, ranks", [(10, (2, 9)), (24, (7, 18)), (48, (17, 32)), (5, (1, 5))])
def test_median_interval_is_the_sign_test_bound(count, ranks):
    # The tabulated 95% order statistics for the median; too few values give their whole range.
    values = [float(rank) for rank in range(count, 0, -1)]
    assert median_interval(values) == tuple(float(rank) for rank in ranks)


def test_median_interval_covers_the_median_at_least_as_often_as_it_says():
    draws = random.Random(0)
    covered = 0
    for _ in range(2000):
        low, high = median_interval([draws.lognormvariate(0.0, 0.1) for _ in range(24)])
        covered += low <= 1.0 <= high  # the median of lognormal(0, s) is 1
    assert 0.95 <= covered / 2000 <= 0.985  # the bound's exact coverage is 0.9773
