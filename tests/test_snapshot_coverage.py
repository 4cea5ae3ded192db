"""The invariant behind every recovery, as a property: one failure never loses state.

A model of a job's snapshots runs the real parts that decide what survives: each rank's
:class:`~megatron_elaswave.runtime.snapshot.SnapshotStore` (what it keeps and drops), the buddy placement
(:func:`~megatron_elaswave.planner.zero.buddy_ranks`), the layouts the planner gives after a
failure (:func:`~megatron_elaswave.training.recovery.planning.plan_without`) and the rollback rule
(:func:`~megatron_elaswave.runtime.snapshot.newest_whole_iteration`). Hypothesis draws the layout, the
number of copies and a sequence of steps, layer moves, re-deals, failures and grows; every
change is cut into the single copies it makes (a rank keeping its own snapshot, one replica
arriving at one buddy), in a drawn order. After every single copy, the job must survive the
loss of any one rank, or of any one node where buddies can be on other nodes: some iteration
no older than the last one settled everywhere must still be whole among the others.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_elaswave.layout import Layout, Replica, StageInstance
from megatron_elaswave.planner.cost import CostModel
from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.planner.profile import SyntheticModel, synthetic_profile
from megatron_elaswave.planner.replan import PlanError
from megatron_elaswave.planner.zero import buddy_ranks
from megatron_elaswave.runtime import wire
from megatron_elaswave.runtime.snapshot import Snapshot, SnapshotConfig, SnapshotStore, newest_whole_iteration
from megatron_elaswave.training.recovery.planning import plan_without

SHARD = {"main_param": torch.zeros(4)}


class SnapshotModel:
    """The snapshots of a job's ranks, changed one copy at a time."""

    def __init__(self, layout: Layout, copies: int, ranks_per_node: int | None,
                 cost: CostModel) -> None:
        self.layout = layout
        self.copies = copies
        self.ranks_per_node = ranks_per_node
        self.cost = cost
        self.version = 0
        self.iteration = 0
        self.settled: int | None = None
        """The newest iteration whose set every rank holds complete, own and replicated."""
        self.stores = {rank: SnapshotStore(rank, SnapshotConfig(replicas=copies))
                       for rank in layout.known_ranks()}
        self.changing_from: Layout | None = None
        """During a layout change, the layout before it: until the new layout's set is whole,
        the old one's protects the state, with the copies it could place."""
        self.recovering = False
        """Between a failure and the end of its recovery's snapshots, one copy of the failed
        rank's state is gone: one failure fewer is survivable."""
        self.checked = 0

    # -- copies ---------------------------------------------------------------------------------

    def copies_of(self, iteration: int) -> list[tuple[int, int]]:
        """Every single copy a set of ``iteration`` in the current layout takes: ``(owner,
        holder)``, the owner keeping its own first."""
        placed = []
        for rank in sorted(self.layout.active_ranks()):
            placed.append((rank, rank))
            placed += [(rank, buddy) for buddy in buddy_ranks(
                self.layout, rank, self.copies, self.ranks_per_node)]
        return placed

    def take_set(self, iteration: int, order: list[int]) -> None:
        """Snapshot ``iteration`` on every active rank and replicate it, copy by copy in
        ``order`` (an owner's replicas leave only once it holds its own), checking the
        invariant after each."""
        copies = self.copies_of(iteration)
        owners = len(self.layout.active_ranks())
        made: dict[int, Snapshot] = {}
        pending = [copies[i % len(copies)] for i in order] + copies
        done: set[tuple[int, int]] = set()
        while len(done) < len(copies):
            owner, holder = next(c for c in pending if c not in done and (
                c[0] == c[1] or c[0] in made))
            pending.remove((owner, holder))
            if owner == holder:
                made[owner] = self.stores[owner].capture(iteration, SHARD, {}, self.version,
                                                         owners)
            else:
                sent = made[owner]
                self.stores[holder]._keep(Snapshot.from_header(wire.loads(sent.header()),
                                                               sent.payload.clone()))
            done.add((owner, holder))
            self.check()
        self.settled = iteration

    # -- events ---------------------------------------------------------------------------------

    def start(self) -> None:
        """The first snapshot, of the state before the first step."""
        self.take_set(0, [])
        self.check()

    def step(self, order: list[int]) -> None:
        self.iteration += 1
        self.take_set(self.iteration, order)

    def move_layers(self, replica_index: int, cuts: list[int], order: list[int]) -> None:
        """Re-cut one replica's layers at the step boundary (a rebalance)."""
        replica = self.layout.replicas[replica_index % len(self.layout.replicas)]
        stages = len(replica.stages)
        if stages < 2:
            return
        counts = _counts(self.layout.num_layers, stages, cuts)
        first, restaged = 0, []
        for stage, count in zip(replica.stages, counts):
            restaged.append(StageInstance(stage.ranks, first, first + count - 1))
            first += count
        moved = replica.keeping_chunks(tuple(restaged), replica.microbatch_ids)
        self.change(Layout(self.layout.num_layers, tuple(
            moved if r.index == replica.index else r for r in self.layout.replicas),
            self.layout.spares), order)

    def fail(self, victim: int, order: list[int]) -> None:
        """``victim`` (one of the known ranks) dies; the others roll back and re-plan."""
        ranks = sorted(self.layout.known_ranks())
        dead = ranks[victim % len(ranks)]
        if len(ranks) == 1:
            return
        survivors = [r for r in ranks if r != dead]
        rollback = newest_whole_iteration(t for r in survivors for t in self.stores[r].held())
        if self.tolerated() < 1 and (rollback is None or rollback < self.settled):
            # Beyond what the layout could protect (no other instance of a tensor-parallel rank
            # to hold copies): the newest set may be gone; resuming is a checkpoint's job.
            raise Stopped
        assert rollback is not None and rollback >= self.settled
        try:
            layout, _ = plan_without(self.layout, {dead}, self.cost, "elaswave")
        except PlanError:  # the survivors save a checkpoint and stop: nothing more to check
            raise Stopped from None
        del self.stores[dead]
        for store in self.stores.values():
            store.forget_after(rollback)
        self.iteration = self.settled = rollback
        self.recovering = True
        self.change(layout, order)
        self.recovering = False

    def grow(self, complete: Layout, order: list[int]) -> None:
        """Every rank lost comes back: the job runs its failure-free layout again."""
        for rank in complete.known_ranks() - self.layout.known_ranks():
            self.stores[rank] = SnapshotStore(rank, SnapshotConfig(replicas=self.copies))
        self.change(complete, order)

    def change(self, layout: Layout, order: list[int]) -> None:
        """A layout change at the step boundary: the state restored into ``layout`` is
        snapshotted there again, as a new version beside the old one."""
        self.changing_from = self.layout
        self.layout, self.version = layout, self.version + 1
        self.take_set(self.iteration, order)
        self.changing_from = None

    # -- the invariant --------------------------------------------------------------------------

    def layouts(self) -> tuple[Layout, ...]:
        """The layout, and during a change the one before it too."""
        return (self.layout,) if self.changing_from is None else (self.layout, self.changing_from)

    def tolerated(self) -> int:
        """How many ranks may fail now: the copies, as far as each of :meth:`layouts` has other
        stage instances of each tensor-parallel rank to hold them; one fewer during a
        recovery."""
        fewest = min(len(ranks) for layout in self.layouts()
                     for ranks in instances(layout).values())
        return min(self.copies, fewest - 1) - self.recovering

    def check(self) -> None:
        """As many failures as there are copies may come now (one fewer during a recovery),
        where the layout has that many other stage instances of each tensor-parallel rank to
        hold them: any one rank, or (but during a recovery) any one node that leaves an instance
        of each tensor-parallel rank on another node; with two copies, any two ranks."""
        if self.settled is None:  # a job stops on a failure before its first snapshot
            return
        tolerated = self.tolerated()
        if tolerated < 1:
            return
        ranks = sorted(self.stores)
        domains = [{rank} for rank in ranks]
        if self.ranks_per_node and not self.recovering:
            for node in {rank // self.ranks_per_node for rank in ranks}:
                on_node = {r for r in ranks if r // self.ranks_per_node == node}
                if all(ranks - on_node for layout in self.layouts()
                       for ranks in instances(layout).values()):
                    domains.append(on_node)
        if tolerated >= 2:
            domains += [{a, b} for a in ranks for b in ranks if a < b]
        held_by = {rank: self.stores[rank].held() for rank in ranks}
        for lost in domains:
            newest = newest_whole_iteration(
                t for r in ranks if r not in lost for t in held_by[r])
            assert newest is not None and newest >= self.settled, (
                f"losing {sorted(lost)} loses state: layout {self.layout.to_json()}, "
                f"held {[t for r in ranks for t in held_by[r]]}")
        self.checked += 1


def instances(layout: Layout) -> dict[int, set[int]]:
    """The ranks of each tensor-parallel rank's stage instances."""
    ranks: dict[int, set[int]] = {}
    for replica in layout.replicas:
        for stage in replica.stages:
            for tp_rank, rank in enumerate(stage.ranks):
                ranks.setdefault(tp_rank, set()).add(rank)
    return ranks


class Stopped(Exception):
    """No layout of the survivors holds the model."""


def _counts(num_layers: int, stages: int, cuts: list[int]) -> list[int]:
    """Layer counts of ``stages`` stages, at least one each, from drawn cut points."""
    points = sorted({1 + c % (num_layers - 1) for c in cuts})[:stages - 1]
    while len(points) < stages - 1:
        points = sorted(set(points) | {next(p for p in range(1, num_layers) if p not in points)})
    bounds = [0, *points, num_layers]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def cost_for(tp: int, pp: int, dp: int, layers: int) -> CostModel:
    model = SyntheticModel(num_layers=layers, hidden_size=256, ffn_hidden_size=704, vocab_size=1000,
                           seq_length=128, tensor_model_parallel_size=tp)
    return CostModel(synthetic_profile(model),
                     JobSpec(tp, pp, dp, layers, global_batch_size=4 * dp, micro_batch_size=1))


orders = st.lists(st.integers(0, 10**6), max_size=24)
events = st.one_of(
    st.tuples(st.just("step"), orders),
    st.tuples(st.just("move"), st.integers(0, 7), st.lists(st.integers(0, 64), min_size=1,
                                                           max_size=4), orders),
    st.tuples(st.just("fail"), st.integers(0, 63), orders),
    st.tuples(st.just("grow"), orders),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(tp=2, pp=1, dp=3, copies=2, nodes=1,  # a third failure, with one replica left
         sequence=[("fail", 4, []), ("fail", 1, []), ("step", []), ("fail", 1, [])])
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2, 3, 4]), dp=st.sampled_from([2, 3]),
       copies=st.sampled_from([1, 2]), nodes=st.sampled_from([1, 2]),
       sequence=st.lists(events, min_size=1, max_size=8))
def test_one_failure_never_loses_state(tp, pp, dp, copies, nodes, sequence):
    layers = 2 * pp
    world = tp * pp * dp
    per_node = world // nodes if world % nodes == 0 and nodes > 1 else None
    complete = Layout.megatron(tp=tp, pp=pp, dp=dp, num_layers=layers, num_microbatches=4 * dp)
    model = SnapshotModel(complete, copies, per_node, cost_for(tp, pp, dp, layers))
    model.start()
    try:
        for event in sequence:
            kind, *arguments = event
            if kind == "step":
                model.step(*arguments)
            elif kind == "move":
                model.move_layers(*arguments)
            elif kind == "fail":
                model.fail(*arguments)
            elif model.layout.known_ranks() != complete.known_ranks():
                model.grow(complete, *arguments)
    except Stopped:
        pass
    assert model.checked > 0


def test_the_model_finds_state_lost_when_a_new_version_replaces_the_old():
    """The property can fail: a store that let a layout's snapshot replace the one of the same
    iteration in the layout before (as it once did) loses state when a rank fails in the middle
    of the new layout's copies."""
    layout = Layout.megatron(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=4)
    model = SnapshotModel(layout, 1, None, cost_for(1, 2, 2, 4))
    model.start()
    model.step([])
    replica = layout.replicas[0]
    moved = Replica(replica.index, (StageInstance(replica.stages[0].ranks, 0, 0),
                                    StageInstance(replica.stages[1].ranks, 1, 3)),
                    replica.microbatch_ids)
    new = Layout(4, (moved, layout.replicas[1]))
    for store in model.stores.values():  # a store of one version per (rank, iteration)
        original = store._keep

        def replacing(snapshot, store=store, original=original):
            for key in [k for k in store._held if k[:2] == (snapshot.rank, snapshot.iteration)]:
                del store._held[key]
            original(snapshot)

        store._keep = replacing
    model.layout, model.version = new, 1
    # Two ranks re-snapshot and replicate; a third has kept only its own.
    try:
        model.take_set(model.iteration, [0, 1, 2, 3, 4])
    except AssertionError as lost:
        assert "loses state" in str(lost)
    else:
        raise AssertionError("the model did not notice the lost state")
