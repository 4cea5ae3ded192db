"""The chaos soak's trajectory check: within 1e-4 of the failure-free run, or within twice what
a failure-free run on another layout drifts in the same window, never beyond both; and its table
of MTTR on both stores."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

from chaos import (  # noqa: E402
    LOSS_TOLERANCE,
    off_trajectory,
    relative_differences,
    comparison,
)


def records(losses: dict[int, float]) -> list[dict]:
    return [{"iteration": i, "lm_loss": loss} for i, loss in losses.items()]


def test_relative_differences_compare_the_iterations_both_runs_have():
    reference = records({1: 2.0, 2: 4.0, 3: 5.0})
    run = records({1: 2.0, 2: 4.5})
    assert relative_differences(run, reference) == {1: 0.0, 2: 0.125}


def test_a_run_within_the_tolerance_is_on_the_trajectory_whatever_the_other_layout_does():
    differences = {i: LOSS_TOLERANCE * 0.9 for i in range(1, 300)}
    assert off_trajectory(differences, {}) == []


def test_late_drift_as_large_as_another_layouts_is_on_the_trajectory():
    floor = {i: 1e-7 for i in range(1, 1100)} | {i: 2e-4 for i in range(1100, 1200)}
    differences = {i: 1e-7 for i in range(1, 1100)} | {1150: 3.5e-4}
    assert off_trajectory(differences, floor) == []


def test_a_jump_beyond_both_bounds_is_off_the_trajectory():
    floor = {i: 1e-6 for i in range(1, 300)} | {1150: 2e-4}
    differences = {i: 1e-7 for i in range(1, 300)} | {120: 5e-4, 1150: 4.5e-4}
    # 120: the other layout drifted 1e-6 there; 1150: more than twice its 2e-4
    assert off_trajectory(differences, floor) == [120, 1150]


def test_the_comparison_has_a_ratio_where_both_soaks_measured_a_kind():
    tcp = {"kill": {"median_s": 1.0, "count": 2, "p90_s": 1.2},
           "node": {"median_s": 0.5, "count": 1, "p90_s": 0.5}}
    etcd = {"kill": {"median_s": 1.5, "count": 2, "p90_s": 1.75},
            "node0": {"median_s": 2.5, "count": 1, "p90_s": 2.5}}
    assert comparison(("TCPStore", tcp), ("etcd", etcd)) == [
        "| fault kind | TCPStore median (n; p90) | etcd median (n; p90) | etcd / TCPStore |",
        "|---|---|---|---|",
        "| kill | 1.00 s (2; 1.20 s) | 1.50 s (2; 1.75 s) | 1.50 |",
        "| node | 0.50 s (1; 0.50 s) |  |  |",
        "| node0 |  | 2.50 s (1; 2.50 s) |  |",
    ]
