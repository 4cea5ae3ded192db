"""An activation sent through megatron-core's unbatched ``_p2p_ops`` and freed by
``deallocate_output_tensor`` before its send is waited for, as megatron-core 0.16.1's interleaved
schedule does with ``overlap_p2p_comm``; the sender then allocates tensors of the same size
filled with -7 before the receiver posts its receive.

Usage: p2p_early_free.py OUT_DIR [--patched]; rank 1 writes ``OUT_DIR/rank1.json`` with how many
of the sends it received intact. With ``--patched`` the project's patches are installed first.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

SENDS = 10
ELEMENTS = 8192  # 32 KB: freed memory goes back to the allocator's free lists, not the system

if __name__ == "__main__":
    out_dir, patched = sys.argv[1], "--patched" in sys.argv[2:]
    if patched:
        from megatron_elaswave.device import resolve_device_backend
        from megatron_elaswave.patches import install

        install(resolve_device_backend("cpu"))
    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

    dist.init_process_group("gloo", init_method="env://")
    group = dist.new_group([0, 1])
    rank, intact = dist.get_rank(), 0
    for send in range(1, SENDS + 1):
        if rank == 0:
            activation = torch.full((ELEMENTS,), float(send))
            requests = p2p_communication._p2p_ops(
                tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=activation,
                tensor_recv_next=None, group=group, prev_pipeline_rank=1, next_pipeline_rank=1)
            deallocate_output_tensor(activation, deallocate_pipeline_outputs=True)
            reusing_the_freed_memory = [torch.full((ELEMENTS,), -7.0) for _ in range(4)]  # noqa: F841
            dist.barrier()
            requests["send_next"].wait()
        else:
            received = torch.empty(ELEMENTS)
            dist.barrier()
            requests = p2p_communication._p2p_ops(
                tensor_send_prev=None, tensor_recv_prev=received, tensor_send_next=None,
                tensor_recv_next=None, group=group, prev_pipeline_rank=0, next_pipeline_rank=0)
            requests["recv_prev"].wait()
            intact += bool(torch.all(received == send))
    if rank == 1:
        with open(os.path.join(out_dir, "rank1.json"), "w") as out:
            json.dump({"intact": intact, "sends": SENDS}, out)
    dist.barrier()
    os._exit(0)
