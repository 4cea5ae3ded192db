"""``pretrain_gpt.py --elastic-profile-out`` measures a profile the planner accepts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import free_port, launch
from megatron_elaswave.planner.profile import load_profile
from test_pretrain_gpt import PRETRAIN

HIDDEN = 64


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_profile_of_a_pipeline_run_calibrates_the_planner(tmp_path):
    profile_path = tmp_path / "profile.json"
    flags = ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
             "--hidden-size", str(HIDDEN), "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
             "--lr", "1e-3", "--mock-data", "--vocab-size", "127",
             "--elastic-profile-out", str(profile_path)]
    with launch([PRETRAIN, *flags], 2, master_port=free_port(), log_path=tmp_path / "log") as job:
        returncode, output = job.wait(240)
    assert returncode == 0, output[-3000:]

    profile = load_profile(profile_path)
    assert profile.num_layers == 4
    # fp32 local-spec layer: QKV, projection and the two MLP matrices plus biases and two norms.
    layer_params = 12 * HIDDEN * HIDDEN + 13 * HIDDEN
    for layer in profile.layers:
        assert layer.param_bytes == 4 * layer_params
        assert layer.forward_s > 0 and layer.backward_s > 0
        assert layer.activation_bytes > 2 * 32 * HIDDEN * 4  # more than its input alone
    assert profile.embedding.forward_s > 0 and profile.loss.backward_s > 0
    assert profile.p2p_latency_s > 0 and profile.dp_bandwidth_bytes_per_s > 0
    assert profile.config.micro_batch_size == 2 and profile.config.params_dtype_bytes == 4

    plan = subprocess.run(
        [sys.executable, "-m", "megatron_elaswave.plan", "--tp", "1", "--pp", "2", "--dp", "2",
         "--num-layers", "4", "--global-batch-size", "8", "--micro-batch-size", "2",
         "--fail", "3", "--profile", str(profile_path), "--json"],
        capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["global_batch_size"] == 8


def test_a_lagging_peer_leaves_an_moe_layers_backward_its_forwards_compute():
    from megatron_elaswave.training.setup.profiling import _PartSamples

    # The forward's exchanges waited 6 ms on a lagging peer; the backward's did not.
    moe = _PartSamples(forward_s=[0.010], backward_s=[0.005], all_to_all_s=[0.006],
                       param_bytes=96, expert_param_bytes=64)
    cost = moe.cost(all_to_all_bytes=128)
    assert cost.forward_s == pytest.approx(0.004) and cost.backward_s == pytest.approx(0.004)
    # Unlagged, the exchanges come out of both.
    moe.backward_s = [0.020]
    assert moe.cost(all_to_all_bytes=128).backward_s == pytest.approx(0.014)
    # A dense part's backward is its own measurement, even when shorter than its forward.
    dense = _PartSamples(forward_s=[0.010], backward_s=[0.005])
    assert dense.cost(all_to_all_bytes=0).backward_s == pytest.approx(0.005)
