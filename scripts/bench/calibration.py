"""The simulator against a real run: step times predicted from a profile measured on this machine,
beside the step times measured before and after a failure.

1. ``profile``: ``pretrain_gpt.py --elastic-profile-out P`` on the job's layout measures the
   per-layer forward and backward times, activation and parameter bytes, the pipeline latency and
   the data-parallel bandwidth (``training/setup/profiling.py``).
2. ``elastic``: the same job with ``--elastic --elastic-profile P`` (the runtime plans its
   recovery with that profile) loses ``--fail-rank`` in iteration ``--fail-at``.
3. The planner, given ``P``, predicts the failure-free step time and that of the layout the
   runtime plans without the failed rank (``training.planning.plan_without``, at the nominal
   clock: a CPU has no DVFS).

Prints predicted and measured medians and their ratio for both, and the layout after the
failure; ``--json`` prints one object. The ratio says how far the simulator's figures (the
post-failure throughput tables) can be trusted on the machine the profile came from.

    python scripts/bench/calibration.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import mock_gpt_flags, pretrain_metrics

from megatron_elaswave.planner.cost import CostModel
from megatron_elaswave.planner.frequency import PowerModel
from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.planner.profile import load_profile
from megatron_elaswave.planner.replan import nominal_clock_plan
from megatron_elaswave.training.recovery.planning import plan_without


def job_flags(args: argparse.Namespace, train_iters: int) -> list[str]:
    return [
        "--tensor-model-parallel-size", str(args.tp),
        *mock_gpt_flags(pipeline=args.pp, num_layers=args.num_layers, hidden_size=args.hidden_size,
                        micro_batch_size=args.micro_batch_size,
                        global_batch_size=args.global_batch_size, train_iters=train_iters,
                        seq_length=args.seq_length),
        "--untie-embeddings-and-output-weights",
    ]


def predictions(args: argparse.Namespace, profile_path: Path) -> dict:
    """Predicted step times (s) of the failure-free layout and of the runtime's plan without
    ``args.fail_rank``, from the measured profile."""
    job = JobSpec(args.tp, args.pp, args.nproc // (args.tp * args.pp), args.num_layers,
                  args.global_batch_size, args.micro_batch_size)
    cost = CostModel(load_profile(profile_path), job)
    grid = job.initial_layout()
    free = nominal_clock_plan(cost, grid, 0, PowerModel())
    layout, clocks = plan_without(grid, {args.fail_rank}, cost, "elaswave")
    return {
        "failure_free_s": free.nominal_step_ns / 1e9,
        "after_failure_s": clocks.nominal_step_ns / 1e9,
        "layout_after": layout.to_json(),
    }


def measured(records: list[dict], fail_at: int, warmup: int) -> dict:
    """Median step times (s) before the failure (after ``warmup`` iterations) and after the
    re-run iteration, and the layout the runtime recovered to."""
    iterations = [r for r in records if r["event"] == "iteration"]
    before = [r["step_time_s"] for r in iterations if warmup < r["iteration"] < fail_at]
    after = [r["step_time_s"] for r in iterations if r["iteration"] > fail_at + 1]
    [recovery] = [r for r in records if r["event"] == "recovery"]
    return {
        "failure_free_s": statistics.median(before),
        "after_failure_s": statistics.median(after),
        "iterations": {"failure_free": len(before), "after_failure": len(after)},
        "failed_ranks": recovery["failed_ranks"],
        "layout_after": recovery["layout"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--profile-iters", type=int, default=8)
    parser.add_argument("--fail-at", type=int, default=10, help="iteration in which a rank dies")
    parser.add_argument("--fail-rank", type=int, default=5)
    parser.add_argument("--iters-after", type=int, default=10,
                        help="iterations trained after the re-run one")
    parser.add_argument("--warmup", type=int, default=3, help="first iterations left out")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.fail_at <= args.warmup + 1:
        parser.error("--fail-at must leave failure-free iterations after --warmup")

    with tempfile.TemporaryDirectory() as scratch:
        profile_path = Path(scratch) / "profile.json"
        pretrain_metrics([*job_flags(args, args.profile_iters),
                          "--elastic-profile-out", str(profile_path)], args.nproc)
        predicted = predictions(args, profile_path)
        profile = json.loads(profile_path.read_text())
        records = pretrain_metrics([
            *job_flags(args, args.fail_at + 1 + args.iters_after), "--elastic",
            "--elastic-rebalance-window", "0", "--elastic-profile", str(profile_path),
            "--elastic-inject-failure", f"rank={args.fail_rank},iteration={args.fail_at}",
        ], args.nproc)
    seen = measured(records, args.fail_at, args.warmup)
    ratios = {key: predicted[key] / seen[key] for key in ("failure_free_s", "after_failure_s")}
    layout = f"TP{args.tp}xPP{args.pp}xDP{args.nproc // (args.tp * args.pp)}"
    result = {"layout": layout, "fail_rank": args.fail_rank, "profile_device": profile["device"],
              "predicted": predicted, "measured": seen, "predicted_over_measured": ratios,
              "same_layout_after": predicted["layout_after"] == seen["layout_after"]}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{layout}, {args.num_layers} layers, hidden {args.hidden_size}; profile measured on "
          f"{profile['device']}; rank {args.fail_rank} fails in iteration {args.fail_at}")
    for key, name in (("failure_free_s", "failure-free"), ("after_failure_s", "after the failure")):
        print(f"  {name:18s} predicted {predicted[key] * 1e3:7.1f} ms, measured "
              f"{seen[key] * 1e3:7.1f} ms, predicted / measured {ratios[key]:.3f}")
    stages = [[stage["ranks"] for stage in replica["stages"]] for replica in seen["layout_after"]]
    print(f"  the runtime recovered to {stages}, micro-batches per replica "
          f"{[replica['num_microbatches'] for replica in seen['layout_after']]}: "
          f"{'the' if result['same_layout_after'] else 'NOT the'} layout predicted")


if __name__ == "__main__":
    main()
