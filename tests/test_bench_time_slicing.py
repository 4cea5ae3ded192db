"""The benchmarks' time slicing (``scripts/bench/common.py``): every arm gets its windows of
measured iterations, and no measured iteration is one that a pause cut in two, whether a run
writes an iteration's record at its end or, like ``pretrain_gpt.py --elastic``, one step later.
The interval given for a median ratio covers the median as often as it says, also where each
set of runs has a speed of its own."""

from __future__ import annotations

import math
import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

from common import (  # noqa: E402
    RESUME_DROPPED,
    Alternated,
    SlicedJob,
    bootstrap_median_ratio,
    median_interval,
    time_sliced,
)

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


def _sets_with_speeds_of_their_own(draws: random.Random, sets: int, rounds: int) -> Alternated:
    """Step times of an arm against a base whose population median ratio is 1: each set's
    runs have a speed of their own (the log of their ratio drawn with a standard deviation of
    0.05), each round adds its own noise (0.08), as measured on a 2-core host."""
    runs = {"base": [], "arm": []}
    for _ in range(sets):
        speed = draws.gauss(0.0, 0.05)
        for _ in range(rounds):
            runs["base"].append([{"step_time_s": 1.0}])
            runs["arm"].append([{"step_time_s": math.exp(speed + draws.gauss(0.0, 0.08))}])
    return Alternated(runs, rounds_per_set=rounds)


def test_ratio_interval_covers_the_median_where_each_set_has_a_speed_of_its_own():
    draws = random.Random(0)
    covered = covered_by_rounds = 0
    trials = 1000
    for _ in range(trials):
        times = _sets_with_speeds_of_their_own(draws, sets=10, rounds=6)
        low, high = times.ratio_interval("arm", "base")
        covered += low <= 1.0 <= high
        low, high = median_interval(times.round_ratios("arm", "base"))
        covered_by_rounds += low <= 1.0 <= high
    assert 0.95 <= covered / trials <= 0.995  # 10 sets: the bound's exact coverage is 0.9785
    # Taken as independent, the rounds would claim what they cannot show.
    assert covered_by_rounds / trials < 0.92  # they claim 0.95 or more


def test_paired_ratio_is_the_median_over_sets_of_each_sets_median_round_ratio():
    step = [1.0, 1.2, 1.1, 0.5, 0.6, 0.7, 2.0, 1.9, 1.8]
    times = Alternated({"base": [[{"step_time_s": 1.0}]] * 9,
                        "arm": [[{"step_time_s": s}] for s in step]}, rounds_per_set=3)
    assert times.set_ratios("arm", "base") == [1.1, 0.6, 1.9]
    assert times.paired_ratio("arm", "base") == 1.1
    assert times.ratio_interval("arm", "base") == (0.6, 1.9)  # 3 sets: their whole range


def test_the_bootstrap_interval_of_a_ratio_of_medians_covers_the_true_ratio():
    draw = random.Random(7)
    covered = 0
    for _ in range(40):
        samples = [draw.lognormvariate(math.log(1.5), 0.2) for _ in range(9)]
        base = [draw.lognormvariate(0.0, 0.2) for _ in range(9)]
        low, high = bootstrap_median_ratio(samples, base, draws=400)
        assert low <= statistics.median(samples) / statistics.median(base) <= high
        covered += low <= 1.5 <= high
    assert covered >= 32  # 95% intervals: about 38 of 40
