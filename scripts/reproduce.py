"""Reproduce the paper's evaluation on this machine and write a report with tables and plots.

    python scripts/reproduce.py            # everything, writes docs/results.md and docs/results/
    python scripts/reproduce.py --smoke    # every experiment at toy size, in a few minutes

Experiments (each runs the benchmark script named, or the planner's simulator in-process):

a. communicator recovery: the recovery's re-creation and the in-place edit against partial and
   full rebuild (``bench/communicator.py``);
b. migration time with interleaved against Megatron's contiguous ZeRO partitions (planner model);
c. loss deviation after a failure: ElasWave, Megatron's RNG, drop-replica, reroute
   (``bench/convergence.py``);
d. post-failure throughput at 96 devices and at 10^3 to 10^5 devices (the calibrated simulator);
e. MTTR against restart-from-checkpoint and TorchFT (``bench/mttr.py``);
f. the plugin's overhead on failure-free training (``bench/overhead.py``, ``bench/snapshot.py``);
g. a seeded chaos soak: random faults of every kind on one long run (``bench/chaos.py``);
h. the simulator against a real run: step times predicted from a profile measured on this machine
   (``--elastic-profile-out``) beside those measured before and after a failure
   (``bench/calibration.py``).

Measured experiments (a, c, e, f, g) run real CPU processes with gloo; b and d are simulated; h
puts the two side by side.
The report says which is which, and on what machine it ran. Exit status 1 if an experiment
failed (its section then says why); the others still run. ``--only`` with ``--keep-others``
re-runs some experiments and keeps the others' sections from the report already there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_elaswave.planner.profile import SyntheticDevice
from megatron_elaswave.simulate import paper_cases, ratio, run_case, scale_cases

SCRIPTS = Path(__file__).resolve().parent
BENCH = SCRIPTS / "bench"
REPO = SCRIPTS.parent
sys.path.insert(0, str(BENCH))
from planner import dvfs_rows, migration_comparison, plot as plot_throughput  # noqa: E402  (scripts/bench/planner.py)


@dataclass(frozen=True)
class Sizes:
    """How much of each experiment to run."""

    communicator_configs: str
    """``TPxPPxDP`` grids of the communicator benchmark."""
    communicator_repetitions: int
    convergence: tuple[str, ...]
    """Arguments of ``bench/convergence.py``."""
    mttr: tuple[str, ...]
    """Arguments of ``bench/mttr.py``."""
    overhead: tuple[str, ...]
    """Arguments of ``bench/overhead.py``."""
    overhead_tokens: tuple[str, ...]
    """Arguments of its second run: ``--elastic`` against plain megatron-core at more tokens per
    iteration (the snapshot and the exchange cost the same per step, the step more)."""
    snapshot: tuple[str, ...]
    scale_cases: bool
    """Simulate 10^3-10^5 devices too (a few seconds)."""
    chaos: tuple[str, ...]
    """Arguments of ``bench/chaos.py``."""
    calibration: tuple[str, ...]
    """Arguments of ``bench/calibration.py``."""


FULL = Sizes(
    communicator_configs="2x2x2,2x2x4", communicator_repetitions=3,
    convergence=("--train-iters", "220", "--fail-at", "20"),
    mttr=("--repetitions", "3"),
    overhead=("--sets", "10", "--rounds", "4"),
    overhead_tokens=("--global-batch-size", "64", "--arms", "elastic", "--sets", "3",
                     "--rounds", "3", "--window", "3", "--warmup-iters", "3"),
    snapshot=("--sets", "8", "--rounds", "3"),
    scale_cases=True,
    chaos=("--faults", "50", "--seed", "1"),
    calibration=(),
)
SMOKE = Sizes(
    communicator_configs="2x2x2", communicator_repetitions=1,
    convergence=("--train-iters", "10", "--fail-at", "4", "--arms", "elaswave"),
    mttr=("--repetitions", "1", "--fail-at", "4", "--skip-restart", "--skip-torchft"),
    overhead=("--nproc", "2", "--tp", "1", "--sets", "1", "--rounds", "1", "--window", "2",
              "--warmup-iters", "2"),
    overhead_tokens=("--nproc", "2", "--tp", "1", "--sets", "1", "--rounds", "1", "--window",
                     "2", "--warmup-iters", "2", "--global-batch-size", "32", "--arms", "elastic"),
    snapshot=("--nproc", "2", "--sets", "1", "--rounds", "1", "--window", "2",
              "--warmup-iters", "2"),
    scale_cases=False,
    chaos=("--faults", "9", "--seed", "62"),  # one fault of each kind
    calibration=("--nproc", "4", "--tp", "1", "--num-layers", "4", "--hidden-size", "64",
                 "--profile-iters", "3", "--fail-at", "5", "--fail-rank", "3",
                 "--iters-after", "3", "--warmup", "2"),
)


class ExperimentFailed(RuntimeError):
    """An experiment did not meet its own checks; ``lines`` is what it measured all the same."""

    def __init__(self, message: str, lines: list[str] | None = None) -> None:
        super().__init__(message)
        self.lines = lines or []


def bench_json(script: str, *arguments: str) -> dict:
    """Run ``scripts/bench/<script> --json``; its last output line, parsed."""
    result = subprocess.run(
        [sys.executable, str(BENCH / script), *arguments, "--json"], cwd=REPO,
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise ExperimentFailed(f"{script} exited with status {result.returncode}: {' | '.join(detail)}")
    return json.loads(lines[-1])


def beside(value: float, target: float, digits: int = 3) -> str:
    """``value`` with at least ``digits`` decimals, and more while it would print as ``target``:
    a ratio that rounds to its target still shows which side of it it is on."""
    for more in range(digits, 9):
        if round(value, more) != round(target, more):
            return f"{value:.{more}f}"
    return f"{value:.{digits}f}"


def quartiles(values: list[float]) -> str:
    """The lower quartile, median and upper quartile of ``values``, to three decimals."""
    cuts = statistics.quantiles(values, n=4) if len(values) > 1 else list(values) * 3
    return " ".join(f"{cut:.3f}" for cut in cuts)


def table(header: list[str], rows: list[list]) -> list[str]:
    def line(cells) -> str:
        return "| " + " | ".join(str(c) for c in cells) + " |"
    return [line(header), line(["---"] * len(header)), *(line(row) for row in rows)]


def geometric_mean(values: list[float]) -> float:
    return statistics.geometric_mean(values) if values else float("nan")


# ---- the experiments: each returns Markdown lines and the raw figures ---------------------------


def communicator(sizes: Sizes, plots: Path) -> tuple[list[str], dict]:
    results = bench_json("communicator.py", "--configs", sizes.communicator_configs,
                         "--repetitions", str(sizes.communicator_repetitions))
    rows = []
    for name, r in results.items():
        rows.append([name, f"{r['recovery_s'] * 1e3:.0f}", f"{r['inplace_s'] * 1e3:.0f}",
                     f"{r['partial_s'] * 1e3:.0f}", f"{r['full_s'] * 1e3:.0f}",
                     f"{r['partial_over_inplace']:.2f}x (paper 3.6x)",
                     f"{r['full_over_inplace']:.2f}x (paper 82x)",
                     "yes" if max(r["inplace_s"], r["recovery_s"]) < 1 else "no"])
    lines = [
        f"Measured: gloo on this machine, Megatron's complete group set, a random rank (rank 0 "
        f"included) SIGKILLed, medians of {sizes.communicator_repetitions} failures per grid. "
        "*Recovery* is the path a recovery takes: the survivors have aborted every connection "
        "to unblock their training threads, so each re-creates every group of the new layout with "
        "its members, all groups concurrently. *In place* is the step-boundary edit, which keeps "
        "the groups that lost no member; *partial* and *full* are the paper's baselines.", "",
        *table(["grid", "recovery (ms)", "in place (ms)", "partial (ms)", "full (ms)",
                "partial / in place", "full / in place", "under 1 s (paper: yes)"], rows),
        "",
        "With gloo on one host a group costs a few store round trips, so the gaps are far smaller "
        "than the paper's NCCL/HCCL figures, where a full rebuild re-initialises every device "
        "communicator.",
    ]
    return lines, results


def migration(sizes: Sizes, plots: Path) -> tuple[list[str], dict]:
    rows, reductions = [], []
    for case, interleaved, contiguous in migration_comparison():
        reduction = 1 - interleaved.estimated_s / contiguous.estimated_s
        reductions.append(reduction)
        rows.append([case.name, case.failures, f"{interleaved.estimated_s:.3f}",
                     f"{contiguous.estimated_s:.3f}", f"{reduction:.0%}"])
    lines = [
        "Simulated: the planner's migration model (7B-class model, 96 devices), the same "
        "failures migrated with interleaved per-layer ZeRO ownership and with Megatron's "
        "contiguous shards, in disjoint rank-to-rank waves.", "",
        *table(["grid", "failed instances", "interleaved (s)", "contiguous (s)", "reduction"], rows),
        "",
        f"Largest reduction {max(reductions):.0%} (paper: up to 51%). The executor shards "
        "whole layers over their holders with `--elastic-zero interleaved` (the planner's finer "
        "chunks are for its predictions; docs/elastic.md, Limits); its measured reduction on "
        "this machine is in docs/elastic.md (`bench/zero_sharding.py`).",
    ]
    return lines, {"reductions": reductions, "max_reduction": max(reductions)}


def convergence(sizes: Sizes, plots: Path) -> tuple[list[str], dict]:
    results = bench_json("convergence.py", *sizes.convergence)
    rows = [[arm, f"{r['mean_rel_dev']:.2e}", f"{r['max_rel_dev']:.2e}", r["global_batch_after"],
             "yes" if r["same_samples"] else "no", r["reference"].replace("_", " ")]
            for arm, r in results["arms"].items()]
    reduction = results.get("deviation_reduction_vs_megatron_rng")
    lines = [
        f"Measured: {results['layout']} on CPU processes, 8 layers, dropout 0.1, the demo's text; "
        f"rank {results['fail_rank']} SIGKILLed in iteration {results['fail_at']} of "
        f"{results['train_iters']}; relative lm-loss deviation from the failure-free run with the "
        "same RNG scheme, over the iterations after the failure.", "",
        *table(["arm", "mean deviation", "max deviation", "global batch after", "same samples",
                "compared with"], rows),
        "",
        *([f"ElasWave's mean deviation is {reduction:.1%} lower than with Megatron's RNG "
           "(paper: about 78% lower). Here the layout-invariant RNG makes the run after the "
           "failure match the failure-free one to floating-point reduction order."]
          if reduction is not None else []),
        "", "![loss curves](results/loss_curves.png)",
    ]
    plot_losses(results, plots / "loss_curves.png")
    return lines, results


def throughput(sizes: Sizes, plots: Path) -> tuple[list[str], dict]:
    paper = [run_case(case) for case in paper_cases()]
    scale = [run_case(case) for case in scale_cases()] if sizes.scale_cases else []
    rows = []
    summary = {}
    for label, results in (("96 devices", paper), ("10^3-10^5 devices", scale)):
        if not results:
            continue
        gains = {base: [g for r in results if (g := ratio(r, base))]
                 for base in ("recycle", "torchft_drop", "torchft_grad_accum")}
        summary[label] = {base: geometric_mean(values) for base, values in gains.items()}
        rows.append([label, len(results), f"{summary[label]['recycle']:.2f}x (paper 1.35x)",
                     f"{summary[label]['torchft_drop']:.2f}x (paper 1.60x)",
                     f"{summary[label]['torchft_grad_accum']:.2f}x"])
    lines = [
        "Simulated: the discrete-event simulator on the planner's cost model with synthetic "
        f"profiles ({SyntheticDevice().name}, {SyntheticDevice().memory_bytes // 2**30} GiB, "
        "7B-class at 96 devices, 175B-class at scale: no such devices here; (h) checks the "
        "simulator against a profile measured on this machine), 1-16 failed stage instances "
        "spread over replicas; geometric mean over the cases where the baseline can still run.",
        "",
        *table(["scale", "cases", "ElasWave / ReCycle-style", "ElasWave / TorchFT (drop)",
                "ElasWave / TorchFT (grad. accumulation)"], rows),
        "", "![throughput](results/throughput.png)", "",
        "DVFS on the degraded 96-device layouts (simulated: the planner's power model; the "
        "governor's `sim` backend on CPU applies the same clocks and accounts energy with it):", "",
        *dvfs_rows(),
    ]
    plot_throughput(paper, scale, str(plots / "throughput.png"))
    return lines, {"summary": summary, "paper": paper, "scale": scale}


def mttr(sizes: Sizes, plots: Path) -> tuple[list[str], dict]:
    results = bench_json("mttr.py", *sizes.mttr)
    torchft_s = results.get("torchft_mttr_s")
    elaswave_s, heartbeat = results["elaswave_mttr_s"], results.get("hang_heartbeat_s", 5.0)
    job = "TP2 x PP2 x DP2 GPT"
    rows = [["ElasWave", "SIGKILL", "its launcher reports the death at once", job, "kept",
             f"{elaswave_s:.2f}", "0", "1.00x"]]
    if "elaswave_hang_mttr_s" in results:
        hang_s = results["elaswave_hang_mttr_s"]
        rows.append(["ElasWave", "SIGSTOP", f"a {heartbeat:g} s heartbeat timeout", job, "kept",
                     f"{hang_s:.2f}", "0", f"{hang_s / elaswave_s:.1f}x"])
    if "restart_mttr_s" in results:
        rows.append(["restart from checkpoint", "SIGKILL", "its launcher (torchrun's)", job,
                     "kept", f"{results['restart_mttr_s']:.2f}",
                     f"{results['restart_lost_iterations']:.0f}",
                     f"{results['restart_over_elaswave']:.1f}x"])
    if torchft_s is not None:
        replicas = results["torchft"].get("replicas", "?")
        rows.append(["TorchFT (torchft package)", "SIGKILL",
                     f"the Lighthouse's {heartbeat:g} s heartbeat timeout",
                     f"{replicas} DDP replicas of the whole GPT", "shrinks by a replica",
                     f"{torchft_s:.2f}", "0", f"{torchft_s / elaswave_s:.1f}x"])
    lines = [
        "Measured: 8 CPU ranks (TP2 x PP2 x DP2, 8 layers, the demo's text), rank 5 SIGKILLed "
        "from outside the job; MTTR from the fault until the broken iteration completes again; "
        "medians. Target: ElasWave at most a tenth of restart-from-checkpoint. TorchFT trains "
        "the same GPT on as many processes, one replica of the whole model each (its fault "
        "tolerance is across data-parallel replicas), with the same global batch, on random "
        "tokens; its last replica is SIGKILLed mid-step, and its MTTR ends with the first step "
        "every survivor commits without it. The arms differ where the table says: ElasWave sees "
        "a SIGKILL at once (its launcher reports the death), TorchFT only once its Lighthouse "
        "misses the heartbeats; the like-for-like pair is ElasWave with the victim SIGSTOPped "
        f"and the same {heartbeat:g} s heartbeat timeout, against TorchFT's SIGKILL.", "",
        *table(["recovery", "fault", "found by", "trains", "global batch", "MTTR (s)",
                "iterations recomputed", "/ ElasWave (SIGKILL)"], rows),
        "", "ElasWave's MTTR by phase (medians, s): " + ", ".join(
            f"{k.removesuffix('_s')} {v:.2f}" for k, v in results["elaswave_breakdown_s"].items()
            if k != "total_s"),
        "", "![MTTR breakdown](results/mttr_breakdown.png)",
    ]
    plot_mttr(results, plots / "mttr_breakdown.png")
    return lines, results


def overhead(sizes: Sizes, plots: Path) -> tuple[list[str], dict]:
    plugin = bench_json("overhead.py", *sizes.overhead)
    tokens = bench_json("overhead.py", *sizes.overhead_tokens)
    snapshot = bench_json("snapshot.py", *sizes.snapshot)
    plain_ms = f"{plugin['median_s']['plain'] * 1e3:.1f}"
    none_ms = f"{snapshot['median_s']['none'] * 1e3:.1f}"

    def row(what: str, arm_ms: float, base_ms: str, ratio: float, interval: list[float],
            target: float) -> list[str]:
        return [what, f"{arm_ms * 1e3:.1f}", base_ms, beside(ratio, target),
                f"{interval[0]:.3f} to {interval[1]:.3f}", f"<= {target}"]

    arms = [("plugin", "plugin vs plain megatron-core", 1.03),
            ("elastic", "--elastic vs plain megatron-core", 1.05),
            ("interleaved", "--elastic --elastic-zero interleaved vs plain megatron-core", 1.05),
            ("settled", "--elastic --elastic-snapshot-overlap off vs plain megatron-core", 1.05)]
    rows = [row(what, plugin["median_s"][arm], plain_ms, plugin["ratio_to_plain"][arm],
                plugin["ratio_interval_to_plain"][arm], target) for arm, what, target in arms]
    rows.append(row(
        f"--elastic vs plain megatron-core, {tokens['tokens_per_iteration']} tokens per iteration",
        tokens["median_s"]["elastic"], f"{tokens['median_s']['plain'] * 1e3:.1f}",
        tokens["ratio_to_plain"]["elastic"], tokens["ratio_interval_to_plain"]["elastic"], 1.05))
    rows += [row(what, snapshot["median_s"][arm], none_ms,
                 snapshot[f"ratio_{arm.replace(' ', '_')}"], snapshot["ratio_interval"][arm], 1.05)
             for arm, what in [
                 ("local", "per-step snapshots, local"),
                 ("replicated", "per-step snapshots, K=1 replica, settled in its step"),
                 ("overlapped", "per-step snapshots, K=1, settled in the next step"),
                 ("two copies", "per-step snapshots, K=2 (the default where memory allows), "
                                "settled in the next step")]]
    lines = [
        f"Measured: {plugin['layout']}, hidden 256, {plugin['tokens_per_iteration']} tokens per "
        "iteration unless the row says otherwise, on CPU processes. The arms run time-sliced: "
        "one run of each is started, and round after round each in turn trains "
        f"{plugin['window']} measured iterations while the others are paused (SIGSTOP), so "
        "that arms are compared seconds apart on the same machine; "
        f"{plugin['sets']} sets of new runs of {plugin['rounds']} rounds each "
        f"({plugin['iterations_per_arm']} iterations per arm; at "
        f"{tokens['tokens_per_iteration']} tokens per iteration {tokens['sets']} sets of "
        f"{tokens['rounds']} rounds of {tokens['window']}). Iteration-time medians after "
        "warm-up. As ratio, per round the two windows' ratio, per set the median of its rounds' "
        "ratios, and the median over sets, with a distribution-free 95% interval for it over "
        "the sets (new runs; rounds of one set share their runs' speed): one round's ratio "
        "varies by a tenth or more on this machine, one set's by several hundredths. "
        "The `--elastic` arms keep per-step snapshots replicated to two buddies (the default "
        "where memory allows; each settled in the next step, or in its own with "
        "`--elastic-snapshot-overlap off`), heartbeats, one chunk per layer group and the step "
        "reports.", "",
        *table(["what", "with (ms)", "without (ms)", "ratio", "95% interval", "target"], rows),
        "", "Ratios to plain megatron-core by round, quartiles (lower, median, upper): "
        + "; ".join(f"{arm} {quartiles(ratios)}"
                    for arm, ratios in plugin["round_ratios_to_plain"].items())
        + f"; elastic at {tokens['tokens_per_iteration']} tokens per iteration "
        + quartiles(tokens["round_ratios_to_plain"]["elastic"]) + ".",
        "", "Ratios to plain megatron-core by set, lowest to highest: "
        + "; ".join(f"{arm} " + " ".join(f"{ratio:.3f}" for ratio in sorted(ratios))
                    for arm, ratios in plugin["set_ratios_to_plain"].items()) + ".",
        "", "CPU time per iteration of rank 0's process (all its threads), as ratio to plain "
        "megatron-core's in the same way: " + ", ".join(
            f"{arm} {ratio:.4f}" for arm, ratio in plugin["cpu_ratio_to_plain"].items())
        + f" (plain: {plugin['cpu_median_s']['plain'] * 1e3:.1f} ms); elastic at "
        f"{tokens['tokens_per_iteration']} tokens per iteration "
        f"{tokens['cpu_ratio_to_plain']['elastic']:.4f} "
        f"(plain: {tokens['cpu_median_s']['plain'] * 1e3:.1f} ms).",
        "", f"Snapshot memory held by rank 0 with K=1: "
        f"{snapshot['snapshot_bytes_rank0'].get('replicated', 0) / 1e6:.1f} MB; with K=2: "
        f"{snapshot['snapshot_bytes_rank0'].get('two copies', 0) / 1e6:.1f} MB.",
    ]
    return lines, {"plugin": plugin, "tokens": tokens, "snapshot": snapshot}


CHAOS_KILLS = ("kill", "recovery-kill", "burst", "save-kill")
"""Fault kinds that a launcher reports at once; ``stop`` and ``node`` are noticed by a timeout.
The other kinds send their second SIGKILL at a moment the job reports (a replacement asking to
join, a grow, a recovery): their MTTR includes that wait, and has no target."""
CHAOS_KILL_TARGET_S = 3.0
CHAOS_TIMEOUT_MARGIN_S = 3.0


def chaos_targets(results: dict) -> dict[str, float]:
    """MTTR p90 targets per fault kind: 3 s for kills, the detecting timeout + 3 s otherwise."""
    return {**{kind: CHAOS_KILL_TARGET_S for kind in CHAOS_KILLS},
            "stop": results["heartbeat_timeout_s"] + CHAOS_TIMEOUT_MARGIN_S,
            "node": results["node_timeout_s"] + CHAOS_TIMEOUT_MARGIN_S}


def chaos(sizes: Sizes, plots: Path) -> tuple[list[str], dict]:
    summary = plots / "chaos.json"
    summary.unlink(missing_ok=True)
    try:
        results = bench_json("chaos.py", *sizes.chaos, "--json-out", str(summary))
    except ExperimentFailed as failure:
        if not summary.exists():
            raise
        # The soak failed its own checks (its summary says which): show what it measured.
        raise ExperimentFailed(str(failure), chaos_report(sizes, json.loads(summary.read_text())))
    return chaos_report(sizes, results), results


def chaos_report(sizes: Sizes, results: dict) -> list[str]:
    targets = chaos_targets(results)
    rows = [[kind, f["count"], f"{f['median_s']:.2f}",
             beside(f["p90_s"], targets[kind], 2) if kind in targets else f"{f['p90_s']:.2f}",
             f"{f['max_s']:.2f}"]
            + ([f"< {targets[kind]:g}", "yes" if f["p90_s"] < targets[kind] else "**no**"]
               if kind in targets else ["-", "-"])
            for kind, f in results["mttr"].items()]
    slowest = max(results["fault_log"], key=lambda fault: fault["mttr_s"] or 0.0,
                  default=None)
    lines = [
        f"Measured: `python scripts/bench/chaos.py {' '.join(sizes.chaos)}`: one run of 8 CPU "
        "ranks (two launchers of four, TP2 x PP2 x DP2) under `elaswave-run --rejoin`, hit by "
        "random faults (SIGKILL of a worker, SIGSTOP of one, a second SIGKILL during the "
        "recovery from a first, a burst of 2 to 4 SIGKILLs within a second, node 1's launcher "
        "SIGKILLed with its workers, a second SIGKILL while the first one's replacement joins, "
        "right after the grow that took it back, or in the iteration after its recovery, a "
        "SIGKILL while a periodic checkpoint is written); every dead worker rejoins before the "
        "next fault. MTTR runs from the fault's first signal to the recovery record of its last "
        "victim (for the kinds with a second SIGKILL, that includes the wait for its moment: "
        "no target). Heartbeat "
        f"timeout {results['heartbeat_timeout_s']:g} s, node timeout "
        f"{results['node_timeout_s']:g} s.", "",
        f"Faults: {results['faults']} ({', '.join(f'{n} {k}' for k, n in results['faults_per_kind'].items())}); "
        f"recoveries {results['recoveries']}, grows {results['grows']}, clean stops "
        f"{results['clean_stops']}. Against the failure-free run of the same {results['iterations']} "
        f"iterations: {results['samples_lost']} samples lost, largest relative loss difference "
        f"{results['largest_relative_loss_difference']:.2e}"
        + ("" if "other_layout_largest_relative_loss_difference" not in results else
           f" (a failure-free run on TP2 x PP1 x DP4, which sums the gradients in another order: "
           f"{results['other_layout_largest_relative_loss_difference']:.2e}); iterations off the "
           f"failure-free trajectory (beyond 1e-4 and beyond twice that run's difference in "
           f"their window of 100): {len(results['iterations_off_trajectory'])}") + ".", "",
        *table(["fault", "count", "MTTR median (s)", "p90 (s)", "max (s)", "p90 target (s)",
                "met"], rows),
    ]
    if slowest is None:
        return lines
    lines += [
        "", f"Slowest: {slowest['kind']} of ranks {slowest['victims']}, "
        f"{slowest['mttr_s']:.2f} s"
        + ("" if slowest.get("death_recorded_s") is None else
           f" (its launcher recorded the first death {slowest['death_recorded_s']:.2f} s after "
           "the signal)")
        + "; its recoveries by phase (s): " + "; ".join(
            ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in r.items() if k != "total_s")
            for r in slowest["recoveries"]) + ".",
    ]
    return lines


def calibration(sizes: Sizes, plots: Path) -> tuple[list[str], dict]:
    results = bench_json("calibration.py", *sizes.calibration)
    predicted, measured = results["predicted"], results["measured"]
    ratios = results["predicted_over_measured"]
    rows = [[name, f"{predicted[key] * 1e3:.1f}", f"{measured[key] * 1e3:.1f}",
             f"{ratios[key]:.3f}"]
            for key, name in (("failure_free_s", "failure-free"),
                              ("after_failure_s", f"after rank {results['fail_rank']} failed"))]
    stages = [[stage["ranks"] for stage in replica["stages"]]
              for replica in measured["layout_after"]]
    lines = [
        f"Measured and simulated: {results['layout']} on CPU processes; the profile was measured "
        f"by `pretrain_gpt.py --elastic-profile-out` on {results['profile_device']}, the same "
        "job then ran with `--elastic --elastic-profile` (so the runtime planned its recovery "
        "from that profile) and lost a rank. Predicted: the planner's step time at the nominal "
        "clock from the profile; measured: median iteration times. Where the ranks outnumber "
        "the cores, every time in the profile includes waiting for a core among all the job's "
        "processes: after a failure fewer processes share the cores and each part runs faster "
        "than profiled.", "",
        *table(["step", "predicted (ms)", "measured (ms)", "predicted / measured"], rows), "",
        f"The runtime recovered to {stages}: "
        f"{'the layout the planner predicted' if results['same_layout_after'] else 'not the layout the planner predicted'}.",
    ]
    return lines, results


def headline_rows(figures: dict) -> list[list]:
    """One row per headline figure: what, measured or simulated, ours, the paper's (or the
    target), ours / paper."""
    rows = []

    def add(what: str, ours: float, paper: float, fmt: str, where: str) -> None:
        how = "simulated" if what.startswith(("migration", "throughput")) else "measured"
        if where and fmt.endswith("f"):  # a target: show which side of it ours is on
            shown = beside(ours, paper, int(fmt[1:-1]))
        else:
            shown = format(ours, fmt)
        rows.append([what, how, shown, format(paper, fmt) + where, beside(ours / paper, 1.0, 2)])

    if "a" in figures:
        for grid, r in figures["a"].items():
            add(f"({grid}) full rebuild / in place", r["full_over_inplace"], 82, ".1f", "")
            add(f"({grid}) partial rebuild / in place", r["partial_over_inplace"], 3.6, ".1f", "")
            add(f"({grid}) in-place edit (s)", r["inplace_s"], 1.0, ".2f", " (at most)")
            if "recovery_s" in r:  # figures stored before the benchmark measured it lack it
                add(f"({grid}) recovery's group re-creation (s)", r["recovery_s"], 1.0, ".2f",
                    " (at most)")
    if "b" in figures:
        add("migration time saved by interleaved ZeRO, best case", figures["b"]["max_reduction"],
            0.51, ".0%", " (up to)")
    if "c" in figures and "deviation_reduction_vs_megatron_rng" in figures["c"]:
        add("loss deviation reduction against Megatron's RNG",
            figures["c"]["deviation_reduction_vs_megatron_rng"], 0.78, ".1%", " (about)")
    if "d" in figures:
        summary = figures["d"]["summary"]["96 devices"]
        add("throughput after failures, ElasWave / ReCycle-style (96 devices)",
            summary["recycle"], 1.35, ".2f", "")
        add("throughput after failures, ElasWave / TorchFT-style (96 devices)",
            summary["torchft_drop"], 1.60, ".2f", "")
    if "e" in figures and "restart_over_elaswave" in figures["e"]:
        add("MTTR, restart-from-checkpoint / ElasWave", figures["e"]["restart_over_elaswave"], 10,
            ".1f", " (target: at least)")
    if "f" in figures:
        ratios = figures["f"]["plugin"]["ratio_to_plain"]
        add("step time with the plugin / plain megatron-core", ratios["plugin"], 1.03, ".3f",
            " (target: at most)")
        add("step time with --elastic / plain megatron-core", ratios["elastic"], 1.05, ".3f",
            " (target: at most)")
        snapshot = figures["f"]["snapshot"]
        if "ratio_two_copies" in snapshot:
            add("step time with K=2 snapshots, settled in the next step (the default) / without",
                snapshot["ratio_two_copies"], 1.05, ".3f", " (target: at most)")
        else:  # figures stored when one copy was the default
            add("step time with K=1 snapshots, settled in the next step / without",
                snapshot["ratio_overlapped"], 1.05, ".3f", " (target: at most)")
    if "g" in figures:
        mttr, targets = figures["g"]["mttr"], chaos_targets(figures["g"])
        kills = [mttr[kind]["p90_s"] for kind in CHAOS_KILLS if kind in mttr]
        if kills:
            add("chaos soak: MTTR p90 of kills (s), worst kind", max(kills), CHAOS_KILL_TARGET_S,
                ".2f", " (target: under)")
        if "stop" in mttr:
            add("chaos soak: MTTR p90 of hangs (s)", mttr["stop"]["p90_s"], targets["stop"],
                ".2f", " (target: under)")
    return rows


EXPERIMENTS = {
    "a": ("Communicator recovery: in place against partial and full rebuild", communicator),
    "b": ("Migration: interleaved against contiguous ZeRO partitions", migration),
    "c": ("Convergence after a failure", convergence),
    "d": ("Post-failure throughput against ReCycle-style and TorchFT-style recovery", throughput),
    "e": ("MTTR against restart-from-checkpoint and TorchFT", mttr),
    "f": ("Overhead on failure-free training", overhead),
    "g": ("Chaos soak: random faults on one long run", chaos),
    "h": ("The simulator against a real run", calibration),
}


# ---- plots ------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_losses(results: dict, path: Path) -> None:
    plt = _pyplot()
    figure, (curves, gaps) = plt.subplots(1, 2, figsize=(13, 4.5))
    losses = results["losses"]
    iterations = range(1, results["train_iters"] + 1)
    for name, values in losses.items():
        curves.plot(iterations, values, label=name.replace("_", " "), linewidth=1)
    for arm, result in results["arms"].items():
        reference = losses[result["reference"]]
        relative = [abs(a - r) / abs(r) for a, r in zip(losses[arm], reference)]
        gaps.plot(iterations, [max(v, 1e-9) for v in relative], label=arm.replace("_", " "))
    for axis in (curves, gaps):
        axis.axvline(results["fail_at"], color="red", linestyle="--", linewidth=1)
        axis.set_xlabel("iteration")
        axis.legend(fontsize=8)
    curves.set_ylabel("lm loss")
    curves.set_title(f"loss, rank {results['fail_rank']} killed in iteration {results['fail_at']}")
    gaps.set_yscale("log")
    gaps.set_ylabel("relative deviation from its failure-free run (floor 1e-9)")
    gaps.set_title("deviation")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_mttr(results: dict, path: Path) -> None:
    plt = _pyplot()
    phases = {k: v for k, v in results["elaswave_breakdown_s"].items() if k != "total_s"}
    figure, axis = plt.subplots(figsize=(9, 3.5))
    left = 0.0
    for phase, seconds in phases.items():
        axis.barh(["ElasWave"], [seconds], left=left, label=phase.removesuffix("_s"))
        left += seconds
    others = {name: results.get(key) for name, key in (("restart from checkpoint", "restart_mttr_s"),
                                                       ("TorchFT", "torchft_mttr_s"))
              if results.get(key) is not None}
    axis.barh(list(others), list(others.values()), color="grey")
    axis.set_xlabel("seconds from SIGKILL to the broken iteration completed again")
    axis.legend(fontsize=8, ncol=4)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---- the report -------------------------------------------------------------------------------


def machine() -> str:
    from importlib.metadata import version

    return (f"{platform.node() or 'this machine'}: {platform.machine()}, {os.cpu_count()} CPU cores, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, megatron-core {version('megatron-core')}; no GPU used")


KEPT_SECTIONS = {
    "## megatron-core 0.16.1 and 0.19.2": "megatron_core_lines.md",
    "## Mixtures of experts": "moe.md",
    "## One GPU: the accelerator path": "gpu_check.md",
}
"""The report's last sections, heading -> file under ``docs/results/`` kept as it stands: written
by ``scripts/bench/lines.py`` (two Python environments), from ``scripts/bench/moe.py`` (which
needs Megatron-LM's training package: the 0.19 line's environment) and by a GPU run of
``scripts/gpu_check.sh``."""


PROVENANCE = "## How this report was written"
"""The report's last section: which run wrote each experiment's section, when, in how long."""

Provenance = dict[str, tuple[str, str, str]]
"""Experiment -> (the command that last wrote its section, its date, its seconds)."""


def read_provenance(text: str) -> Provenance:
    """The :data:`PROVENANCE` table of a report (or the sentences earlier reports opened with)."""
    runs: Provenance = {}
    sentences = re.findall(r"(?:Written by|Sections ((?:\([a-z]\)(?:, )?)+) written again by) "
                           r"`([^`]+)` on (\S+) in (\d+) s\.", text)
    rows = re.findall(r"(?m)^\| ((?:\([a-z]\)(?:, )?)+) \| `([^`]+)` \| (\S+) \| (\d+) s \|$", text)
    for letters, command, date, seconds in sentences + rows:
        for key in re.findall(r"\(([a-z])\)", letters) if letters else EXPERIMENTS:
            runs[key] = (command, date, seconds)
    return runs


def provenance_section(runs: Provenance) -> list[str]:
    """:data:`PROVENANCE`: a row per run that wrote sections still in the report."""
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for key in EXPERIMENTS:
        if key in runs:
            grouped.setdefault(runs[key], []).append(key)
    rows = [[", ".join(f"({key})" for key in keys), f"`{command}`", date, f"{seconds} s"]
            for (command, date, seconds), keys in grouped.items()]
    return [PROVENANCE, "", *table(["sections", "written by", "on", "in"], rows), ""]


def read_report(output: Path) -> tuple[dict[str, list[str]], dict, Provenance]:
    """The report in ``output``: its sections by experiment, its figures, and which run wrote
    each section."""
    whole = (output / "results.md").read_text()
    text = re.split("|".join(f"\n{re.escape(heading)}\n" for heading in
                             [*KEPT_SECTIONS, PROVENANCE]), whole)[0]
    figures = json.loads((output / "results" / "results.json").read_text())
    sections = {block[4]: block.rstrip("\n").split("\n") + [""]
                for block in re.split(r"(?m)^(?=## \([a-z]\))", text)[1:]}
    return sections, figures, read_provenance(whole)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="every experiment at toy size")
    parser.add_argument("--output", help="report directory (default: docs, or runs/reproduce-smoke "
                                         "with --smoke)")
    parser.add_argument("--only", default="".join(EXPERIMENTS),
                        help="experiments to run, e.g. 'ace'")
    parser.add_argument("--keep-others", action="store_true",
                        help="keep the sections of the experiments not run from the report "
                             "already in the output directory")
    args = parser.parse_args()
    unknown = sorted(set(args.only) - set(EXPERIMENTS))
    if unknown:
        parser.error(f"unknown experiments {unknown}; choose from {''.join(EXPERIMENTS)}")
    sizes = SMOKE if args.smoke else FULL
    output = Path(args.output or ("runs/reproduce-smoke" if args.smoke else "docs"))
    plots = output / "results"
    kept_sections, figures, provenance = {}, {}, {}
    if args.keep_others:
        if not (output / "results.md").exists() or not (plots / "results.json").exists():
            parser.error(f"--keep-others: no report in {output} to keep sections from")
        kept_sections, kept_figures, provenance = read_report(output)
        figures = {key: value for key, value in kept_figures.items() if key not in args.only}
    plots.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sections, failed = [], []
    for key, (title, experiment) in EXPERIMENTS.items():
        if key not in args.only:
            sections += kept_sections.get(key, [])
            continue
        print(f"reproduce: ({key}) {title} ...", flush=True)
        began = time.monotonic()
        try:
            lines, figures[key] = experiment(sizes, plots)
        except ExperimentFailed as error:
            if error.lines:
                lines = [f"**Failed its checks**: {error}. What it measured all the same:", "",
                         *error.lines]
            else:
                lines = [f"**Not measured**: {error}"]
            failed.append(key)
        print(f"reproduce: ({key}) done in {time.monotonic() - began:.0f} s", flush=True)
        sections += [f"## ({key}) {title}", "", *lines, ""]
    command = ("python scripts/reproduce.py" + (" --smoke" if args.smoke else "")
               + (f" --only {args.only}" if args.only != "".join(EXPERIMENTS) else "")
               + (" --keep-others" if args.keep_others else ""))
    provenance.update({key: (command, datetime.date.today().isoformat(),
                             f"{time.monotonic() - started:.0f}") for key in args.only})
    header = [
        "# Results: the paper's evaluation, reproduced", "",
        f"Machine: {machine()}.", "",
        "Measured figures come from real CPU processes (gloo) on that machine, which is shared "
        "and noisy: medians and ratios of interleaved runs. Simulated figures come from the "
        "planner's cost model and discrete-event simulator; they are predictions, not "
        "measurements." + (" **Smoke run: toy sizes, not for quoting.**" if args.smoke else ""), "",
    ]
    (plots / "results.json").write_text(json.dumps(figures, indent=1, default=str))
    headline = ["## Headline figures", "",
                *table(["figure", "how", "ours", "paper (or target)", "ours / paper"],
                       headline_rows(figures)),
                ""]
    for heading, name in KEPT_SECTIONS.items():
        if (plots / name).exists():
            sections += [heading, "", (plots / name).read_text().rstrip("\n"), ""]
    sections += provenance_section(provenance)
    (output / "results.md").write_text("\n".join(header + headline + sections))
    print(f"reproduce: report written to {output / 'results.md'}"
          + (f"; experiments that failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
