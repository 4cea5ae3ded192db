"""Predicted step time, bubble fraction, throughput and energy of a whole job.

A job is a set of replicas, each a pipeline simulated by :mod:`megatron_elaswave.simulator.pipeline`.
Replicas of a mixture-of-experts job that share expert-parallel groups run in lockstep: their
all-to-alls pair the same micro-batches of the same layers, so they run as one unit, one pipeline
for all of them (:attr:`ReplicaWork.lockstep`). An MoE stage's times include its all-to-alls
(:attr:`ReplicaWork.all_to_all_s`). The step ends when the slowest replica's pipeline has drained
and the data-parallel gradient and parameter synchronisation that follows it (not overlapped with
compute) is done. Energy uses the power model of :mod:`megatron_elaswave.planner.frequency`:
static power for every live device over the whole step, dynamic power at each stage's clock while
it computes (not while it waits in an all-to-all).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from megatron_elaswave.planner.frequency import PowerModel
from megatron_elaswave.simulator.pipeline import PipelineResult, simulate_pipeline


@dataclass(frozen=True)
class ReplicaWork:
    """One replica for one step, at the clocks it runs at."""

    forward_s: tuple[float, ...]
    """Per stage: forward time of one micro-batch."""
    backward_s: tuple[float, ...]
    """Per stage: backward time of one micro-batch."""
    devices: tuple[int, ...]
    """Per stage: devices computing it (0 for a stage whose work runs elsewhere)."""
    clocks: tuple[float, ...]
    """Per stage: relative clock, for the power model."""
    num_microbatches: int
    send_s: float
    """One pipeline send."""
    sync_s: float
    """Data-parallel synchronisation after the pipeline drains."""
    num_chunks: int = 1
    """Model chunks per stage: the interleaved schedule with more than one."""
    all_to_all_s: tuple[float, ...] = ()
    """Per stage: of ``forward_s``, and as much of ``backward_s``, the time spent in MoE
    all-to-alls, which draws no dynamic power; empty for a stage without (a dense model)."""
    lockstep: int = 1
    """Replicas this work stands for, run in lockstep as one unit: each has these stages, devices,
    clocks and micro-batches."""

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        if not n or any(len(v) != n for v in (self.backward_s, self.devices, self.clocks)):
            raise ValueError("every per-stage tuple needs one entry per stage")
        if (self.all_to_all_s and len(self.all_to_all_s) != n) or self.lockstep < 1:
            raise ValueError("all_to_all_s needs one entry per stage (or none), lockstep >= 1")

    def compute_s(self, stage: int, busy_s: float) -> float:
        """Of ``busy_s``, the time stage ``stage`` spent in this step computing, all-to-alls
        excluded."""
        waiting = 2 * self.num_microbatches * self.all_to_all_s[stage] if self.all_to_all_s else 0.0
        return busy_s - waiting


@dataclass(frozen=True)
class StepPrediction:
    """What the simulator predicts for one optimizer step."""

    step_time_s: float
    bubble_fraction: float
    """Share of the working devices' step time spent neither computing nor in an all-to-all."""
    tokens_per_s: float
    energy_j: float
    """Energy of one step, all live devices."""
    samples_per_step: int

    def to_json(self) -> dict:
        return {
            "tokens_per_s": self.tokens_per_s,
            "step_time_s": self.step_time_s,
            "energy_j": self.energy_j,
            "bubble_fraction": self.bubble_fraction,
            "samples_per_step": self.samples_per_step,
        }


@lru_cache(maxsize=4096)
def _pipeline(forward_s, backward_s, num_microbatches, send_s, num_chunks) -> PipelineResult:
    return simulate_pipeline(forward_s, backward_s, num_microbatches, send_s=send_s, num_chunks=num_chunks)


def predict_step(
    replicas: Sequence[ReplicaWork],
    *,
    micro_batch_size: int,
    tokens_per_microbatch: int,
    idle_devices: int,
    power: PowerModel,
) -> StepPrediction:
    """Simulate every distinct replica (or lockstep unit) once and combine them (module
    docstring)."""
    if not replicas:
        raise ValueError("a job needs at least one replica")
    results = [
        _pipeline(r.forward_s, r.backward_s, r.num_microbatches, r.send_s, r.num_chunks)
        for r in replicas
    ]
    step = max(res.makespan_s for res in results) + max(r.sync_s for r in replicas)
    energy = idle_devices * power.static_w * step
    busy_device_s = working_device_s = 0.0
    for replica, result in zip(replicas, results):
        for s, (devices, clock, busy) in enumerate(zip(replica.devices, replica.clocks, result.busy_s)):
            devices *= replica.lockstep
            energy += devices * (power.static_w * step
                                 + power.busy_power_w(clock) * replica.compute_s(s, busy))
            busy_device_s += devices * busy
            working_device_s += devices * step
    microbatches = sum(r.num_microbatches * r.lockstep for r in replicas)
    return StepPrediction(
        step_time_s=step,
        bubble_fraction=1.0 - busy_device_s / working_device_s if working_device_s else 0.0,
        tokens_per_s=microbatches * tokens_per_microbatch / step if step else 0.0,
        energy_j=energy,
        samples_per_step=microbatches * micro_batch_size,
    )
