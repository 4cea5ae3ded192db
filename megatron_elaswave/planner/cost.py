"""Per-layer costs of one job, as integers (nanoseconds and bytes).

The planner takes every decision on these integers, so two processes that read the same profile
compute bit-identical plans: no decision depends on floating-point summation order.

Memory of one stage instance, per rank (ZeRO-1 with interleaved ownership, 1F1B):

    parameters + gradients + optimizer share + activations * micro-batches in flight

where the optimizer share of a layer is ``ceil(K / n) / K`` of its optimizer state (``K`` chunks
per layer, ``n`` live replicas; the bound interleaved ownership guarantees), and stage ``s`` of a
``P``-stage pipeline holds ``P - s`` micro-batches in flight. The embedding is charged to the
first stage and the output layer with the loss to the last.

Mixture of experts. An MoE layer's routed experts on a rank (``E / EP`` experts, each cut over
``ETP`` ranks) are part of its parameters and gradients, but their optimizer state is sharded
over the expert data-parallel ranks, ``TP * n / (EP * ETP)`` of them (the number of live lockstep
sets where expert parallelism spans replicas): a holder keeps ``ceil(count / that)`` elements of
it. A layer that moves carries its experts' parameters and this share to the rank at the same
expert coordinates. Each forward and each backward of an MoE layer adds its all-to-alls,
dispatch and combine, each ``latency + bytes * (EP - 1) / EP / expert bandwidth``, none when
``EP`` is 1; they are part of the layer's time, and :attr:`CostModel.all_to_all_ns` says how
much (the clock does not speed them up). The experts' gradients are reduced over the expert
data-parallel ranks after the dense ones.
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
    """Forward time, the all-to-alls of an MoE layer included."""
    backward_ns: int
    """Backward time, the all-to-alls of an MoE layer included."""
    param_bytes: int
    """Parameters on one rank, routed experts included."""
    param_count: int
    activation_bytes: int
    expert_param_bytes: int = 0
    """Of ``param_bytes``: the routed experts' (0 for a dense part)."""
    expert_param_count: int = 0
    all_to_all_ns: int = 0
    """Of ``forward_ns``, and as much of ``backward_ns``: the MoE all-to-alls (dispatch, combine)."""


def check_experts(profile: Profile, job: JobSpec) -> None:
    """Raise :class:`ProfileError` unless the profile has MoE layers exactly when the job has
    experts, and as many experts."""
    if job.experts is None:
        if profile.is_moe:
            raise ProfileError("the profile has MoE layers but the job has no experts (--num-experts)")
    elif not profile.is_moe:
        raise ProfileError(f"the job has {job.experts.num_experts} experts but the profile has no "
                           "MoE layer")
    elif profile.config.num_experts != job.experts.num_experts:
        raise ProfileError(f"the profile's MoE layers have {profile.config.num_experts} experts but "
                           f"the job has {job.experts.num_experts}")


class CostModel:
    """The profile of a job, scaled to the job's tensor-parallel and micro-batch sizes."""

    def __init__(self, profile: Profile, job: JobSpec, memory: MemoryModel = MemoryModel()):
        if profile.num_layers != job.num_layers:
            raise ProfileError(
                f"the profile describes {profile.num_layers} layers but the job has {job.num_layers}"
            )
        check_experts(profile, job)
        self.profile = profile
        self.job = job
        self.memory = memory
        self.p2p_latency_ns = round(profile.p2p_latency_s * NS)
        measured = profile.config
        time_scale = (
            job.micro_batch_size
            * measured.tensor_model_parallel_size
            / (measured.micro_batch_size * job.tensor_parallel_size)
        )
        layers = [self._scaled(op, time_scale) for op in profile.layers]
        self.embedding = self._scaled(profile.embedding, time_scale)
        self.loss = self._scaled(profile.loss, time_scale)

        def per_layer(name: str) -> np.ndarray:
            return np.array([getattr(p, name) for p in layers], dtype=np.int64)

        self.forward_ns = per_layer("forward_ns")
        self.backward_ns = per_layer("backward_ns")
        self.param_bytes = per_layer("param_bytes")
        self.param_count = per_layer("param_count")
        self.activation_bytes = per_layer("activation_bytes")
        self.expert_param_bytes = per_layer("expert_param_bytes")
        self.expert_param_count = per_layer("expert_param_count")
        self.all_to_all_ns = per_layer("all_to_all_ns")
        self.layer_time_ns = self.forward_ns + self.backward_ns
        self.tokens_per_microbatch = job.micro_batch_size * measured.seq_length
        message_bytes = profile.pipeline_message * time_scale
        self.send_ns = self.p2p_latency_ns + round(message_bytes / profile.p2p_bandwidth * NS)
        self.dp_bandwidth = profile.dp_bandwidth_bytes_per_s
        cap = memory.memory_cap_bytes if memory.memory_cap_bytes is not None else profile.device_memory_bytes
        self.memory_cap_bytes: int | None = None if cap is None else cap - memory.reserved_bytes
        self.compute_bound_fraction = profile.compute_bound_fraction

    def _scaled(self, op: OpCost, time_scale: float) -> PartCost:
        """``op`` at the job's micro-batch, tensor-parallel and expert-parallel sizes, in integer
        nanoseconds and bytes, its all-to-alls added to its times."""
        measured, experts = self.profile.config, self.job.experts
        expert_scale = 1.0 if experts is None else measured.expert_span / experts.span
        expert_bytes = round(op.expert_param_bytes * expert_scale)
        dense_bytes = round((op.param_bytes - op.expert_param_bytes)
                            * measured.tensor_model_parallel_size / self.job.tensor_parallel_size)
        all_to_all = 0 if op.moe is None else self._all_to_all_ns(op.moe.all_to_all_bytes * time_scale)
        dtype_bytes = measured.params_dtype_bytes
        return PartCost(
            forward_ns=round(op.forward_s * NS * time_scale) + all_to_all,
            backward_ns=round(op.backward_s * NS * time_scale) + all_to_all,
            param_bytes=dense_bytes + expert_bytes,
            param_count=(dense_bytes + expert_bytes) // dtype_bytes,
            activation_bytes=round(op.activation_bytes * time_scale),
            expert_param_bytes=expert_bytes,
            expert_param_count=expert_bytes // dtype_bytes,
            all_to_all_ns=all_to_all,
        )

    def _all_to_all_ns(self, dispatch_bytes: float) -> int:
        """Dispatch plus combine of one micro-batch whose dispatch sends ``dispatch_bytes`` from a
        rank: each keeps ``1 / EP`` of them local and sends the rest over the expert link."""
        ep = self.job.experts.expert_parallel_size
        if ep == 1:
            return 0
        sent = dispatch_bytes * (ep - 1) / ep
        return 2 * (self.p2p_latency_ns + round(sent / self.profile.expert_bandwidth * NS))

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

    def stage_all_to_all_ns(self, first: int, last: int) -> int:
        """Of one micro-batch's forward (and as much of its backward) on a stage holding layers
        ``first..last``: the time spent in MoE all-to-alls."""
        return int(self.all_to_all_ns[first : last + 1].sum())

    def stage_sync_ns(
        self, first: int, last: int, *, is_first: bool, is_last: bool, num_replicas: int
    ) -> int:
        """Data-parallel synchronisation of one stage instance per step: a ring reduce-scatter of
        its gradients and a ring all-gather of its parameters over the ``num_replicas`` holders,
        then the same for its experts over the expert data-parallel ranks."""
        layers = slice(first, last + 1)
        expert_count = int(self.expert_param_count[layers].sum())
        count = int(self.param_count[layers].sum()) - expert_count
        params = int(self.param_bytes[layers].sum()) - int(self.expert_param_bytes[layers].sum())
        for part, holds in ((self.embedding, is_first), (self.loss, is_last)):
            if holds:
                count += part.param_count
                params += part.param_bytes
        grad = self.memory.grad_bytes_per_param
        expert_volume = expert_count * grad + int(self.expert_param_bytes[layers].sum())
        return (self._ring_ns(count * grad + params, num_replicas)
                + self._ring_ns(expert_volume, self.expert_data_parallel_size(num_replicas)))

    def _ring_ns(self, volume: int, holders: int) -> int:
        """A ring reduce-scatter plus all-gather moving ``volume`` bytes per holder."""
        if holders <= 1 or volume == 0:
            return 0
        hops = holders - 1
        return hops * 2 * self.p2p_latency_ns + round(hops * volume / (holders * self.dp_bandwidth) * NS)

    # ---- memory -----------------------------------------------------------------------------

    def optimizer_share(self, num_replicas: int) -> tuple[int, int]:
        """``(numerator, denominator)`` of the optimizer-state fraction one holder of a layer owns."""
        chunks = self.job.zero_chunks_per_layer
        return math.ceil(chunks / num_replicas), chunks

    def expert_data_parallel_size(self, num_replicas: int) -> int:
        """Ranks holding the same expert shards when ``num_replicas`` replicas (whole lockstep
        sets) run: ``TP * n / (EP * ETP)``, the number of lockstep sets where expert parallelism
        spans replicas; ``n`` for a dense model, which has no expert state."""
        span = self.job.tensor_parallel_size if self.job.experts is None else self.job.experts.span
        return self.job.tensor_parallel_size * num_replicas // span

    def _optimizer_bytes(self, param_count, expert_count, num_replicas: int):
        """One holder's optimizer share: ``ceil(K / n) / K`` of the dense state, ``ceil(count /
        expert data-parallel size)`` elements of the experts'."""
        owned, chunks = self.optimizer_share(num_replicas)
        per_param = self.memory.optimizer_bytes_per_param
        expert_holders = self.expert_data_parallel_size(num_replicas)
        return ((param_count - expert_count) * per_param * owned // chunks
                + -(-expert_count // expert_holders) * per_param)

    def _static_bytes(self, param_bytes, param_count, expert_count, num_replicas: int):
        grads = param_count * self.memory.grad_bytes_per_param
        return param_bytes + grads + self._optimizer_bytes(param_count, expert_count, num_replicas)

    def layer_static_bytes(self, num_replicas: int) -> np.ndarray:
        """Per layer: parameters, gradients and the optimizer share of one holder."""
        return self._static_bytes(self.param_bytes, self.param_count, self.expert_param_count,
                                  num_replicas)

    def layer_move_bytes(self, num_replicas: int) -> np.ndarray:
        """Per layer: what it carries to a stage instance that did not hold it, on each rank:
        its parameters (experts included, to the rank at the same expert coordinates) and the
        holder's optimizer share."""
        return self.param_bytes + self._optimizer_bytes(self.param_count, self.expert_param_count,
                                                        num_replicas)

    def stage_extra_bytes(self, stage: int, num_stages: int, num_replicas: int) -> int:
        """Embedding (first stage) and loss (last stage) memory, with their in-flight activations."""
        extra = 0
        if stage == 0:
            e = self.embedding
            extra += self._static_bytes(e.param_bytes, e.param_count, 0, num_replicas)
            extra += e.activation_bytes * num_stages
        if stage == num_stages - 1:
            s = self.loss
            extra += self._static_bytes(s.param_bytes, s.param_count, 0, num_replicas) + s.activation_bytes
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
