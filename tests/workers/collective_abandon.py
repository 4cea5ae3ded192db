"""A gloo all-reduce that rank 1 never joins, two reduce-scatters coalesced into one work as
megatron-core's bucket groups issue them, or a receive from rank 1 that it never sends (it stays
alive 8 s, or until rank 0 has given the operation up, then exits); rank 0's wait is given up 1 s
in by setting the event the wait was armed with.

Usage: collective_abandon.py OUT_DIR all_reduce|coalesced|recv [--patched]; rank 0 writes
``OUT_DIR/rank0.json`` with the first (completed) all-reduce's result, how long the operation
that follows it was waited for, the error that ended the wait, and how long destroying its group
then took. With ``--patched`` the project's patches are installed first and the wait is armed;
the report then also says how many gloo event loops ran before and after the group was retired
and destroyed, and after the abandoned operation ended (rank 1 gone) and the retired groups
were released.
"""

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager


def gloo_event_loops() -> int:
    """Threads of this process that run a gloo TCP event loop: one per live gloo group."""
    return sum(open(f"/proc/self/task/{task}/comm").read().strip() == "gloo_tcp_loop"
               for task in os.listdir("/proc/self/task"))


if __name__ == "__main__":
    out_dir, operation, patched = sys.argv[1], sys.argv[2], "--patched" in sys.argv[3:]
    abandon = threading.Event()
    if patched:
        from megatron_elaswave.device import resolve_device_backend
        from megatron_elaswave.patches import distributed_work, install

        install(resolve_device_backend("cpu"))
        distributed_work.abandon_waits_when(abandon)
    from megatron_elaswave.runtime.world import release_retired, retire
    from megatron_elaswave.waiting import wait_until

    timeout = timedelta(seconds=30)
    dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    group = dist.new_group([0, 1], timeout=timeout)
    tensor = torch.ones(4)
    dist.all_reduce(tensor, group=group)
    gave_up = os.path.join(out_dir, "rank0-gave-up")
    if dist.get_rank() == 1:
        # Alive 8 s, or until rank 0 has given its operation up and counted what is pending.
        wait_until(lambda: os.path.exists(gave_up), 8)
        os._exit(0)
    report = {"first": tensor.tolist()}
    threading.Timer(1.0, abandon.set).start()
    started = time.monotonic()
    try:
        if operation == "recv":
            dist.recv(tensor, src=1, group=group)
        elif operation == "coalesced":  # synchronous, as without overlap_grad_reduce
            with _coalescing_manager(group, async_ops=False):
                for shard in (torch.empty(2), torch.empty(2)):
                    dist.reduce_scatter_tensor(shard, tensor, group=group)
        else:
            dist.all_reduce(tensor, group=group)
    except RuntimeError as error:
        report["error"] = f"{type(error).__name__}: {str(error)[:200]}"
    report["waited_s"] = time.monotonic() - started
    loops_before = gloo_event_loops()
    started = time.monotonic()
    retire([group], timeout)
    dist.destroy_process_group(group)
    del group
    report["destroyed_in_s"] = time.monotonic() - started
    if patched:
        report["loops_before"] = loops_before
        report["loops_retired"] = gloo_event_loops()
        report["pending_retired"] = distributed_work.abandoned_work_pending()
        open(gave_up, "w").close()  # rank 1 may leave: that ends the abandoned operation
        wait_until(lambda: not distributed_work.abandoned_work_pending(), 20)
        started = time.monotonic()
        release_retired()
        report["released_in_s"] = time.monotonic() - started
        report["loops_released"] = gloo_event_loops()
    with open(os.path.join(out_dir, "rank0.json"), "w") as out:
        json.dump(report, out)
    os._exit(0)
