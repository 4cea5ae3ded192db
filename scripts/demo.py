"""The demo: GPT pretraining on 8 CPU ranks (TP2 x PP2 x DP2) on real text, surviving a failure.

It builds a corpus from the Python standard library's sources, converts it to Megatron's indexed
format and trains twice through ``elaswave-run`` with ``--elastic``: once without failures, once
with a worker SIGKILLed in the middle of the run. It then prints the recovery (time per phase,
new layout) and how far the run with the failure strayed from the failure-free one.
Everything it writes goes under ``--workdir`` (default ``runs/demo``).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from megatron_elaswave.metrics import read_metrics

SCRIPTS = Path(__file__).resolve().parent


def run(command: list[str], **kwargs) -> None:
    subprocess.run(command, check=True, **kwargs)


def prepare_data(workdir: Path) -> str:
    prefix = workdir / "data" / "stdlib"
    if not Path(f"{prefix}_text_document.idx").exists():
        corpus = workdir / "data" / "stdlib.jsonl"
        corpus.parent.mkdir(parents=True, exist_ok=True)
        run([sys.executable, str(SCRIPTS / "make_demo_corpus.py"), "--output", str(corpus),
             "--max-bytes", str(2 << 20)])
        run([sys.executable, str(SCRIPTS / "preprocess_data.py"), "--input", str(corpus),
             "--tokenizer-type", "ByteLevelTokenizer", "--append-eod",
             "--output-prefix", str(prefix)])
    return f"{prefix}_text_document"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--train-iters", type=int, default=40)
    parser.add_argument("--fail-rank", type=int, default=5, help="the rank to SIGKILL")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    data = prepare_data(workdir)
    training = [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "16",
        "--train-iters", str(args.train_iters), "--lr", "2e-3", "--min-lr", "2e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "4", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--seed", "1234", "--use-distributed-optimizer",
        "--untie-embeddings-and-output-weights", "--data-path", data, "--split", "90,10,0",
        "--log-interval", "5", "--eval-interval", str(10 * args.train_iters), "--elastic",
    ]
    failure_at = args.train_iters // 2
    runs = {
        "reference": [],
        "failure": ["--elastic-inject-failure", f"rank={args.fail_rank},iteration={failure_at}"],
    }
    results = {}
    for name, extra in runs.items():
        metrics = workdir / f"{name}.jsonl"
        metrics.unlink(missing_ok=True)
        what = ("failure-free reference" if name == "reference" else
                f"the same run, SIGKILLing rank {args.fail_rank} in iteration {failure_at}")
        print(f"demo: training on 8 CPU ranks (TP2 x PP2 x DP2): {what}", flush=True)
        start = time.monotonic()
        status = launch([*training, *extra, "--elastic-metrics-file", str(metrics)])
        if status != 0:
            print(f"demo: training failed with exit status {status}", file=sys.stderr)
            return status
        results[name] = (read_metrics(str(metrics), "iteration"),
                         read_metrics(str(metrics), "recovery"), time.monotonic() - start)
    return summarise(results, failure_at)


def launch(flags: list[str]) -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "megatron_elaswave.launch.run", "--nproc-per-node", "8",
         "--master-port", str(port), str(SCRIPTS / "pretrain_gpt.py"), *flags],
        env=environment,
    ).returncode


def summarise(results: dict, failure_at: int) -> int:
    reference, _, reference_s = results["reference"]
    iterations, recoveries, failure_s = results["failure"]
    if not recoveries or len(iterations) != len(reference):
        print("demo: the run with a failure did not recover", file=sys.stderr)
        return 1
    same_samples = all(a["samples_digest"] == b["samples_digest"]
                       for a, b in zip(reference, iterations))
    deviation = max(abs(a["lm_loss"] - b["lm_loss"]) / abs(a["lm_loss"])
                    for a, b in zip(reference, iterations) if a["iteration"] >= failure_at)
    record = recoveries[0]
    phases = ("detect", "agree", "plan", "comm", "rebuild", "migrate", "first_step")
    print()
    failed = ", ".join(str(rank) for rank in record["failed_ranks"])
    print(f"demo: rank {failed} failed in iteration {failure_at}; the "
          f"{iterations[-1]['world_size']} survivors rolled back to iteration "
          f"{record['rolled_back_to']}, resharded and finished all {len(iterations)} iterations "
          "without a restart or a checkpoint")
    print("demo: time to recover (MTTR) "
          f"{record['total_s']:.2f} s = " + " + ".join(
              f"{name.replace('_', ' ')} {record[name + '_s']:.2f}" for name in phases)
          + f"; {record['bytes_moved'] / 1e6:.1f} MB of state moved between ranks")
    print("demo: layout after the failure: " + "; ".join(
        f"replica {r['replica']}: " + " | ".join(
            f"ranks {s['ranks']} layers {s['layers'][0]}-{s['layers'][1]}" for s in r["stages"])
        + f" ({r['num_microbatches']} micro-batches)" for r in record["layout"]))
    print(f"demo: against the failure-free run: same samples every iteration: {same_samples}; "
          f"largest relative lm-loss difference from iteration {failure_at} on: {deviation:.1e}; "
          f"global batch {iterations[-1]['global_batch_size']} throughout")
    print(f"demo: lm loss {reference[0]['lm_loss']:.3f} -> {iterations[-1]['lm_loss']:.3f}; "
          f"wall time {reference_s:.0f} s (reference) and {failure_s:.0f} s (with the failure)")
    return 0 if same_samples else 1


if __name__ == "__main__":
    sys.exit(main())
