"""The plan command line: JSON output, deterministic across processes, clean errors."""

import json
import os
import subprocess
import sys

from megatron_elaswave.planner.profile import SyntheticModel, save_profile, synthetic_profile

GRID = [
    "--tp",
    "2",
    "--pp",
    "4",
    "--dp",
    "3",
    "--num-layers",
    "8",
    "--global-batch-size",
    "24",
    "--micro-batch-size",
    "1",
    "--hidden-size",
    "1024",
    "--ffn-hidden-size",
    "2816",
    "--vocab-size",
    "8000",
    "--seq-length",
    "1024",
]


def plan(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "megatron_elaswave.plan", *GRID, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_json_output_has_the_documented_shape():
    result = plan("--fail", "10", "--json", "--compare-zero")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["global_batch_size"] == 24
    ids = sorted(i for r in record["replicas"] for i in r["microbatch_ids"])
    assert ids == list(range(24))
    for replica in record["replicas"]:
        layers = [l for s in replica["stages"] for l in range(s["layers"][0], s["layers"][1] + 1)]
        assert layers == list(range(8))
        assert replica["num_microbatches"] == len(replica["microbatch_ids"])
    used = {r for rep in record["replicas"] for s in rep["stages"] for r in s["ranks"]}
    assert 10 not in used and 10 not in record["spares"] and 11 in record["spares"]
    assert set(record["frequencies"]) == {str(r) for r in used}
    assert record["transfers"] and all(
        set(t) == {"wave", "src", "dst", "bytes", "what"} for t in record["transfers"]
    )
    assert {"interleaved", "megatron_contiguous"} <= set(record["migration"])
    for name in ("elaswave", "recycle", "torchft_drop", "restart"):
        assert {"tokens_per_s", "step_time_s", "energy_j"} <= set(record["predicted"][name])


def test_same_plan_in_processes_with_different_hash_seeds():
    outputs = {
        plan("--fail", "3,17", "--json", env=dict(os.environ, PYTHONHASHSEED=seed)).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1 and json.loads(outputs.pop())["failed_ranks"] == [3, 17]


def test_second_failure_from_a_previous_plan(tmp_path):
    first = plan("--fail", "10", "--json")
    path = tmp_path / "plan.json"
    path.write_text(first.stdout)
    second = plan("--fail", "0", "--layout", str(path), "--json")
    assert second.returncode == 0, second.stderr
    record = json.loads(second.stdout)
    assert [len(r["stages"]) for r in record["replicas"]] == [
        3,
        4,
        3,
    ]  # rank 10: replica 2, rank 0: replica 0


def test_measured_profile_is_used(tmp_path):
    model = SyntheticModel(
        num_layers=8,
        hidden_size=512,
        ffn_hidden_size=1408,
        vocab_size=4000,
        seq_length=256,
        tensor_model_parallel_size=2,
    )
    path = tmp_path / "profile.json"
    save_profile(synthetic_profile(model), path)
    result = plan("--fail", "10", "--profile", str(path), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["predicted"]["elaswave"]["tokens_per_s"] > 0
    path.write_text('{"version": 1}')
    broken = plan("--fail", "10", "--profile", str(path))
    assert broken.returncode == 2 and broken.stderr.count("\n") == 1 and "missing 'config'" in broken.stderr


def test_unrunnable_failure_is_one_line_and_exit_2():
    result = plan("--fail", "10", "--memory-cap-gib", "0.01")
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr and result.stdout == ""
    lost = plan("--fail", "0,8")  # a rank and its snapshot buddy (next replica, next stage)
    assert lost.returncode == 2 and "checkpoint" in lost.stderr and lost.stderr.count("\n") == 1


def test_bad_flags_are_argparse_errors():
    for args in (
        ["--fail", "x"],
        ["--fail", "999"],
        ["--fail", "1", "--tp", "0"],
        ["--fail", "1", "--bogus"],
    ):
        result = plan(*args)
        assert result.returncode == 2 and "usage:" in result.stderr and "Traceback" not in result.stderr
    result = plan("--fail", "1", "--num-layers", "6")
    assert result.returncode == 2 and "divisible" in result.stderr
