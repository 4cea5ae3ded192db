"""Megatron-LM's production recipes, scaled down to four CPU ranks, under ``--elastic``.

``examples/gpt3/train_gpt3_175b_distributed.sh`` and ``examples/llama/train_llama3_8b_h100_fp8.sh``
(Megatron-LM core_v0.16.1 and the 0.19 line) with their flags kept where they run on CPU: the
GPT-3 recipe's batch size ramp-up (core_v0.19 spells it ``--step-batch-size-schedule``), cosine
schedule with a warm-up fraction, blended ``--data-path``, TensorBoard, here with virtual
pipeline stages; the Llama 3 recipe's GQA, RoPE, SwiGLU, RMSNorm, untied embeddings, no bias,
distributed optimizer with ``--overlap-grad-reduce --overlap-param-gather``,
``--calculate-per-token-loss``, ``--train-samples`` with the ``--lr-*-samples`` schedule,
``--log-throughput``, TensorBoard and W&B (offline). fp8, bf16, Transformer Engine, sequence
parallelism and checkpoints are left out. Each run is compared with the failure-free run of the
same flags: same samples every iteration (``samples_digest``), loss within 1e-4.

Megatron-LM's loop comes from the training package of the installed megatron-core (0.19 on) or
a checkout named by ``MEGATRON_LM_PATH``, as in ``test_megatron_adaptor.py``; skipped where
neither is at hand, or without ``tensorboard`` (``pip install -e .[logging]``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from harness import free_port, launch
from megatron_elaswave.metrics import read_metrics
from test_megatron_adaptor import LOG_LINE, TRAINING_SCRIPT

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(TRAINING_SCRIPT is None, reason="no Megatron-LM training package: set "
                       "MEGATRON_LM_PATH, or install megatron-core 0.19 or later"),
]
event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is not installed (pip install -e .[logging])")

REPO = Path(__file__).resolve().parent.parent
LOSS_TOLERANCE = 1e-4
ITERATION_LINE = re.compile(r"iteration +(\d+)/ +\d+ \|")
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> list[str]:
    """A blend of two indexed datasets (``--data-path W1 P1 W2 P2``) of 500-character documents
    of the Python standard library, made with the project's own preprocessing."""
    root = tmp_path_factory.mktemp("blend")
    corpus = root / "corpus.jsonl"
    subprocess.run([sys.executable, str(REPO / "scripts/make_demo_corpus.py"), "--output",
                    str(corpus), "--max-bytes", "400000"], check=True, capture_output=True)
    documents = [text[i:i + 500] for line in corpus.read_text().splitlines()
                 for text in [json.loads(line)["text"]] for i in range(0, len(text), 500)]
    half = len(documents) // 2
    prefixes = []
    for name, part in (("a", documents[:half]), ("b", documents[half:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
        subprocess.run([sys.executable, str(REPO / "scripts/preprocess_data.py"), "--input",
                        str(root / f"{name}.jsonl"), "--tokenizer-type", "ByteLevelTokenizer",
                        "--append-eod", "--output-prefix", str(root / name)],
                       check=True, capture_output=True)
        prefixes.append(str(root / f"{name}_text_document"))
    return ["0.3", prefixes[0], "0.7", prefixes[1]]


CPU = ["--distributed-backend", "gloo", "--transformer-impl", "local",
       "--no-gradient-accumulation-fusion", "--no-persist-layer-norm"]
"""What Megatron-LM needs on CPU ranks (docs/megatron-lm.md)."""


def batch_ramp() -> list[str]:
    """Eight iterations, the global batch 4 samples, then 8 from the 16th sample (512 tokens) on,
    the learning rate decaying over all of them, in the flags of the loop at hand: core_v0.16's
    ``--rampup-batch-size``, which it allows only in a run measured in samples, or
    ``--step-batch-size-schedule``, which replaced it."""
    training = Path(TRAINING_SCRIPT).parent / "megatron/training"  # a checkout's, if any
    if training.is_dir() and not any("step_batch_size_schedule" in source.read_text()
                                     for source in training.rglob("*.py")):
        return ["--rampup-batch-size", "4", "4", "16", "--global-batch-size", "8",
                "--train-samples", "48", "--lr-decay-samples", "48"]
    return ["--step-batch-size-schedule", "0:4 512:8", "--train-iters", "8", "--lr-decay-iters", "8"]


def gpt3_recipe(blend: list[str], tensorboard: Path) -> list[str]:
    """``train_gpt3_175b_distributed.sh`` at 4 layers, hidden 64, TP2 x PP2 with two virtual
    stages per rank; the ramp-up goes from 4 to 8 samples after 16 samples (512 tokens)."""
    return [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "1", *batch_ramp(),
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--lr", "6.0e-5",
        "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer",
        "--data-path", *blend, "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
        "--split", "90,8,2",
        "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "2",
        "--tensorboard-dir", str(tensorboard), *CPU,
    ]


def llama3_recipe(blend: list[str], tensorboard: Path, cache: Path, *, tp: int = 2,
                  samples: int = 64) -> list[str]:
    """``train_llama3_8b_h100_fp8.sh`` at 4 layers, hidden 64, GQA with 2 query groups, TP2 x
    PP2 (or TP1 x PP2 x DP2), global batch 8, ``samples`` training samples."""
    return [
        "--use-mcore-models", "--num-layers", "4", "--hidden-size", "64",
        "--ffn-hidden-size", "160", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "32",
        "--max-position-embeddings", "32", "--position-embedding-type", "rope",
        "--no-rope-fusion", "--rotary-base", "1000000", "--rotary-percent", "1.0",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu",
        "--normalization", "RMSNorm", "--init-method-std", "0.0134",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-samples", str(samples), "--lr-decay-samples", str(samples - 4),
        "--lr-warmup-samples", "8", "--lr", "0.00015", "--min-lr", "0.00001",
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--calculate-per-token-loss",
        "--manual-gc", "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
        "--overlap-grad-reduce", "--overlap-param-gather",
        "--data-path", *blend, "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
        "--data-cache-path", str(cache), "--split", "90,10,0",
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
        "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "4", "--log-throughput",
        "--tensorboard-dir", str(tensorboard), *CPU,
    ]


def run(tmp_path: Path, name: str, flags: list[str], *, kill_after: int | None = None,
        kill_rank: int = 3, launcher_args: tuple[str, ...] = (),
        wait_for: str | None = None) -> dict:
    """Megatron-LM's ``pretrain_gpt.py`` with ``flags --elastic`` on four ranks; with
    ``kill_after``, SIGKILL ``kill_rank`` from outside once Megatron-LM's log line of that
    iteration is out (the log line follows the iteration's step, so the kill lands after it).
    With ``wait_for``, the run must print it. The run's exit status, output and records."""
    metrics = tmp_path / f"{name}.jsonl"
    command = ["-m", "megatron_elaswave.run_megatron_lm", str(TRAINING_SCRIPT), *flags,
               "--elastic", "--elastic-rebalance-window", "0",
               "--elastic-metrics-file", str(metrics)]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    with launch(command, 4, master_port=free_port(), launcher_args=launcher_args, env=env,
                log_path=tmp_path / f"{name}.log") as job:
        if kill_after is not None:
            job.wait_for(lambda: any(int(i) >= kill_after
                                     for i in ITERATION_LINE.findall(job.output())),
                         180, f"iteration {kill_after}")
            job.kill_worker(kill_rank)
        if wait_for is not None:
            job.wait_for(lambda: wait_for in job.output(), 300, wait_for)
        returncode, output = job.wait(300)
    assert returncode == 0, output[-6000:]
    return {"output": output,
            "iterations": read_metrics(str(metrics), "iteration"),
            "recoveries": read_metrics(str(metrics), "recovery"),
            "grows": read_metrics(str(metrics), "grow")}


def assert_on_trajectory(got: dict, reference: dict) -> None:
    """Every iteration once, with the reference's samples, loss within 1e-4 (relative)."""
    assert [r["iteration"] for r in got["iterations"]] == \
        [r["iteration"] for r in reference["iterations"]]
    for ref, record in zip(reference["iterations"], got["iterations"], strict=True):
        assert record["samples_digest"] == ref["samples_digest"], record["iteration"]
        assert record["global_batch_size"] == ref["global_batch_size"], record["iteration"]
        relative = abs(record["lm_loss"] - ref["lm_loss"]) / abs(ref["lm_loss"])
        assert relative <= LOSS_TOLERANCE, (record["iteration"], ref["lm_loss"], record["lm_loss"])


def scalars(directory: Path, tag: str) -> dict[int, float]:
    """TensorBoard's scalars of ``tag`` by step, read back from every event file of
    ``directory`` (a later writer's steps replace an earlier one's)."""
    accumulator = event_accumulator.EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {event.step: event.value for event in accumulator.Scalars(tag)}


def event_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("events.out.tfevents.*"))


def validation_losses(output: str) -> dict[int, float]:
    return {int(i): float(loss) for i, loss in VALIDATION_LINE.findall(output)}


@pytest.mark.timeout(600)
def test_gpt3_recipe_ramps_its_batch_and_survives_a_kill_during_evaluation(tmp_path, blend):
    """The last rank (the logging rank, TensorBoard's writer) is SIGKILLed as the evaluation
    after iteration 4 starts, the others already in it: the survivors recover, evaluate again
    and train on, ramping the batch from 4 to 8 as Megatron's schedule says."""
    reference = run(tmp_path, "reference", gpt3_recipe(blend, tmp_path / "tb-reference"))
    killed = run(tmp_path, "killed", gpt3_recipe(blend, tmp_path / "tb-killed") + [
        "--elastic-inject-failure", "rank=3,iteration=4,phase=evaluation"])
    assert "injected failure: rank 3 kill in the evaluation of iteration 4" in killed["output"]
    assert_on_trajectory(killed, reference)
    assert [r["global_batch_size"] for r in reference["iterations"]] == [4] * 4 + [8] * 4
    [recovery] = killed["recoveries"]
    assert recovery["failed_ranks"] == [3] and recovery["rolled_back_to"] == 4
    # The evaluation the kill broke was run again on the survivors' layout, same loss.
    assert validation_losses(killed["output"])[4] == pytest.approx(
        validation_losses(reference["output"])[4], rel=LOSS_TOLERANCE)
    # TensorBoard: every iteration's loss and batch size, the later ones from the new logging
    # rank's writer in the same directory.
    assert len(event_files(tmp_path / "tb-killed")) == 2
    losses, reference_losses = (scalars(tmp_path / f"tb-{name}", "lm loss")
                                for name in ("killed", "reference"))
    assert sorted(losses) == list(range(1, 9))
    for step, loss in reference_losses.items():
        assert losses[step] == pytest.approx(loss, rel=LOSS_TOLERANCE)
    batch_sizes = scalars(tmp_path / "tb-killed", "batch-size")
    assert [batch_sizes[step] for step in range(1, 9)] == [4] * 4 + [8] * 4


@pytest.mark.timeout(600)
def test_llama3_recipe_survives_a_sigkilled_logging_rank(tmp_path, blend):
    """The last rank, which writes TensorBoard and W&B, is SIGKILLed from outside after
    iteration 3; the run ends on the failure-free trajectory and the new last rank writes
    Megatron-LM's log line (every iteration's once), TensorBoard (in the same directory) and
    W&B (resuming the same run) from then on."""
    def flags(name):
        return llama3_recipe(blend, tmp_path / f"tb-{name}", tmp_path / "cache") + [
            "--wandb-project", "recipes", "--wandb-exp-name", name,
            "--wandb-save-dir", str(tmp_path / f"wandb-{name}")]

    reference = run(tmp_path, "reference", flags("reference"))
    killed = run(tmp_path, "killed", flags("killed"), kill_after=3)
    assert_on_trajectory(killed, reference)
    [recovery] = killed["recoveries"]
    assert recovery["failed_ranks"] == [3]
    assert "throughput per GPU (TFLOP/s/GPU)" in killed["output"]  # --log-throughput
    # Megatron-LM's own line of every iteration, once, the new logging rank's after the kill.
    logged = [int(iteration) for iteration, _, _ in LOG_LINE.findall(killed["output"])]
    assert logged == list(range(1, 9)), logged
    losses = scalars(tmp_path / "tb-killed", "lm loss")
    assert sorted(losses) == list(range(1, 9))
    learning_rates = scalars(tmp_path / "tb-killed", "learning-rate")
    for step, rate in scalars(tmp_path / "tb-reference", "learning-rate").items():
        assert learning_rates[step] == pytest.approx(rate, rel=1e-6)  # --lr-*-samples
    assert len(event_files(tmp_path / "tb-killed")) == 2
    runs = sorted((tmp_path / "wandb-killed" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({path.name.rsplit("-", 1)[1] for path in runs}) == 1, runs


def rank_3_rejoins(tmp_path: Path, flags: Callable[[str], list[str]],
                   shrunk_world_size: int) -> tuple[dict, dict, dict]:
    """``flags(name)`` without a failure (``reference``) and under ``elaswave-run --rejoin``
    (``rejoined``) with rank 3 SIGKILLed after iteration 3: the second run stays on the first's
    trajectory, recovers from rank 3 once and takes its replacement back once, trains on
    ``shrunk_world_size`` ranks until then and on four at the end. The two runs and the grow."""
    reference = run(tmp_path, "reference", flags("reference"))
    rejoined = run(tmp_path, "rejoined", flags("rejoined"), kill_after=3,
                   launcher_args=("--rejoin", "--rejoin-delay", "1"),
                   wait_for="ranks [3] joined after iteration")
    assert_on_trajectory(rejoined, reference)
    [recovery] = rejoined["recoveries"]
    [grow] = rejoined["grows"]
    assert recovery["failed_ranks"] == [3] and grow["joined_ranks"] == [3]
    by_iteration = {r["iteration"]: r for r in rejoined["iterations"]}
    assert by_iteration[grow["iteration"]]["world_size"] == shrunk_world_size
    assert rejoined["iterations"][-1]["world_size"] == 4
    return reference, rejoined, grow


@pytest.mark.timeout(900)
def test_a_replacement_rejoins_megatron_lms_loop_on_the_trajectory(tmp_path, blend):
    """TP1 x PP2 x DP2 under ``elaswave-run --rejoin``: rank 3 is SIGKILLed after iteration 3,
    its replica re-partitions onto rank 2, the launcher starts rank 3 again, and the replacement
    joins Megatron-LM's running loop at an iteration boundary; the job runs at its first layout
    again, on the failure-free trajectory. The run is long enough for the replacement to start
    (a few seconds) before the job ends."""
    def flags(name):
        return llama3_recipe(blend, tmp_path / f"tb-{name}", tmp_path / "cache", tp=1,
                             samples=1200) + ["--log-interval", "10", "--eval-interval", "50"]

    _, rejoined, _ = rank_3_rejoins(tmp_path, flags, shrunk_world_size=3)
    # The replacement logs again as the last rank: Megatron-LM's lines go on to the end.
    printed = [int(i) for i in ITERATION_LINE.findall(rejoined["output"])]
    assert max(printed) == 150


@pytest.mark.timeout(900)
def test_a_tensor_parallel_partner_waits_as_a_spare_and_rejoins_megatron_lms_loop(tmp_path, blend):
    """TP2 x PP2 (one replica) under ``elaswave-run --rejoin``, saving every 10 iterations: rank
    3 is SIGKILLed after iteration 3; its tensor-parallel partner, rank 2, is left without a
    stage while ranks 0 and 1 run the whole model as one stage. When the replacement of rank 3
    joins, rank 2 holds a stage again, and Megatron-LM's loop on it, behind since iteration 3,
    catches up with the job without taking part in the log lines, evaluations and saves it
    missed. The job ends at its first layout, on the failure-free trajectory, with the last
    checkpoint complete."""
    def flags(name):
        return llama3_recipe(blend, tmp_path / f"tb-{name}", tmp_path / "cache", samples=800) + [
            "--log-interval", "5", "--eval-interval", "10",
            "--save", str(tmp_path / f"ckpt-{name}"), "--save-interval", "10"]

    reference, rejoined, grow = rank_3_rejoins(tmp_path, flags, shrunk_world_size=2)
    assert grow["iteration"] > 10  # rank 2 missed a save, an evaluation and log lines
    printed = [int(i) for i in ITERATION_LINE.findall(rejoined["output"])]
    assert max(printed) == 100 and printed == sorted(set(printed))
    assert validation_losses(rejoined["output"]).keys() == validation_losses(
        reference["output"]).keys()
    tracker = tmp_path / "ckpt-rejoined" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == "100"
