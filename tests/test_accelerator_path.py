"""The accelerator path: device groups aborted by their backend, host state on gloo, snapshots
from device memory, NVML clocks read from the real GPU.

The first tests run everywhere (with stand-ins for a device backend's groups); those marked
``needs_cuda`` run wherever CUDA is, with NCCL on one rank (several NCCL ranks cannot share one
GPU) and NVML read-only: nothing here changes a GPU's settings.
"""

from __future__ import annotations

import sys
import threading
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_elaswave.layout import Layout
from megatron_elaswave.patches import distributed_work
from megatron_elaswave.runtime import world
from megatron_elaswave.runtime.communicator import GroupRegistry, Role
from megatron_elaswave.runtime.dvfs import clock_backend
from megatron_elaswave.runtime.snapshot import SnapshotConfig, SnapshotStore

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class DeviceGroupStandIn:
    """Records the backend abort that :func:`world.abort_collectives` asks of a device group."""

    def __init__(self, fails: bool = False) -> None:
        self.aborted = 0
        self.fails = fails

    def abort(self) -> None:
        self.aborted += 1
        if self.fails:
            raise RuntimeError("communicator never formed")


def test_a_failure_aborts_every_device_group_with_its_backends_abort_once():
    kept, broken = DeviceGroupStandIn(), DeviceGroupStandIn(fails=True)
    with world.recording_connections() as device_groups:
        device_groups += [kept, broken]
    world.abort_collectives()
    world.abort_collectives()  # a second failure: those groups are gone already
    assert (kept.aborted, broken.aborted) == (1, 1)


def test_a_device_group_still_forming_when_the_abort_comes_is_aborted_once_formed():
    forming = DeviceGroupStandIn()
    with world.recording_connections() as device_groups:
        world.abort_collectives()  # from the monitor's thread, in the middle of a recovery
        device_groups.append(forming)
        assert forming.aborted == 0
    assert forming.aborted == 1


# --- CUDA: one rank ----------------------------------------------------------------------------


@pytest.fixture
def nccl_rank():
    """A one-rank NCCL default group; the registry's groups on top of it."""
    torch.cuda.set_device(0)
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield store
    distributed_work.abandon_waits_when(None)
    dist.destroy_process_group()


@needs_cuda
@pytest.mark.timeout(120)
def test_on_nccl_host_state_goes_over_gloo_twins_and_the_abort_ends_the_device_groups(nccl_rank):
    layout = Layout.megatron(tp=1, pp=1, dp=1, num_layers=2, num_microbatches=1)
    registry = GroupRegistry(layout, 0, store=nccl_rank, backend="nccl",
                             timeout=timedelta(seconds=30))
    for role in (Role.WORLD, Role.MEMBERS):
        device, host = registry.group(role), registry.host_group(role)
        assert (dist.get_backend(device), dist.get_backend(host)) == ("nccl", "gloo")
        on_host = torch.ones(3)
        dist.all_reduce(on_host, group=host)  # NCCL would refuse a host tensor
        on_device = torch.ones(3, device="cuda")
        dist.all_reduce(on_device, group=device)
        torch.cuda.synchronize()
    # With a failure detected, a wait on an NCCL work goes straight to torch's: it is never
    # abandoned (its future completed when it was enqueued), and blocks no host thread.
    detected = threading.Event()
    detected.set()
    distributed_work.abandon_waits_when(detected)
    dist.all_reduce(torch.ones(4, device="cuda"), group=registry.group(Role.WORLD),
                    async_op=True).wait()
    distributed_work.abandon_waits_when(None)
    world.abort_collectives()
    with pytest.raises(Exception):  # noqa: B017 - torch's error type differs between versions
        dist.all_reduce(torch.ones(1, device="cuda"), group=registry.group(Role.WORLD))
        torch.cuda.synchronize()
    # The gloo twins are not NCCL's to abort: host state still moves until the edit.
    dist.all_reduce(torch.ones(1), group=registry.host_group(Role.WORLD))


@needs_cuda
def test_a_snapshot_from_cuda_waits_for_the_writes_queued_before_it_and_restores_bit_exactly():
    store = SnapshotStore(0, SnapshotConfig(replicas=0))
    live = {name: torch.zeros(1 << 22, device="cuda") for name in ("param", "exp_avg")}
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the optimizer step, still running on the current stream
    for tensor in live.values():
        tensor.add_(1.0)
    pending = store.start_capture(1, live, {"iteration": 1})  # returns before the copies end
    assert pending.snapshot.payload.is_pinned() and pending.sealed is not None
    store.complete(pending)
    for tensor in live.values():
        tensor.add_(1.0)  # the next step writes only after complete()
    tensors, state = store.restore(0, 1)
    assert state == {"iteration": 1}
    for name, tensor in tensors.items():
        assert torch.equal(tensor, torch.ones(1 << 22)), name


class ReadOnlyNvml(types.ModuleType):
    """The real ``pynvml`` for every read; clock changes recorded, never made."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("pynvml")
        self._real = real
        self.locked: list[tuple[int, int]] = []

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def nvmlDeviceSetGpuLockedClocks(self, handle, low: int, high: int) -> None:
        self.locked.append((low, high))

    def nvmlDeviceResetGpuLockedClocks(self, handle) -> None:
        self.locked.append((0, 0))


@needs_cuda
def test_nvml_boosts_of_the_real_gpu_go_up_to_its_maximum_clock_and_say_so_beyond(monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    nvml = ReadOnlyNvml(pynvml)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    clocks = clock_backend("nvml", 0)
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    maximum = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_GRAPHICS)
    nominal = pynvml.nvmlDeviceGetDefaultApplicationsClock(handle, pynvml.NVML_CLOCK_GRAPHICS)
    nvml.locked.clear()
    clocks.set_clock(0.8)
    boost = maximum / nominal
    clocks.set_clock(boost)
    assert nvml.locked == [(round(0.8 * nominal),) * 2, (round(boost * nominal),) * 2]
    with pytest.warns(UserWarning, match="above the GPU's maximum"):
        clocks.set_clock(boost * 1.1)
    assert nvml.locked[-1] == (maximum, maximum)
    clocks.close()
    assert nvml.locked[-1] == (0, 0)
