"""Interleaved ZeRO ownership and migration waves, against Megatron's contiguous layout."""

from collections import Counter
from math import ceil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_elaswave.layout import Layout
from megatron_elaswave.planner.cost import CostModel, MemoryModel
from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.planner.profile import SyntheticModel, synthetic_profile
from megatron_elaswave.planner.replan import plan_recovery
from megatron_elaswave.planner.zero import (
    StateLostError,
    buddy_rank,
    buddy_ranks,
    chunk_owners,
    contiguous_migration,
    interleaved_migration,
    schedule_waves,
    survival,
)


@st.composite
def ownership_cases(draw):
    replicas = draw(st.integers(1, 6))
    live = tuple(sorted(draw(st.sets(st.integers(0, replicas - 1), min_size=1))))
    per_replica = draw(st.integers(1, 3))
    return draw(st.integers(0, 40)), live, replicas, per_replica * replicas


@settings(max_examples=200, deadline=None)
@given(ownership_cases())
def test_ownership_is_balanced_and_only_orphans_move(case):
    part, live, replicas, chunks = case
    owners = chunk_owners(part, live, replicas, chunks).tolist()
    counts = Counter(owners)
    assert set(owners) <= set(live)
    assert max(counts.values()) <= ceil(chunks / len(live))
    full = chunk_owners(part, tuple(range(replicas)), replicas, chunks).tolist()
    assert Counter(full) == {r: chunks // replicas for r in range(replicas)}
    assert all(now == home for now, home in zip(owners, full) if home in live)


def test_orphans_of_consecutive_parts_go_to_different_replicas():
    live = (0, 1, 2)  # replica 3 of 4 is gone: one orphan chunk per part
    totals = Counter()
    for part in range(12):
        totals.update(chunk_owners(part, live, 4, 4).tolist())
    assert totals == {0: 16, 1: 16, 2: 16}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(1, 100)), max_size=30))
def test_waves_are_disjoint_and_keep_every_copy(raw):
    copies = [(s, d, b, f"copy {i}") for i, (s, d, b) in enumerate(raw) if s != d]
    cost = small_cost()
    plan = schedule_waves(copies, cost)
    assert sorted((t.src, t.dst, t.bytes, t.what) for t in plan.transfers) == sorted(copies)
    for wave in range(plan.num_waves):
        ranks = [r for t in plan.transfers if t.wave == wave for r in (t.src, t.dst)]
        assert len(ranks) == len(set(ranks)) and ranks
    # No rank takes part in more copies than there are waves, and the greedy is within 2x of that bound.
    degree = Counter(r for s, d, _, _ in copies for r in (s, d))
    if copies:
        assert max(degree.values()) <= plan.num_waves <= 2 * max(degree.values()) - 1


def small_cost(tp=2, pp=4, dp=3, **memory) -> CostModel:
    model = SyntheticModel(
        num_layers=8,
        hidden_size=256,
        ffn_hidden_size=704,
        vocab_size=1000,
        seq_length=128,
        tensor_model_parallel_size=tp,
    )
    return CostModel(
        synthetic_profile(model),
        JobSpec(tp, pp, dp, 8, global_batch_size=12 * dp, micro_batch_size=1),
        MemoryModel(**memory),
    )


def test_stage_failure_moves_only_that_replicas_state():
    cost = small_cost()
    old = cost.job.initial_layout()
    failed = frozenset({old.replicas[1].stages[2].ranks[0]})
    plan = plan_recovery(old, failed, cost)
    replica_ranks = {r for s in plan.layout.replicas[1].stages for r in s.ranks}
    transfers = plan.migration.transfers
    assert transfers and all(t.dst in replica_ranks for t in transfers)
    assert not any({t.src, t.dst} & failed for t in transfers)
    lost = [
        t
        for t in transfers
        if t.what.startswith("optimizer") and any(t.what.startswith(f"optimizer layer {l} ") for l in (4, 5))
    ]
    buddy = buddy_rank(old, min(failed))
    assert lost and {t.src for t in lost if t.what.endswith("tp 0")} == {buddy}
    contiguous = contiguous_migration(old, plan.layout, failed, cost)
    assert plan.migration.total_bytes < contiguous.total_bytes


def largest_stage(cost, layout, num_replicas):
    """Memory of the largest failure-free stage once ``num_replicas`` replicas share the optimizer."""
    stages = layout.replicas[0].stages
    return max(
        cost.stage_memory_bytes(s.first_layer, s.last_layer, i, len(stages), num_replicas)
        for i, s in enumerate(stages)
    )


def test_dissolved_replica_hands_over_its_chunks():
    cost = small_cost()
    old = cost.job.initial_layout()
    doomed = {r for s in old.replicas[2].stages for r in s.ranks}
    failed = {old.replicas[2].stages[0].ranks[0], old.replicas[2].stages[2].ranks[1]}
    # Two surviving stages would each need about twice a normal stage's memory: dissolve.
    plan = plan_recovery(old, failed, small_cost(memory_cap_bytes=int(largest_stage(cost, old, 2) * 1.2)))
    assert plan.dissolved_replicas == (2,)
    assert set(plan.layout.spares) == doomed - failed
    optimizer = [t for t in plan.migration.transfers if t.what.startswith("optimizer")]
    # One chunk of each of the 10 parts (embedding, 8 layers, loss) per TP rank was homed on replica 2.
    # The failed ranks' chunks come from their buddies, in other replicas: where a buddy is the
    # new owner it already holds the chunk and nothing moves.
    buddies = {buddy_rank(old, rank) for rank in failed}
    assert buddies.isdisjoint(doomed)
    assert 0 < len(optimizer) <= 10 * 2
    assert all(t.src in (doomed - failed) | buddies and t.dst not in doomed for t in optimizer)
    assert not [t for t in plan.migration.transfers if t.what.startswith("params")]


def test_parameters_are_rebuilt_from_snapshots_when_every_holder_failed():
    cost = small_cost(tp=1, pp=4, dp=1)
    old = cost.job.initial_layout()
    plan = plan_recovery(old, {1}, cost)  # stage 1 (layers 2-3) had no other copy
    rebuilt = [t for t in plan.migration.transfers if "from snapshot" in t.what]
    assert rebuilt and {t.src for t in rebuilt} == {buddy_rank(old, 1)}
    assert {t.what.split(" chunk")[0] for t in rebuilt} <= {"params layer 2", "params layer 3"}


def test_losing_a_rank_and_its_buddy_needs_a_checkpoint():
    cost = small_cost()
    old = cost.job.initial_layout()
    rank = old.replicas[0].stages[1].ranks[0]
    buddy = buddy_rank(old, rank)
    assert old.position(buddy)[0] != 0  # another replica, same TP rank
    with pytest.raises(StateLostError, match="both failed"):
        plan_recovery(old, {rank, buddy}, cost)


def test_interleaved_needs_fewer_bytes_than_contiguous_when_a_replica_dissolves():
    cost = small_cost(tp=1, pp=2, dp=4)
    old = cost.job.initial_layout()
    failed = frozenset({old.replicas[3].stages[0].ranks[0]})
    tight = small_cost(tp=1, pp=2, dp=4, memory_cap_bytes=int(largest_stage(cost, old, 3) * 1.2))
    plan = plan_recovery(old, failed, tight)
    interleaved = interleaved_migration(old, plan.layout, failed, tight)
    contiguous = contiguous_migration(old, plan.layout, failed, tight)
    assert plan.dissolved_replicas == (3,)
    assert interleaved.total_bytes * 2 < contiguous.total_bytes


def correlated_losses(layout: Layout, ranks_per_node: int | None) -> dict[str, set[int]]:
    """Every rank of one node, of one replica, and one stage index in every replica."""
    ranks = layout.active_ranks()
    losses = {}
    if ranks_per_node is not None:
        for node in {rank // ranks_per_node for rank in ranks}:
            losses[f"node {node}"] = {r for r in ranks if r // ranks_per_node == node}
    else:
        for replica in layout.replicas:
            losses[f"replica {replica.index}"] = {r for s in replica.stages for r in s.ranks}
        for stage in range(min(len(r.stages) for r in layout.replicas)):
            losses[f"stage {stage}"] = {rank for r in layout.replicas for rank in r.stages[stage].ranks}
    return losses


@pytest.mark.parametrize("tp, pp, dp, ranks_per_node", [
    (1, 4, 2, None), (2, 2, 2, None), (2, 2, 3, None), (1, 2, 4, None),
    (2, 2, 2, 4), (1, 4, 2, 4), (2, 4, 2, 8), (4, 2, 4, 8), (1, 4, 4, 2),
])
def test_a_correlated_loss_keeps_a_copy_of_every_snapshot(tp, pp, dp, ranks_per_node):
    layout = Layout.megatron(tp=tp, pp=pp, dp=dp, num_layers=8, num_microbatches=12)
    buddies = {rank: buddy_ranks(layout, rank, 1, ranks_per_node) for rank in layout.active_ranks()}
    for what, lost in correlated_losses(layout, ranks_per_node).items():
        if lost == layout.active_ranks():
            continue
        for rank in lost:
            assert not set(buddies[rank]) <= lost, (what, rank, buddies[rank])
    for rank, (buddy,) in buddies.items():
        assert layout.position(buddy)[2] == layout.position(rank)[2]  # the same TP rank


def test_one_shift_gives_every_rank_one_copy_where_it_can():
    layout = Layout.megatron(tp=1, pp=4, dp=2, num_layers=8, num_microbatches=8)
    held = Counter(b for rank in layout.active_ranks() for b in buddy_ranks(layout, rank, 1))
    assert sorted(held) == sorted(layout.active_ranks()) and set(held.values()) == {1}
    assert all(len(set(buddy_ranks(layout, rank, 3))) == 3 for rank in layout.active_ranks())


def test_survival_says_which_losses_the_snapshot_copies_survive():
    """No copy: no rank's loss is survived (and the pairs are not listed: every pair with any
    rank, a million at 1,024 ranks); one copy: every rank and its buddy are a fatal pair; two
    copies: any two ranks may fail."""
    large = Layout.megatron(tp=1, pp=4, dp=256, num_layers=8, num_microbatches=256)
    alone = survival(large, 0)
    assert not alone.any_rank and alone.fatal_pairs == ()
    assert alone.describe() == "survives no loss of a rank that holds a stage"
    layout = Layout.megatron(tp=1, pp=2, dp=4, num_layers=8, num_microbatches=8)
    one = survival(layout, 1)
    assert one.any_rank and len(one.fatal_pairs) >= len(layout.active_ranks()) // 2
    assert all(buddy_ranks(layout, a, 1)[0] == b or buddy_ranks(layout, b, 1)[0] == a
               for a, b in one.fatal_pairs)
    two = survival(layout, 2)
    assert two.any_rank and two.fatal_pairs == ()
    assert "of any two ranks" in two.describe()

