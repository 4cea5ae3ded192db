"""Per-step snapshots: bit-exact restore, corruption caught, double buffering, replication to a
buddy that keeps a dead rank's state."""

from __future__ import annotations

import json

import pytest
import torch

from harness import free_port, launch, worker_script
from megatron_elaswave.snapshot import (
    SnapshotConfig,
    SnapshotCorrupted,
    SnapshotMissing,
    SnapshotStore,
)


def shard(rank: int, iteration: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + iteration)
    return {
        "main_param": torch.randn(1000, generator=generator),
        "exp_avg": torch.randn(37, 5, generator=generator),
        "step": torch.tensor(float(iteration)),
    }


def test_restore_is_bit_exact_and_double_buffered():
    store = SnapshotStore(rank=0, config=SnapshotConfig(chunk_bytes=256))
    live = shard(0, 1)
    for iteration in (1, 2, 3):
        live = shard(0, iteration)
        store.capture(iteration, live, {"consumed_samples": 16 * iteration})
    assert store.held() == [(0, 2), (0, 3)]
    tensors, state = store.restore(0, 3)
    assert state == {"consumed_samples": 48}
    for name, tensor in live.items():
        assert torch.equal(tensors[name], tensor) and tensors[name].data_ptr() != tensor.data_ptr()
    live["main_param"].add_(1.0)  # training goes on; the snapshot must not follow
    assert not torch.equal(store.restore(0, 3)[0]["main_param"], live["main_param"])
    expected_bytes = 2 * sum(t.numel() * t.element_size() for t in live.values())
    assert expected_bytes <= store.bytes_held < expected_bytes + 200
    with pytest.raises(SnapshotMissing):
        store.restore(0, 1)


def test_a_flipped_byte_is_reported_not_loaded():
    store = SnapshotStore(rank=3, config=SnapshotConfig(chunk_bytes=64))
    store.capture(7, shard(3, 7), {"cursor": 7})
    held, _ = store.restore(3, 7)
    held["exp_avg"].view(-1).view(torch.uint8)[101] ^= 0x10
    with pytest.raises(SnapshotCorrupted, match="'exp_avg' does not match"):
        store.restore(3, 7)


def test_config_is_validated():
    with pytest.raises(ValueError, match="replicas"):
        SnapshotConfig(replicas=-1)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_buddy_restores_a_killed_ranks_snapshot(tmp_path):
    """Four ranks snapshot every step and replicate to the next rank; rank 2 is SIGKILLed after
    step 3, and rank 3 restores rank 2's step-3 state bit-exactly."""
    world, victim, steps = 4, 2, 3
    job = launch([worker_script("snapshot_ring.py"), str(tmp_path), str(steps)], world,
                 master_port=free_port())
    with job:
        job.wait_for(lambda: all((tmp_path / f"done{r}").exists() for r in range(world)), 90,
                     "every rank to finish its snapshots")
        job.kill_worker(victim)
        job.wait_for_deaths(1)
        (tmp_path / "go").touch()
        returncode, output = job.wait(60)
    assert returncode == 0, output
    result = json.loads((tmp_path / "restored3.json").read_text())
    assert result == {"rank": victim, "iteration": steps, "bit_exact": True,
                      "held": [[2, 2], [2, 3], [3, 2], [3, 3]]}
