"""The dynamic communicator: group specs against Megatron's, edits after a real death, and
``parallel_state`` rebuilt from the registry.

The multi-process tests run gloo workers under ``elaswave-run`` (``tests/workers``).
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist
from harness import free_port, launch, worker_script

from megatron_elaswave.launch.store import WaitInterrupted
from megatron_elaswave.layout import ExpertParallelism, Layout, Replica, StageInstance
from megatron_elaswave.patches.distributed_c10d import forget_unformed_default_group
from megatron_elaswave.runtime.communicator import (
    CREATION_TIMEOUT,
    HOST_ROLES,
    SEPARATE_HOST_GROUPS_ENV,
    EditMode,
    GroupSpec,
    Role,
    group_specs,
    host_member_lists,
    member_lists,
    plan_edit,
)
from megatron_elaswave.runtime.world import InterruptibleStore

multiprocess = pytest.mark.multiprocess

MEGATRON_ORDER = "tp-cp-ep-dp-pp"


def lists_of(specs, role: Role) -> list[tuple[int, ...]]:
    return sorted(spec.ranks for spec in specs if spec.role == role)


def read_reports(directory: Path) -> dict[int, dict]:
    return {
        int(path.stem.removeprefix("rank")): json.loads(path.read_text())
        for path in directory.glob("rank*.json")
    }


# --- pure: specs and edit plans ---------------------------------------------------------------


@pytest.mark.parametrize("tp, pp, dp", [(2, 2, 2), (2, 2, 4), (1, 4, 2), (4, 1, 2), (2, 4, 1)])
def test_specs_of_the_grid_are_megatrons_groups(tp, pp, dp):
    from megatron.core.parallel_state import (
        RankGenerator,
        default_embedding_ranks,
        default_position_embedding_ranks,
    )

    generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=MEGATRON_ORDER)
    pipelines = generator.get_ranks("pp")
    expected = {
        Role.TP: generator.get_ranks("tp"),
        Role.PP: pipelines,
        Role.MP: generator.get_ranks("tp-pp"),
        Role.DP: generator.get_ranks("dp"),
        Role.DP_CP: generator.get_ranks("dp-cp"),
        Role.TP_DP: generator.get_ranks("tp-dp"),
        Role.CP: generator.get_ranks("cp"),
        Role.EMBEDDING: [default_embedding_ranks(ranks) for ranks in pipelines],
        Role.POSITION_EMBEDDING: [default_position_embedding_ranks(ranks) for ranks in pipelines],
        # Megatron's distributed-optimizer instance group with one instance: every rank.
        Role.WORLD: [list(range(tp * pp * dp))],
    }
    specs = group_specs(Layout.megatron(tp=tp, pp=pp, dp=dp, num_layers=4 * pp, num_microbatches=dp))
    for role, groups in expected.items():
        assert lists_of(specs, role) == sorted(tuple(ranks) for ranks in groups), role


@pytest.mark.parametrize("tp, pp, dp, ep, etp", [
    (1, 2, 4, 4, 1),  # expert parallelism over every replica (Mixtral's recipe)
    (1, 2, 4, 2, 1),  # two lockstep sets, expert data parallelism 2
    (2, 2, 2, 2, 1),  # expert parallelism inside each tensor-parallel group
    (2, 1, 4, 4, 1),  # expert parallelism over the TP group and two replicas
    (2, 2, 2, 2, 2),  # expert tensor parallelism in the TP group, EP over the replicas
    (4, 1, 2, 2, 1),  # expert parallelism inside the TP group, expert DP inside it too
])
def test_expert_specs_of_the_grid_are_megatrons_expert_groups(tp, pp, dp, ep, etp):
    from megatron.core.parallel_state import RankGenerator

    experts = ExpertParallelism(num_experts=8, expert_parallel_size=ep,
                                expert_tensor_parallel_size=etp)
    generator = RankGenerator(tp=etp, ep=ep, dp=tp * dp // (ep * etp), pp=pp, cp=1,
                              order=MEGATRON_ORDER)
    expected = {Role.EP: generator.get_ranks("ep"), Role.EXPT_TP: generator.get_ranks("tp"),
                Role.TP_EP: generator.get_ranks("tp-ep"), Role.EXPT_DP: generator.get_ranks("dp")}
    layout = Layout.megatron(tp=tp, pp=pp, dp=dp, num_layers=2 * pp, num_microbatches=dp,
                             experts=experts)
    specs = group_specs(layout)
    for role, groups in expected.items():
        assert lists_of(specs, role) == sorted(tuple(ranks) for ranks in groups), role
    assert layout.lockstep_size == max(1, ep * etp // tp)


@pytest.mark.parametrize("experts, tp, dp, message", [
    ((6, 4, 1), 1, 4, "6 experts cannot be split evenly over 4 expert-parallel ranks"),
    ((8, 4, 1), 1, 2, "expert tensor x expert parallel size 4 must divide the 2 ranks"),
    ((6, 3, 1), 2, 3, "expert tensor x expert parallel size 3 and tensor-parallel size 2 "
     "must divide one another"),
])
def test_an_expert_grid_the_layout_cannot_keep_is_refused(experts, tp, dp, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Layout.megatron(tp=tp, pp=1, dp=dp, num_layers=2, num_microbatches=dp,
                        experts=ExpertParallelism(*experts))


def test_expert_groups_follow_a_layer_that_moves_to_a_new_holder():
    """TP1 x PP2 x DP2 with EP2 after rank 3 died: both replicas of the lockstep set run one
    stage, rank 1 is a spare; the expert groups of the merged layer group pair the holders, with
    each replica's expert-parallel rank unchanged."""
    experts = ExpertParallelism(num_experts=4, expert_parallel_size=2)
    layout = Layout(num_layers=4, replicas=(
        Replica(0, (StageInstance((0,), 0, 3),), (0, 2)),
        Replica(1, (StageInstance((2,), 0, 3),), (1, 3))), spares=(1,), experts=experts)
    specs = group_specs(layout)
    assert lists_of(specs, Role.EP) == [(0, 2)] and lists_of(specs, Role.EXPT_DP) == [(0,), (2,)]
    with pytest.raises(ValueError, match="differ in stages or micro-batches"):
        Layout(num_layers=4, replicas=(
            Replica(0, (StageInstance((0,), 0, 3),), (0, 2)),
            Replica(1, (StageInstance((1,), 0, 1), StageInstance((3,), 2, 3)), (1, 3))),
            spares=(2,), experts=experts).validate()


def heterogeneous_layout() -> Layout:
    """TP2 x PP2 x DP2 after rank 5 died: replica 0 runs on ranks 0-1 alone, rank 4 is a spare."""
    return Layout(
        num_layers=4,
        replicas=(
            Replica(0, (StageInstance((0, 1), 0, 3),), (0, 2, 4, 6, 7)),
            Replica(1, (StageInstance((2, 3), 0, 1), StageInstance((6, 7), 2, 3)), (1, 3, 5)),
        ),
        spares=(4,),
    )


def test_specs_of_heterogeneous_replicas_follow_layer_groups():
    specs = group_specs(heterogeneous_layout())
    assert lists_of(specs, Role.WORLD) == [(0, 1, 2, 3, 6, 7)]
    assert lists_of(specs, Role.MEMBERS) == [(0, 1, 2, 3, 4, 6, 7)]
    assert lists_of(specs, Role.TP) == [(0, 1), (2, 3), (6, 7)]
    assert lists_of(specs, Role.PP) == [(0,), (1,), (2, 6), (3, 7)]
    assert lists_of(specs, Role.EMBEDDING) == [(0,), (1,), (2, 6), (3, 7)]
    assert lists_of(specs, Role.POSITION_EMBEDDING) == [(0,), (1,), (2,), (3,)]
    assert lists_of(specs, Role.MP) == [(0, 1), (2, 3, 6, 7)]
    # Layer groups [0-1] and [2-3]: one DP group per layer group and TP rank, one rank per replica.
    dp = {spec.key: spec.ranks for spec in specs if spec.role == Role.DP}
    assert dp == {(0, 0): (0, 2), (0, 1): (1, 3), (1, 0): (0, 6), (1, 1): (1, 7)}
    assert lists_of(specs, Role.DP_CP) == sorted(dp.values())
    assert lists_of(specs, Role.TP_DP) == [(0, 1, 2, 3), (0, 1, 6, 7)]
    assert lists_of(specs, Role.CP) == [(0,), (1,), (2,), (3,), (6,), (7,)]


def test_an_edit_changes_only_the_groups_with_a_failed_rank_or_new_members():
    old = Layout.megatron(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=8)
    plan = plan_edit(old, heterogeneous_layout(), {5})
    assert set(plan.create) == {(0, 1, 2, 3, 6, 7), (0, 1, 2, 3, 4, 6, 7), (0, 6), (1, 7), (0, 1, 6, 7)}
    assert set(plan.drop) == {
        (0, 1, 2, 3, 4, 5, 6, 7), (4, 5), (0, 4), (1, 5), (0, 1, 4, 5), (4, 6), (5, 7),
        (4, 5, 6, 7), (4,), (5,),
    }
    # Replica 1's groups, and rank 0's and 1's stage-0 DP groups, survive untouched.
    assert {(2, 3), (6, 7), (2, 6), (3, 7), (2, 3, 6, 7), (0, 2), (1, 3), (0, 1, 2, 3)} <= set(plan.keep)
    assert set(plan.keep) | set(plan.create) == set(member_lists(group_specs(heterogeneous_layout())))
    assert all(5 not in members for members in plan.keep + plan.create)


def test_a_broken_group_is_recreated_even_if_its_members_live():
    old = Layout.megatron(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=8)
    plan = plan_edit(old, heterogeneous_layout(), {5}, broken=[(2, 6)])
    assert (2, 6) in plan.create and (2, 6) in plan.drop and (2, 6) not in plan.keep


def test_host_twins_follow_their_device_groups():
    old = Layout.megatron(tp=1, pp=1, dp=3, num_layers=2, num_microbatches=3)
    new = Layout(num_layers=2, replicas=(
        Replica(0, (StageInstance((0,), 0, 1),), (0, 1)),
        Replica(2, (StageInstance((2,), 0, 1),), (2,)),
    ))
    assert host_member_lists(old) == ((0, 1, 2),)  # the world is every member
    plan = plan_edit(old, new, {1})
    assert plan.host_create == ((0, 2),) and plan.host_drop == ((0, 1, 2),)
    # A re-plan that keeps the groups keeps their twins; a broken group's twin is re-created.
    assert plan_edit(old, old, ()).host_create == ()
    assert plan_edit(old, old, (), broken=[(0, 1, 2)]).host_create == ((0, 1, 2),)


def test_an_edit_refuses_a_layout_that_uses_a_failed_rank():
    old = Layout.megatron(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=8)
    with pytest.raises(ValueError, match="failed"):
        plan_edit(old, heterogeneous_layout(), {4})
    with pytest.raises(ValueError, match="not part of the job"):
        plan_edit(old, heterogeneous_layout(), {9})


def test_specs_validate_their_members():
    with pytest.raises(ValueError, match="no member"):
        GroupSpec(Role.TP, (0, 0), ())
    with pytest.raises(ValueError, match="bad ranks"):
        GroupSpec(Role.TP, (0, 0), (1, 1))


# --- a rendezvous that a failure interrupts -----------------------------------------------------


def test_a_rendezvous_waiting_for_a_missing_member_ends_when_a_failure_is_detected():
    """Rank 1 of the group never comes (it died before publishing its address): the read of its
    address ends when the failure is detected, not at the 60 s timeout."""
    failure = threading.Event()
    store = InterruptibleStore(dist.HashStore(), failure, timedelta(seconds=60))
    detection = threading.Timer(0.5, failure.set)
    detection.start()
    started = time.monotonic()
    with pytest.raises(WaitInterrupted, match="a failure was detected"):
        dist.init_process_group("gloo", store=dist.PrefixStore("gen1/", store), rank=0,
                                world_size=2, timeout=timedelta(seconds=60))
    assert 0.4 < time.monotonic() - started < 10
    assert not dist.is_initialized()


@multiprocess
@pytest.mark.timeout(300)
def test_a_recovery_stops_connecting_to_a_member_that_hung_after_publishing_its_address(tmp_path):
    """Gloo alone would keep rank 0 waiting for the stopped rank 1 for about five times
    ``CREATION_TIMEOUT`` (10 s); the edit ends within one of them of the failure's detection,
    with WaitInterrupted (the recovery then starts again without the hung member)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=90),
                          wait_for_workers=False)
    workers = [subprocess.Popen([sys.executable, worker_script("group_connect_abort.py"), str(rank),
                                 str(port), str(tmp_path)]) for rank in (0, 1)]
    hung = psutil.Process(workers[1].pid)
    try:
        for generation in itertools.count(1):
            store.wait([f"test/published/{generation}"])
            deadline = time.monotonic() + 10
            while hung.status() != psutil.STATUS_STOPPED:
                assert time.monotonic() < deadline, "rank 1 did not stop"
                time.sleep(0.01)
            store.set(f"test/stopped/{generation}", "")
            store.wait([f"test/result/{generation}"])
            if store.get(f"test/result/{generation}") == b"ended":
                break
            hung.resume()  # the group formed without waiting: try the next generation
        assert workers[0].wait(timeout=60) == 0
    finally:
        for worker in workers:
            worker.kill()
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["error"].startswith("WaitInterrupted: a failure was detected"), report
    assert report["after_abort_s"] < CREATION_TIMEOUT.total_seconds(), report


def test_a_default_group_whose_rendezvous_failed_leaves_the_next_one_named_as_a_first_one():
    """A survivor whose rebuild was interrupted while its default group formed must name the
    next one as the survivors that never got that far do, or their rendezvous never meet."""
    assert not dist.is_initialized()
    with pytest.raises(dist.DistStoreError):  # rank 1 never comes
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=2,
                                timeout=timedelta(seconds=1))
    forget_unformed_default_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.group.WORLD.group_name == "0"
    finally:
        dist.destroy_process_group()


def test_an_interruptible_store_reads_and_writes_through():
    store = InterruptibleStore(dist.HashStore(), threading.Event(), timedelta(seconds=5))
    store.set("key", "value")
    assert store.get("key") == b"value"
    assert store.add("count", 2) == 2 and store.check(["key", "count"])
    store.wait(["key"])


# --- processes: edits after a death -----------------------------------------------------------

WORLD_8 = 8


def run_edit_job(
    tmp_path: Path, mode: EditMode, victim: int, sigkill: bool, broken: list[tuple[int, ...]]
) -> dict[int, dict]:
    args = [worker_script("communicator_edit.py"), str(tmp_path), mode.value, str(victim)]
    args.append("--broken=" + ";".join(",".join(map(str, members)) for members in broken))
    if not sigkill:
        args.append("--victim-exits")
    with launch(args, nproc_per_node=WORLD_8, master_port=free_port()) as job:
        if sigkill:
            store = job.store()
            job.wait_for(lambda: store.check([f"test/ready/{r}" for r in range(WORLD_8)]), 45,
                         "every rank to build its groups")
            job.kill_worker(victim)
        returncode, output = job.wait(timeout=100)
    assert returncode == 0, output
    return read_reports(tmp_path)


def assert_groups_work(reports: dict[int, dict], victim: int) -> None:
    survivors = set(range(WORLD_8)) - {victim}
    assert reports.keys() == survivors
    first = reports[min(survivors)]
    for rank, report in reports.items():
        assert report["failed"] == [victim]
        assert (report["layout"], report["spares"]) == (first["layout"], first["spares"])
        for phase in ("before", "after"):
            for check in report[phase]:
                assert check["sum"] == sum(check["ranks"]), (rank, phase, check)
        assert all(victim not in check["ranks"] for check in report["after"])
        for p2p in report["default_group_p2p"]:
            assert p2p["received"] == p2p["peer"], (rank, p2p)
    # Every group of the new layout was checked by each of its members.
    for spec in group_specs(Layout.from_json(first["layout"], first["spares"])):
        for member in spec.ranks:
            checked = {(c["role"], tuple(c["key"])) for c in reports[member]["after"]}
            assert (spec.role.value, spec.key) in checked


@multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "mode, victim, sigkill, broken, separate_host",
    [
        (EditMode.INPLACE, 5, True, [(2, 6)], False),
        (EditMode.INPLACE, 0, True, [], False),
        (EditMode.PARTIAL, 3, False, [], False),
        (EditMode.FULL, 0, False, [], False),
        (EditMode.INPLACE, 5, True, [(2, 6)], True),
        (EditMode.PARTIAL, 3, False, [], True),
        (EditMode.FULL, 0, False, [], True),
    ],
    ids=["inplace-sigkill-5-broken", "inplace-sigkill-0", "partial-exit-3", "full-exit-0",
         "host-twins-inplace-sigkill-5", "host-twins-partial-exit-3", "host-twins-full-exit-0"],
)
def test_survivors_edit_their_groups_and_every_group_works(tmp_path, monkeypatch, mode, victim,
                                                           sigkill, broken, separate_host):
    """With ``separate_host``, the host-memory groups have gloo twins (an NCCL job's groups,
    gloo for both): every twin works after the edit too, and is a group of its own."""
    if separate_host:
        monkeypatch.setenv(SEPARATE_HOST_GROUPS_ENV, "1")
    reports = run_edit_job(tmp_path, mode, victim, sigkill, broken)
    assert_groups_work(reports, victim)
    new_layout = Layout.from_json(reports[min(reports)]["layout"], reports[min(reports)]["spares"])
    old_layout = Layout.megatron(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=4)
    plan = plan_edit(old_layout, new_layout, {victim}, broken)
    for rank, report in reports.items():
        edit = report["edit"]
        assert (edit["mode"], edit["generation"]) == (mode.value, 1)
        host_checks = [c for c in report["after"] if c["kind"] == "host"]
        assert {(c["role"], c["separate"]) for c in host_checks} == {
            (role.value, separate_host) for role in HOST_ROLES
            if any(s.role == role and rank in s.ranks for s in group_specs(new_layout))}, rank
        twins = host_member_lists(new_layout) if separate_host else ()
        if mode == EditMode.FULL:
            created = [m for m in member_lists(group_specs(new_layout)) + twins if rank in m]
            assert (edit["created"], edit["kept"]) == (len(created), 0), rank
            assert report["world_size_after"] == WORLD_8 - 1
        else:
            # Exactly the planned groups changed; the default group is the stale one.
            created = [m for m in plan.create + (plan.host_create if separate_host else ())
                       if rank in m]
            kept = [m for m in plan.keep if rank in m]
            assert (edit["created"], edit["kept"]) == (len(created), len(kept)), rank
            assert report["world_size_after"] == WORLD_8


# --- processes: parallel_state ------------------------------------------------------------------


@multiprocess
@pytest.mark.timeout(120)
def test_parallel_state_from_the_registry_matches_initialize_model_parallel(tmp_path):
    with launch([worker_script("communicator_parallel_state.py"), str(tmp_path)], nproc_per_node=4,
                master_port=free_port()) as job:
        returncode, output = job.wait(timeout=90)
    assert returncode == 0, output
    reports = read_reports(tmp_path)
    assert reports.keys() == {0, 1, 2, 3}
    for rank, report in reports.items():
        assert report["from_registry"] == report["from_megatron"], rank
        assert all(report["same_groups"].values()), (rank, report["same_groups"])
