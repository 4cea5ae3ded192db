"""Mixtures of experts in the planner: what an MoE layer costs, plans that keep lockstep sets,
expert memory, migrations that keep expert coordinates, the simulator and the command lines."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_elaswave.layout import ExpertParallelism, Layout
from megatron_elaswave.planner.cost import CostModel, MemoryModel
from megatron_elaswave.planner.frequency import PowerModel
from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.planner.predict import layout_prediction, stage_sync_s, stage_work
from megatron_elaswave.planner.profile import (
    ExpertCost,
    ProfileError,
    SyntheticDevice,
    SyntheticModel,
    SyntheticMoE,
    load_profile,
    save_profile,
    synthetic_profile,
)
from megatron_elaswave.planner.replan import PlanError, PlanOptions, plan_recovery
from megatron_elaswave.planner.zero import StateLostError, buddy_rank
from megatron_elaswave.simulator import ReplicaWork, predict_step, simulate_pipeline

B, S, H, F, V = 1, 128, 256, 704, 1000
DEVICE = SyntheticDevice()
FLOPS_PER_S = DEVICE.peak_tflops * 1e12 * DEVICE.model_flops_utilisation


def moe_cost(tp=1, pp=2, dp=4, *, layers=4, experts=4, ep=2, etp=None, topk=2, ffn=F,
             layer_freq=1, gbs=None) -> CostModel:
    """A synthetic MoE job and its costs (``ffn``: one expert's width)."""
    grid = ExpertParallelism(experts, ep, etp or tp)
    job = JobSpec(tp, pp, dp, layers, global_batch_size=gbs or 4 * dp, micro_batch_size=B,
                  experts=grid)
    model = SyntheticModel(num_layers=layers, hidden_size=H, ffn_hidden_size=F, vocab_size=V,
                           seq_length=S, tensor_model_parallel_size=tp,
                           moe=SyntheticMoE(grid, ffn_hidden_size=ffn, router_topk=topk,
                                            layer_freq=layer_freq))
    return CostModel(synthetic_profile(model, DEVICE), job)


def ring_ns(cost: CostModel, volume: int, holders: int) -> int:
    """A ring reduce-scatter and all-gather of ``volume`` bytes per holder, as documented."""
    hops = holders - 1
    return hops * 2 * cost.p2p_latency_ns + round(hops * volume / (holders * cost.dp_bandwidth) * 1e9)


# ---- costs --------------------------------------------------------------------------------------


def test_moe_layer_costs_a_dense_layer_plus_its_router_and_top_k_experts():
    # Every other layer is an MoE layer: layer 0 has experts, layer 1 is dense.
    one = moe_cost(dp=1, ep=1, topk=1, layer_freq=2)
    two = moe_cost(dp=1, ep=1, topk=2, layer_freq=2)
    router_ns = 2 * B * S * H * 4 / FLOPS_PER_S * 1e9
    mlp_ns = 2 * B * S * 3 * H * F / FLOPS_PER_S * 1e9
    # Top-1 of experts as wide as the dense MLP: the dense layer's work plus the router's.
    assert one.forward_ns[0] - one.forward_ns[1] == pytest.approx(router_ns, abs=1)
    assert one.backward_ns[0] - one.backward_ns[1] == pytest.approx(2 * router_ns, abs=2)
    # Each more expert per token adds one expert MLP per token; more experts add router work only.
    assert two.forward_ns[0] - one.forward_ns[0] == pytest.approx(mlp_ns, abs=1)
    assert two.forward_ns[1] == one.forward_ns[1]
    more = moe_cost(dp=1, ep=1, topk=1, layer_freq=2, experts=8)
    assert more.forward_ns[0] - one.forward_ns[0] == pytest.approx(router_ns, abs=1)
    # Parameters: all four experts on the one expert-parallel rank, the router, no dense MLP.
    expert_bytes = 4 * 2 * 3 * H * F
    assert one.expert_param_bytes.tolist() == [expert_bytes, 0, expert_bytes, 0]
    assert one.param_bytes[0] - expert_bytes == one.param_bytes[1] - 2 * 3 * H * F + 2 * H * 4
    assert one.expert_param_count[0] == expert_bytes // 2
    assert not one.all_to_all_ns.any()  # expert parallelism 1: nothing to exchange


def test_all_to_alls_join_the_forward_and_the_backward_over_the_expert_link():
    local = moe_cost(ep=1)
    spread = moe_cost(ep=4)  # expert parallelism over all four replicas: one lockstep set
    sent = 2 * B * S * H * 2 * 3 / 4  # top-2 x tokens x hidden x bf16, 3/4 of it leaves the rank
    exchange = round(DEVICE.p2p_latency_s * 1e9) + round(sent / DEVICE.bandwidth_bytes_per_s * 1e9)
    assert spread.all_to_all_ns.tolist() == [2 * exchange] * 4  # dispatch and combine
    assert (spread.forward_ns - local.forward_ns).tolist() == [2 * exchange] * 4
    assert (spread.backward_ns - local.backward_ns).tolist() == [2 * exchange] * 4
    assert spread.stage_all_to_all_ns(1, 2) == 4 * exchange
    # Each rank holds a quarter of the experts.
    assert spread.expert_param_bytes[0] * 4 == local.expert_param_bytes[0]


def test_expert_state_is_sharded_over_expert_data_parallelism():
    cost = moe_cost(tp=1, dp=4, ep=2)  # two lockstep sets of two replicas
    assert cost.job.lockstep_size == 2
    assert [cost.expert_data_parallel_size(n) for n in (4, 2)] == [2, 1]
    count, experts = int(cost.param_count[0]), int(cost.expert_param_count[0])
    dense_share = (count - experts) * 12 * 1 // 4  # interleaved ZeRO: ceil(K/n)/K with K = n = 4
    expected = int(cost.param_bytes[0]) + 4 * count + dense_share + -(-experts // 2) * 12
    assert cost.layer_static_bytes(4)[0] == expected
    assert cost.layer_move_bytes(4)[0] == expected - 4 * count  # no gradients travel
    # One set left: each holder keeps its experts' whole optimizer state, and syncs them alone.
    assert cost.layer_static_bytes(2)[0] - cost.layer_static_bytes(4)[0] == (
        (count - experts) * 12 * 2 // 4 - dense_share + experts * 12 - -(-experts // 2) * 12)
    # Gradients and parameters sync over the replicas, the experts' over the expert data-parallel
    # ranks: none are left to sync with once one set is left.
    dense_volume = (count - experts) * 4 + int(cost.param_bytes[0] - cost.expert_param_bytes[0])
    expert_volume = experts * 4 + int(cost.expert_param_bytes[0])
    sync = [cost.stage_sync_ns(1, 1, is_first=False, is_last=False, num_replicas=n) for n in (4, 2)]
    assert sync == [ring_ns(cost, dense_volume, 4) + ring_ns(cost, expert_volume, 2),
                    ring_ns(cost, dense_volume, 2)]
    # Expert parallelism inside a tensor-parallel group: every replica holds every expert.
    inside = moe_cost(tp=4, dp=2, ep=2, etp=1)
    assert inside.job.lockstep_size == 1 and inside.expert_data_parallel_size(2) == 4


def test_profile_and_job_must_agree_on_experts():
    moe = moe_cost()
    dense_job = replace(moe.job, experts=None)
    with pytest.raises(ProfileError, match="no experts"):
        CostModel(moe.profile, dense_job)
    dense = synthetic_profile(replace(SyntheticModel(num_layers=4, hidden_size=H, ffn_hidden_size=F,
                                                     vocab_size=V, seq_length=S)))
    with pytest.raises(ProfileError, match="no MoE layer"):
        CostModel(dense, moe.job)
    with pytest.raises(ProfileError, match="have 4 experts but the job has 8"):
        CostModel(moe.profile, replace(moe.job, experts=ExpertParallelism(8, 2, 1)))


def test_moe_profile_round_trip_and_errors(tmp_path):
    profile = moe_cost(layer_freq=2).profile
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    record = json.loads(path.read_text())
    assert [("moe" in layer) for layer in record["layers"]] == [True, False, True, False]
    assert record["config"]["num_experts"] == 4 and record["config"]["expert_model_parallel_size"] == 2
    assert load_profile(path) == profile
    broken = json.loads(path.read_text())
    broken["layers"][0]["moe"]["expert_param_bytes"] = broken["layers"][0]["param_bytes"] + 1
    path.write_text(json.dumps(broken))
    with pytest.raises(ProfileError, match=r"layers\[0\]: moe.expert_param_bytes .* exceeds"):
        load_profile(path)
    del record["config"]["num_experts"]
    path.write_text(json.dumps(record))
    with pytest.raises(ProfileError, match="num_experts must be given exactly when"):
        load_profile(path)
    with pytest.raises(ProfileError, match="only layers"):
        replace(profile, loss=replace(profile.loss, moe=ExpertCost(0, 0)))


# ---- plans --------------------------------------------------------------------------------------


@st.composite
def moe_scenarios(draw):
    tp = draw(st.sampled_from([1, 2]))
    sets, size = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
    dp, pp = sets * size, draw(st.integers(1, 3))
    ep = tp * size if size > 1 else draw(st.sampled_from([1, tp]))  # over replicas, or inside TP
    layers = pp * draw(st.integers(1, 3))
    cost = moe_cost(tp=tp, pp=pp, dp=dp, layers=layers, experts=4 * ep, ep=ep, etp=1,
                    layer_freq=draw(st.sampled_from([1, 2])), gbs=dp * draw(st.integers(1, 4)))
    failed = draw(st.sets(st.integers(0, cost.job.world_size - 1), min_size=1, max_size=3))
    return cost, failed


def lockstep_shapes(layout: Layout) -> dict[int, set]:
    shapes: dict[int, set] = {}
    for replica in layout.replicas:
        shape = (tuple((s.first_layer, s.last_layer) for s in replica.stages), replica.num_microbatches)
        shapes.setdefault(layout.lockstep_set(replica.index), set()).add(shape)
    return shapes


def check_expert_transfers(old: Layout, new: Layout, failed: frozenset, plan) -> None:
    """Experts' parameters come from ranks that hold the same experts; their optimizer state
    too, but for a failed holder's, which its snapshot buddy sends."""
    buddies = {buddy_rank(old, rank) for rank in failed if old.position(rank) is not None}
    for transfer in plan.migration.transfers:
        if "experts" not in transfer.what or "snapshot" in transfer.what:
            continue
        same = old.expert_coordinates(transfer.src)[:2] == new.expert_coordinates(transfer.dst)[:2]
        assert same or (transfer.what.startswith("optimizer") and transfer.src in buddies)


@settings(max_examples=60, deadline=None)
@given(moe_scenarios())
def test_moe_plans_keep_lockstep_sets_equal_and_the_global_batch(scenario):
    cost, failed = scenario
    old = cost.job.initial_layout()
    try:
        plan = plan_recovery(old, failed, cost, PlanOptions(dvfs=False))
    except (PlanError, StateLostError):
        return
    layout = plan.layout
    layout.validate()  # lockstep sets whole, with the same stages and micro-batch counts
    assert layout.experts == cost.job.experts
    assert all(len(shapes) == 1 for shapes in lockstep_shapes(layout).values())
    assert sorted(i for r in layout.replicas for i in r.microbatch_ids) == list(range(cost.job.num_microbatches))
    size = layout.lockstep_size
    kept = {r.index for r in layout.replicas}
    assert all(r - r % size + k in kept for r in kept for k in range(size))  # whole sets
    assert not set(plan.dissolved_replicas) & kept
    check_expert_transfers(old, layout, frozenset(failed), plan)


def test_expert_memory_dissolves_a_lockstep_set_that_no_longer_fits():
    """Two sets of two replicas, two stages each; a stage of replica 2 fails, so its set must
    hold all layers on one stage per replica. With the experts' state charged it does not fit
    and leaves whole; the same cap holds it when only the dense part is counted."""
    probe = moe_cost(tp=1, pp=2, dp=4, ep=2)
    one_stage = probe.stage_memory_bytes(0, 3, 0, 1, 4)
    set_zero = max(probe.stage_memory_bytes(0, 1, 0, 2, 2), probe.stage_memory_bytes(2, 3, 1, 2, 2))
    dense_layers = tuple(replace(layer, param_bytes=layer.param_bytes - layer.expert_param_bytes,
                                 moe=None) for layer in probe.profile.layers)
    dense_profile = replace(probe.profile, layers=dense_layers,
                            config=replace(probe.profile.config, num_experts=None))
    dense = CostModel(dense_profile, replace(probe.job, experts=None))
    cap = max(set_zero, dense.stage_memory_bytes(0, 3, 0, 1, 4))
    assert cap < one_stage  # the experts' state is what does not fit
    cost = CostModel(probe.profile, probe.job, MemoryModel(memory_cap_bytes=cap))
    old = cost.job.initial_layout()
    failed = {old.replicas[2].stages[1].ranks[0]}
    plan = plan_recovery(old, failed, cost, PlanOptions(dvfs=False))
    assert plan.dissolved_replicas == (2, 3)
    assert [r.index for r in plan.layout.replicas] == [0, 1]
    assert plan.layout.global_num_microbatches == cost.job.num_microbatches
    # The survivors now hold their experts' whole optimizer state: set 1's shards move to them.
    moved = [t for t in plan.migration.transfers if t.what.startswith("optimizer layer")]
    assert moved and all(plan.layout.position(t.dst)[0] in (0, 1) for t in moved)
    check_expert_transfers(old, plan.layout, frozenset(failed), plan)
    # Counting only the dense part, the set would have stayed.
    dense_cost = CostModel(dense_profile, dense.job, MemoryModel(memory_cap_bytes=cap))
    kept = plan_recovery(dense.job.initial_layout(), failed, dense_cost, PlanOptions(dvfs=False))
    assert kept.dissolved_replicas == ()


def test_a_moved_layer_takes_its_experts_from_a_holder_of_the_same_experts():
    cost = moe_cost(tp=1, pp=2, dp=4, ep=2)  # sets {0, 1} and {2, 3}
    old = cost.job.initial_layout()
    failed = frozenset({old.replicas[1].stages[0].ranks[0]})
    plan = plan_recovery(old, failed, cost, PlanOptions(dvfs=False))
    experts = [t for t in plan.migration.transfers if t.what.startswith("params layer")
               and "experts" in t.what]
    for transfer in experts:
        assert old.expert_coordinates(transfer.src)[:2] == plan.layout.expert_coordinates(transfer.dst)[:2]
    # Replica 1's holder failed: its experts come from replica 3, the other set's replica at the
    # same coordinates, while its dense parameters come from the next replica, 2.
    into_1 = {t.what.split(" tp ")[0]: old.position(t.src)[0] for t in plan.migration.transfers
              if t.what.startswith("params layer 0") and plan.layout.position(t.dst)[0] == 1}
    assert into_1 == {"params layer 0 experts": 3, "params layer 0": 2}


# ---- simulator ----------------------------------------------------------------------------------


def test_a_lockstep_unit_predicts_what_its_replicas_would():
    work = ReplicaWork((1.0, 1.0), (2.0, 2.0), (2, 2), (1.0, 0.9), 4, send_s=0.1, sync_s=0.5,
                       all_to_all_s=(0.25, 0.0))
    kwargs = dict(micro_batch_size=1, tokens_per_microbatch=8, idle_devices=1, power=PowerModel())
    unit = predict_step([replace(work, lockstep=2)], **kwargs)
    apart = predict_step([work, work], **kwargs)
    assert unit.step_time_s == apart.step_time_s and unit.samples_per_step == 8
    assert unit.energy_j == pytest.approx(apart.energy_j)
    # Time in all-to-alls draws static power only: 2 devices x 4 micro-batches x 2 exchanges.
    alone = predict_step([work], **kwargs)
    computing = predict_step([replace(work, all_to_all_s=())], **kwargs)
    assert computing.step_time_s == alone.step_time_s
    assert computing.energy_j - alone.energy_j == pytest.approx(
        2 * PowerModel().busy_power_w(1.0) * 4 * 2 * 0.25)


def test_moe_layout_prediction_includes_the_all_to_alls():
    cost = moe_cost(tp=1, pp=2, dp=4, ep=2)
    local = moe_cost(tp=1, pp=2, dp=4, ep=1)
    layout = cost.job.initial_layout()
    clocks = [(1.0, 1.0)] * 4
    predicted = layout_prediction(cost, layout, clocks, 0, PowerModel())
    ranges = [(0, 1), (2, 3)]
    forward, backward, all_to_all = stage_work(cost, ranges, (1.0, 1.0))
    expected = simulate_pipeline(forward, backward, 4, send_s=cost.send_ns / 1e9).makespan_s
    assert predicted.step_time_s == pytest.approx(expected + stage_sync_s(cost, ranges, 4))
    assert all_to_all == pytest.approx([cost.stage_all_to_all_ns(a, b) / 1e9 for a, b in ranges])
    assert all(a > 0 for a in all_to_all)
    assert predicted.samples_per_step == cost.job.global_batch_size
    assert predicted.step_time_s > layout_prediction(local, layout, clocks, 0, PowerModel()).step_time_s
    # A set runs at its slowest member's clocks: slowing replica 1 slows replica 0 with it.
    slowed = layout_prediction(cost, layout, [(1.0, 1.0), (0.8, 1.0), (1.0, 1.0), (1.0, 1.0)], 0,
                               PowerModel())
    both = layout_prediction(cost, layout, [(0.8, 1.0), (0.8, 1.0), (1.0, 1.0), (1.0, 1.0)], 0,
                             PowerModel())
    assert slowed == both and slowed.step_time_s > predicted.step_time_s


# ---- command lines ------------------------------------------------------------------------------

GRID = ["--tp", "1", "--pp", "2", "--dp", "4", "--num-layers", "4", "--global-batch-size", "16",
        "--micro-batch-size", "1", "--hidden-size", "256", "--ffn-hidden-size", "704",
        "--vocab-size", "1000", "--seq-length", "128"]


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"megatron_elaswave.{module}", *args],
                          capture_output=True, text=True, timeout=120)


def test_plan_command_line_plans_an_moe_job(tmp_path):
    flags = ["--num-experts", "8", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "352", "--moe-layer-freq", "2"]
    result = run("plan", *GRID, *flags, "--fail", "5", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["experts"] == {"num_experts": 8, "expert_parallel_size": 2,
                                 "expert_tensor_parallel_size": 1}
    replicas = {r["replica"]: r for r in record["replicas"]}
    for first in (0, 2):  # lockstep sets {0, 1} and {2, 3}
        if first in replicas:
            a, b = replicas[first], replicas[first + 1]
            assert [s["layers"] for s in a["stages"]] == [s["layers"] for s in b["stages"]]
            assert a["num_microbatches"] == b["num_microbatches"]
    assert sorted(i for r in record["replicas"] for i in r["microbatch_ids"]) == list(range(16))
    assert any("experts" in t["what"] for t in record["transfers"])
    path = tmp_path / "plan.json"
    path.write_text(result.stdout)
    second = run("plan", *GRID, *flags, "--fail", "0", "--layout", str(path), "--json")
    assert second.returncode == 0, second.stderr


@pytest.mark.parametrize("flags, message", [
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], "cannot be split evenly"),
    (["--num-experts", "8", "--expert-model-parallel-size", "8"], "must divide the 4 ranks"),
    (["--tp", "4", "--dp", "6", "--global-batch-size", "24", "--num-experts", "6",
      "--expert-model-parallel-size", "6", "--expert-tensor-parallel-size", "1"],
     "must divide one another"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size needs --num-experts"),
    (["--num-experts", "2", "--moe-router-topk", "3"], "top-k 3 exceeds the 2 experts"),
])
def test_plan_refuses_an_expert_grid_in_one_line(flags, message):
    result = run("plan", *GRID, *flags, "--fail", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert message in result.stderr


def test_plan_refuses_a_dense_profile_for_an_moe_job(tmp_path):
    path = tmp_path / "dense.json"
    save_profile(synthetic_profile(SyntheticModel(num_layers=4, hidden_size=H, ffn_hidden_size=F,
                                                  vocab_size=V, seq_length=S)), path)
    result = run("plan", *GRID, "--num-experts", "4", "--profile", str(path), "--fail", "1")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "no MoE layer" in result.stderr


def test_simulate_command_line_predicts_moe_scenarios():
    result = run("simulate", "paper-96", "--num-experts", "6", "--expert-model-parallel-size", "3",
                 "--json")
    assert result.returncode == 0, result.stderr
    cases = json.loads(result.stdout)["paper-96"]
    assert all(case["predicted"]["failure_free"]["samples_per_step"] == 768 for case in cases)
    assert all(case["predicted"]["elaswave"]["runnable"] for case in cases if case["failed_instances"] == 1)
    refused = run("simulate", "paper-96", "--num-experts", "6", "--expert-model-parallel-size", "2")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert refused.stderr.startswith("error: TP8xPP4xDP3: ") and "Traceback" not in refused.stderr


# ---- a measured profile -------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_profile_of_an_moe_run_marks_its_moe_layers(tmp_path):
    from harness import free_port, launch
    from test_pretrain_gpt import PRETRAIN

    path = tmp_path / "profile.json"
    hidden, expert_ffn = 64, 32
    flags = ["--num-layers", "2", "--hidden-size", str(hidden), "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--vocab-size", "127",
             "--disable-bias-linear", "--num-experts", "4", "--expert-model-parallel-size", "2",
             "--moe-router-topk", "2", "--moe-ffn-hidden-size", str(expert_ffn),
             "--moe-layer-freq", "2", "--moe-token-dispatcher-type", "alltoall",
             "--elastic-profile-out", str(path)]
    with launch([PRETRAIN, *flags], 2, master_port=free_port(), log_path=tmp_path / "log") as job:
        returncode, output = job.wait(240)
    assert returncode == 0, output[-3000:]

    profile = load_profile(path)
    moe, dense = profile.layers  # --moe-layer-freq 2: layer 0 is an MoE layer, layer 1 is not
    assert dense.moe is None and moe.moe is not None
    # Two of the four experts on each rank, two fp32 matrices each.
    assert moe.moe.expert_param_bytes == 2 * 2 * hidden * expert_ffn * 4
    assert moe.moe.all_to_all_bytes == 2 * 2 * 32 * hidden * 4  # top-2 x 2 x 32 tokens x fp32
    assert moe.forward_s > 0 and moe.backward_s > 0
    assert profile.config.num_experts == 4 and profile.config.expert_model_parallel_size == 2
    assert profile.expert_bandwidth_bytes_per_s > 0

    grid = ["--tp", "1", "--pp", "1", "--dp", "4", "--num-layers", "2", "--global-batch-size", "8",
            "--micro-batch-size", "2", "--profile", str(path), "--json"]
    planned = run("plan", *grid, "--num-experts", "4", "--expert-model-parallel-size", "2",
                  "--fail", "3")
    assert planned.returncode == 0, planned.stderr
    assert [r["replica"] for r in json.loads(planned.stdout)["replicas"]] == [0, 1]
    assert run("plan", *grid, "--fail", "3").returncode == 2  # the job must say it has experts
