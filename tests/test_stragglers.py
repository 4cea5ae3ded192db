"""The straggler detector: when re-dealing micro-batches pays, and what it deals."""

from __future__ import annotations

import pytest

from megatron_elaswave.layout import Layout
from megatron_elaswave.training.stragglers import RebalanceConfig, StragglerDetector


def grid() -> Layout:
    # TP1 x PP2 x DP2, 8 micro-batches: replica 0 is ranks 0 and 2, replica 1 ranks 1 and 3.
    return Layout.megatron(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=8)


def observe(detector: StragglerDetector, layout: Layout, replica_s: dict[int, float],
            iterations: int) -> None:
    for _ in range(iterations):
        detector.observe(layout, {rank: replica_s[replica.index]
                                  for replica in layout.replicas
                                  for stage in replica.stages for rank in stage.ranks})


def test_a_replica_twice_as_slow_gets_fewer_microbatches():
    layout, detector = grid(), StragglerDetector(RebalanceConfig(window=3, min_gain=1.1))
    observe(detector, layout, {0: 1.0, 1: 2.0}, iterations=2)
    assert detector.proposal(layout) is None  # not enough iterations yet
    observe(detector, layout, {0: 1.0, 1: 2.0}, iterations=1)
    decision = detector.proposal(layout)
    counts = [r.num_microbatches for r in decision.layout.replicas]
    # 1F1B on 2 stages: 0.2 s and 0.4 s per micro-batch slot. (6, 2) takes max(7 * 0.2, 3 * 0.4)
    # = 1.4 s, (5, 3) 1.6 s, the even (4, 4) 2.0 s.
    assert counts == [6, 2]
    assert decision.predicted_gain == pytest.approx(2.0 / 1.4)
    assert "replica 1 takes 2.00x as long per micro-batch as replica 0" in decision.reason
    decision.layout.validate()
    # Replicas keep as many of their ids as they can; the stages do not change.
    assert set(decision.layout.replicas[1].microbatch_ids) <= set(layout.replicas[1].microbatch_ids)
    assert [r.stages for r in decision.layout.replicas] == [r.stages for r in layout.replicas]


def test_noise_below_the_minimum_gain_changes_nothing():
    layout, detector = grid(), StragglerDetector(RebalanceConfig(window=3, min_gain=1.2))
    observe(detector, layout, {0: 1.0, 1: 1.15}, iterations=3)
    assert detector.proposal(layout) is None


def test_the_median_ignores_one_slow_iteration():
    layout, detector = grid(), StragglerDetector(RebalanceConfig(window=3, min_gain=1.1))
    observe(detector, layout, {0: 1.0, 1: 1.0}, iterations=2)
    observe(detector, layout, {0: 1.0, 1: 9.0}, iterations=1)
    assert detector.proposal(layout) is None


def test_a_very_slow_replica_keeps_one_microbatch():
    layout, detector = grid(), StragglerDetector(RebalanceConfig(window=1, min_gain=1.1))
    observe(detector, layout, {0: 1.0, 1: 100.0}, iterations=1)
    counts = [r.num_microbatches for r in detector.proposal(layout).layout.replicas]
    assert counts == [7, 1]


def test_a_recovered_straggler_gets_its_share_back():
    layout, detector = grid(), StragglerDetector(RebalanceConfig(window=1, min_gain=1.1))
    observe(detector, layout, {0: 1.0, 1: 2.0}, iterations=1)
    slowed = detector.proposal(layout).layout
    detector.reset()
    observe(detector, slowed, {0: 1.4, 1: 0.6}, iterations=1)  # 7 and 3 slots of 0.2 s each
    assert [r.num_microbatches for r in detector.proposal(slowed).layout.replicas] == [4, 4]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="window"):
        RebalanceConfig(window=0)
    with pytest.raises(ValueError, match="min_gain"):
        RebalanceConfig(min_gain=0.5)
