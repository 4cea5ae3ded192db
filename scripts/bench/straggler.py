"""Throughput with one rank slowed down, with and without re-dealing micro-batches.

Both arms train the same GPT with ``--elastic`` on TP1 x PP2 x DP2 while rank 1 (stage 0 of
replica 1) computes ``--factor`` times as slowly from the first iteration
(``--elastic-inject-slowdown``): ``rebalance`` follows the straggler (the default), ``static``
keeps the even deal (``--elastic-rebalance-window 0``). Runs alternate; the first
``--warmup-iters`` iterations of each run (the rebalance window included) are dropped. Prints
the median iteration time of each arm and the throughput ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics

from common import alternate, pretrain_records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--train-iters", type=int, default=25)
    parser.add_argument("--warmup-iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="runs per arm")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = [
        "--pipeline-model-parallel-size", "2", "--num-layers", "4",
        "--hidden-size", str(args.hidden_size), "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "2", "--global-batch-size", str(args.global_batch_size),
        "--train-iters", str(args.train_iters), "--lr", "1e-3", "--mock-data", "--vocab-size", "511",
        "--use-distributed-optimizer", "--untie-embeddings-and-output-weights", "--elastic",
        "--log-interval", "1000", "--eval-interval", "100000",
        "--elastic-inject-slowdown", f"rank=1,factor={args.factor}",
    ]
    deals: dict[str, list[int]] = {}

    def arm(name: str, flags: list[str]):
        def run() -> list[float]:
            records = pretrain_records(base + flags, 4)
            deals[name] = [r["num_microbatches"] for r in records[-1]["layout"]]
            return [r["step_time_s"] for r in records]
        return run

    times = alternate({"rebalance": arm("rebalance", []),
                       "static": arm("static", ["--elastic-rebalance-window", "0"])},
                      args.rounds, args.warmup_iters,
                      report=(lambda line: None) if args.json else print)
    medians = {name: statistics.median(values) for name, values in times.items()}
    summary = {"median_s": medians, "speedup": medians["static"] / medians["rebalance"],
               "microbatches_per_replica": deals, "factor": args.factor,
               "iterations_per_arm": len(times["static"])}
    if args.json:
        print(json.dumps(summary))
        return
    print(f"rank 1 {args.factor:g}x slower, TP1xPP2xDP2, {summary['iterations_per_arm']} iterations "
          f"per arm: static deal {deals['static']} {medians['static'] * 1e3:.1f} ms, re-dealt "
          f"{deals['rebalance']} {medians['rebalance'] * 1e3:.1f} ms: throughput "
          f"x{summary['speedup']:.2f} with rebalancing")


if __name__ == "__main__":
    main()
