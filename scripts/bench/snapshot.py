"""Step time with and without per-step in-memory snapshots, and the memory they take.

Five arms of ``pretrain_gpt.py`` on the same job, time-sliced (``common.time_sliced``): no
snapshots; snapshots kept locally (``--elastic-snapshot-replicas 0``); snapshots replicated to
one buddy (K=1), each settled in its own step (``--elastic-snapshot-overlap off``); the same,
each settled in the next step before its optimizer step (``--elastic-snapshot-overlap on``, the
default): its exchange with the buddy runs on a thread beside the next step's forward and
backward, and on CUDA its device-to-host copies too; and two buddies (K=2, the default where
memory allows: any two ranks may fail together), settled in the next step.
Prints the median iteration time of each arm, their ratios to the arm without snapshots (the
median over sets of each set's median over rounds of the windows' ratio within a round; target:
at most 1.05) with a 95% interval for each over the sets (``common.median_interval``), and the
snapshot bytes held per rank.
"""

from __future__ import annotations

import argparse
import json

from common import SlicedJob, mock_gpt_flags, time_sliced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--window", type=int, default=4,
                        help="iterations measured per arm and round")
    parser.add_argument("--warmup-iters", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--bf16", action="store_true", help="train in bf16 (CUDA, NPU)")
    parser.add_argument("--rounds", type=int, default=6, help="windows per arm and set")
    parser.add_argument("--sets", type=int, default=2, help="runs per arm, one after the other")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    def base(train_iters: int) -> list[str]:
        flags = mock_gpt_flags(pipeline=args.pp, num_layers=args.num_layers,
                               hidden_size=args.hidden_size,
                               micro_batch_size=args.micro_batch_size,
                               global_batch_size=args.global_batch_size,
                               train_iters=train_iters, seq_length=args.seq_length)
        return flags + (["--bf16"] if args.bf16 else [])

    arms_flags = {
        "none": [],
        "local": ["--elastic-snapshots", "--elastic-snapshot-replicas", "0"],
        "replicated": ["--elastic-snapshots", "--elastic-snapshot-replicas", "1",
                       "--elastic-snapshot-overlap", "off"],
        "overlapped": ["--elastic-snapshots", "--elastic-snapshot-replicas", "1",
                       "--elastic-snapshot-overlap", "on"],
        "two copies": ["--elastic-snapshots", "--elastic-snapshot-replicas", "2",
                       "--elastic-snapshot-overlap", "on"],
    }

    def arm(name: str):
        return lambda train_iters: SlicedJob.pretrain(base(train_iters) + arms_flags[name],
                                                      args.nproc)

    times = time_sliced({name: arm(name) for name in arms_flags}, args.rounds, args.window,
                        args.warmup_iters, sets=args.sets,
                        report=(lambda line: None) if args.json else print)
    snapshot_bytes = {name: runs[-1][-1].get("snapshot_bytes", 0)
                      for name, runs in times.runs.items()}
    medians = {name: times.median(name) for name in arms_flags}
    summary = {
        "median_s": medians,
        "ratio_local": times.paired_ratio("local", "none"),
        "ratio_replicated": times.paired_ratio("replicated", "none"),
        "ratio_overlapped": times.paired_ratio("overlapped", "none"),
        "ratio_two_copies": times.paired_ratio("two copies", "none"),
        "ratio_interval": {name: times.ratio_interval(name, "none")
                           for name in ("local", "replicated", "overlapped", "two copies")},
        "snapshot_bytes_rank0": {k: v for k, v in snapshot_bytes.items() if k != "none"},
        "iterations_per_arm": len(times.pooled("none")),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"hidden {args.hidden_size}, TP1xPP{args.pp}xDP{args.nproc // args.pp}, "
              f"{summary['iterations_per_arm']} iterations per arm: "
              f"no snapshots {medians['none'] * 1e3:.1f} ms, local {medians['local'] * 1e3:.1f} ms "
              f"(x{summary['ratio_local']:.3f}), replicated K=1 {medians['replicated'] * 1e3:.1f} ms "
              f"(x{summary['ratio_replicated']:.3f}), settled in the next step "
              f"{medians['overlapped'] * 1e3:.1f} ms (x{summary['ratio_overlapped']:.3f}), "
              f"two copies {medians['two copies'] * 1e3:.1f} ms "
              f"(x{summary['ratio_two_copies']:.3f}); "
              f"target <= 1.05; 95% intervals: " + ", ".join(
                  f"{name} {low:.3f} to {high:.3f}"
                  for name, (low, high) in summary["ratio_interval"].items())
              + "; bytes held by rank 0: "
              f"local {snapshot_bytes['local']}, K=1 {snapshot_bytes['replicated']}, "
              f"K=2 {snapshot_bytes['two copies']}")


if __name__ == "__main__":
    main()
