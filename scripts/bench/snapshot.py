"""Step time with and without per-step in-memory snapshots, and the memory they take.

Four arms of ``pretrain_gpt.py`` on the same job, alternating: no snapshots; snapshots kept
locally (``--elastic-snapshot-replicas 0``); snapshots replicated to one buddy (K=1, the
default), each settled in its own step (``--elastic-snapshot-overlap off``); the same, each
settled in the next step before its optimizer step (``--elastic-snapshot-overlap on``, the
default): its exchange with the buddy runs on a thread beside the next step's forward and
backward, and on CUDA its device-to-host copies too.
Prints the median iteration time of each arm, their ratios to the arm without snapshots (the
median over rounds of the runs' ratio within a round; target: at most 1.05) and the snapshot
bytes held per rank.
"""

from __future__ import annotations

import argparse
import json

from common import alternate, mock_gpt_flags, pretrain_records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--train-iters", type=int, default=25)
    parser.add_argument("--warmup-iters", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--bf16", action="store_true", help="train in bf16 (CUDA, NPU)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per arm")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = mock_gpt_flags(pipeline=args.pp, num_layers=args.num_layers,
                          hidden_size=args.hidden_size, micro_batch_size=args.micro_batch_size,
                          global_batch_size=args.global_batch_size,
                          train_iters=args.train_iters, seq_length=args.seq_length)
    base += ["--bf16"] if args.bf16 else []
    arms_flags = {
        "none": [],
        "local": ["--elastic-snapshots", "--elastic-snapshot-replicas", "0"],
        "replicated": ["--elastic-snapshots", "--elastic-snapshot-replicas", "1",
                       "--elastic-snapshot-overlap", "off"],
        "overlapped": ["--elastic-snapshots", "--elastic-snapshot-replicas", "1",
                       "--elastic-snapshot-overlap", "on"],
    }
    snapshot_bytes: dict[str, int] = {}

    def arm(name: str):
        def run() -> list[dict]:
            records = pretrain_records(base + arms_flags[name], args.nproc)
            snapshot_bytes[name] = records[-1].get("snapshot_bytes", 0)
            return records
        return run

    times = alternate({name: arm(name) for name in arms_flags}, args.rounds, args.warmup_iters,
                      report=(lambda line: None) if args.json else print)
    medians = {name: times.median(name) for name in arms_flags}
    summary = {
        "median_s": medians,
        "ratio_local": times.paired_ratio("local", "none"),
        "ratio_replicated": times.paired_ratio("replicated", "none"),
        "ratio_overlapped": times.paired_ratio("overlapped", "none"),
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
              f"{medians['overlapped'] * 1e3:.1f} ms (x{summary['ratio_overlapped']:.3f}); "
              f"target <= 1.05; bytes held by rank 0: "
              f"local {snapshot_bytes['local']}, K=1 {snapshot_bytes['replicated']}")


if __name__ == "__main__":
    main()
