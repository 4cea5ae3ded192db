"""How long an ``--elastic`` job takes to start, with the launcher's preloading and without.

Runs the same 8-rank ``pretrain_gpt.py --elastic`` job (TP1 x PP4 x DP2, mock data, a few
iterations) through ``elaswave-run`` with its default ``--preload`` and with ``--preload none``,
alternating the arms, and prints per arm the median time from launch to the first iteration
record and to the launcher's exit, and the ratios preloaded / afresh.

    python scripts/bench/startup.py [--rounds 3] [--nproc 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import SCRIPTS, launch, mock_gpt_flags

ARMS = {"preloaded": [], "afresh": ["--preload=none"]}


def one_run(launcher_args: list[str], nproc: int) -> tuple[float, float]:
    """``(seconds to the first iteration record, seconds to the launcher's exit)``."""
    flags = mock_gpt_flags(pipeline=4, num_layers=8, hidden_size=64, micro_batch_size=2,
                           global_batch_size=8, train_iters=3)
    with tempfile.TemporaryDirectory() as workdir:
        metrics = Path(workdir) / "metrics.jsonl"
        start = time.time()
        launch(SCRIPTS / "pretrain_gpt.py",
               [*flags, "--elastic", "--untie-embeddings-and-output-weights",
                "--elastic-metrics-file", str(metrics)], nproc,
               launcher_args)
        end = time.time()
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    first = min(r["time"] for r in records if r["event"] == "iteration")
    return first - start, end - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=8)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in ARMS}
    names = list(ARMS)
    for round_index in range(args.rounds):
        for name in names[round_index % 2:] + names[:round_index % 2]:
            first, total = one_run(ARMS[name], args.nproc)
            results[name].append((first, total))
            print(f"  {name:9s} first iteration {first:6.2f} s, exit {total:6.2f} s", flush=True)
    medians = {name: (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
               for name, runs in results.items()}
    print(f"{'arm':9s} {'first iteration (s)':>20s} {'exit (s)':>9s}   ({args.rounds} runs each, "
          f"{args.nproc} ranks)")
    for name, (first, total) in medians.items():
        print(f"{name:9s} {first:20.2f} {total:9.2f}")
    print(f"ratio preloaded / afresh: first iteration "
          f"{medians['preloaded'][0] / medians['afresh'][0]:.3f}, exit "
          f"{medians['preloaded'][1] / medians['afresh'][1]:.3f}")


if __name__ == "__main__":
    main()
