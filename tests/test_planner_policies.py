"""Baseline policies against the ElasWave plan on the same job and failures."""

from megatron_elaswave.planner.cost import CostModel
from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.planner.policies import POLICIES, predict_policies
from megatron_elaswave.planner.profile import SyntheticModel, synthetic_profile


def cost_for(tp, pp, dp, microbatches_per_replica=64) -> CostModel:
    model = SyntheticModel(
        num_layers=8,
        hidden_size=2048,
        ffn_hidden_size=5632,
        vocab_size=8000,
        seq_length=4096,
        tensor_model_parallel_size=tp,
    )
    job = JobSpec(tp, pp, dp, 8, global_batch_size=microbatches_per_replica * dp, micro_batch_size=1)
    return CostModel(synthetic_profile(model), job)


def run(cost, failed):
    return predict_policies(cost, cost.job.initial_layout(), failed)


def test_one_failed_stage_instance():
    cost = cost_for(2, 4, 3)
    out = run(cost, {cost.job.initial_layout().replicas[1].stages[2].ranks[0]})
    assert list(out) == list(POLICIES)
    tokens = {name: o.step.tokens_per_s for name, o in out.items()}
    assert tokens["failure_free"] > tokens["elaswave"] > tokens["recycle"]
    assert tokens["elaswave"] > tokens["torchft_drop"] and tokens["elaswave"] > tokens["torchft_grad_accum"]
    assert tokens["elaswave"] >= tokens["elaswave_no_dvfs"] > tokens["recycle"]
    gbs = cost.job.global_batch_size
    assert out["torchft_drop"].step.samples_per_step == 2 * gbs // 3
    assert all(out[p].step.samples_per_step == gbs for p in POLICIES if p != "torchft_drop")
    assert out["restart"].downtime_s > 10 * out["elaswave"].downtime_s
    # ReCycle overloads the failed stage's peers by D / (D - 1): its bottleneck is 1.5x slower.
    assert out["recycle"].step.step_time_s > 1.3 * out["failure_free"].step.step_time_s


def test_policies_that_cannot_run_say_why():
    cost = cost_for(1, 2, 2)
    layout = cost.job.initial_layout()
    stage_zero_everywhere = {r.stages[0].ranks[0] for r in layout.replicas}
    out = run(cost, stage_zero_everywhere)
    assert out["recycle"].step is None and "every instance" in out["recycle"].reason
    assert out["torchft_drop"].step is None and "every replica" in out["torchft_drop"].reason
    assert out["elaswave"].step is not None  # stage 1 of each replica takes over all layers
    assert out["restart"].step is not None  # two healthy stage instances form one replica
    assert out["restart"].to_json()["samples_per_step"] == cost.job.global_batch_size


def test_energy_and_bubbles_are_reported():
    cost = cost_for(2, 4, 3)
    out = run(cost, {0})
    free = out["failure_free"].step
    assert 0 < free.bubble_fraction < 1 and free.energy_j > 0
    record = out["elaswave"].to_json()
    assert set(record) >= {"tokens_per_s", "step_time_s", "energy_j", "bubble_fraction", "downtime_s"}
