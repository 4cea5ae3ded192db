"""What interleaved ZeRO saves in a recovery and what it costs per step, against Megatron's
contiguous shards.

Both arms train the same GPT with ``--elastic`` on TP1 x PP4 x DP2 (8 ranks) and kill rank
``--kill-rank`` (stage 2 of replica 1 by default) in iteration ``--kill-iteration``: replica 1
re-partitions its layers over three stages, so the layer groups change. ``contiguous``
(``--elastic-zero contiguous``, Megatron's sharding of each layer group's flat buffer) re-shards
every layer group whose boundaries moved; ``interleaved`` shards each layer's state over its own
holders, so only the state of re-placed layers moves. Runs alternate; each run's recovery and
the iterations after it (``--warmup-iters`` dropped) are kept. Prints the bytes moved, the
migration time and the step time of each arm (medians).
"""

from __future__ import annotations

import argparse
import json
import statistics

from common import alternate, mock_gpt_flags, pretrain_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--train-iters", type=int, default=20)
    parser.add_argument("--kill-rank", type=int, default=5)
    parser.add_argument("--kill-iteration", type=int, default=4)
    parser.add_argument("--warmup-iters", type=int, default=2,
                        help="iterations after the recovery dropped from the step times")
    parser.add_argument("--rounds", type=int, default=3, help="runs per arm")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = [
        *mock_gpt_flags(pipeline=4, num_layers=args.num_layers, hidden_size=args.hidden_size,
                        micro_batch_size=1, global_batch_size=8, train_iters=args.train_iters),
        "--untie-embeddings-and-output-weights", "--elastic", "--elastic-rebalance-window", "0",
        "--elastic-inject-failure", f"rank={args.kill_rank},iteration={args.kill_iteration}",
    ]
    recoveries: dict[str, list[dict]] = {"contiguous": [], "interleaved": []}

    def arm(zero: str):
        def run() -> list[dict]:
            records = pretrain_metrics([*base, "--elastic-zero", zero], 8)
            recoveries[zero] += [r for r in records if r["event"] == "recovery"]
            return [r for r in records
                    if r["event"] == "iteration" and r["iteration"] > args.kill_iteration]
        return run

    times = alternate({zero: arm(zero) for zero in recoveries}, args.rounds, args.warmup_iters,
                      report=(lambda line: None) if args.json else print)
    summary = {zero: {"bytes_moved": statistics.median(r["bytes_moved"] for r in recoveries[zero]),
                      "migrate_s": statistics.median(r["migrate_s"] for r in recoveries[zero]),
                      "step_s": times.median(zero)}
               for zero in recoveries}
    summary["bytes_ratio"] = summary["contiguous"]["bytes_moved"] / summary["interleaved"]["bytes_moved"]
    summary["step_ratio"] = summary["interleaved"]["step_s"] / summary["contiguous"]["step_s"]
    if args.json:
        print(json.dumps(summary))
        return
    for zero in recoveries:
        figures = summary[zero]
        print(f"{zero:11s}: {figures['bytes_moved'] / 1e6:.2f} MB moved in "
              f"{figures['migrate_s'] * 1e3:.0f} ms, {figures['step_s'] * 1e3:.1f} ms per step after")
    print(f"interleaved moves {summary['bytes_ratio']:.2f}x fewer bytes; its steps take "
          f"{summary['step_ratio']:.2f}x as long")


if __name__ == "__main__":
    main()
