"""Megatron-LM's default-group calls, redirected to the group of ranks that still run.

Usage: default_group_redirect.py OUT_DIR. Every rank forms the default group and the group of
ranks 0, 1 and 3; rank 2 then SIGKILLs itself. The others call ``torch.distributed`` functions
without a group through :class:`DefaultGroupRedirect`, which must send them to the group of
survivors (on the default group they would wait for rank 2 until the timeout). Each survivor
writes ``OUT_DIR/rank<r>.json`` with what it saw.
"""

import json
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_elaswave.patches.megatron_lm_elastic import DefaultGroupRedirect

SURVIVORS = [0, 1, 3]

if __name__ == "__main__":
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=20))
    survivors = dist.new_group(SURVIVORS)
    rank = dist.get_rank()
    if rank not in SURVIVORS:
        os.kill(os.getpid(), signal.SIGKILL)
    redirected = DefaultGroupRedirect(lambda: survivors)
    redirected.barrier()
    total = torch.tensor([float(rank)])
    redirected.all_reduce(total)
    # src is a rank of the survivors' group: 2 is launch rank 3
    token = torch.tensor([float(rank * 10)])
    redirected.broadcast(token, 2)
    gathered = torch.zeros(len(SURVIVORS))
    redirected.all_gather_into_tensor(gathered, torch.tensor([float(rank)]))
    report = {
        "rank": redirected.get_rank(),
        "world_size": redirected.get_world_size(),
        "sum": total.item(),
        "broadcast": token.item(),
        "gathered": gathered.tolist(),
        "explicit_group_size": redirected.get_world_size(dist.group.WORLD),
        "untouched": redirected.ReduceOp.SUM == dist.ReduceOp.SUM,
    }
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
        json.dump(report, out)
    os._exit(0)  # the default group still counts rank 2: do not wait for it on the way out
