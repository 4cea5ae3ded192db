"""The demo: GPT pretraining on 8 CPU ranks (TP2 x PP2 x DP2) on real text.

It builds a corpus from the Python standard library's sources, converts it to Megatron's indexed
format, trains through ``elaswave-run`` and prints a summary from the metrics file.
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
    parser.add_argument("--master-port", type=int, default=0, help="default: a free port")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    data = prepare_data(workdir)
    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    training = [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "16",
        "--train-iters", str(args.train_iters), "--lr", "2e-3", "--min-lr", "2e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "4", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--seed", "1234", "--use-distributed-optimizer",
        "--data-path", data, "--split", "90,10,0", "--log-interval", "5",
        "--eval-interval", str(args.train_iters), "--eval-iters", "2",
        "--elastic-metrics-file", str(metrics),
    ]
    if not args.master_port:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            args.master_port = probe.getsockname()[1]
    start = time.monotonic()
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "megatron_elaswave.run", "--nproc-per-node", "8",
         "--master-port", str(args.master_port), str(SCRIPTS / "pretrain_gpt.py"), *training],
        env=environment,
    )
    if result.returncode != 0:
        print(f"demo: training failed with exit status {result.returncode}", file=sys.stderr)
        return result.returncode
    records = read_metrics(str(metrics), "iteration")
    first, last = records[0], records[-1]
    print(
        f"demo: {len(records)} iterations on {last['world_size']} ranks in "
        f"{time.monotonic() - start:.0f} s; lm loss {first['lm_loss']:.3f} -> {last['lm_loss']:.3f}; "
        f"median step time {sorted(r['step_time_s'] for r in records)[len(records) // 2]:.3f} s; "
        f"metrics in {metrics}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
