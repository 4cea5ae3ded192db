"""Per-iteration time of ``pretrain_gpt.py`` (the plugin) against plain megatron-core.

Both arms train the same GPT on the same layout through ``elaswave-run``: ``pretrain_gpt.py`` with
everything the plugin adds (its patches, layout-invariant init, per-step metrics reduction,
micro-batch ids), and ``plain_gpt.py``, megatron-core's own training loop. Runs alternate
between the arms (ABBA order) so that machine noise hits both alike; the first iterations of
each run are dropped as warm-up. Prints the median iteration time of each arm and their ratio
(target: at most 1.03).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1]


def launch(script: Path, script_args: list[str], nproc: int, port: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron_elaswave.run", f"--nproc-per-node={nproc}",
               f"--master-port={port}", str(script), *script_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"overhead: {script.name} failed:\n{result.stderr[-3000:]}")
    return result


def plugin_times(args, port: int) -> list[float]:
    with tempfile.TemporaryDirectory() as workdir:
        metrics = Path(workdir) / "metrics.jsonl"
        launch(SCRIPTS / "pretrain_gpt.py", [
            "--tensor-model-parallel-size", str(args.tp), "--pipeline-model-parallel-size", str(args.pp),
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
            "--micro-batch-size", "2", "--global-batch-size", str(args.global_batch_size),
            "--train-iters", str(args.train_iters), "--lr", "1e-3", "--mock-data",
            "--vocab-size", "511", "--use-distributed-optimizer", "--log-interval", "1000",
            "--eval-interval", "100000", "--elastic-metrics-file", str(metrics),
        ], args.nproc, port)
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["step_time_s"] for r in records if r["event"] == "iteration"]


def plain_times(args, port: int) -> list[float]:
    result = launch(SCRIPTS / "bench" / "plain_gpt.py", [
        "--tp", str(args.tp), "--pp", str(args.pp), "--num-layers", str(args.num_layers),
        "--hidden-size", str(args.hidden_size), "--seq-length", str(args.seq_length),
        "--global-batch-size", str(args.global_batch_size), "--vocab-size", "512",
        "--train-iters", str(args.train_iters),
    ], args.nproc, port)
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return [r["step_time_s"] for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--train-iters", type=int, default=25)
    parser.add_argument("--warmup-iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds (2 runs per arm each)")
    parser.add_argument("--port", type=int, default=29571)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    arms = {"plugin": plugin_times, "plain": plain_times}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for round_index in range(args.rounds):
        for name in ("plugin", "plain", "plain", "plugin") if round_index % 2 == 0 else (
                "plain", "plugin", "plugin", "plain"):
            run = arms[name](args, args.port)
            times[name].extend(run[args.warmup_iters:])
            if not args.json:
                print(f"  {name:6s} run: median {statistics.median(run[args.warmup_iters:]) * 1e3:.1f} ms "
                      f"over {len(run) - args.warmup_iters} iterations", flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["plugin"] / medians["plain"]
    summary = {"plugin_median_s": medians["plugin"], "plain_median_s": medians["plain"],
               "ratio": ratio, "iterations_per_arm": len(times["plugin"]),
               "layout": f"TP{args.tp}xPP{args.pp}xDP{args.nproc // (args.tp * args.pp)}"}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['layout']}, hidden {args.hidden_size}, {summary['iterations_per_arm']} "
              f"iterations per arm: plugin {medians['plugin'] * 1e3:.1f} ms, plain megatron-core "
              f"{medians['plain'] * 1e3:.1f} ms, ratio {ratio:.3f} (target <= 1.03)")


if __name__ == "__main__":
    main()
