"""The DVFS governor: applies the planner's per-stage clocks and accounts energy.

After every plan each rank sets the clock the :class:`~megatron_elaswave.planner.frequency.ClockPlan`
gives its stage instance, through one of three backends (``--elastic-dvfs``):

* ``sim`` (the default): sets nothing; the clock is logged and the planner's power model
  accounts energy, so every figure is labelled simulated;
* ``nvml``: locks the GPU's graphics clock with ``nvidia-ml-py``
  (``nvmlDeviceSetGpuLockedClocks``) at ``clock x`` the nominal clock (the default applications
  clock), so that the planner's boosts (``clock > 1``) raise it, up to the maximum clock: a boost
  beyond it is applied as the maximum, with one warning that says so. Resets the clock when the
  job ends; refuses at start-up, with the reason, where the clocks cannot be set (no NVIDIA GPU,
  no ``nvidia-ml-py``, no permission);
* ``npu``: runs ``--elastic-dvfs-command``, a shell command whose ``{device}``, ``{clock}``
  (relative to nominal) and ``{percent}`` are filled in, e.g. an ``npu-smi`` call.

Energy per iteration is the plan's average power times the measured iteration time: the model's
power, the real time.
"""

from __future__ import annotations

import shlex
import subprocess
import warnings
from dataclasses import dataclass
from typing import Protocol

from megatron_elaswave.layout import Layout
from megatron_elaswave.planner.frequency import ClockPlan

BACKENDS = ("sim", "nvml", "npu")


class DvfsError(RuntimeError):
    """Clocks cannot be set the way the job was asked to."""


class ClockBackend(Protocol):
    name: str

    def set_clock(self, clock: float) -> None:
        """Run this rank's device at ``clock`` times its nominal clock."""

    def close(self) -> None:
        """Give the device its default clocks back."""


class SimulatedClocks:
    """Remembers the clock; the device is left alone."""

    name = "sim"

    def __init__(self) -> None:
        self.clock = 1.0

    def set_clock(self, clock: float) -> None:
        self.clock = clock

    def close(self) -> None:
        self.clock = 1.0


class NvmlClocks:
    """Locked graphics clocks through NVML, relative to the nominal (default applications)
    clock."""

    name = "nvml"

    def __init__(self, device_index: int) -> None:
        try:
            import pynvml
        except ImportError:
            raise DvfsError("--elastic-dvfs nvml needs nvidia-ml-py (pip install "
                            "'megatron-elaswave[dvfs]')") from None
        self._nvml = pynvml
        self._warned = False
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self._max_mhz = pynvml.nvmlDeviceGetMaxClockInfo(self._handle, pynvml.NVML_CLOCK_GRAPHICS)
            self._nominal_mhz = pynvml.nvmlDeviceGetDefaultApplicationsClock(
                self._handle, pynvml.NVML_CLOCK_GRAPHICS)
            # Locking to the current maximum changes nothing but proves the permission.
            pynvml.nvmlDeviceSetGpuLockedClocks(self._handle, self._max_mhz, self._max_mhz)
            pynvml.nvmlDeviceResetGpuLockedClocks(self._handle)
        except pynvml.NVMLError as error:
            raise DvfsError(f"--elastic-dvfs nvml cannot set the clocks of GPU {device_index}: "
                            f"{error} (locking clocks needs root or a driver that allows it)") from None

    def set_clock(self, clock: float) -> None:
        mhz = round(self._nominal_mhz * clock)
        if mhz > self._max_mhz:
            if not self._warned:
                warnings.warn(f"--elastic-dvfs nvml: the planned clock {clock:.3f} x nominal "
                              f"({self._nominal_mhz} MHz) is above the GPU's maximum of "
                              f"{self._max_mhz} MHz; running at the maximum instead",
                              stacklevel=2)
                self._warned = True
            mhz = self._max_mhz
        self._nvml.nvmlDeviceSetGpuLockedClocks(self._handle, mhz, mhz)

    def close(self) -> None:
        self._nvml.nvmlDeviceResetGpuLockedClocks(self._handle)


class CommandClocks:
    """A shell command per clock change (Ascend NPUs: ``npu-smi``)."""

    name = "npu"

    def __init__(self, template: str, device_index: int) -> None:
        if not template:
            raise DvfsError("--elastic-dvfs npu needs --elastic-dvfs-command, e.g. "
                            "'npu-smi set -t freq -i {device} -c 0 -d {percent}'")
        self._template, self._device = template, device_index

    def set_clock(self, clock: float) -> None:
        command = self._template.format(device=self._device, clock=f"{clock:g}",
                                        percent=round(100 * clock))
        result = subprocess.run(shlex.split(command), capture_output=True, text=True)
        if result.returncode != 0:
            raise DvfsError(f"--elastic-dvfs-command {command!r} failed with status "
                            f"{result.returncode}: {result.stderr.strip()[-300:]}")

    def close(self) -> None:
        self.set_clock(1.0)


def clock_backend(name: str, device_index: int, command: str | None = None) -> ClockBackend:
    """The backend called ``name`` (one of :data:`BACKENDS`) for this rank's device."""
    if name == "sim":
        return SimulatedClocks()
    if name == "nvml":
        return NvmlClocks(device_index)
    if name == "npu":
        return CommandClocks(command or "", device_index)
    raise ValueError(f"unknown DVFS backend {name!r}; choose from {', '.join(BACKENDS)}")


@dataclass
class DvfsGovernor:
    """Applies clock plans on one rank and accounts the job's energy."""

    backend: ClockBackend
    rank: int
    plan: ClockPlan | None = None

    def apply(self, plan: ClockPlan, layout: Layout) -> float:
        """Set this rank's clock from ``plan`` (a spare idles at nominal); returns it."""
        self.plan = plan
        position = layout.position(self.rank)
        replicas = [replica.index for replica in layout.replicas]  # the plan's order
        clock = 1.0 if position is None else plan.clocks[replicas.index(position[0])][position[1]]
        self.backend.set_clock(clock)
        return clock

    def energy_j(self, step_time_s: float) -> float:
        """The job's energy for one iteration that took ``step_time_s``."""
        return self.plan.average_power_w * step_time_s if self.plan else 0.0
