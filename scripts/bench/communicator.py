"""Recovery time of the process groups after one death: the recovery's re-creation and the
in-place edit against partial and full rebuild.

For each configuration (TP2 x PP2 x DP2 on 8 processes, TP2 x PP2 x DP4 on 16 by default) and
each repetition, one rank fails (rank 0 first, then seeded random ranks); for each mode, in
rotating order, a fresh gloo job under ``elaswave-run`` builds the complete group set
(``GroupRegistry``), the victim SIGKILLs itself, and the survivors plan the new layout, meet in
the store and time ``GroupRegistry.edit``:

* ``recovery``: what a recovery does. The survivors abort every connection
  (``world.abort_collectives``, which unblocks a training thread stuck on the dead rank), so every
  group of the new layout is re-created, each by its own members, with a failure monitor's event
  able to interrupt the edit.
* ``inplace``: the step-boundary edit, which keeps every group that lost no member.
* ``partial`` and ``full``: the paper's baselines (every survivor takes part in every creation;
  a new default group and every group).

A repetition's time is the slowest survivor's (the groups are usable when every survivor has
them). Every group is then checked with an all-reduce.

Prints per-configuration medians and their ratios to the in-place median; with ``--json`` one
object ``{"tp2pp2dp2": {"recovery_s": w, "inplace_s": x, "partial_s": y, "full_s": z, ...}, ...}``.

    python scripts/bench/communicator.py --repetitions 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

MODES = ("recovery", "inplace", "partial", "full")
TIMEOUT = timedelta(seconds=120)


# ---- the worker (one rank of a benchmark job) --------------------------------------------------


def worker(out_dir: str, mode: str, victim: int, tp: int, pp: int, dp: int) -> None:
    import signal
    import threading

    import torch
    import torch.distributed as dist

    from megatron_elaswave.launch.store import connect_store, read_deaths
    from megatron_elaswave.planner.cost import CostModel, MemoryModel
    from megatron_elaswave.planner.job import JobSpec
    from megatron_elaswave.planner.profile import SyntheticDevice, SyntheticModel, synthetic_profile
    from megatron_elaswave.planner.replan import PlanOptions, plan_recovery
    from megatron_elaswave.runtime.communicator import GroupRegistry, group_specs, member_lists
    from megatron_elaswave.runtime.world import abort_collectives

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job = JobSpec(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                  num_layers=4 * pp, global_batch_size=2 * dp, micro_batch_size=1)
    store = connect_store(timeout=TIMEOUT)

    def meet(name: str, ranks) -> None:
        store.set(f"bench/{name}/{rank}", "")
        store.wait([f"bench/{name}/{r}" for r in ranks])

    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=rank,
                            world_size=world_size, timeout=TIMEOUT)
    layout = job.initial_layout()
    registry = GroupRegistry(layout, rank, store=store, timeout=TIMEOUT)
    meet("built", range(world_size))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    while victim not in {death.rank for death in read_deaths(store)}:
        time.sleep(0.01)
    model = SyntheticModel(num_layers=job.num_layers, hidden_size=256, ffn_hidden_size=1024,
                           vocab_size=512, seq_length=128, tensor_model_parallel_size=tp)
    cost = CostModel(synthetic_profile(model, SyntheticDevice()), job, MemoryModel())
    new_layout = plan_recovery(layout, {victim}, cost, PlanOptions(dvfs=False)).layout
    meet("edit", sorted(new_layout.known_ranks()))
    if mode == "recovery":
        abort_collectives()
        report = registry.edit({victim}, new_layout, "inplace",
                               broken=member_lists(group_specs(layout)), abort=threading.Event())
    else:
        report = registry.edit({victim}, new_layout, mode)
    for spec in registry.specs():
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=registry.group_of(spec))
        if value.item() != sum(spec.ranks):
            sys.exit(f"rank {rank}: {spec} all-reduced to {value.item()}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
        json.dump({"seconds": report.seconds, "created": report.created, "kept": report.kept}, out)
    meet("done", sorted(new_layout.known_ranks()))
    registry.destroy()


# ---- the driver ---------------------------------------------------------------------------------


def run_job(mode: str, victim: int, tp: int, pp: int, dp: int) -> dict:
    from common import launch

    with tempfile.TemporaryDirectory() as out_dir:
        launch(Path(__file__), ["--worker", out_dir, mode, str(victim), str(tp), str(pp), str(dp)],
               tp * pp * dp)
        reports = [json.loads(path.read_text()) for path in Path(out_dir).glob("rank*.json")]
    if len(reports) != tp * pp * dp - 1:
        sys.exit(f"{mode}: {len(reports)} survivors reported, expected {tp * pp * dp - 1}")
    return {
        "seconds": max(r["seconds"] for r in reports),
        "created": sum(r["created"] for r in reports),
        "kept": sum(r["kept"] for r in reports),
    }


def bench(tp: int, pp: int, dp: int, repetitions: int, rng: random.Random, say) -> dict:
    world = tp * pp * dp
    victims = [0] + [rng.randrange(world) for _ in range(repetitions - 1)]
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    groups: dict[str, dict] = {}
    for repetition, victim in enumerate(victims):
        order = MODES[repetition % len(MODES):] + MODES[:repetition % len(MODES)]
        for mode in order:
            result = run_job(mode, victim, tp, pp, dp)
            times[mode].append(result["seconds"])
            groups[mode] = {"created": result["created"], "kept": result["kept"]}
            say(f"  tp{tp}pp{pp}dp{dp} rank {victim:2d} dies  {mode:8s} {result['seconds'] * 1e3:8.1f} ms"
                f"  (group memberships created {result['created']}, kept {result['kept']})")
    medians = {f"{mode}_s": statistics.median(values) for mode, values in times.items()}
    return {
        **medians,
        "recovery_over_inplace": medians["recovery_s"] / medians["inplace_s"],
        "partial_over_inplace": medians["partial_s"] / medians["inplace_s"],
        "full_over_inplace": medians["full_s"] / medians["inplace_s"],
        "victims": victims,
        "samples_s": times,
        "communicators_last_repetition": groups,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=3, help="failures per configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default="2x2x2,2x2x4", help="TPxPPxDP, comma-separated")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    say = (lambda line: None) if args.json else (lambda line: print(line, flush=True))
    results = {}
    for config in args.configs.split(","):
        tp, pp, dp = (int(size) for size in config.split("x"))
        results[f"tp{tp}pp{pp}dp{dp}"] = bench(tp, pp, dp, args.repetitions, rng, say)
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'config':<12}{'recovery ms':>13}{'inplace ms':>12}{'partial ms':>12}{'full ms':>10}"
          f"{'partial/in':>12}{'full/in':>9}")
    for name, r in results.items():
        print(f"{name:<12}{r['recovery_s'] * 1e3:>13.1f}{r['inplace_s'] * 1e3:>12.1f}"
              f"{r['partial_s'] * 1e3:>12.1f}{r['full_s'] * 1e3:>10.1f}"
              f"{r['partial_over_inplace']:>12.2f}{r['full_over_inplace']:>9.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        out, mode, victim, tp, pp, dp = sys.argv[2:8]
        worker(out, mode, int(victim), int(tp), int(pp), int(dp))
    else:
        main()
