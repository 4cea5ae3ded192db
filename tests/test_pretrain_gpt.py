"""``scripts/pretrain_gpt.py`` through the launcher: flags, layouts, schedules and checkpoints.

The layout-equivalence tests are the foundation of the correctness oracle: with the same seed,
global batch and no dropout, a TP2 x PP2 x DP2 run (1F1B or interleaved) must follow the
single-rank trajectory to fp32 reduction-order tolerance, on identical samples.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import free_port, launch, once
from megatron_elaswave.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = str(REPO / "scripts" / "pretrain_gpt.py")
LOSS_TOLERANCE = 1e-5
TRAIN_ITERS = 6


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> str:
    """A small corpus of real text (standard-library sources) in Megatron's indexed format,
    made once for the session."""
    return once("text_data", lambda: _make_text_data(tmp_path_factory.mktemp("data")))


def _make_text_data(directory: Path) -> str:
    corpus = directory / "corpus.jsonl"
    prefix = directory / "stdlib"
    for command in (
        [sys.executable, str(REPO / "scripts" / "make_demo_corpus.py"), "--output", str(corpus),
         "--max-bytes", "400000"],
        [sys.executable, str(REPO / "scripts" / "preprocess_data.py"), "--input", str(corpus),
         "--tokenizer-type", "ByteLevelTokenizer", "--append-eod", "--output-prefix", str(prefix)],
    ):
        subprocess.run(command, check=True, capture_output=True, timeout=120)
    return f"{prefix}_text_document"


def model_flags(data_prefix: str, **overrides) -> list[str]:
    flags = {
        "num-layers": 4, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 64,
        "micro-batch-size": 2, "global-batch-size": 16, "train-iters": TRAIN_ITERS, "lr": 3e-3,
        "lr-warmup-iters": 1, "hidden-dropout": 0.0, "attention-dropout": 0.0, "seed": 7,
        "data-path": data_prefix, "split": "98,2,0", "eval-interval": 1000, "log-interval": 1,
        # ByteLevel's 257 ids pad to 512 for TP 1 and 2 alike, so the layouts share one vocab.
        "make-vocab-size-divisible-by": 256,
    }
    flags.update({key.replace("_", "-"): value for key, value in overrides.items()})
    return [item for key, value in flags.items() for item in (f"--{key}", str(value))]


def train(tmp_path: Path, name: str, nproc: int, flags: list[str], timeout: float = 240) -> list[dict]:
    metrics = tmp_path / f"{name}.jsonl"
    with launch([PRETRAIN, *flags, "--elastic-metrics-file", str(metrics)], nproc,
                master_port=free_port(), log_path=tmp_path / f"{name}.log") as job:
        returncode, output = job.wait(timeout)
    assert returncode == 0, output[-4000:]
    return read_metrics(str(metrics), "iteration")


def assert_same_trajectory(reference: list[dict], run: list[dict]) -> None:
    assert [r["iteration"] for r in run] == [r["iteration"] for r in reference]
    for ref, got in zip(reference, run):
        assert got["samples_digest"] == ref["samples_digest"], got["iteration"]
        assert got["global_batch_size"] == ref["global_batch_size"]
        relative = abs(got["lm_loss"] - ref["lm_loss"]) / abs(ref["lm_loss"])
        assert relative <= LOSS_TOLERANCE, (got["iteration"], ref["lm_loss"], got["lm_loss"])


@pytest.fixture(scope="module")
def single_rank_reference(text_data, tmp_path_factory) -> list[dict]:
    return train(tmp_path_factory.mktemp("reference"), "tp1pp1dp1", 1, model_flags(text_data))


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_tp2_pp2_dp2_learns_and_matches_a_single_rank(text_data, single_rank_reference, tmp_path):
    flags = model_flags(text_data, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    records = train(tmp_path, "tp2pp2dp2", 8, flags + ["--use-distributed-optimizer"])
    assert_same_trajectory(single_rank_reference, records)
    losses = [r["lm_loss"] for r in records]
    assert losses[-1] < losses[0] - 0.5, losses
    last = records[-1]
    assert last["world_size"] == 8 and last["consumed_samples"] == 16 * TRAIN_ITERS
    assert last["layout"] == [
        {"replica": d, "num_microbatches": 4, "stages": [
            {"ranks": [2 * d + 4 * s, 2 * d + 4 * s + 1], "layers": [2 * s, 2 * s + 1]}
            for s in range(2)]}
        for d in range(2)
    ]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_interleaved_schedule_matches_a_single_rank(text_data, single_rank_reference, tmp_path):
    flags = model_flags(text_data, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                        num_layers_per_virtual_pipeline_stage=1)
    assert_same_trajectory(single_rank_reference, train(tmp_path, "interleaved", 8, flags))


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_checkpoint_resumes_on_another_layout(text_data, single_rank_reference, tmp_path):
    """Save on PP2 x DP2 with the distributed optimizer, resume on DP2: the resumed iterations
    follow the uninterrupted trajectory. The first run also keeps per-step snapshots, which
    must not change the trajectory either, and accounts for their memory and the CPU time."""
    save = tmp_path / "checkpoints"
    base = ["--use-distributed-optimizer", "--lr-decay-iters", str(TRAIN_ITERS)]
    first = train(tmp_path, "save", 4, model_flags(text_data, pipeline_model_parallel_size=2,
                                                   train_iters=3)
                  + base + ["--save", str(save), "--elastic-snapshots"])
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert all(r["snapshot_bytes"] > 0 and r["cpu_time_s"] > 0 for r in first)
    resumed = train(tmp_path, "load", 2, model_flags(text_data) + base + ["--load", str(save)])
    assert [r["iteration"] for r in resumed] == list(range(4, TRAIN_ITERS + 1))
    assert_same_trajectory(single_rank_reference, first + resumed)


def run_single(flags: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    environment.pop("MASTER_ADDR", None)
    return subprocess.run([sys.executable, PRETRAIN, *flags], capture_output=True, text=True,
                          env=environment, timeout=120)


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"]
MOE = ["--mock-data", "--vocab-size", "64", "--num-experts", "8", "--disable-bias-linear"]


@pytest.mark.parametrize("flags, world_size, message", [
    (["--mock-data", "--vocab-size", "64", "--global-batch-size", "7"], 1,
     "--global-batch-size 7 is not divisible by --micro-batch-size 2"),
    (["--mock-data", "--vocab-size", "64", "--tensor-model-parallel-size", "3"], 3,
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    (["--mock-data", "--vocab-size", "64", "--tensor-model-parallel-size", "2"], 3,
     "world size 3 is not a multiple of tensor (2) x pipeline (1)"),
    (["--data-path", "/nonexistent/corpus"], 1, "/nonexistent/corpus.bin does not exist"),
    (["--vocab-size", "64"], 1, "give exactly one of --mock-data and --data-path"),
    (["--mock-data"], 1, "NullTokenizer needs --vocab-size"),
    (["--mock-data", "--vocab-size", "64", "--bf16"], 1, "--bf16 needs a CUDA or NPU device"),
    (["--mock-data", "--vocab-size", "64", "--train-samples", "8"], 1,
     "give exactly one of --train-iters and --train-samples"),
    (["--mock-data", "--vocab-size", "64", "--lr-decay-samples", "8"], 1,
     "--lr-decay-samples and --lr-warmup-samples need --train-samples"),
    (["--mock-data", "--vocab-size", "64", "--lr-warmup-iters", "1", "--lr-warmup-fraction",
      "0.1"], 1, "give one of --lr-warmup-fraction, --lr-warmup-iters and --lr-warmup-samples"),
    (["--data-path", "0.5", "/nonexistent/a", "/nonexistent/b"], 1,
     "give one prefix, or weights and prefixes in pairs (W1 P1 W2 P2 ...)"),
    (["--mock-data", "--vocab-size", "64", "--wandb-project", "p"], 1,
     "--wandb-project needs --wandb-exp-name"),
    (MOE + ["--num-experts", "6", "--expert-model-parallel-size", "4"], 4,
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    (MOE[:-2] + ["6", "--disable-bias-linear", "--expert-model-parallel-size", "3"], 4,
     "--expert-model-parallel-size 3 x --expert-tensor-parallel-size 1 does not divide the 4 "
     "ranks of a pipeline stage"),
    (["--mock-data", "--vocab-size", "64", "--no-such-flag"], 1,
     "unrecognized arguments: --no-such-flag"),
    (MOE + ["--moe-layer-freq", "[0]*1+[1]*2"], 1, "--moe-layer-freq names 3 layers, the model "
     "has 2"),
    (MOE + ["--moe-layer-freq", "[0]+[2]"], 1, "a layer pattern holds only 0 and 1"),
    (MOE + ["--moe-router-topk", "9"], 1, "--moe-router-topk must be between 1 and "
     "--num-experts 8"),
    ([*MOE[:-1]], 1, "MoE layers have no bias: add --disable-bias-linear"),
    (MOE + ["--tensor-model-parallel-size", "2"], 2, "MoE with --tensor-model-parallel-size > 1 "
     "needs sequence parallelism"),
    (["--mock-data", "--vocab-size", "64", "--mtp-num-layers", "1"], 1,
     "--mtp-num-layers with tied embeddings (megatron-core cannot checkpoint"),
    (["--mock-data", "--vocab-size", "64", "--mtp-num-layers", "1",
      "--untie-embeddings-and-output-weights"], 1,
     "--mtp-num-layers with --position-embedding-type learned_absolute"),
    (["--mock-data", "--vocab-size", "64", "--mtp-num-layers", "0"], 1,
     "--mtp-num-layers must be positive, got 0"),
])
def test_bad_input_is_a_one_line_error(flags, world_size, message):
    result = run_single(BASE + flags, env={"WORLD_SIZE": str(world_size), "RANK": "0"})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("pretrain_gpt.py: error: ") and message in lines[0], lines[0]


def test_a_torch_without_an_api_used_is_a_one_line_error():
    """torch's ``ProcessGroup.abort`` taken away: refused before any group or model is made."""
    flags = BASE + ["--mock-data", "--vocab-size", "64"]
    script = ("import runpy, sys, torch.distributed as dist; del dist.ProcessGroup.abort; "
              f"sys.argv = {[PRETRAIN, *flags]!r}; runpy.run_path(sys.argv[0], run_name='__main__')")
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1", "RANK": "0"}
    environment.pop("MASTER_ADDR", None)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=environment, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("pretrain_gpt.py: error: megatron-elaswave needs torch>=2.12: "
                               "torch "), lines[0]
    assert lines[0].endswith(" has no torch.distributed.ProcessGroup.abort (new in torch 2.7)")


def test_load_from_a_directory_without_checkpoint(tmp_path):
    result = run_single(BASE + ["--mock-data", "--vocab-size", "64", "--load", str(tmp_path)])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "no latest_checkpointed_iteration.txt" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_blends_samples_and_writers_as_megatron_lm_means_them(text_data, tmp_path):
    """A blend of two prefixes with ``--data-cache-path``, ``--train-samples`` with the
    ``--lr-*-samples`` schedule, ``--log-throughput``, TensorBoard and W&B (offline), under
    ``--elastic`` on TP1 x PP2 x DP2: rank 0, the logging rank that writes the metrics file,
    TensorBoard and W&B, is SIGKILLed after iteration 3. The run follows the failure-free run
    of the same schedule given in iterations (same samples, loss, learning rates), and the new
    logging rank writes on: every iteration's scalars in the same TensorBoard directory, the
    same W&B run resumed."""
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard is not installed (pip install -e .[logging])")
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e .[logging])")
    common = model_flags(text_data, train_iters=8, global_batch_size=8, micro_batch_size=1,
                         seq_length=32, lr_warmup_iters=2, lr_decay_style="cosine",
                         min_lr=3e-4, split="90,10,0")
    at = common.index("--data-path")  # the one prefix becomes a blend
    common[at:at + 2] = ["--data-path", "0.3", text_data, "0.7", text_data]
    elastic = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
               "--elastic", "--data-cache-path", str(tmp_path / "cache")]
    iterations = train(tmp_path, "iterations", 4, common + elastic)
    in_samples = list(common)
    for flag, value in (("--train-iters", "--train-samples"), ("--lr-warmup-iters",
                                                               "--lr-warmup-samples")):
        at = in_samples.index(flag)
        in_samples[at:at + 2] = [value, str(int(in_samples[at + 1]) * 8)]
    writers = ["--log-throughput", "--tensorboard-dir", str(tmp_path / "tb"),
               "--wandb-project", "own", "--wandb-exp-name", "samples",
               "--wandb-save-dir", str(tmp_path / "wandb")]
    metrics = tmp_path / "samples.jsonl"
    with launch([PRETRAIN, *in_samples, *elastic, *writers, "--elastic-metrics-file",
                 str(metrics)], 4, master_port=free_port(), env={"WANDB_MODE": "offline"},
                log_path=tmp_path / "samples.log") as job:
        job.wait_for(lambda: "iteration        3/" in job.output(), 240, "iteration 3")
        job.kill_worker(0)
        returncode, output = job.wait(240)
    assert returncode == 0, output[-4000:]
    assert "throughput per GPU (TFLOP/s/GPU)" in output
    samples = read_metrics(str(metrics), "iteration")
    assert_same_trajectory(iterations, samples)
    [recovery] = read_metrics(str(metrics), "recovery")
    assert recovery["failed_ranks"] == [0]
    accumulator = event_accumulator.EventAccumulator(str(tmp_path / "tb"),
                                                     size_guidance={"scalars": 0})
    accumulator.Reload()
    losses = {e.step: e.value for e in accumulator.Scalars("lm loss")}
    assert sorted(losses) == list(range(1, 9))
    for record in samples:
        assert losses[record["iteration"]] == pytest.approx(record["lm_loss"], rel=1e-6)
    for tag in ("learning-rate", "grad-norm", "batch-size", "throughput"):
        assert sorted(e.step for e in accumulator.Scalars(tag))[-1] == 8, tag
    assert {e.value for e in accumulator.Scalars("batch-size")} == {8}
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    runs = sorted((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({path.name.rsplit("-", 1)[1] for path in runs}) == 1, runs
