"""Planner benchmarks: replan time at 10^3-10^5 ranks, and predicted post-failure throughput.

    python scripts/bench/planner.py [--repeats 5] [--plot docs/planner_throughput.png]

Prints Markdown tables (the ones in docs/planner.md). Replan time is the wall time of
``plan_recovery`` (graph, dataflow, ZeRO migration, clocks and their simulated check) from the
failure-free layout, median over ``--repeats`` runs; building the failure-free layout is timed
apart. Throughput comes from ``megatron_elaswave.simulate``'s ``paper-96`` and ``scale`` scenarios.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import replace

from megatron_elaswave.planner.cost import CostModel
from megatron_elaswave.planner.profile import synthetic_profile
from megatron_elaswave.planner.replan import plan_recovery
from megatron_elaswave.planner.zero import contiguous_migration
from megatron_elaswave.simulate import paper_cases, ratio, run_case, scale_cases, spread_failures

POLICY_COLUMNS = ("elaswave", "elaswave_no_dvfs", "recycle", "torchft_drop", "torchft_grad_accum", "restart")


def cost_of(case) -> CostModel:
    model = replace(
        case.model,
        tensor_model_parallel_size=case.job.tensor_parallel_size,
        micro_batch_size=case.job.micro_batch_size,
    )
    return CostModel(synthetic_profile(model), case.job)


def markdown_row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_header(*cells: str) -> list[str]:
    return [markdown_row(cells), markdown_row("---" for _ in cells)]


def replan_times(repeats: int) -> list[str]:
    rows = markdown_header(
        "ranks",
        "grid",
        "failed instances",
        "build layout (s)",
        "replan median (s)",
        "replan min (s)",
        "copies",
        "waves",
    )
    for case in scale_cases():
        if case.failures not in (1, 16):
            continue
        cost = cost_of(case)
        failed = spread_failures(case.job, case.failures)
        build, replan = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            old = case.job.initial_layout()
            middle = time.perf_counter()
            plan = plan_recovery(old, failed, cost)
            replan.append(time.perf_counter() - middle)
            build.append(middle - start)
        job = case.job
        grid = f"TP{job.tensor_parallel_size}xPP{job.pipeline_parallel_size}xDP{job.data_parallel_size}"
        rows.append(
            markdown_row(
                [
                    job.world_size,
                    grid,
                    case.failures,
                    f"{statistics.median(build):.3f}",
                    f"{statistics.median(replan):.3f}",
                    f"{min(replan):.3f}",
                    len(plan.migration.transfers),
                    plan.migration.num_waves,
                ]
            )
        )
    return rows


def migration_comparison() -> list[tuple]:
    """``(case, interleaved, contiguous)`` migration plans of every paper case: the same
    recovery moved with interleaved per-layer ZeRO ownership and with Megatron's shards."""
    compared = []
    for case in paper_cases():
        cost = cost_of(case)
        failed = frozenset(spread_failures(case.job, case.failures))
        old = case.job.initial_layout()
        plan = plan_recovery(old, failed, cost)
        compared.append((case, plan.migration, contiguous_migration(old, plan.layout, failed, cost)))
    return compared


def migration_rows() -> list[str]:
    rows = markdown_header(
        "grid",
        "failed instances",
        "interleaved: GiB / copies / waves / est. s",
        "Megatron contiguous: GiB / copies / waves / est. s",
    )
    for case, interleaved, contiguous in migration_comparison():
        cells = []
        for migration in (interleaved, contiguous):
            cells.append(
                f"{migration.total_bytes / 2**30:.1f} / {len(migration.transfers)} / "
                f"{migration.num_waves} / {migration.estimated_s:.3f}"
            )
        rows.append(markdown_row([case.name, case.failures, *cells]))
    return rows


def dvfs_rows() -> list[str]:
    """Step time and energy of each degraded layout at the planned clocks against nominal ones
    (simulated: the planner's power model)."""
    rows = markdown_header("grid", "failed instances", "step nominal (s)", "step DVFS (s)",
                           "energy nominal (kJ)", "energy DVFS (kJ)", "energy saved")
    for case in paper_cases():
        cost = cost_of(case)
        plan = plan_recovery(case.job.initial_layout(), spread_failures(case.job, case.failures), cost)
        clocks = plan.clocks
        rows.append(markdown_row([
            case.name, case.failures, f"{clocks.nominal_step_ns / 1e9:.2f}",
            f"{clocks.step_ns / 1e9:.2f}", f"{clocks.nominal_energy_j / 1e3:.1f}",
            f"{clocks.energy_j / 1e3:.1f}", f"{1 - clocks.energy_j / clocks.nominal_energy_j:.1%}"]))
    return rows


def throughput_rows(results: list[dict]) -> list[str]:
    rows = markdown_header(
        "case", "failed", "failure-free", *POLICY_COLUMNS, "x ReCycle", "x TorchFT drop", "x TorchFT accum"
    )
    for result in results:
        predicted = result["predicted"]
        cells = [
            f"{p['tokens_per_s'] / 1e3:.1f}k" if p["runnable"] else "-"
            for p in (predicted[name] for name in ("failure_free", *POLICY_COLUMNS))
        ]
        ratios = [
            f"{r:.2f}" if (r := ratio(result, b)) else "-"
            for b in ("recycle", "torchft_drop", "torchft_grad_accum")
        ]
        rows.append(markdown_row([result["case"], result["failed_instances"], *cells, *ratios]))
    return rows


def plot(paper: list[dict], scale: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = ("elaswave", "recycle", "torchft_grad_accum", "torchft_drop", "restart")
    groups = [("TP8xPP4xDP3", paper), ("TP4xPP4xDP6", paper)]
    figure, axes = plt.subplots(1, 3 if scale else 2, figsize=(16 if scale else 11, 4.5))
    for axis, (name, results) in zip(axes[:2], groups):
        rows = [r for r in results if r["case"] == name]
        width = 0.16
        for i, policy in enumerate(policies):
            values = [
                (
                    r["predicted"][policy]["tokens_per_s"] / r["predicted"]["failure_free"]["tokens_per_s"]
                    if r["predicted"][policy]["runnable"]
                    else 0
                )
                for r in rows
            ]
            axis.bar([r["failed_instances"] + (i - 2) * width for r in rows], values, width, label=policy)
        axis.set_title(f"96 devices, {name}, 7B-class")
        axis.set_xlabel("failed stage instances")
        axis.set_ylabel("tokens/s relative to failure-free")
        axis.set_ylim(0, 1.1)
    axes[0].legend(fontsize=8)
    if scale:
        axis = axes[2]
        for policy in policies:
            points = [
                (
                    r["devices"],
                    r["predicted"][policy]["tokens_per_s"] / r["predicted"]["failure_free"]["tokens_per_s"],
                )
                for r in scale
                if r["failed_instances"] == 16 and r["predicted"][policy]["runnable"]
            ]
            axis.plot(*zip(*points), marker="o", label=policy)
        axis.set_xscale("log")
        axis.set_title("16 failed stage instances, 175B-class")
        axis.set_xlabel("devices")
        axis.set_ylabel("tokens/s relative to failure-free")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", metavar="PNG", help="write the throughput plot here (needs matplotlib)")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}\n")
    print("\n".join(replan_times(args.repeats)), "\n")
    print("\n".join(migration_rows()), "\n")
    print("\n".join(dvfs_rows()), "\n")
    paper = [run_case(case) for case in paper_cases()]
    scale = [run_case(case) for case in scale_cases()]
    print("\n".join(throughput_rows(paper)), "\n")
    print("\n".join(throughput_rows(scale)))
    if args.plot:
        plot(paper, scale, args.plot)
        print(f"\nplot written to {args.plot}")


if __name__ == "__main__":
    main()
