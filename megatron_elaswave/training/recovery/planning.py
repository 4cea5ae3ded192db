"""Which layout an elastic job runs next: the failure-free one, one without the failed ranks,
or one that takes replacements back, priced by the planner's cost model."""

from __future__ import annotations

import argparse

from megatron_elaswave.device import DeviceBackend
from megatron_elaswave.layout import ExpertParallelism, Layout, stage_totals
from megatron_elaswave.planner.cost import CostModel, MemoryModel
from megatron_elaswave.planner.frequency import ClockPlan, PowerModel
from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.planner.profile import (
    SyntheticDevice,
    SyntheticModel,
    SyntheticMoE,
    load_profile,
    synthetic_profile,
)
from megatron_elaswave.planner.replan import (
    PlanError,
    PlanOptions,
    nominal_clock_plan,
    plan_recovery,
    plan_replica_drop,
)

from ..arguments import pipeline_chunk_layers
from ..step.snapshots import ranks_per_node

CPU_DEVICE = SyntheticDevice(name="CPU core (gloo)", peak_tflops=0.02, model_flops_utilisation=0.5,
                             memory_bytes=16 * 2**30, bandwidth_bytes_per_s=1e9, p2p_latency_s=1e-4)
"""What a CPU rank with one thread roughly does, for plans made without a measured profile."""


def expert_parallelism(args: argparse.Namespace) -> ExpertParallelism | None:
    """How ``--num-experts``, ``--expert-model-parallel-size`` and
    ``--expert-tensor-parallel-size`` (default: the tensor-parallel size, as in Megatron) shard
    the experts; ``None`` for a dense model."""
    if not getattr(args, "num_experts", None):
        return None
    return ExpertParallelism(
        num_experts=args.num_experts,
        expert_parallel_size=getattr(args, "expert_model_parallel_size", 1) or 1,
        expert_tensor_parallel_size=(getattr(args, "expert_tensor_parallel_size", None)
                                     or args.tensor_model_parallel_size))


def failure_free_layout(args: argparse.Namespace, global_batch_size: int | None = None) -> Layout:
    """The layout Megatron builds for the job's flags, dealing ``global_batch_size`` samples
    (default ``--global-batch-size``; a ramp-up's first size), its pipeline split as the flags
    give it (:func:`pipeline_chunk_layers`)."""
    return Layout.megatron(tp=args.tensor_model_parallel_size,
                           pp=args.pipeline_model_parallel_size, dp=args.data_parallel_size,
                           num_layers=args.num_layers,
                           num_microbatches=(global_batch_size or args.global_batch_size)
                           // args.micro_batch_size,
                           virtual_stages=args.virtual_pipeline_model_parallel_size or 1,
                           experts=expert_parallelism(args),
                           chunk_layers=pipeline_chunk_layers(args))


def _stage_layers(args: argparse.Namespace) -> tuple[int, ...] | None:
    """Transformer layers of each pipeline stage where the flags split them unevenly."""
    chunk_layers = pipeline_chunk_layers(args)
    return None if chunk_layers is None else stage_totals(chunk_layers,
                                                          args.pipeline_model_parallel_size)


def cost_model(args: argparse.Namespace, vocab_size: int, backend: DeviceBackend) -> CostModel:
    """The planner's costs: a measured profile (``--elastic-profile``) or one from FLOP counts
    on a nominal device of the backend's kind; for an MoE model (``--num-experts``) with its
    experts, as the layout shards them, and the ``--moe-*`` shape of its MoE layers."""
    experts = expert_parallelism(args)
    job = JobSpec(
        tensor_parallel_size=args.tensor_model_parallel_size,
        pipeline_parallel_size=args.pipeline_model_parallel_size,
        data_parallel_size=args.data_parallel_size,
        num_layers=args.num_layers,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        ranks_per_node=ranks_per_node(),
        experts=experts,
        stage_layers=_stage_layers(args),
    )
    if args.elastic_profile:
        profile = load_profile(args.elastic_profile)
    else:
        moe = None if experts is None else SyntheticMoE(
            experts, ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
            router_topk=args.moe_router_topk,
            layer_freq=args.moe_layer_freq if isinstance(args.moe_layer_freq, int)
            else tuple(args.moe_layer_freq))
        profile = synthetic_profile(
            SyntheticModel(num_layers=args.num_layers, hidden_size=args.hidden_size,
                           ffn_hidden_size=args.ffn_hidden_size, vocab_size=vocab_size,
                           seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                           tensor_model_parallel_size=args.tensor_model_parallel_size, moe=moe),
            CPU_DEVICE if backend.name == "cpu" else SyntheticDevice())
    return CostModel(profile, job, MemoryModel())


def plan_without(base: Layout, failed: set[int], cost: CostModel,
                 policy: str) -> tuple[Layout, ClockPlan]:
    """The layout (and clocks) that continues ``base`` without ``failed`` under ``policy``
    (``--elastic-policy``). Raises :class:`~megatron_elaswave.planner.replan.PlanError` when no
    layout of the rest holds the model. Whether their state survives is for the restore to
    find, from the snapshots the survivors hold."""
    # Plans start from a deal of the micro-batches fixed by the replicas alone: a failure in the
    # all-reduce of the step that re-dealt them may leave ranks on either deal.
    total = base.global_num_microbatches
    count = len(base.replicas)
    old = base.with_replicas(tuple(
        r.keeping_chunks(r.stages, tuple(range(k, total, count)))
        for k, r in enumerate(base.replicas)))
    if policy == "elaswave":
        plan = plan_recovery(old, failed, cost, PlanOptions(dvfs=True, migration=False))
        return plan.layout, plan.clocks
    layout = plan_replica_drop(old, failed, keep_global_batch=policy == "reroute")
    return layout, nominal_clock_plan(cost, layout, len(layout.spares), PowerModel())


def plan_growth(args: argparse.Namespace, current: Layout, joined: frozenset[int],
                cost: CostModel, clocks: ClockPlan) -> tuple[Layout, ClockPlan]:
    """The failure-free layout when every rank it uses is back, else a plan for it without the
    ranks still missing; when none fits, ``current`` with the joiners as spares (and
    ``clocks``), until more ranks are back."""
    complete = failure_free_layout(args)
    missing = set(complete.known_ranks() - current.known_ranks() - joined)
    if not missing:
        return complete, nominal_clock_plan(cost, complete, 0, PowerModel())
    try:
        return plan_without(complete, missing, cost, args.elastic_policy)
    except PlanError:
        return current.with_replicas(current.replicas,
                                     tuple(sorted({*current.spares, *joined}))), clocks
