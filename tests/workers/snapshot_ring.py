"""Snapshot every step and replicate to the next rank; after the last step wait for the test,
then the buddy of the rank the test killed restores its snapshot and reports."""

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

out, steps = Path(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
store = SnapshotStore(rank, SnapshotConfig(chunk_bytes=512))
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
        {"rank": 2, "iteration": steps, "bit_exact": exact, "held": [tag[:2] for tag in store.held()]}))
os._exit(0)  # the dead rank would make destroy_process_group wait
