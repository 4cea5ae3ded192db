"""What each recovery policy achieves on the same job after the same failures.

Policies (all start from the failure-free TP x PP x DP grid of the job; ranks that failed earlier
count as failed):

* ``failure_free``: the job before any failure, for reference;
* ``elaswave``: the plan of :func:`~megatron_elaswave.planner.replan.plan_recovery`, with its clocks;
* ``elaswave_no_dvfs``: the same layout with every clock nominal;
* ``recycle`` (ReCycle-style): no layer moves; the micro-batches of a failed stage instance are
  re-routed to the same stage of the other replicas, so stage ``s`` of every live replica does
  ``D / live_s`` times its work. Impossible when every instance of some stage failed;
* ``torchft_drop`` (TorchFT-style): every replica containing a failed rank is dropped and the global
  batch shrinks to what the others run;
* ``torchft_grad_accum``: the same replicas, with gradient accumulation keeping the global batch;
* ``restart``: all workers restart from the last checkpoint on the live devices, re-packed into as
  many full replicas as the healthy stage instances allow, keeping the global batch.

In a mixture-of-experts job whose expert-parallel groups span replicas, the baselines keep its
lockstep sets whole: a failed stage instance takes the expert-parallel partners of its stage (the
same stage of the other replicas of its set) out with it, a replica runs only while its whole set
does, and a restart packs whole sets.

Throughput is the steady state after the change; ``downtime_s`` estimates the time the change
itself costs (:class:`DowntimeModel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from megatron_elaswave.layout import Layout
from megatron_elaswave.planner.cost import CostModel
from megatron_elaswave.planner.frequency import PowerModel
from megatron_elaswave.planner.predict import layout_prediction, predict, stage_sync_s, stage_work
from megatron_elaswave.planner.replan import PlanError, PlanOptions, RecoveryPlan, plan_recovery
from megatron_elaswave.planner.zero import StateLostError
from megatron_elaswave.simulator.step import ReplicaWork, StepPrediction

POLICIES = (
    "failure_free",
    "elaswave",
    "elaswave_no_dvfs",
    "recycle",
    "torchft_drop",
    "torchft_grad_accum",
    "restart",
)


@dataclass(frozen=True)
class DowntimeModel:
    """One-off cost of a change, by policy."""

    restart_s: float = 300.0
    """Relaunching every worker: process start, communicators, model and optimizer construction."""
    checkpoint_load_s: float = 60.0
    """Reading the last checkpoint back."""
    checkpoint_interval_steps: int = 200
    """Steps between checkpoints; a restart loses half an interval of work on average."""
    reconfigure_s: float = 5.0
    """Detection, agreement and communicator repair of an in-place policy."""

    def __post_init__(self) -> None:
        if (
            min(self.restart_s, self.checkpoint_load_s, self.reconfigure_s) < 0
            or self.checkpoint_interval_steps < 1
        ):
            raise ValueError("times must be non-negative and checkpoint_interval_steps positive")


@dataclass(frozen=True)
class PolicyOutcome:
    """One policy's prediction, or why it cannot run."""

    policy: str
    step: StepPrediction | None
    downtime_s: float | None = None
    reason: str = ""
    """Why the policy cannot run, when ``step`` is ``None``."""

    def to_json(self) -> dict:
        if self.step is None:
            return {"runnable": False, "reason": self.reason}
        return {"runnable": True, **self.step.to_json(), "downtime_s": self.downtime_s}


def _uniform(
    cost: CostModel,
    counts: list[int],
    idle_devices: int,
    power: PowerModel,
    stage_load_factor: list[float] | None = None,
    devices: list[tuple[int, ...]] | None = None,
) -> StepPrediction:
    """Replicas of the failure-free shape at nominal clocks running ``counts`` micro-batches each.
    ``stage_load_factor[s]`` multiplies stage ``s``'s work (re-routed micro-batches);
    ``devices[r][s]`` overrides the devices computing stage ``s`` of replica ``r``."""
    job = cost.job
    ranges = job.initial_ranges()
    ones = (1.0,) * len(ranges)
    forward, backward, all_to_all = stage_work(cost, ranges, ones, stage_load_factor)
    sync = stage_sync_s(cost, ranges, len(counts))
    work = [
        ReplicaWork(
            forward_s=forward,
            backward_s=backward,
            devices=devices[r] if devices else (job.tensor_parallel_size,) * len(ranges),
            clocks=ones,
            num_microbatches=n,
            send_s=cost.send_ns / 1e9,
            sync_s=sync,
            all_to_all_s=all_to_all,
        )
        for r, n in enumerate(counts)
    ]
    return predict(cost, work, idle_devices, power)


def _even_counts(total: int, replicas: int, lockstep: int) -> list[int]:
    """``total`` micro-batches dealt as evenly as whole lockstep sets of ``lockstep`` replicas
    allow (each member of a set runs as many)."""
    sets = replicas // lockstep
    return [total // lockstep // sets + (r // lockstep < total // lockstep % sets)
            for r in range(replicas)]


def _lockstep_hits(hit: list[list[bool]], lockstep: int) -> list[list[bool]]:
    """Per replica and stage, whether the stage instance failed or an expert-parallel partner
    of it did (the same stage of a replica of its lockstep set)."""
    def partners(replica: int) -> range:
        first = replica - replica % lockstep
        return range(first, first + lockstep)

    return [[any(hit[p][s] for p in partners(r)) for s in range(len(stages))]
            for r, stages in enumerate(hit)]


def predict_policies(
    cost: CostModel,
    old: Layout,
    failed_ranks: Iterable[int],
    *,
    options: PlanOptions = PlanOptions(),
    downtime: DowntimeModel = DowntimeModel(),
    plan: RecoveryPlan | None = None,
) -> dict[str, PolicyOutcome]:
    """Every policy of :data:`POLICIES` on the job of ``cost`` after ``failed_ranks`` fail in
    ``old``. ``plan`` may pass an ElasWave plan already computed for the same inputs."""
    job, power = cost.job, options.power
    failed = frozenset(failed_ranks)
    grid = job.initial_layout()
    all_failed = failed | (grid.known_ranks() - old.known_ranks())
    tp, pp, dp = job.tensor_parallel_size, job.pipeline_parallel_size, job.data_parallel_size
    lockstep = job.lockstep_size
    total = job.num_microbatches
    alive = job.world_size - len(all_failed)
    failed_instances = [[not all_failed.isdisjoint(stage.ranks) for stage in r.stages]
                        for r in grid.replicas]
    hit = _lockstep_hits(failed_instances, lockstep)
    healthy_replicas = sum(1 for r in hit if not any(r))
    outcomes: dict[str, PolicyOutcome] = {}

    free = _uniform(cost, [total // dp] * dp, 0, power)
    outcomes["failure_free"] = PolicyOutcome("failure_free", free, 0.0)
    step_s = free.step_time_s

    try:
        plan = plan or plan_recovery(old, failed, cost, options)
    except (PlanError, StateLostError) as error:
        for name in ("elaswave", "elaswave_no_dvfs"):
            outcomes[name] = PolicyOutcome(name, None, reason=str(error))
    else:
        idle = len(plan.layout.spares)
        elastic_downtime = downtime.reconfigure_s + plan.migration.estimated_s + step_s
        outcomes["elaswave"] = PolicyOutcome(
            "elaswave",
            layout_prediction(cost, plan.layout, plan.clocks.clocks, idle, power),
            elastic_downtime,
        )
        nominal = [(1.0,) * len(r.stages) for r in plan.layout.replicas]
        outcomes["elaswave_no_dvfs"] = PolicyOutcome(
            "elaswave_no_dvfs", layout_prediction(cost, plan.layout, nominal, idle, power), elastic_downtime
        )

    live_per_stage = [sum(1 for r in hit if not r[s]) for s in range(pp)]
    if min(live_per_stage) == 0:
        outcomes["recycle"] = PolicyOutcome("recycle", None, reason="every instance of some stage failed")
    else:
        scale = [dp / live for live in live_per_stage]
        devices = [tuple(0 if h else tp for h in r) for r in hit]
        working = tp * sum(live_per_stage)
        outcomes["recycle"] = PolicyOutcome(
            "recycle",
            _uniform(cost, [total // dp] * dp, alive - working, power, scale, devices),
            downtime.reconfigure_s + step_s,
        )

    if healthy_replicas == 0:
        for name in ("torchft_drop", "torchft_grad_accum"):
            outcomes[name] = PolicyOutcome(name, None, reason="every replica lost a rank")
    else:
        idle = alive - healthy_replicas * tp * pp
        outcomes["torchft_drop"] = PolicyOutcome(
            "torchft_drop",
            _uniform(cost, [total // dp] * healthy_replicas, idle, power),
            downtime.reconfigure_s + step_s,
        )
        outcomes["torchft_grad_accum"] = PolicyOutcome(
            "torchft_grad_accum",
            _uniform(cost, _even_counts(total, healthy_replicas, lockstep), idle, power),
            downtime.reconfigure_s + step_s,
        )

    healthy_instances = sum(1 for r in failed_instances for h in r if not h)
    restart_replicas = min(dp, healthy_instances // pp) // lockstep * lockstep
    if restart_replicas == 0:
        outcomes["restart"] = PolicyOutcome(
            "restart", None,
            reason=f"fewer healthy stage instances than the {lockstep * pp} of one lockstep set"
            if lockstep > 1 else "fewer healthy stage instances than stages"
        )
    else:
        outcomes["restart"] = PolicyOutcome(
            "restart",
            _uniform(cost, _even_counts(total, restart_replicas, lockstep),
                     alive - restart_replicas * tp * pp, power),
            downtime.restart_s + downtime.checkpoint_load_s + downtime.checkpoint_interval_steps / 2 * step_s,
        )
    return {name: outcomes[name] for name in POLICIES}
