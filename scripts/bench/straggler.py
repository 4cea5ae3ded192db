"""Throughput with one rank slowed down, with and without following the straggler.

Both arms train the same GPT with ``--elastic`` while rank 1 computes ``--factor`` times as
slowly from the first iteration (``--elastic-inject-slowdown``): ``follow`` lets the job react
(the default), ``static`` keeps the planned layout (``--elastic-rebalance-window 0``). With
``--data-parallel 2`` (TP1 x PP2 x DP2, rank 1 is stage 0 of replica 1) the job re-deals the
micro-batches; with ``--data-parallel 1`` (TP1 x PP2, rank 1 is the last stage of the lone
replica) re-dealing cannot help and layers move off the slow stage. Runs alternate; the first
``--warmup-iters`` iterations of each run (the rebalance windows included) are dropped. Prints
the median iteration time of each arm and the throughput ratio.
"""

from __future__ import annotations

import argparse
import json

from common import alternate, mock_gpt_flags, pretrain_records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--data-parallel", type=int, choices=(1, 2), default=2)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--train-iters", type=int, default=25)
    parser.add_argument("--warmup-iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="runs per arm")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = [
        *mock_gpt_flags(pipeline=2, num_layers=args.num_layers, hidden_size=args.hidden_size,
                        micro_batch_size=2, global_batch_size=args.global_batch_size,
                        train_iters=args.train_iters),
        "--untie-embeddings-and-output-weights", "--elastic",
        "--elastic-inject-slowdown", f"rank=1,factor={args.factor}",
    ]
    layouts: dict[str, dict] = {}

    def arm(name: str, flags: list[str]):
        def run() -> list[dict]:
            records = pretrain_records(base + flags, 2 * args.data_parallel)
            layouts[name] = {
                "microbatches_per_replica": [r["num_microbatches"] for r in records[-1]["layout"]],
                "layers_per_stage": [[s["layers"][1] - s["layers"][0] + 1 for s in r["stages"]]
                                     for r in records[-1]["layout"]]}
            return records
        return run

    times = alternate({"follow": arm("follow", []),
                       "static": arm("static", ["--elastic-rebalance-window", "0"])},
                      args.rounds, args.warmup_iters,
                      report=(lambda line: None) if args.json else print)
    medians = {name: times.median(name) for name in times.runs}
    summary = {"median_s": medians, "speedup": medians["static"] / medians["follow"],
               "layouts": layouts, "factor": args.factor, "data_parallel": args.data_parallel,
               "iterations_per_arm": len(times.pooled("static"))}
    if args.json:
        print(json.dumps(summary))
        return
    grid = f"TP1xPP2xDP{args.data_parallel}"
    print(f"rank 1 {args.factor:g}x slower, {grid}, {summary['iterations_per_arm']} iterations per "
          f"arm: static {layouts['static']} {medians['static'] * 1e3:.1f} ms, following the "
          f"straggler {layouts['follow']} {medians['follow'] * 1e3:.1f} ms: throughput "
          f"x{summary['speedup']:.2f}")


if __name__ == "__main__":
    main()
