"""Rank 0 offers its snapshot (in shared memory) to ranks 1 and 2, which do not map others'
memory, so each is sent the payload once it answers. The test stops rank 1 from outside before
the exchange; rank 2 reports the copy it kept."""

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

out = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
store = SnapshotStore(rank, SnapshotConfig(chunk_bytes=512, shared_memory=rank == 0))
snapshot = store.capture(1, shard(rank, 1), {"iteration": 1})
(out / f"ready{rank}").touch()
while not (out / "go").exists():
    time.sleep(0.05)
if rank == 0:
    store.replicate(snapshot, send_to=[1, 2], receive_from=[])
elif rank == 2:
    store.replicate(snapshot, send_to=[], receive_from=[0])
    tensors, state = store.restore(0, 1)
    expected = shard(0, 1)
    (out / "kept2.json").write_text(json.dumps({
        "bit_exact": all(torch.equal(tensors[n], expected[n]) for n in expected),
        "mapped": store._held[0, 1, 0].mapped}))
os._exit(0)
