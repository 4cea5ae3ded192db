"""Joins the job's default process group through ``env://`` and all-reduces its rank.

Usage: allreduce.py OUT_DIR; writes ``OUT_DIR/rank<r>.json`` with the rank, world
size, sum and the pid of its launcher.
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    report = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": value.item(),
        "launcher_pid": os.getppid(),
    }
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as out:
        json.dump(report, out)
    dist.destroy_process_group()
