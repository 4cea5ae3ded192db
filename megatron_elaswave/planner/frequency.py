"""Frequency scheduling: one clock per stage instance, from a time model and a power model.

Time model: a stage's time per micro-batch at relative clock ``f`` (1.0 = nominal) is
``compute_ns / f + fixed_ns + communication_ns``: the compute-bound part scales with the clock,
the memory-bound part and the MoE all-to-alls do not. A replica's pipeline time is the 1F1B model of
:mod:`megatron_elaswave.planner.dataflow`; the job's step time is the slowest replica's plus the
data-parallel synchronisation, which no clock changes.

Power model: a device draws ``static_w`` whenever it is on and ``dynamic_w * f**exponent`` more while
it computes (all of a stage's time but its all-to-alls). Energy per step sums both over all live
devices (spares draw static power).

:func:`plan_clocks` first minimises the step time, then the energy, under a power envelope: the
job's average power may not exceed what it draws with every clock at nominal. Critical stages are
boosted with the power the stages that would otherwise idle give up by slowing down. For a given
step time, each replica's clocks come from a greedy descent (start at the highest level, keep
lowering the stage that saves the most energy per nanosecond of pipeline time it adds); a
bisection over the step time (to 0.05 % of it) then finds the fastest step whose plan stays
within the envelope. It is a heuristic, not an exact optimum; when it cannot beat the nominal
clocks within the envelope, every clock stays nominal.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class PowerModel:
    """Power draw of one device and the clock levels it offers."""

    static_w: float = 100.0
    """Power drawn whenever the device is on, busy or idle, watts."""
    dynamic_w: float = 300.0
    """Additional power while computing at the nominal clock, watts."""
    exponent: float = 3.0
    """Dynamic power grows as ``clock ** exponent`` (voltage rises with the clock)."""
    clock_levels: tuple[float, ...] = (0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15)
    """Selectable clocks relative to nominal, ascending; must include 1.0."""

    def __post_init__(self) -> None:
        if self.static_w < 0 or self.dynamic_w < 0 or self.exponent < 1:
            raise ValueError("static_w and dynamic_w must be >= 0 and exponent >= 1")
        levels = self.clock_levels
        if not levels or list(levels) != sorted(set(levels)) or levels[0] <= 0 or 1.0 not in levels:
            raise ValueError("clock_levels must be ascending, positive, distinct and include 1.0")

    def busy_power_w(self, clock: float) -> float:
        return self.dynamic_w * clock**self.exponent


@dataclass(frozen=True)
class StageLoad:
    """One stage instance's work per micro-batch at the nominal clock."""

    compute_ns: int
    """Part of forward plus backward time that scales with the clock."""
    fixed_ns: int
    """Part that does not, but computes."""
    devices: int
    """Devices in the stage instance (its tensor-parallel size); they share one clock."""
    communication_ns: int = 0
    """Part spent in MoE all-to-alls: it does not scale with the clock and draws static power only."""

    def time_ns(self, clock: float) -> int:
        return round(self.compute_ns / clock) + self.fixed_ns + self.communication_ns

    def busy_ns(self, clock: float) -> int:
        """Of :meth:`time_ns`, the part that draws dynamic power."""
        return self.time_ns(clock) - self.communication_ns


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's stages and micro-batch count."""

    stages: tuple[StageLoad, ...]
    num_microbatches: int
    send_ns: int
    """One pipeline send."""


@dataclass(frozen=True)
class ClockPlan:
    """Clocks per replica and stage, and what the model predicts for them."""

    clocks: tuple[tuple[float, ...], ...]
    step_ns: int
    average_power_w: float
    nominal_step_ns: int
    nominal_average_power_w: float

    @property
    def energy_j(self) -> float:
        return self.average_power_w * self.step_ns / 1e9

    @property
    def nominal_energy_j(self) -> float:
        return self.nominal_average_power_w * self.nominal_step_ns / 1e9


def pipeline_ns(replica: ReplicaLoad, clocks: Sequence[float]) -> int:
    """1F1B pipeline time of a replica at the given clocks."""
    if replica.num_microbatches == 0:
        return 0
    times = [stage.time_ns(f) for stage, f in zip(replica.stages, clocks)]
    return sum(times) + (replica.num_microbatches - 1) * max(times) + 2 * (len(times) - 1) * replica.send_ns


def _energy_j(
    groups: dict[ReplicaLoad, int], clocks: dict, step_ns: int, idle_devices: int, power: PowerModel
) -> float:
    """Energy of one step; ``groups`` maps each distinct replica to how many replicas are like it."""
    step_s = step_ns / 1e9
    energy = idle_devices * power.static_w * step_s
    for replica, multiplicity in groups.items():
        for stage, f in zip(replica.stages, clocks[replica]):
            busy_s = replica.num_microbatches * stage.busy_ns(f) / 1e9
            energy += (
                multiplicity * stage.devices * (power.static_w * step_s + power.busy_power_w(f) * busy_s)
            )
    return energy


def _slowest_clocks(replica: ReplicaLoad, deadline_ns: int, power: PowerModel) -> tuple[float, ...] | None:
    """Low-energy clocks that keep the replica's pipeline within ``deadline_ns``, or ``None`` when
    even the highest clocks miss it. Greedy: start with every stage at the highest level, then
    keep lowering by one level the stage that saves the most energy per nanosecond it adds to the
    pipeline (free savings first), while the deadline holds."""
    levels = power.clock_levels
    if replica.num_microbatches == 0:
        return tuple(levels[0] for _ in replica.stages)
    times = [[stage.time_ns(f) for f in levels] for stage in replica.stages]
    energy = [
        [stage.devices * power.busy_power_w(f) * (t - stage.communication_ns)
         for f, t in zip(levels, stage_times)]
        for stage, stage_times in zip(replica.stages, times)
    ]
    index = [len(levels) - 1] * len(replica.stages)
    now = [t[-1] for t in times]
    repeats, sends = replica.num_microbatches - 1, 2 * (len(now) - 1) * replica.send_ns
    total = sum(now)
    if total + repeats * max(now) + sends > deadline_ns:
        return None
    while True:
        order = sorted(range(len(now)), key=now.__getitem__, reverse=True)
        first, second = now[order[0]], (now[order[1]] if len(order) > 1 else 0)
        current = total + repeats * first + sends
        best, best_key = None, None
        for s, level in enumerate(index):
            if level == 0:
                continue
            slower = times[s][level - 1]
            others = second if s == order[0] else first
            after = total - now[s] + slower + repeats * max(others, slower) + sends
            if after > deadline_ns:
                continue
            key = (after == current, (energy[s][level] - energy[s][level - 1]) / max(after - current, 1))
            if best_key is None or key > best_key:
                best, best_key = s, key
        if best is None:
            return tuple(levels[i] for i in index)
        index[best] -= 1
        total += times[best][index[best]] - now[best]
        now[best] = times[best][index[best]]


def plan_clocks(
    replicas: Sequence[ReplicaLoad], *, sync_ns: int, idle_devices: int, power: PowerModel
) -> ClockPlan:
    """The clock plan described in the module docstring. Identical replicas are solved once."""
    groups = Counter(replicas)

    def step_of(clocks: dict) -> int:
        return max(pipeline_ns(r, clocks[r]) for r in groups) + sync_ns

    def average_w(clocks: dict, step: int) -> float:
        return _energy_j(groups, clocks, step, idle_devices, power) / (step / 1e9)

    nominal = {r: tuple(1.0 for _ in r.stages) for r in groups}
    nominal_step = step_of(nominal)
    budget_w = average_w(nominal, nominal_step)

    def plan_for(deadline_ns: int) -> dict | None:
        clocks = {r: _slowest_clocks(r, deadline_ns - sync_ns, power) for r in groups}
        return None if any(c is None for c in clocks.values()) else clocks

    def within_envelope(deadline_ns: int) -> bool:
        clocks = plan_for(deadline_ns)
        return clocks is not None and average_w(clocks, step_of(clocks)) <= budget_w * (1 + 1e-12)

    fastest = step_of({r: tuple(power.clock_levels[-1] for _ in r.stages) for r in groups})
    best = nominal
    if within_envelope(nominal_step):  # else the greedy cannot beat nominal clocks: keep them
        low, high = fastest, nominal_step
        resolution = max(1, nominal_step // 2000)  # bisect to 0.05 % of the step time
        while high - low > resolution:
            middle = (low + high) // 2
            if within_envelope(middle):
                high = middle
            else:
                low = middle
        best = plan_for(high)
    step = step_of(best)
    return ClockPlan(
        clocks=tuple(best[r] for r in replicas),
        step_ns=step,
        average_power_w=average_w(best, step),
        nominal_step_ns=nominal_step,
        nominal_average_power_w=budget_w,
    )


def stage_load(forward_ns: int, backward_ns: int, devices: int, compute_bound_fraction: float,
               all_to_all_ns: int = 0) -> StageLoad:
    """Split a stage's time, ``all_to_all_ns`` of which is MoE all-to-alls (forward and backward
    together), into its clock-scaled, fixed and communication parts."""
    work = forward_ns + backward_ns - all_to_all_ns
    compute = math.floor(work * compute_bound_fraction)
    return StageLoad(compute_ns=compute, fixed_ns=work - compute, devices=devices,
                     communication_ns=all_to_all_ns)
