"""Micro-batch counts and ids: exact global batch, minimal step time, deterministic, stable."""

from itertools import product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_elaswave.planner.dataflow import (
    ReplicaSpeed,
    assign_microbatch_ids,
    balance_microbatches,
    pipeline_speed,
    resize_deal,
)

speeds_strategy = st.lists(st.tuples(st.integers(0, 50), st.integers(1, 30)), min_size=1, max_size=4).map(
    lambda pairs: [ReplicaSpeed(i, fill, per) for i, (fill, per) in enumerate(pairs)]
)


@settings(max_examples=120, deadline=None)
@given(speeds_strategy, st.integers(0, 9))
def test_counts_are_exact_and_minimise_the_slowest_replica(speeds, total):
    counts = balance_microbatches(speeds, total)
    assert sum(counts.values()) == total
    achieved = max(s.step_ns(counts[s.replica]) for s in speeds)
    best = min(
        max(s.step_ns(n) for s, n in zip(speeds, split))
        for split in product(range(total + 1), repeat=len(speeds))
        if sum(split) == total
    )
    assert achieved == best


def test_counts_follow_speed():
    speeds = [ReplicaSpeed(0, 0, 10), ReplicaSpeed(1, 0, 10), ReplicaSpeed(2, 0, 20)]
    assert balance_microbatches(speeds, 50) == {0: 20, 1: 20, 2: 10}


def test_ties_go_to_the_lower_replica_index():
    speeds = [ReplicaSpeed(3, 0, 10), ReplicaSpeed(1, 0, 10)]
    assert balance_microbatches(speeds, 3) == {1: 2, 3: 1}


def test_pipeline_speed_is_the_1f1b_model():
    speed = pipeline_speed(0, [(1, 2), (2, 4), (1, 2)], send_ns=1)
    assert speed.per_microbatch_ns == 6
    assert speed.step_ns(5) == 3 + 6 + 3 + 4 * 6 + 4 * 1  # every stage once, then the slowest


@st.composite
def reassignments(draw):
    num_replicas = draw(st.integers(1, 5))
    total = draw(st.integers(0, 20))
    owners = draw(st.lists(st.integers(0, num_replicas - 1), min_size=total, max_size=total))
    previous = {r: [i for i, o in enumerate(owners) if o == r] for r in range(num_replicas)}
    survivors = draw(st.lists(st.sampled_from(range(num_replicas)), min_size=1, unique=True))
    cuts = sorted(
        draw(st.lists(st.integers(0, total), min_size=len(survivors) - 1, max_size=len(survivors) - 1))
    )
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    return previous, dict(zip(sorted(survivors), sizes)), total


@settings(max_examples=120, deadline=None)
@given(reassignments())
def test_ids_are_a_permutation_and_replicas_keep_what_they_can(case):
    previous, counts, total = case
    ids = assign_microbatch_ids(counts, previous, total)
    assert sorted(i for v in ids.values() for i in v) == list(range(total))
    for replica, assigned in ids.items():
        assert len(assigned) == counts[replica]
        assert list(assigned) == sorted(assigned)
        kept = set(assigned) & set(previous[replica])
        assert len(kept) == min(counts[replica], len(previous[replica]))
    assert ids == assign_microbatch_ids(dict(reversed(list(counts.items()))), previous, total)


def test_a_dissolved_replica_hands_its_ids_to_the_others():
    previous = {0: [0, 3, 6], 1: [1, 4, 7], 2: [2, 5, 8]}
    ids = assign_microbatch_ids({0: 5, 1: 4}, previous, 9)
    assert ids == {0: (0, 2, 3, 5, 6), 1: (1, 4, 7, 8)}


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError):
        assign_microbatch_ids({0: 2}, {0: [0, 1, 2]}, 3)
    with pytest.raises(ValueError):
        assign_microbatch_ids({0: 2}, {0: [0, 0]}, 2)
    with pytest.raises(ValueError):
        balance_microbatches([], 4)


def test_a_resized_batch_is_dealt_round_robin_where_the_shares_are_equal():
    """A batch size ramp-up deals the ids as Megatron-LM's sampler does on equal replicas."""
    assert resize_deal({0: 2, 1: 2}, 8) == {0: (0, 2, 4, 6), 1: (1, 3, 5, 7)}


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 5), st.integers(1, 8), min_size=1, max_size=4),
       st.integers(0, 64))
def test_a_resized_batch_keeps_the_replicas_proportions(counts, total):
    """Every id once; each replica's new count within one of its exact share."""
    dealt = resize_deal(counts, total)
    assert sorted(i for ids in dealt.values() for i in ids) == list(range(total))
    whole = sum(counts.values())
    for replica, ids in dealt.items():
        assert abs(len(ids) - counts[replica] * total / whole) < 1
