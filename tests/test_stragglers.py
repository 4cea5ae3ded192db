"""The straggler detector: when re-dealing micro-batches pays, and what it deals."""

from __future__ import annotations

import pytest

from megatron_elaswave.layout import Layout
from megatron_elaswave.training.stragglers import (
    RebalanceConfig,
    StageCompute,
    StragglerDetector,
    balanced_layer_counts,
)


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


def test_a_very_slow_interleaved_replica_keeps_a_microbatch_per_stage():
    """The interleaved schedule it is built for runs at least one micro-batch per stage."""
    layout = Layout.megatron(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=8, virtual_stages=2)
    detector = StragglerDetector(RebalanceConfig(window=1, min_gain=1.1))
    observe(detector, layout, {0: 1.0, 1: 100.0}, iterations=1)
    new = detector.proposal(layout).layout
    assert [r.num_microbatches for r in new.replicas] == [6, 2]
    assert [r.virtual_stages for r in new.replicas] == [2, 2]


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
    with pytest.raises(ValueError, match="slow_stage_factor"):
        RebalanceConfig(slow_stage_factor=1.0)


# --- moving layers off a slow stage ----------------------------------------------------------


def layer_ranges(layout: Layout) -> list[list[tuple[int, int]]]:
    return [[(s.first_layer, s.last_layer) for s in r.stages] for r in layout.replicas]


def lone_replica() -> Layout:
    return Layout.megatron(tp=1, pp=2, dp=1, num_layers=8, num_microbatches=4)


def observe_compute(detector: StragglerDetector, layout: Layout,
                    compute: dict[int, tuple[float, float]], iterations: int) -> None:
    """``compute``: stage leader -> (time in its transformer layers, time in the rest)."""
    for _ in range(iterations):
        detector.observe(layout, {rank: 1.0 for rank in compute},
                         {rank: StageCompute(*times) for rank, times in compute.items()})


@pytest.mark.parametrize("per_layer, rest, counts", [
    ([1.0, 3.0], [0.0, 0.0], (6, 2)),
    ([1.0, 1.0], [0.0, 0.0], (4, 4)),
    ([1.0, 1.0], [0.0, 2.0], (5, 3)),  # the output layer's cost stays on the last stage
    ([2.0, 1.0, 1.0], [0.0, 0.0, 0.0], (2, 3, 3)),
])
def test_layers_go_where_they_finish_soonest(per_layer, rest, counts):
    assert balanced_layer_counts(per_layer, rest, 8) == counts


def test_a_slow_stage_of_a_lone_replica_gives_layers_away():
    """One replica (re-dealing micro-batches cannot help): its second stage takes three times
    as long per layer, so it keeps two of eight layers; predicted twice as fast."""
    layout = lone_replica()
    detector = StragglerDetector(RebalanceConfig(window=3, min_gain=1.2))
    detector.reset(planned=layout)
    observe_compute(detector, layout, {0: (4.0, 0.0), 1: (12.0, 0.0)}, iterations=2)
    assert detector.proposal(layout) is None and detector.layer_proposal(layout) is None
    observe_compute(detector, layout, {0: (4.0, 0.0), 1: (12.0, 0.0)}, iterations=1)
    moved = detector.layer_proposal(layout)
    assert layer_ranges(moved.layout) == [[(0, 5), (6, 7)]]
    assert moved.predicted_gain == pytest.approx(2.0)
    assert "3.00x as long per layer" in moved.reason
    moved.layout.validate()


def test_stages_that_differ_by_construction_keep_the_planned_layers():
    """Even devices, but the last stage also runs the output layer: that is the planner's
    business, not a straggler's, so no layer moves however much it would gain."""
    layout = lone_replica()
    detector = StragglerDetector(RebalanceConfig(window=3, min_gain=1.2))
    detector.reset(planned=layout)
    observe_compute(detector, layout, {0: (4.0, 0.2), 1: (4.2, 4.0)}, iterations=3)
    assert detector.layer_proposal(layout) is None


def test_a_stage_below_the_slow_stage_factor_keeps_its_layers():
    layout = lone_replica()
    detector = StragglerDetector(RebalanceConfig(window=3, min_gain=1.1, slow_stage_factor=1.5))
    detector.reset(planned=layout)
    observe_compute(detector, layout, {0: (4.0, 0.0), 1: (5.6, 0.0)}, iterations=3)
    assert detector.layer_proposal(layout) is None


def test_layers_go_back_to_the_planned_counts_once_the_stage_recovers():
    layout = lone_replica()
    detector = StragglerDetector(RebalanceConfig(window=3, min_gain=1.2))
    detector.reset(planned=layout)
    observe_compute(detector, layout, {0: (4.0, 0.0), 1: (12.0, 0.0)}, iterations=3)
    moved = detector.layer_proposal(layout).layout
    detector.reset()  # a layer move keeps the planned counts
    observe_compute(detector, moved, {0: (6.0, 0.0), 1: (2.0, 0.0)}, iterations=3)
    back = detector.layer_proposal(moved)
    assert layer_ranges(back.layout) == layer_ranges(layout)
    assert back.predicted_gain == pytest.approx(1.5)
    assert "even again" in back.reason


def test_a_stage_that_measured_nothing_moves_no_layers():
    layout = lone_replica()
    detector = StragglerDetector(RebalanceConfig(window=2))
    detector.reset(planned=layout)
    observe_compute(detector, layout, {0: (0.0, 0.0), 1: (4.0, 0.0)}, iterations=2)
    assert detector.layer_proposal(layout) is None
