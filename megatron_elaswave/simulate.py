"""Predicted post-failure throughput of every recovery policy in named scenarios (command line).

    python -m megatron_elaswave.simulate                 # every scenario
    python -m megatron_elaswave.simulate paper-96 --json

Scenarios (synthetic profiles unless ``--profile``):

* ``paper-96``: the ElasWave paper's scale, 96 devices as TP8xPP4xDP3 and TP4xPP4xDP6, a 32-layer
  7B-class model, 1 to 4 failed stage instances;
* ``scale``: 10^3, 10^4 and 10^5 devices (TP8 with PP8/PP16), a 96-layer 175B-class model, 1, 4
  and 16 failed stage instances;
* ``schedules``: the failure-free 7B-class job under 1F1B and the interleaved schedule.

Failed stage instances are spread over replicas and stages, never an instance together with its
snapshot buddy, so that every policy can recover. ``--num-experts`` (with the other
mixture-of-experts flags of ``python -m megatron_elaswave.plan``) makes every scenario's model an
MoE model, its experts sharded over each case's grid; a grid that cannot keep them prints one
line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace

from megatron_elaswave.layout import even_layer_split, megatron_rank
from megatron_elaswave.plan import add_moe_arguments, moe_model
from megatron_elaswave.planner.cost import CostModel
from megatron_elaswave.planner.frequency import PowerModel
from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.planner.policies import POLICIES, predict_policies
from megatron_elaswave.planner.predict import stage_work
from megatron_elaswave.planner.profile import (
    Profile,
    ProfileError,
    SyntheticModel,
    load_profile,
    synthetic_profile,
)
from megatron_elaswave.planner.zero import buddy_rank
from megatron_elaswave.simulator.step import ReplicaWork, predict_step

MODEL_7B = SyntheticModel(
    num_layers=32, hidden_size=4096, ffn_hidden_size=11008, vocab_size=32000, seq_length=4096
)
MODEL_175B = SyntheticModel(
    num_layers=96, hidden_size=12288, ffn_hidden_size=32768, vocab_size=51200, seq_length=2048
)


@dataclass(frozen=True)
class Case:
    """One job and one number of failed stage instances."""

    name: str
    job: JobSpec
    model: SyntheticModel
    failures: int


def spread_failures(job: JobSpec, count: int) -> list[int]:
    """First TP rank of ``count`` stage instances spread over replicas (round-robin) and stages
    (the least-hit stage first), never an instance together with its snapshot buddy: their
    joint loss needs a checkpoint."""
    tp, pp, dp = job.tensor_parallel_size, job.pipeline_parallel_size, job.data_parallel_size
    layout = job.initial_layout()
    chosen: list[tuple[int, int]] = []
    hits = [0] * pp

    def rank_of(replica: int, stage: int) -> int:
        return megatron_rank(0, replica, stage, tp=tp, dp=dp)

    def buddy(rank: int) -> int | None:
        return buddy_rank(layout, rank, job.ranks_per_node)

    for i in range(count * dp + dp):
        if len(chosen) == count:
            break
        replica = i % dp
        failed = {rank_of(r, s) for r, s in chosen}
        blocked = {buddy(rank) for rank in failed}
        free = [s for s in range(pp)
                if (replica, s) not in chosen and rank_of(replica, s) not in blocked
                and buddy(rank_of(replica, s)) not in failed]
        if free:
            stage = min(free, key=lambda s: (hits[s], (s - 2 * i) % pp))
            chosen.append((replica, stage))
            hits[stage] += 1
    if len(chosen) < count:
        raise ValueError(f"cannot place {count} recoverable failures in {dp} x {pp} stage instances")
    return [rank_of(r, s) for r, s in chosen]


def paper_cases() -> list[Case]:
    cases = []
    for tp, pp, dp in ((8, 4, 3), (4, 4, 6)):
        job = JobSpec(tp, pp, dp, num_layers=32, global_batch_size=768, micro_batch_size=1)
        cases += [Case(f"TP{tp}xPP{pp}xDP{dp}", job, MODEL_7B, k) for k in (1, 2, 3, 4)]
    return cases


def scale_cases() -> list[Case]:
    cases = []
    for tp, pp, dp in ((8, 8, 16), (8, 16, 80), (8, 16, 782)):
        job = JobSpec(tp, pp, dp, num_layers=96, global_batch_size=4 * pp * dp, micro_batch_size=1)
        cases += [
            Case(f"{tp * pp * dp} devices TP{tp}xPP{pp}xDP{dp}", job, MODEL_175B, k) for k in (1, 4, 16)
        ]
    return cases


def moe_case(case: Case, args: argparse.Namespace) -> Case:
    """``case`` with the mixture-of-experts layers of the flags (itself without
    ``--num-experts``). Raises ``ValueError`` naming the case when its grid cannot keep them."""
    job = case.job
    try:
        moe = moe_model(args, job.tensor_parallel_size, job.data_parallel_size,
                        case.model.ffn_hidden_size)
    except ValueError as error:
        raise ValueError(f"{case.name}: {error}") from None
    if moe is None:
        return case
    return replace(case, job=replace(job, experts=moe.experts), model=replace(case.model, moe=moe))


def _profile_for(case: Case, profile: Profile | None) -> Profile:
    if profile is not None:
        return profile
    return synthetic_profile(
        replace(
            case.model,
            tensor_model_parallel_size=case.job.tensor_parallel_size,
            micro_batch_size=case.job.micro_batch_size,
        )
    )


def run_case(case: Case, profile: Profile | None = None) -> dict:
    """Predictions of every policy for one case, as JSON-ready dictionaries."""
    cost = CostModel(_profile_for(case, profile), case.job)
    failed = spread_failures(case.job, case.failures)
    outcomes = predict_policies(cost, case.job.initial_layout(), failed)
    return {
        "case": case.name,
        "devices": case.job.world_size,
        "failed_instances": case.failures,
        "failed_ranks": failed,
        "predicted": {name: outcome.to_json() for name, outcome in outcomes.items()},
    }


def schedules_case() -> Case:
    """The failure-free TP8xPP4 7B-class replica of the ``schedules`` scenario."""
    job = JobSpec(8, 4, 1, num_layers=32, global_batch_size=32, micro_batch_size=1)
    return Case("schedules", job, MODEL_7B, 0)


def schedule_rows(profile: Profile | None = None, case: Case | None = None) -> list[dict]:
    """A failure-free replica (:func:`schedules_case` by default) under 1F1B and the interleaved
    schedule."""
    case = case or schedules_case()
    job = case.job
    cost = CostModel(_profile_for(case, profile), job)
    ranges = even_layer_split(job.num_layers, job.pipeline_parallel_size)
    clocks = (1.0,) * len(ranges)
    forward, backward, all_to_all = stage_work(cost, ranges, clocks)
    rows = []
    for chunks in (1, 2, 4):
        for n in (8, 16, 32):
            work = ReplicaWork(
                forward_s=forward,
                backward_s=backward,
                devices=(job.tensor_parallel_size,) * len(ranges),
                clocks=clocks,
                num_microbatches=n,
                send_s=cost.send_ns / 1e9,
                sync_s=0.0,
                num_chunks=chunks,
                all_to_all_s=all_to_all,
            )
            step = predict_step(
                [work],
                micro_batch_size=1,
                tokens_per_microbatch=cost.tokens_per_microbatch,
                idle_devices=0,
                power=PowerModel(),
            )
            rows.append(
                {
                    "schedule": "1f1b" if chunks == 1 else f"interleaved v={chunks}",
                    "microbatches": n,
                    "step_time_s": step.step_time_s,
                    "bubble_fraction": step.bubble_fraction,
                }
            )
    return rows


def ratio(result: dict, baseline: str) -> float | None:
    """ElasWave's tokens/s over a baseline's, or ``None`` when either cannot run."""
    ours, theirs = result["predicted"]["elaswave"], result["predicted"][baseline]
    if not (ours["runnable"] and theirs["runnable"]):
        return None
    return ours["tokens_per_s"] / theirs["tokens_per_s"]


def _print_cases(results: list[dict]) -> None:
    header = f"{'case':<34}{'fail':>5}" + "".join(f"{p[:14]:>15}" for p in POLICIES)
    print(header + f"{'x recycle':>11}{'x torchft':>11}")
    for result in results:
        cells = "".join(
            f"{p['tokens_per_s'] / 1e3:>14.1f}k" if p["runnable"] else f"{'-':>15}"
            for p in result["predicted"].values()
        )
        ratios = "".join(
            f"{r:>11.3f}" if (r := ratio(result, b)) else f"{'-':>11}" for b in ("recycle", "torchft_drop")
        )
        print(f"{result['case']:<34}{result['failed_instances']:>5}{cells}{ratios}")


SCENARIOS = {"paper-96": paper_cases, "scale": scale_cases, "schedules": None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_elaswave.simulate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "scenarios", nargs="*", metavar="SCENARIO", help=f"any of {', '.join(SCENARIOS)} (default: all)"
    )
    parser.add_argument("--profile", metavar="FILE", help="profile JSON instead of the synthetic ones")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_moe_arguments(parser)
    args = parser.parse_args(argv)
    unknown = [name for name in args.scenarios if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    output = {}
    try:
        scenarios = {name: [moe_case(case, args) for case in
                            (SCENARIOS[name]() if SCENARIOS[name] else [schedules_case()])]
                     for name in args.scenarios or list(SCENARIOS)}
        profile = load_profile(args.profile) if args.profile else None
    except (ValueError, OSError) as error:  # a grid that cannot keep the experts, a bad profile
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        for name, cases in scenarios.items():
            if name == "schedules":
                output[name] = schedule_rows(profile, cases[0])
            else:
                output[name] = [run_case(case, profile) for case in cases]
    except ProfileError as error:  # a profile that does not fit a scenario's job
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(output, sys.stdout)
        sys.stdout.write("\n")
        return 0
    for name, rows in output.items():
        print(
            f"== {name} (tokens/s per policy; last columns: ElasWave over ReCycle and over TorchFT-drop)"
            if name != "schedules"
            else f"== {name}"
        )
        if name == "schedules":
            for row in rows:
                print(
                    f"{row['schedule']:<16} n={row['microbatches']:<4} step {row['step_time_s']:.3f} s  "
                    f"bubble {row['bubble_fraction']:.3f}"
                )
        else:
            _print_cases(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
