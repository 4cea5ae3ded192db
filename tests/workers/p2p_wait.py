"""Pipeline send/receive through megatron-core's ``_batched_p2p_ops`` on a gloo group created
with a 1 s timeout and then set to 60 s; the receiver's peer sends 3 s late.

Usage: p2p_wait.py OUT_DIR [--patched]; rank 1 writes ``OUT_DIR/rank1.json`` with what it
received (or the error) and how long it waited. With ``--patched`` the project's patches are
installed first.
"""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

if __name__ == "__main__":
    out_dir, patched = sys.argv[1], "--patched" in sys.argv[2:]
    if patched:
        from megatron_elaswave.device import resolve_device_backend
        from megatron_elaswave.patches import install

        install(resolve_device_backend("cpu"))
    from megatron.core.pipeline_parallel import p2p_communication

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    group.set_timeout(timedelta(seconds=60))
    rank, tensor = dist.get_rank(), torch.full((4,), float(dist.get_rank()))
    if rank == 0:
        time.sleep(3)
    started = time.monotonic()
    try:
        requests = p2p_communication._batched_p2p_ops(
            tensor_send_prev=None, tensor_recv_prev=None,
            tensor_send_next=tensor if rank == 0 else None,
            tensor_recv_next=None if rank == 0 else tensor,
            group=group, prev_pipeline_rank=0, next_pipeline_rank=1 - rank)
        for request in requests:
            request.wait()
        report = {"received": tensor.tolist()}
    except RuntimeError as error:
        report = {"error": str(error)[:200]}
    report["waited_s"] = time.monotonic() - started
    if rank == 1:
        with open(os.path.join(out_dir, "rank1.json"), "w") as out:
            json.dump(report, out)
    os._exit(0)
