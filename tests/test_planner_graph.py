"""Minimax layer partition: optimal against brute force, memory caps, fewest moved bytes."""

from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_elaswave.planner.graph import PartitionProblem, solve_partition


def brute_force(problem: PartitionProblem):
    """Every contiguous partition, as (bottleneck, moved, ranges) of those that fit memory."""
    n, p = problem.num_layers, problem.num_stages
    found = []
    for cuts in combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        ranges = [(bounds[s], bounds[s + 1] - 1) for s in range(p)]
        times, moved, fits = [], 0, True
        for s, (a, b) in enumerate(ranges):
            layers = range(a, b + 1)
            times.append(sum(problem.layer_time_ns[l] for l in layers) + problem.stage_extra_time_ns[s])
            memory = (
                sum(
                    problem.layer_static_bytes[l]
                    + problem.stage_in_flight[s] * problem.layer_activation_bytes[l]
                    for l in layers
                )
                + problem.stage_extra_bytes[s]
            )
            fits &= problem.memory_cap_bytes is None or memory <= problem.memory_cap_bytes
            moved += sum(problem.layer_move_bytes[l] for l in layers if problem.current_stage[l] != s)
        if fits:
            found.append((max(times), moved, tuple(ranges)))
    return found


@st.composite
def problems(draw):
    num_layers = draw(st.integers(1, 7))
    num_stages = draw(st.integers(1, min(num_layers, 4)))
    small = st.integers(0, 20)
    return PartitionProblem(
        layer_time_ns=draw(st.lists(st.integers(1, 20), min_size=num_layers, max_size=num_layers)),
        layer_static_bytes=draw(st.lists(small, min_size=num_layers, max_size=num_layers)),
        layer_activation_bytes=draw(st.lists(small, min_size=num_layers, max_size=num_layers)),
        stage_extra_time_ns=draw(st.lists(small, min_size=num_stages, max_size=num_stages)),
        stage_extra_bytes=draw(st.lists(small, min_size=num_stages, max_size=num_stages)),
        stage_in_flight=[num_stages - s for s in range(num_stages)],
        memory_cap_bytes=draw(st.one_of(st.none(), st.integers(0, 200))),
        layer_move_bytes=draw(st.lists(st.integers(0, 50), min_size=num_layers, max_size=num_layers)),
        current_stage=draw(
            st.lists(st.integers(-1, num_stages - 1), min_size=num_layers, max_size=num_layers)
        ),
        tolerance=draw(st.sampled_from([0.0, 0.1, 0.5])),
    )


@settings(max_examples=150, deadline=None)
@given(problems())
def test_matches_brute_force(problem):
    candidates = brute_force(problem)
    result = solve_partition(problem)
    if not candidates:
        assert result is None
        return
    optimum = min(c[0] for c in candidates)
    assert result.optimal_bottleneck_ns == optimum
    threshold = int(optimum * (1 + problem.tolerance))
    near_optimal = [c for c in candidates if c[0] <= threshold]
    least_moved = min(c[1] for c in near_optimal)
    assert result.moved_bytes == least_moved
    assert result.bottleneck_ns == min(c[0] for c in near_optimal if c[1] == least_moved)
    # The returned ranges really have the figures it reports.
    assert (result.bottleneck_ns, result.moved_bytes, result.ranges) in candidates


@settings(max_examples=60, deadline=None)
@given(problems())
def test_ranges_cover_every_layer_once_in_order(problem):
    result = solve_partition(problem)
    if result is None:
        return
    layers = [l for first, last in result.ranges for l in range(first, last + 1)]
    assert layers == list(range(problem.num_layers))
    assert all(first <= last for first, last in result.ranges)


def uniform(num_layers, num_stages, **overrides):
    fields = dict(
        layer_time_ns=[10] * num_layers,
        layer_static_bytes=[1] * num_layers,
        layer_activation_bytes=[0] * num_layers,
        stage_extra_time_ns=[0] * num_stages,
        stage_extra_bytes=[0] * num_stages,
        stage_in_flight=[num_stages - s for s in range(num_stages)],
        memory_cap_bytes=None,
        layer_move_bytes=[1] * num_layers,
        current_stage=[-1] * num_layers,
    )
    fields.update(overrides)
    return PartitionProblem(**fields)


def test_lost_stage_spreads_over_survivors():
    # 32 layers, 4 stages of 8 before; stage 1 (layers 8-15) died, stages 0, 2, 3 survive.
    current = [0] * 8 + [-1] * 8 + [1] * 8 + [2] * 8
    result = solve_partition(uniform(32, 3, current_stage=current))
    assert result.optimal_bottleneck_ns == 110  # ceil(32 / 3) layers
    assert result.bottleneck_ns == 110
    assert max(last - first + 1 for first, last in result.ranges) == 11


def test_embedding_and_loss_costs_shift_layers_away_from_the_ends():
    result = solve_partition(uniform(12, 3, stage_extra_time_ns=[30, 0, 30]))
    assert result.ranges == ((0, 2), (3, 8), (9, 11))
    assert result.bottleneck_ns == 60


def test_memory_cap_forces_a_slower_partition_or_none():
    # Stage s holds 3 - s micro-batches in flight, so activations push layers to later stages.
    free = solve_partition(uniform(6, 3, layer_activation_bytes=[1] * 6, layer_static_bytes=[0] * 6))
    assert free.optimal_bottleneck_ns == 20
    capped = solve_partition(
        uniform(6, 3, layer_activation_bytes=[1] * 6, layer_static_bytes=[0] * 6, memory_cap_bytes=4)
    )
    assert capped.ranges == ((0, 0), (1, 2), (3, 5))
    assert capped.optimal_bottleneck_ns == 30
    assert (
        solve_partition(
            uniform(6, 3, layer_activation_bytes=[1] * 6, layer_static_bytes=[0] * 6, memory_cap_bytes=3)
        )
        is None
    )


def test_tolerance_trades_bottleneck_for_fewer_moved_bytes():
    # Stage 0 holds layers 0-5, stage 1 layers 6-8. The optimum (5 + 4 layers) moves the heavy
    # layer 5; within 25 % of the optimum, staying put moves nothing.
    current = [0] * 6 + [1] * 3
    move = [1, 1, 1, 1, 1, 1000, 1, 1, 1]
    strict = solve_partition(uniform(9, 2, current_stage=current, layer_move_bytes=move))
    assert strict.ranges == ((0, 4), (5, 8)) and strict.moved_bytes == 1000 and strict.bottleneck_ns == 50
    relaxed = solve_partition(uniform(9, 2, current_stage=current, layer_move_bytes=move, tolerance=0.25))
    assert relaxed.ranges == ((0, 5), (6, 8)) and relaxed.moved_bytes == 0
    assert relaxed.bottleneck_ns == 60 and relaxed.optimal_bottleneck_ns == 50


def test_invalid_problems_are_rejected():
    with pytest.raises(ValueError):
        uniform(2, 3)
    with pytest.raises(ValueError):
        uniform(4, 2, current_stage=[0, 5, 0, 0])
