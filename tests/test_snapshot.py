"""Per-step snapshots: bit-exact restore, corruption caught, double buffering, captures held only
once complete, replicas kept as sent and verified when read, RNG states through a pickle,
replication to a buddy that keeps a dead rank's state."""

from __future__ import annotations

import json
import pickle
import random
import signal
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy
import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

from harness import free_port, launch, worker_script
from megatron_elaswave.layout import Layout
from megatron_elaswave.runtime import snapshot as snapshot_module
from megatron_elaswave.runtime.snapshot import (
    SnapshotConfig,
    SnapshotCorrupted,
    SnapshotMissing,
    SnapshotStore,
)
from megatron_elaswave.training.step.snapshots import StepSnapshots, restore_rng_states, rng_states


def shard(rank: int, iteration: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + iteration)
    return {
        "main_param": torch.randn(1000, generator=generator),
        "exp_avg": torch.randn(37, 5, generator=generator),
        "step": torch.tensor(float(iteration)),
    }


def held(store: SnapshotStore) -> list[tuple[int, int]]:
    """``(rank, iteration)`` of every snapshot ``store`` holds."""
    return [tag[:2] for tag in store.held()]


def test_restore_is_bit_exact_and_double_buffered():
    store = SnapshotStore(rank=0, config=SnapshotConfig(chunk_bytes=256))
    live = shard(0, 1)
    for iteration in (1, 2, 3):
        live = shard(0, iteration)
        store.capture(iteration, live, {"consumed_samples": 16 * iteration})
    assert held(store) == [(0, 2), (0, 3)]
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


def test_a_started_capture_is_held_only_once_complete():
    store = SnapshotStore(rank=0)
    for iteration in (1, 2):
        store.capture(iteration, shard(0, iteration), {})
    pending = store.start_capture(3, shard(0, 3), {"cursor": 3})
    # Its buffer was iteration 1's, which is no longer held; iteration 2 is still whole.
    assert held(store) == [(0, 2)]
    assert torch.equal(store.restore(0, 2)[0]["main_param"], shard(0, 2)["main_param"])
    assert store.complete(pending).iteration == 3
    assert held(store) == [(0, 2), (0, 3)]
    tensors, state = store.restore(0, 3)
    assert state == {"cursor": 3}
    assert all(torch.equal(tensors[name], tensor) for name, tensor in shard(0, 3).items())


def test_step_snapshots_settle_in_the_next_step_with_overlap():
    layout = Layout.megatron(tp=1, pp=1, dp=1, num_layers=2, num_microbatches=1)
    snapshots = StepSnapshots(layout, 0, SnapshotConfig(replicas=0, overlap=True))
    scheduler = SimpleNamespace(state_dict=lambda: {"lr": 0.1})
    snapshots.after_step(1, None, scheduler, 8, tensors=shard(0, 1))
    assert snapshots.pending and held(snapshots.store) == []
    snapshots.settle()
    assert not snapshots.pending and held(snapshots.store) == [(0, 1)]
    snapshots.after_step(2, None, scheduler, 16, tensors=shard(0, 2))
    # A failure came first: the capture of iteration 2 is complete, so it is held all the same.
    snapshots.discard()
    assert not snapshots.pending and held(snapshots.store) == [(0, 1), (0, 2)]
    assert snapshots.store.restore(0, 2)[1]["consumed_samples"] == 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_capture_from_cuda_is_copied_on_a_side_stream_and_checksummed_when_complete():
    # torch's Adam keeps its step on the host beside state on the device
    live = {name: tensor if name == "step" else tensor.cuda() for name, tensor in shard(0, 1).items()}
    store = SnapshotStore(rank=0)
    pending = store.start_capture(1, live, {})
    assert pending.snapshot.payload.is_pinned() and held(store) == []
    snapshot = store.complete(pending)
    for tensor in live.values():
        tensor.add_(1.0)  # the next optimizer step, after the snapshot is complete
    tensors, _ = store.restore(0, 1)
    assert snapshot.checksums and held(store) == [(0, 1)]
    assert all(torch.equal(tensors[name], tensor) for name, tensor in shard(0, 1).items())


SENT = SnapshotConfig(shared_memory=False)
"""Copies sent through the group, as to buddies on other hosts."""


class Loopback:
    """Stand-in for torch.distributed's point-to-point calls within one process: messages
    arrive in the order they were sent, whoever sends them; with ``peer_died`` set, waiting
    for a send fails."""

    def __init__(self) -> None:
        self.queue: deque[torch.Tensor] = deque()
        self.peer_died = False
        self.tags: set[int] = set()

    def isend(self, tensor, group=None, tag=0, group_dst=None):
        self.tags.add(tag)
        self.queue.append(tensor.clone())
        return SimpleNamespace(wait=self._send_done)

    def _send_done(self) -> None:
        if self.peer_died:
            raise RuntimeError("Connection reset by peer")

    def irecv(self, tensor, group=None, tag=0, group_src=None):
        self.tags.add(tag)
        return SimpleNamespace(wait=lambda: tensor.copy_(self.queue.popleft()))


def test_a_replica_is_kept_as_sent_and_verified_when_read(monkeypatch):
    loopback = Loopback()
    monkeypatch.setattr(snapshot_module, "dist", loopback)
    sent_config = SnapshotConfig(chunk_bytes=256, shared_memory=False)
    sender, buddy = SnapshotStore(rank=1, config=sent_config), SnapshotStore(0, sent_config)
    for iteration in (1, 2, 3, 4):
        sender.replicate(sender.capture(iteration, shard(1, iteration), {"cursor": iteration}),
                         send_to=[0], receive_from=[])
        if iteration == 4:
            loopback.queue[-1][100] ^= 0x01  # the payload, damaged in transit
        buddy.replicate(buddy.capture(iteration, shard(0, iteration), {"cursor": iteration}),
                        send_to=[], receive_from=[1])
    assert held(buddy) == [(0, 3), (0, 4), (1, 3), (1, 4)]
    assert buddy.bytes_held == 2 * sender.bytes_held  # same-sized shards: its own and rank 1's
    tensors, state = buddy.restore(1, 3)
    assert state == {"cursor": 3}
    assert all(torch.equal(tensors[name], tensor) for name, tensor in shard(1, 3).items())
    with pytest.raises(SnapshotCorrupted, match="rank 1 at iteration 4 .*: 'main_param'"):
        buddy.restore(1, 4)


def test_a_copy_that_arrived_is_kept_when_a_send_to_its_dead_sender_fails(monkeypatch):
    loopback = Loopback()
    monkeypatch.setattr(snapshot_module, "dist", loopback)
    sender, buddy = SnapshotStore(1, SENT), SnapshotStore(0, SENT)
    sender.replicate(sender.capture(5, shard(1, 5), {}), send_to=[0], receive_from=[])
    loopback.peer_died = True
    with pytest.raises(RuntimeError, match="reset by peer"):
        buddy.replicate(buddy.capture(5, shard(0, 5), {}), send_to=[1], receive_from=[1])
    assert held(buddy) == [(0, 5), (1, 5)]


def test_an_exchange_runs_on_a_thread_and_a_failure_that_ends_it_loses_no_arrived_copy(
        monkeypatch):
    loopback = Loopback()
    monkeypatch.setattr(snapshot_module, "dist", loopback)
    sender, buddy = SnapshotStore(1, SENT), SnapshotStore(0, SENT)
    exchanges = []
    replicate = snapshot_module.SnapshotStore.replicate

    def replicate_on_record(store, *args, **kwargs):
        exchanges.append(threading.current_thread().name)
        return replicate(store, *args, **kwargs)

    monkeypatch.setattr(snapshot_module.SnapshotStore, "replicate", replicate_on_record)
    sent = sender.replicate_when_captured(sender.start_capture(5, shard(1, 5), {}), [0], [])
    sent.result()
    loopback.peer_died = True  # rank 1 dies once its copy is out
    received = buddy.replicate_when_captured(buddy.start_capture(5, shard(0, 5), {}), [1], [1])
    with pytest.raises(RuntimeError, match="reset by peer"):
        received.result()
    assert exchanges and all(name.startswith("elaswave-snapshot-exchange") for name in exchanges)
    # Never matched with a pipeline's messages (tag 0) on a group that is also a pipeline's.
    assert loopback.tags == {snapshot_module.SNAPSHOT_TAG} != {0}
    assert held(buddy) == [(1, 5)]  # its own is held once settled (or discarded)
    assert all(torch.equal(buddy.restore(1, 5)[0][name], tensor)
               for name, tensor in shard(1, 5).items())


def test_a_rollback_forgets_the_snapshots_of_the_steps_it_runs_again():
    store = SnapshotStore(rank=0)
    for iteration in (4, 5):
        store.capture(iteration, shard(0, iteration), {})
    store._keep(SnapshotStore(rank=1).capture(5, shard(1, 5), {}))  # rank 1's replica
    assert held(store) == [(0, 4), (0, 5), (1, 5)]
    store.forget_after(4)
    assert held(store) == [(0, 4)]


def test_rng_states_survive_a_pickle(monkeypatch):
    tracker = CudaRNGStatesTracker()
    tracker.set_states({"model-parallel-rng": torch.Generator().manual_seed(5).get_state()})
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: tracker)
    saved = pickle.loads(pickle.dumps(rng_states()))
    expected = random.random(), numpy.random.rand(), torch.rand(3)
    tracker.set_states({"model-parallel-rng": torch.Generator().manual_seed(6).get_state()})
    restore_rng_states(saved)
    assert (random.random(), numpy.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])
    assert torch.equal(tracker.get_states()["model-parallel-rng"],
                       torch.Generator().manual_seed(5).get_state())


def test_config_is_validated():
    with pytest.raises(ValueError, match="replicas"):
        SnapshotConfig(replicas=-1)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shared", pytest.param("sent", marks=pytest.mark.sweep),
                                       "mixed"])
def test_buddy_restores_a_killed_ranks_snapshot(tmp_path, transport):
    """Four ranks snapshot every step and replicate to the next rank; rank 2 is SIGKILLed after
    step 3, and rank 3 restores rank 2's step-3 state bit-exactly: from rank 2's shared memory,
    which outlives it, where both map shared memory; from the copy sent where rank 3 does not."""
    world, victim, steps = 4, 2, 3
    job = launch([worker_script("snapshot_ring.py"), str(tmp_path), str(steps), transport],
                 world, master_port=free_port())
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
                      "held": [[2, 2], [2, 3], [3, 2], [3, 3]],
                      "mapped": transport == "shared"}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_buddy_that_never_answers_an_offer_holds_up_no_other(tmp_path):
    """Rank 0 offers its snapshot to ranks 1 and 2, neither of which maps it; rank 1 is
    SIGSTOPped before the exchange, and rank 2 still gets and keeps its copy."""
    job = launch([worker_script("snapshot_offer.py"), str(tmp_path)], 3, master_port=free_port())
    with job:
        job.wait_for(lambda: all((tmp_path / f"ready{r}").exists() for r in range(3)), 90,
                     "every rank to capture its snapshot")
        job.kill_worker(1, signal.SIGSTOP)
        (tmp_path / "go").touch()
        job.wait_for(lambda: (tmp_path / "kept2.json").exists(), 60, "rank 2's copy")
    assert json.loads((tmp_path / "kept2.json").read_text()) == {"bit_exact": True,
                                                                "mapped": False}


def test_a_snapshot_sealed_as_its_copies_arrive_has_the_checksums_of_one_sealed_at_once():
    class Arrived:
        """Stands in for a CUDA event: the copy it follows lands when it is waited for."""

        def __init__(self, target: torch.Tensor, source: torch.Tensor) -> None:
            self.target, self.source = target, source

        def synchronize(self) -> None:
            self.target.copy_(self.source)

    live, config = shard(0, 1), SnapshotConfig(chunk_bytes=1 << 12)
    zeros = {name: torch.zeros_like(tensor) for name, tensor in live.items()}
    copy = SnapshotStore(0, config).capture(1, zeros, {"iteration": 1})
    arriving = [Arrived(copy.tensors[name], tensor) for name, tensor in live.items()]
    with ThreadPoolExecutor(3) as pool:
        copy.seal_as_copied(arriving, pool)
    at_once = SnapshotStore(0, config).capture(1, live, {"iteration": 1})
    assert copy.checksums == at_once.checksums
    copy.verify()


def test_a_restore_verifies_the_tensors_it_reads_and_only_those():
    store = SnapshotStore(rank=0, config=SnapshotConfig(chunk_bytes=256))
    store.capture(5, shard(0, 5), {"cursor": "own"})
    peer = SnapshotStore(rank=1, config=SnapshotConfig(chunk_bytes=256)).capture(
        5, {f"peer_{name}": tensor for name, tensor in shard(1, 5).items()}, {"cursor": "peer"})
    store._keep(peer)
    peer.view("peer_main_param")[3] += 1.0  # rank 1's replica, damaged in memory
    tensors, state = store.restore_iteration(5, rank=0)
    assert state == {"cursor": "own"} and sorted(tensors) == sorted(
        [*shard(0, 5), *(f"peer_{name}" for name in shard(1, 5))])
    assert torch.equal(tensors["main_param"], shard(0, 5)["main_param"])
    assert torch.equal(tensors["peer_exp_avg"], shard(1, 5)["exp_avg"])
    with pytest.raises(SnapshotCorrupted, match="rank 1 at iteration 5 .*'peer_main_param'"):
        tensors["peer_main_param"]
    assert store.restore_iteration(5, rank=2)[1] == {"cursor": "own"}  # any held, where not its own
    nothing, no_state = store.restore_iteration(6, rank=0)
    assert len(nothing) == 0 and no_state is None
