"""Per-layer costs of one job, as integers (nanoseconds and bytes).

The planner takes every decision on these integers, so two processes that read the same profile
compute bit-identical plans: no decision depends on floating-point summation order.

Memory of one stage instance, per rank (ZeRO-1 with interleaved ownership, 1F1B):

    parameters + gradients + optimizer share + activations * micro-batches in flight

where the optimizer share of a layer is ``ceil(K / n) / K`` of its optimizer state (``K`` chunks
per layer, ``n`` live replicas; the bound interleaved ownership guarantees), and stage ``s`` of a
``P``-stage pipeline holds ``P - s`` micro-batches in flight. The embedding is charged to the
first stage and the output layer with the loss to the last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.planner.profile import OpCost, Profile, ProfileError

NS = 1e9


@dataclass(frozen=True)
class MemoryModel:
    """How parameters turn into memory, beyond what the profile measured."""

    grad_bytes_per_param: int = 4
    """Gradient buffer bytes per parameter (Megatron keeps fp32 main gradients by default)."""
    optimizer_bytes_per_param: int = 12
    """Optimizer state bytes per parameter before sharding (fp32 master weights and two Adam moments)."""
    reserved_bytes: int = 0
    """Bytes per device kept free for workspace and fragmentation."""
    memory_cap_bytes: int | None = None
    """Usable bytes per device; ``None`` takes the profile's ``device_memory_bytes``."""

    def __post_init__(self) -> None:
        for name in ("grad_bytes_per_param", "optimizer_bytes_per_param", "reserved_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative")
        if self.memory_cap_bytes is not None and self.memory_cap_bytes <= 0:
            raise ValueError("memory_cap_bytes must be positive")


@dataclass(frozen=True)
class PartCost:
    """Integer costs of one part (a layer, the embedding or the loss) for one micro-batch."""

    forward_ns: int
    backward_ns: int
    param_bytes: int
    param_count: int
    activation_bytes: int


class CostModel:
    """The profile of a job, scaled to the job's tensor-parallel and micro-batch sizes."""

    def __init__(self, profile: Profile, job: JobSpec, memory: MemoryModel = MemoryModel()):
        if profile.num_layers != job.num_layers:
            raise ProfileError(
                f"the profile describes {profile.num_layers} layers but the job has {job.num_layers}"
            )
        self.profile = profile
        self.job = job
        self.memory = memory
        measured = profile.config
        time_scale = (
            job.micro_batch_size
            * measured.tensor_model_parallel_size
            / (measured.micro_batch_size * job.tensor_parallel_size)
        )
        param_scale = measured.tensor_model_parallel_size / job.tensor_parallel_size

        def scaled(op: OpCost) -> PartCost:
            param_bytes = round(op.param_bytes * param_scale)
            return PartCost(
                forward_ns=round(op.forward_s * NS * time_scale),
                backward_ns=round(op.backward_s * NS * time_scale),
                param_bytes=param_bytes,
                param_count=param_bytes // measured.params_dtype_bytes,
                activation_bytes=round(op.activation_bytes * time_scale),
            )

        layers = [scaled(op) for op in profile.layers]
        self.embedding = scaled(profile.embedding)
        self.loss = scaled(profile.loss)
        self.forward_ns = np.array([p.forward_ns for p in layers], dtype=np.int64)
        self.backward_ns = np.array([p.backward_ns for p in layers], dtype=np.int64)
        self.param_bytes = np.array([p.param_bytes for p in layers], dtype=np.int64)
        self.param_count = np.array([p.param_count for p in layers], dtype=np.int64)
        self.activation_bytes = np.array([p.activation_bytes for p in layers], dtype=np.int64)
        self.layer_time_ns = self.forward_ns + self.backward_ns
        self.tokens_per_microbatch = job.micro_batch_size * measured.seq_length
        self.p2p_latency_ns = round(profile.p2p_latency_s * NS)
        message_bytes = profile.pipeline_message * time_scale
        self.send_ns = self.p2p_latency_ns + round(message_bytes / profile.p2p_bandwidth * NS)
        self.dp_bandwidth = profile.dp_bandwidth_bytes_per_s
        cap = memory.memory_cap_bytes if memory.memory_cap_bytes is not None else profile.device_memory_bytes
        self.memory_cap_bytes: int | None = None if cap is None else cap - memory.reserved_bytes
        self.compute_bound_fraction = profile.compute_bound_fraction

    # ---- time -------------------------------------------------------------------------------

    def stage_forward_backward_ns(
        self, first: int, last: int, *, is_first: bool, is_last: bool
    ) -> tuple[int, int]:
        """Forward and backward time of one micro-batch on a stage holding layers ``first..last``."""
        forward = int(self.forward_ns[first : last + 1].sum())
        backward = int(self.backward_ns[first : last + 1].sum())
        if is_first:
            forward += self.embedding.forward_ns
            backward += self.embedding.backward_ns
        if is_last:
            forward += self.loss.forward_ns
            backward += self.loss.backward_ns
        return forward, backward

    def stage_sync_ns(
        self, first: int, last: int, *, is_first: bool, is_last: bool, num_replicas: int
    ) -> int:
        """Data-parallel synchronisation of one stage instance per step: a ring reduce-scatter of
        its gradients and a ring all-gather of its parameters over the ``num_replicas`` holders."""
        if num_replicas <= 1:
            return 0
        count = int(self.param_count[first : last + 1].sum())
        params = int(self.param_bytes[first : last + 1].sum())
        for part, holds in ((self.embedding, is_first), (self.loss, is_last)):
            if holds:
                count += part.param_count
                params += part.param_bytes
        volume = count * self.memory.grad_bytes_per_param + params
        hops = num_replicas - 1
        return hops * 2 * self.p2p_latency_ns + round(hops * volume / (num_replicas * self.dp_bandwidth) * NS)

    # ---- memory -----------------------------------------------------------------------------

    def optimizer_share(self, num_replicas: int) -> tuple[int, int]:
        """``(numerator, denominator)`` of the optimizer-state fraction one holder of a layer owns."""
        chunks = self.job.zero_chunks_per_layer
        return math.ceil(chunks / num_replicas), chunks

    def _static_bytes(self, param_bytes, param_count, num_replicas: int):
        owned, chunks = self.optimizer_share(num_replicas)
        grads = param_count * self.memory.grad_bytes_per_param
        optimizer = param_count * self.memory.optimizer_bytes_per_param * owned // chunks
        return param_bytes + grads + optimizer

    def layer_static_bytes(self, num_replicas: int) -> np.ndarray:
        """Per layer: parameters, gradients and the optimizer share of one holder."""
        return self._static_bytes(self.param_bytes, self.param_count, num_replicas)

    def stage_extra_bytes(self, stage: int, num_stages: int, num_replicas: int) -> int:
        """Embedding (first stage) and loss (last stage) memory, with their in-flight activations."""
        extra = 0
        if stage == 0:
            e = self.embedding
            extra += self._static_bytes(e.param_bytes, e.param_count, num_replicas)
            extra += e.activation_bytes * num_stages
        if stage == num_stages - 1:
            s = self.loss
            extra += self._static_bytes(s.param_bytes, s.param_count, num_replicas) + s.activation_bytes
        return int(extra)

    def stage_memory_bytes(
        self, first: int, last: int, stage: int, num_stages: int, num_replicas: int
    ) -> int:
        """Peak memory of one rank of stage ``stage`` (of ``num_stages``) holding ``first..last``."""
        layers = slice(first, last + 1)
        in_flight = num_stages - stage
        return int(
            self.layer_static_bytes(num_replicas)[layers].sum()
            + in_flight * self.activation_bytes[layers].sum()
            + self.stage_extra_bytes(stage, num_stages, num_replicas)
        )

    def fits(self, memory_bytes: int) -> bool:
        return self.memory_cap_bytes is None or memory_bytes <= self.memory_cap_bytes
