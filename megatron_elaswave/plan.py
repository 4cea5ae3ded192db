"""Plan the recovery of a TP x PP x DP job from a set of failed ranks (command line).

    python -m megatron_elaswave.plan --tp 8 --pp 4 --dp 3 --num-layers 32 \\
        --global-batch-size 96 --micro-batch-size 1 --fail 40 --json

prints the new layout (replicas with their stages, layer ranges and micro-batch ids), the spares,
the migration transfers in waves, the clock of every rank and the predicted throughput of every
policy. Without ``--profile``, costs come from a synthetic profile built from the model-dimension
flags (7B-class defaults). ``--num-experts`` makes it a mixture-of-experts model, its experts
sharded as Megatron's ``--expert-model-parallel-size`` and ``--expert-tensor-parallel-size`` say.
``--layout`` plans from an earlier plan's output instead of the failure-free grid. A failed set
that leaves nothing runnable, or an expert grid the layout cannot keep, prints one line on stderr
and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from megatron_elaswave.layout import ExpertParallelism, Layout
from megatron_elaswave.planner.cost import CostModel, MemoryModel
from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.planner.policies import predict_policies
from megatron_elaswave.planner.profile import (
    ProfileError,
    SyntheticDevice,
    SyntheticModel,
    SyntheticMoE,
    load_profile,
    synthetic_profile,
)
from megatron_elaswave.planner.replan import PlanError, PlanOptions, RecoveryPlan, plan_recovery
from megatron_elaswave.planner.zero import StateLostError, contiguous_migration

GIB = 2**30


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ranks, got {text!r}") from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"expected one or more non-negative ranks, got {text!r}")
    return ranks


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


MOE_FLAGS = ("expert_model_parallel_size", "expert_tensor_parallel_size", "moe_router_topk",
             "moe_ffn_hidden_size", "moe_layer_freq")
"""The flags that shape a mixture-of-experts model (``--num-experts``), by ``args`` name."""


def add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron's mixture-of-experts flags, as far as the costs and the layout need them."""
    moe = parser.add_argument_group("mixture of experts (a dense model without --num-experts)")
    moe.add_argument("--num-experts", type=_positive(int), help="routed experts per MoE layer")
    moe.add_argument("--expert-model-parallel-size", type=_positive(int), help="default 1")
    moe.add_argument("--expert-tensor-parallel-size", type=_positive(int),
                     help="default: the tensor-parallel size")
    moe.add_argument("--moe-router-topk", type=_positive(int), help="experts per token, default 2")
    moe.add_argument("--moe-ffn-hidden-size", type=_positive(int),
                     help="one expert's MLP width, default --ffn-hidden-size")
    moe.add_argument("--moe-layer-freq", type=_positive(int), metavar="N",
                     help="every N-th layer from layer 0 is an MoE layer, default 1 (all)")


def moe_model(args: argparse.Namespace, tp: int, dp: int, ffn_hidden_size: int) -> SyntheticMoE | None:
    """The MoE layers the flags describe for a TP ``tp`` x DP ``dp`` grid, with Megatron's
    defaults (an expert as wide as the dense MLP, ``ffn_hidden_size``); ``None`` without
    ``--num-experts``. Raises ``ValueError`` with one line for flags
    without ``--num-experts`` and for an expert grid the layout cannot keep
    (:meth:`~megatron_elaswave.layout.ExpertParallelism.check`)."""
    if args.num_experts is None:
        given = [name for name in MOE_FLAGS if getattr(args, name) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --num-experts")
        return None
    experts = ExpertParallelism(args.num_experts, args.expert_model_parallel_size or 1,
                                args.expert_tensor_parallel_size or tp)
    experts.check(tp, dp)
    return SyntheticMoE(experts, ffn_hidden_size=args.moe_ffn_hidden_size or ffn_hidden_size,
                        router_topk=args.moe_router_topk or 2, layer_freq=args.moe_layer_freq or 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_elaswave.plan", description=__doc__.split("\n\n")[0].strip()
    )
    job = parser.add_argument_group("job")
    job.add_argument("--tp", type=_positive(int), required=True, help="tensor-parallel size")
    job.add_argument("--pp", type=_positive(int), required=True, help="pipeline-parallel size")
    job.add_argument("--dp", type=_positive(int), required=True, help="data-parallel size")
    job.add_argument("--num-layers", type=_positive(int), required=True)
    job.add_argument("--global-batch-size", type=_positive(int), required=True, help="samples per step")
    job.add_argument("--micro-batch-size", type=_positive(int), required=True)
    job.add_argument("--fail", type=_ranks, required=True, metavar="RANK[,RANK...]", help="ranks that failed")
    job.add_argument(
        "--layout", metavar="FILE", help="plan from this earlier plan output (JSON) instead of the grid"
    )
    costs = parser.add_argument_group("costs (synthetic profile unless --profile)")
    costs.add_argument("--profile", metavar="FILE", help="profile JSON (see docs/planner.md)")
    costs.add_argument("--hidden-size", type=_positive(int), default=4096)
    costs.add_argument("--ffn-hidden-size", type=_positive(int), default=11008)
    costs.add_argument("--vocab-size", type=_positive(int), default=32000)
    costs.add_argument("--seq-length", type=_positive(int), default=4096)
    costs.add_argument("--device-tflops", type=_positive(float), default=300.0, help="dense bf16 peak")
    costs.add_argument("--device-memory-gib", type=_positive(float), default=64.0)
    costs.add_argument("--bandwidth-gbytes", type=_positive(float), default=25.0, help="per-device GB/s")
    costs.add_argument("--memory-cap-gib", type=_positive(float), help="override the profile's device memory")
    add_moe_arguments(parser)
    plan = parser.add_argument_group("planner")
    plan.add_argument("--tolerance", type=float, default=0.02, help="bottleneck slack for fewer moved bytes")
    plan.add_argument("--zero-chunks-per-replica", type=_positive(int), default=1)
    plan.add_argument("--no-dvfs", action="store_true", help="keep every clock nominal")
    plan.add_argument(
        "--compare-zero", action="store_true", help="add Megatron's contiguous-layout migration figures"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _load_layout(path: str, experts: ExpertParallelism | None) -> Layout:
    """The layout of an earlier plan's output (or of its ``replicas`` list), with the job's
    expert grid."""
    with open(path, encoding="utf-8") as handle:
        try:
            record = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
    grid = None if experts is None else experts.to_json()
    try:
        if isinstance(record, dict):
            return Layout.from_json(record["replicas"], record.get("spares", []), grid)
        return Layout.from_json(record, experts=grid)
    except (KeyError, TypeError, IndexError) as error:
        raise ValueError(f"{path}: not a plan's replicas list (missing or malformed {error})") from None
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def plan_to_json(plan: RecoveryPlan, job: JobSpec, predicted: dict, comparison: dict | None) -> dict:
    record = {
        "global_batch_size": job.global_batch_size,
        "micro_batch_size": job.micro_batch_size,
        "num_layers": job.num_layers,
        "failed_ranks": sorted(plan.failed_ranks),
        "dissolved_replicas": list(plan.dissolved_replicas),
        "replicas": plan.layout.to_json(with_microbatch_ids=True),
        "spares": list(plan.layout.spares),
        "transfers": [t.to_json() for t in plan.migration.transfers],
        "migration": {"interleaved": plan.migration.summary()},
        "frequencies": {str(rank): f for rank, f in sorted(plan.frequencies().items())},
        "predicted": {name: outcome.to_json() for name, outcome in predicted.items()},
    }
    if job.experts is not None:
        record["experts"] = job.experts.to_json()
    if comparison is not None:
        record["migration"]["megatron_contiguous"] = comparison
    return record


def _print_text(record: dict) -> None:
    print(f"failed ranks {record['failed_ranks']}; dissolved replicas {record['dissolved_replicas']}")
    for replica in record["replicas"]:
        stages = "  ".join(
            f"[{s['layers'][0]}-{s['layers'][1]}] ranks {s['ranks'][0]}..{s['ranks'][-1]}"
            for s in replica["stages"]
        )
        print(f"replica {replica['replica']}: {replica['num_microbatches']} micro-batches  {stages}")
    print(f"spares: {record['spares']}")
    for name, summary in record["migration"].items():
        print(
            f"migration ({name}): {summary['transfers']} copies in {summary['waves']} waves, "
            f"{summary['bytes'] / GIB:.2f} GiB, ~{summary['estimated_s']:.3f} s"
        )
    print(f"{'policy':<20}{'tokens/s':>14}{'step s':>10}{'energy J':>12}{'bubble':>8}{'samples':>9}")
    for name, p in record["predicted"].items():
        if p["runnable"]:
            print(
                f"{name:<20}{p['tokens_per_s']:>14.0f}{p['step_time_s']:>10.3f}{p['energy_j']:>12.0f}"
                f"{p['bubble_fraction']:>8.3f}{p['samples_per_step']:>9}"
            )
        else:
            print(f"{name:<20}  cannot run: {p['reason']}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        job = JobSpec(
            tensor_parallel_size=args.tp,
            pipeline_parallel_size=args.pp,
            data_parallel_size=args.dp,
            num_layers=args.num_layers,
            global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            zero_chunks_per_replica=args.zero_chunks_per_replica,
        )
        options = PlanOptions(tolerance=args.tolerance, dvfs=not args.no_dvfs)
    except ValueError as error:
        parser.error(str(error))
    out_of_range = sorted(r for r in args.fail if r >= job.world_size)
    if out_of_range:
        parser.error(f"--fail: ranks {out_of_range} are outside the job's {job.world_size} ranks")
    try:
        moe = moe_model(args, args.tp, args.dp, args.ffn_hidden_size)
        job = replace(job, experts=None if moe is None else moe.experts)
        if args.profile:
            profile = load_profile(args.profile)
        else:
            profile = synthetic_profile(
                SyntheticModel(
                    num_layers=args.num_layers,
                    hidden_size=args.hidden_size,
                    ffn_hidden_size=args.ffn_hidden_size,
                    vocab_size=args.vocab_size,
                    seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size,
                    tensor_model_parallel_size=args.tp,
                    moe=moe,
                ),
                SyntheticDevice(
                    peak_tflops=args.device_tflops,
                    memory_bytes=int(args.device_memory_gib * GIB),
                    bandwidth_bytes_per_s=args.bandwidth_gbytes * 1e9,
                ),
            )
        memory = MemoryModel(memory_cap_bytes=int(args.memory_cap_gib * GIB) if args.memory_cap_gib else None)
        cost = CostModel(profile, job, memory)
        old = _load_layout(args.layout, job.experts) if args.layout else job.initial_layout()
        failed = set(args.fail)
        plan = plan_recovery(old, failed, cost, options)
        predicted = predict_policies(cost, old, failed, options=options, plan=plan)
        comparison = (
            contiguous_migration(old, plan.layout, frozenset(failed), cost).summary()
            if args.compare_zero
            else None
        )
    except (PlanError, StateLostError, ProfileError, OSError, ValueError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    record = plan_to_json(plan, job, predicted, comparison)
    if args.json:
        json.dump(record, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_text(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
