"""Per-iteration time of ``pretrain_gpt.py`` (the plugin) against plain megatron-core.

Both arms train the same GPT on the same layout through ``elaswave-run``: ``pretrain_gpt.py`` with
everything the plugin adds (its patches, layout-invariant init, per-step metrics reduction,
micro-batch ids), and ``plain_gpt.py``, megatron-core's own training loop. Runs alternate
between the arms so that machine noise hits both alike; the first iterations of each run are
dropped as warm-up. Prints the median iteration time of each arm and their ratio (target: at
most 1.03).
"""

from __future__ import annotations

import argparse
import json
import statistics

from common import SCRIPTS, alternate, launch, pretrain_records


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
    parser.add_argument("--rounds", type=int, default=4, help="runs per arm")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    def plugin() -> list[float]:
        records = pretrain_records([
            "--tensor-model-parallel-size", str(args.tp), "--pipeline-model-parallel-size", str(args.pp),
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
            "--micro-batch-size", "2", "--global-batch-size", str(args.global_batch_size),
            "--train-iters", str(args.train_iters), "--lr", "1e-3", "--mock-data",
            "--vocab-size", "511", "--use-distributed-optimizer", "--log-interval", "1000",
            "--eval-interval", "100000",
        ], args.nproc)
        return [r["step_time_s"] for r in records]

    def plain() -> list[float]:
        result = launch(SCRIPTS / "bench" / "plain_gpt.py", [
            "--tp", str(args.tp), "--pp", str(args.pp), "--num-layers", str(args.num_layers),
            "--hidden-size", str(args.hidden_size), "--seq-length", str(args.seq_length),
            "--global-batch-size", str(args.global_batch_size), "--vocab-size", "512",
            "--train-iters", str(args.train_iters),
        ], args.nproc)
        return [json.loads(line)["step_time_s"] for line in result.stdout.splitlines()
                if line.startswith("{")]

    times = alternate({"plugin": plugin, "plain": plain}, args.rounds, args.warmup_iters,
                      report=(lambda line: None) if args.json else print)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["plugin"] / medians["plain"]
    layout = f"TP{args.tp}xPP{args.pp}xDP{args.nproc // (args.tp * args.pp)}"
    if args.json:
        print(json.dumps({"plugin_median_s": medians["plugin"], "plain_median_s": medians["plain"],
                          "ratio": ratio, "iterations_per_arm": len(times["plugin"]),
                          "layout": layout}))
    else:
        print(f"{layout}, hidden {args.hidden_size}, {len(times['plugin'])} iterations per arm: "
              f"plugin {medians['plugin'] * 1e3:.1f} ms, plain megatron-core "
              f"{medians['plain'] * 1e3:.1f} ms, ratio {ratio:.3f} (target <= 1.03)")


if __name__ == "__main__":
    main()
