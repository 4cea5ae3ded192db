"""The DVFS governor and its clock backends."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from megatron_elaswave.layout import Layout
from megatron_elaswave.planner.frequency import ClockPlan
from megatron_elaswave.runtime.dvfs import (
    CommandClocks,
    DvfsError,
    DvfsGovernor,
    SimulatedClocks,
    clock_backend,
)


def plan(clocks) -> ClockPlan:
    return ClockPlan(clocks=clocks, step_ns=2_000_000_000, average_power_w=500.0,
                     nominal_step_ns=2_000_000_000, nominal_average_power_w=600.0)


def test_each_rank_runs_its_stage_clock_and_spares_run_nominal():
    layout = Layout.megatron(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=4)
    clocks = ((0.9, 1.1), (0.8, 1.0))
    # Replica 1, stage 1 is ranks 6 and 7 (Megatron order); replica 0, stage 0 ranks 0 and 1.
    for rank, expected in ((7, 1.0), (6, 1.0), (1, 0.9), (3, 0.8), (4, 1.1)):
        governor = DvfsGovernor(SimulatedClocks(), rank)
        assert governor.apply(plan(clocks), layout) == expected
        assert governor.backend.clock == expected
    spare = Layout(layout.num_layers, layout.replicas[1:], spares=(0, 1, 4, 5))
    governor = DvfsGovernor(SimulatedClocks(), 0)
    # Only replica 1 is left: the plan has one row, the spare idles at nominal.
    assert governor.apply(plan(((0.8, 1.0),)), spare) == 1.0
    assert DvfsGovernor(SimulatedClocks(), 6).apply(plan(((0.8, 1.05),)), spare) == 1.05


def test_energy_is_the_plans_power_over_the_measured_time():
    governor = DvfsGovernor(SimulatedClocks(), 0)
    assert governor.energy_j(1.5) == 0.0  # no plan yet
    governor.apply(plan(((1.0,),)), Layout.megatron(tp=1, pp=1, dp=1, num_layers=2,
                                                    num_microbatches=1))
    assert governor.energy_j(1.5) == pytest.approx(750.0)


def test_the_command_backend_fills_in_device_and_clock(tmp_path):
    out = tmp_path / "clock.txt"
    script = f"{sys.executable} -c \"open('{out}', 'a').write('{{device}} {{clock}} {{percent}};')\""
    backend = CommandClocks(script, device_index=3)
    backend.set_clock(0.85)
    backend.close()
    assert out.read_text() == "3 0.85 85;3 1 100;"


def test_a_failing_command_and_a_missing_one_are_clear_errors():
    with pytest.raises(DvfsError, match="needs --elastic-dvfs-command"):
        clock_backend("npu", 0)
    with pytest.raises(DvfsError, match="failed with status 3"):
        CommandClocks(f"{sys.executable} -c 'raise SystemExit(3)'", 0).set_clock(0.9)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on a GPU machine this would set the clocks where permitted")
def test_nvml_refuses_clearly_where_clocks_cannot_be_set():
    # No NVIDIA GPU here (or no nvidia-ml-py): refused at start-up, with the reason.
    with pytest.raises(DvfsError, match="--elastic-dvfs nvml"):
        clock_backend("nvml", 0)


class FakeNvml(types.ModuleType):
    """Stands in for ``pynvml`` (no GPU here): records the calls the backend makes of the NVML
    API, and refuses clock locking like a driver without the permission when told to."""

    NVML_CLOCK_GRAPHICS = 0

    class NVMLError(Exception):
        pass

    def __init__(self, max_mhz: int, permitted: bool, nominal_mhz: int = 1755) -> None:
        super().__init__("pynvml")
        self.max_mhz, self.nominal_mhz = max_mhz, nominal_mhz
        self.permitted, self.calls = permitted, []

    def nvmlInit(self) -> None:
        self.calls.append(("init",))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"gpu{index}"

    def nvmlDeviceGetMaxClockInfo(self, handle: str, clock_type: int) -> int:
        assert clock_type == self.NVML_CLOCK_GRAPHICS
        return self.max_mhz

    def nvmlDeviceGetDefaultApplicationsClock(self, handle: str, clock_type: int) -> int:
        assert clock_type == self.NVML_CLOCK_GRAPHICS
        return self.nominal_mhz

    def nvmlDeviceSetGpuLockedClocks(self, handle: str, low: int, high: int) -> None:
        if not self.permitted:
            raise self.NVMLError("Insufficient Permissions")
        self.calls.append(("lock", handle, low, high))

    def nvmlDeviceResetGpuLockedClocks(self, handle: str) -> None:
        self.calls.append(("reset", handle))


def test_nvml_locks_the_graphics_clock_to_the_planned_multiple_of_nominal(monkeypatch):
    nvml = FakeNvml(max_mhz=1980, nominal_mhz=1755, permitted=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    clocks = clock_backend("nvml", 3)
    assert nvml.calls == [("init",), ("lock", "gpu3", 1980, 1980), ("reset", "gpu3")]
    clocks.set_clock(0.8)
    clocks.set_clock(1.1)  # a boost, applied
    with pytest.warns(UserWarning, match=r"1.200 x nominal \(1755 MHz\) is above the GPU's "
                                         r"maximum of 1980 MHz"):
        clocks.set_clock(1.2)
    clocks.close()
    assert nvml.calls[3:] == [("lock", "gpu3", 1404, 1404), ("lock", "gpu3", 1931, 1931),
                              ("lock", "gpu3", 1980, 1980), ("reset", "gpu3")]


def test_nvml_without_the_permission_is_refused_at_start_up(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(max_mhz=1980, permitted=False))
    with pytest.raises(DvfsError, match="cannot set the clocks of GPU 0: Insufficient Permissions"):
        clock_backend("nvml", 0)
