"""Profile JSON: round trip, validation with clear errors, synthetic 7B-class costs, scaling."""

import json

import pytest

from megatron_elaswave.planner.cost import CostModel, MemoryModel
from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.planner.profile import (
    ProfileError,
    SyntheticModel,
    load_profile,
    save_profile,
    synthetic_profile,
)


def measured(**overrides) -> dict:
    layer = {"forward_s": 0.01, "backward_s": 0.02, "param_bytes": 1000, "activation_bytes": 500}
    record = {
        "version": 1,
        "device": "cpu",
        "config": {
            "tensor_model_parallel_size": 1,
            "micro_batch_size": 2,
            "seq_length": 128,
            "hidden_size": 64,
        },
        "layers": [dict(layer) for _ in range(4)],
        "embedding": {"forward_s": 0.001, "backward_s": 0.002, "param_bytes": 4000, "activation_bytes": 100},
        "loss": {"forward_s": 0.003, "backward_s": 0.006, "param_bytes": 4000, "activation_bytes": 200},
        "p2p_latency_s": 1e-4,
        "dp_bandwidth_bytes_per_s": 1e9,
    }
    record.update(overrides)
    return record


def write(tmp_path, record) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(record))
    return str(path)


def test_round_trip_keeps_every_field(tmp_path):
    profile = load_profile(write(tmp_path, measured(device_memory_bytes=2**30, compute_bound_fraction=0.5)))
    assert profile.config.notes == {"hidden_size": 64}
    assert profile.device_memory_bytes == 2**30 and profile.compute_bound_fraction == 0.5
    assert profile.p2p_bandwidth == 1e9  # defaults to the data-parallel bandwidth
    again = tmp_path / "again.json"
    save_profile(profile, again)
    assert load_profile(again) == profile


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(version=2), "unsupported profile version"),
        (dict(layers=[]), "at least one"),
        (dict(p2p_latency_s=-1), "p2p_latency_s"),
        (dict(dp_bandwidth_bytes_per_s=0), "dp_bandwidth_bytes_per_s must be positive"),
        (dict(config={"micro_batch_size": 1, "seq_length": 8}), "tensor_model_parallel_size"),
        (dict(compute_bound_fraction=1.5), "compute_bound_fraction"),
    ],
)
def test_invalid_profiles_name_the_problem(tmp_path, change, message):
    with pytest.raises(ProfileError, match=message):
        load_profile(write(tmp_path, measured(**change)))


def test_invalid_layer_entry_names_its_index(tmp_path):
    record = measured()
    record["layers"][2]["backward_s"] = "fast"
    with pytest.raises(ProfileError, match=r"layers\[2\]\.backward_s"):
        load_profile(write(tmp_path, record))
    del record["layers"][1]["param_bytes"]
    with pytest.raises(ProfileError, match=r"layers\[1\] is missing param_bytes"):
        load_profile(write(tmp_path, record))


def test_not_json_is_a_profile_error(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(path)


def test_synthetic_7b_class_profile():
    profile = synthetic_profile(SyntheticModel())
    params = (
        sum(l.param_bytes for l in profile.layers) / 2
        + (profile.embedding.param_bytes + profile.loss.param_bytes) / 2
    )
    assert 6.5e9 < params < 7.0e9
    layer = profile.layers[0]
    assert layer.backward_s == pytest.approx(2 * layer.forward_s)
    # ~1.93 TFLOP forward per layer and micro-batch at 45 % of 300 TFLOP/s.
    assert layer.forward_s == pytest.approx(1.93e12 / 135e12, rel=0.02)


def test_costs_scale_with_tensor_parallel_and_micro_batch(tmp_path):
    profile = load_profile(write(tmp_path, measured()))
    base = CostModel(profile, JobSpec(1, 2, 1, 4, global_batch_size=4, micro_batch_size=2))
    wide = CostModel(profile, JobSpec(2, 2, 1, 4, global_batch_size=8, micro_batch_size=4))
    assert base.forward_ns[0] == 10_000_000 and wide.forward_ns[0] == 10_000_000  # x2 batch / x2 TP
    assert wide.param_bytes[0] == 500 and wide.activation_bytes[0] == 500
    assert base.tokens_per_microbatch == 256 and wide.tokens_per_microbatch == 512


def test_layer_count_must_match_and_memory_cap_can_be_overridden(tmp_path):
    profile = load_profile(write(tmp_path, measured(device_memory_bytes=10**6)))
    with pytest.raises(ProfileError, match="4 layers but the job has 8"):
        CostModel(profile, JobSpec(1, 2, 1, 8, global_batch_size=2, micro_batch_size=2))
    job = JobSpec(1, 2, 1, 4, global_batch_size=2, micro_batch_size=2)
    assert CostModel(profile, job).memory_cap_bytes == 10**6
    assert (
        CostModel(profile, job, MemoryModel(memory_cap_bytes=5000, reserved_bytes=1000)).memory_cap_bytes
        == 4000
    )
