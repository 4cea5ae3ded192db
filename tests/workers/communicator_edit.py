"""Builds every group of a TP x PP x DP job, survives one death, edits the groups and checks them.

Usage: communicator_edit.py OUT_DIR MODE VICTIM [--tp 2 --pp 2 --dp 2] [--victim-exits]
                           [--broken RANKS[;RANKS...]]

Every rank joins generation 0's default group on the job store, builds a ``GroupRegistry`` and
all-reduces its launch rank on every group it belongs to, then sets ``test/ready/<rank>``. The
victim then waits to be SIGKILLed by the test or, with ``--victim-exits``, exits with status 3
once every rank is ready. The survivors learn the failed rank from the launcher's death records,
plan the new layout with the planner, ``edit`` the registry in MODE (declaring the groups of
``--broken``, comma-separated member lists, as aborted) and check again: an
all-reduce on every group they belong to (the sum must be the sum of its members' launch ranks),
then a send/recv between the two ranks of every two-stage pipeline over the default group. Each
survivor writes ``OUT_DIR/rank<r>.json``.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_elaswave.launch.store import connect_store, read_deaths
from megatron_elaswave.layout import Layout
from megatron_elaswave.planner.cost import CostModel, MemoryModel
from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.planner.profile import SyntheticDevice, SyntheticModel, synthetic_profile
from megatron_elaswave.planner.replan import PlanOptions, plan_recovery
from megatron_elaswave.runtime.communicator import HOST_ROLES, GroupRegistry, Role

TIMEOUT = timedelta(seconds=30)
NUM_LAYERS = 4


def replan(job: JobSpec, layout: Layout, failed: set[int]) -> Layout:
    """The layout every survivor computes alike: the planner on a small synthetic profile."""
    model = SyntheticModel(
        num_layers=job.num_layers, hidden_size=256, ffn_hidden_size=1024, vocab_size=512,
        seq_length=128, tensor_model_parallel_size=job.tensor_parallel_size,
    )
    cost = CostModel(synthetic_profile(model, SyntheticDevice()), job, MemoryModel())
    return plan_recovery(layout, failed, cost, PlanOptions(dvfs=False)).layout


def check_all_reduces(registry: GroupRegistry) -> list[dict]:
    """All-reduce the launch rank on every group of this rank, in the registry's canonical
    order (the same on every rank, so no two ranks wait on each other in a cycle)."""
    results = []
    for spec in registry.specs():
        groups = {"device": registry.group_of(spec)}
        if spec.role in HOST_ROLES:
            groups["host"] = registry.host_group(spec.role, spec.key)
        for kind, group in groups.items():
            value = torch.tensor([float(registry.rank)])
            dist.all_reduce(value, group=group)
            results.append({"role": spec.role.value, "key": list(spec.key), "kind": kind,
                            "ranks": list(spec.ranks), "sum": value.item(),
                            "separate": kind == "device" or group is not groups["device"]})
    return results


def check_default_group_p2p(registry: GroupRegistry) -> list[dict]:
    """Send/recv over the default group between the two ranks of a two-stage pipeline, as
    megatron-core's P2P code does for a pipeline group of size 2 (``batch_p2p_comm=False``)."""
    pipeline = registry.spec(Role.PP).ranks
    if len(pipeline) != 2:
        return []
    peer = pipeline[1 - pipeline.index(registry.rank)]
    sent, received = torch.tensor([float(registry.rank)]), torch.tensor([-1.0])
    if registry.rank == pipeline[0]:
        dist.send(sent, dst=registry.world_rank(peer))
        dist.recv(received, src=registry.world_rank(peer))
    else:
        dist.recv(received, src=registry.world_rank(peer))
        dist.send(sent, dst=registry.world_rank(peer))
    return [{"peer": peer, "received": received.item()}]


def wait_for_deaths(store, victims: set[int]) -> set[int]:
    deaths, deadline = [], time.monotonic() + 60
    while not victims <= {death.rank for death in deaths}:
        if time.monotonic() > deadline:
            sys.exit(f"no death record for {sorted(victims)} after 60 s")
        time.sleep(0.02)
        deaths += read_deaths(store, start=len(deaths))
    return {death.rank for death in deaths}


def store_barrier(store, name: str, ranks) -> None:
    store.set(f"test/{name}/{os.environ['RANK']}", "")
    store.wait([f"test/{name}/{rank}" for rank in ranks])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("mode")
    parser.add_argument("victim", type=int)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--victim-exits", action="store_true")
    parser.add_argument("--broken", default="", type=lambda text: [
        tuple(int(r) for r in members.split(",")) for members in text.split(";") if members
    ])
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job = JobSpec(
        tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, data_parallel_size=args.dp,
        num_layers=NUM_LAYERS, global_batch_size=2 * args.dp, micro_batch_size=1,
    )
    store = connect_store(timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=rank,
                            world_size=world_size, timeout=TIMEOUT)
    layout = job.initial_layout()
    registry = GroupRegistry(layout, rank, store=store, timeout=TIMEOUT)
    before = check_all_reduces(registry)
    store_barrier(store, "ready", range(world_size))
    if rank == args.victim:
        if args.victim_exits:
            os._exit(3)
        while True:
            time.sleep(1)

    failed = wait_for_deaths(store, {args.victim})
    new_layout = replan(job, layout, failed)
    report = registry.edit(failed, new_layout, args.mode, broken=args.broken)
    after = check_all_reduces(registry)
    p2p = check_default_group_p2p(registry) if rank in new_layout.active_ranks() else []
    record = {
        "rank": rank,
        "failed": sorted(failed),
        "layout": new_layout.to_json(with_microbatch_ids=True),
        "spares": list(new_layout.spares),
        "edit": {**asdict(report), "mode": report.mode.value},
        "before": before,
        "after": after,
        "default_group_p2p": p2p,
        "world_size_after": dist.get_world_size(),
    }
    path = os.path.join(args.out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as out:
        json.dump(record, out)
    os.replace(path + ".tmp", path)
    # Nobody leaves while a peer may still be reading from it.
    store_barrier(store, "done", sorted(new_layout.known_ranks()))
    registry.destroy()


if __name__ == "__main__":
    main()
