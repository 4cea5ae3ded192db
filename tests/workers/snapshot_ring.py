"""Snapshot every step and replicate to the next rank; after the last step wait for the test,
then the buddy of the rank the test killed restores its snapshot and reports.

``argv[3]``: ``shared`` (snapshots in shared memory), ``sent`` (every copy sent through the group)
or ``mixed`` (odd ranks do not map others' memory, so their copies are sent)."""

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_elaswave.runtime.snapshot import SnapshotConfig, SnapshotStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_snapshot import shard  # noqa: E402

out, steps, transport = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
shared = transport == "shared" or (transport == "mixed" and rank % 2 == 0)
store = SnapshotStore(rank, SnapshotConfig(chunk_bytes=512, shared_memory=shared))
for iteration in range(1, steps + 1):
    snapshot = store.capture(iteration, shard(rank, iteration), {"iteration": iteration})
    store.replicate(snapshot, send_to=[(rank + 1) % world], receive_from=[(rank - 1) % world])
(out / f"done{rank}").touch()
while not (out / "go").exists():
    time.sleep(0.05)
if rank == 3:
    tensors, state = store.restore(2, steps)
    expected = shard(2, steps)
    exact = all(torch.equal(tensors[n], expected[n]) for n in expected) and state == {"iteration": steps}
    (out / "restored3.json").write_text(json.dumps(
        {"rank": 2, "iteration": steps, "bit_exact": exact, "held": [tag[:2] for tag in store.held()],
         "mapped": store._held[2, steps, 0].mapped}))
os._exit(0)  # the dead rank would make destroy_process_group wait
