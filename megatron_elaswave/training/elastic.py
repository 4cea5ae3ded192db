"""``--elastic`` training: a rank dies, the survivors reshard and re-run the iteration it broke.

Recovery, on every survivor (DESIGN section 3):

1. *detect*: the failure monitor notices (launcher death record, heartbeat, or a collective that
   fails) and aborts every in-flight collective, so the training thread unblocks;
2. *agree* through the store on the failed set and the next generation;
3. *plan* the next layout with the planner (a pure function every survivor evaluates alike);
4. *edit* the process groups in place (only their members take part);
5. *rebuild* the Megatron objects of this rank's stage for the new layout, then *migrate*: roll
   back to the newest iteration whose snapshots survive, and fetch parameters and Adam shards
   from the survivors' snapshots and the failed ranks' replicas (checksummed transfers);
6. re-run the broken iteration with the same micro-batch ids; the global batch, the LR schedule
   and the consumed-samples counter continue exactly.

When no layout of the survivors can hold the model, they gather the state of the rollback
iteration into the checkpoint layout (:mod:`.rescue`), save it with ``dist_checkpointing`` to
``--save`` (default ``./elaswave-checkpoint``) and stop with :class:`CannotContinue`, naming what
is missing and where the checkpoint is; ``--load`` resumes from it in any layout.

A ``recovery`` record with the time of each phase goes into the metrics file. A rank the new
layout does not use (a spare) serves its snapshots and waits, taking part in later recoveries.

Without a failure, a replica that runs persistently slower gets fewer of the global batch's
micro-batches, or layers move off a stage on a slow device (:mod:`.stragglers`; a ``rebalance``
record says why and the predicted gain). Replacement ranks join at a step boundary
(:mod:`.relayout`; a ``grow`` record), and a job whose lost ranks are all back runs at its
failure-free layout again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from megatron_elaswave.agreement import Decision, agree
from megatron_elaswave.communicator import EditMode, GroupRegistry, Role, group_specs, member_lists
from megatron_elaswave.device import DeviceBackend
from megatron_elaswave.dvfs import DvfsGovernor, clock_backend
from megatron_elaswave.faults import FaultInjector, InjectedSlowdown, slow_down
from megatron_elaswave.layout import Layout, Replica
from megatron_elaswave.metrics import MetricsWriter
from megatron_elaswave.monitor import (
    HEARTBEAT,
    FailureDetected,
    FailureMonitor,
    MonitorConfig,
    round_key,
)
from megatron_elaswave.planner.cost import CostModel, MemoryModel
from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.planner.profile import SyntheticDevice, SyntheticModel, load_profile, synthetic_profile
from megatron_elaswave.planner.frequency import ClockPlan, PowerModel
from megatron_elaswave.planner.replan import (
    PlanError,
    PlanOptions,
    nominal_clock_plan,
    plan_recovery,
    plan_replica_drop,
)
from megatron_elaswave.planner.zero import StateLostError
from megatron_elaswave.store import STORE_ADDR_ENV, STORE_PORT_ENV, connect_store, read_deaths, wait_for_keys

from . import relayout
from .checkpoint import TrainingProgress, save_checkpoint
from .data import MicrobatchSource
from .relayout import LayoutChange
from .layer_groups import ModelFactory, build_stage_objects
from .loop import StepResult, Trainer, log
from .model import seed_random_generators, transformer_layers
from .migration import adam_step, load_pieces, migrate, named_shard, needed_pieces
from .rescue import checkpoint_layout
from .snapshots import StepSnapshots, ranks_per_node, restore_rng_states, snapshot_config
from .stragglers import ForwardTimer, RebalanceConfig, StageCompute, StragglerDetector

class CannotContinue(RuntimeError):
    """The survivors cannot hold the model any more."""


class StepFailed(RuntimeError):
    """An iteration failed again when re-run from its snapshot while no rank failed: its data,
    its hyper-parameters or the code are at fault, not the job's ranks. Every member raises it;
    the one with ``announce`` set says it."""

    def __init__(self, message: str, announce: bool) -> None:
        super().__init__(message)
        self.announce = announce


class NonFiniteLoss(FloatingPointError):
    """The reduced loss of an iteration is not finite (every rank sees the same value)."""


CPU_DEVICE = SyntheticDevice(name="CPU core (gloo)", peak_tflops=0.02, model_flops_utilisation=0.5,
                             memory_bytes=16 * 2**30, bandwidth_bytes_per_s=1e9, p2p_latency_s=1e-4)
"""What a CPU rank with one thread roughly does, for plans made without a measured profile."""

RESCUE_DIRECTORY = "elaswave-checkpoint"
"""Where the survivors save when they cannot continue and ``--save`` is not given."""


def cost_model(args: argparse.Namespace, vocab_size: int, backend: DeviceBackend) -> CostModel:
    """The planner's costs: a measured profile (``--elastic-profile``) or one from FLOP counts
    on a nominal device of the backend's kind."""
    job = JobSpec(
        tensor_parallel_size=args.tensor_model_parallel_size,
        pipeline_parallel_size=args.pipeline_model_parallel_size,
        data_parallel_size=args.data_parallel_size,
        num_layers=args.num_layers,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        ranks_per_node=ranks_per_node(),
    )
    if args.elastic_profile:
        profile = load_profile(args.elastic_profile)
    else:
        profile = synthetic_profile(
            SyntheticModel(num_layers=args.num_layers, hidden_size=args.hidden_size,
                           ffn_hidden_size=args.ffn_hidden_size, vocab_size=vocab_size,
                           seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                           tensor_model_parallel_size=args.tensor_model_parallel_size),
            CPU_DEVICE if backend.name == "cpu" else SyntheticDevice())
    return CostModel(profile, job, MemoryModel())


@dataclass
class RecoveryTimes:
    """Wall-clock marks of one recovery on this rank (``time.time()``)."""

    failure_at: float
    noticed_at: float
    agreed_at: float = 0.0
    planned_at: float = 0.0
    edited_at: float = 0.0
    rebuilt_at: float = 0.0
    migrated_at: float = 0.0
    failed_ranks: list[int] = field(default_factory=list)
    causes: dict[int, str] = field(default_factory=dict)
    """Why each failed rank was excluded, as this rank saw it."""
    bytes_moved: int = 0
    rolled_back_to: int = 0
    rerun_cause: str = ""
    """With no failed rank: the error that made the iteration run again."""


@dataclass
class ElasticTrainer(Trainer):
    """:class:`Trainer` that survives failures of other ranks (module docstring)."""

    registry: GroupRegistry = None
    monitor: FailureMonitor = None
    store: object = None
    cost: CostModel = None
    model_factory: ModelFactory = None
    injector: FaultInjector = None
    governor: DvfsGovernor = None
    slowdowns: tuple[InjectedSlowdown, ...] = ()
    detector: StragglerDetector | None = None
    """``None``: micro-batches are not re-dealt to follow stragglers."""
    _pending: RecoveryTimes | None = None

    def __post_init__(self) -> None:
        self._step_started = self._pipeline_done = 0.0
        self._nan_output = False
        self._stage_timer = self._layers_timer = None
        if self.rank in self.layout.active_ranks():  # a replacement has no stage before it joins
            super().__post_init__()
        self.state_layout = self.layout
        """The layout whose snapshots the ranks hold: the last one restored."""
        self.lost: set[int] = set()
        """Ranks failed since the state was last restored; their replicas must serve it."""
        self.reruns = 0
        """Recoveries in which no rank failed since :attr:`rerun_iteration` last completed."""
        self.rerun_iteration = 0
        """The iteration that failed with no rank failing."""
        self.nonfinite_loss: float | None = None
        """The non-finite loss that made :attr:`rerun_iteration` run again, if that was why."""
        if self.detector is not None:
            self.detector.reset(planned=self.layout)

    def _bind(self) -> None:
        super()._bind()
        self.reduce_group = self.registry.group(Role.WORLD)
        self.tp_rank = self.layout.position(self.rank)[2]
        finalize = self.objects.config.finalize_model_grads_func

        def timed_finalize(*args, **kwargs):
            """Replicas first wait for each other in the gradient reduction: time up to it."""
            self._pipeline_done = time.perf_counter()
            self.injector.at("allreduce", self.iteration + 1)
            return finalize(*args, **kwargs)

        self.objects.config.finalize_model_grads_func = timed_finalize
        if self.injector.armed:  # hooks only where a failure is to be injected
            self.objects.model[-1].module.register_forward_hook(self._inject_into_output)
        chunks = [ddp.module for ddp in self.objects.model]
        layers = transformer_layers(chunks)
        for slowdown in self.slowdowns:
            if slowdown.rank == self.rank:
                slow_down(layers, slowdown, lambda: self.iteration + 1)
        if self.detector is not None:  # after the slowdown's hooks, so that they count
            self._stage_timer, self._layers_timer = ForwardTimer(chunks), ForwardTimer(layers)

    def _inject_into_output(self, module, inputs, output):
        """The injected failures that act on the last chunk's output: a NaN, a backward fault."""
        if self._nan_output and torch.is_tensor(output):
            self._nan_output = False
            output = output * float("nan")
        if torch.is_tensor(output) and output.requires_grad:
            iteration = self.iteration + 1

            def backward_fault(grad: torch.Tensor) -> None:
                self.injector.at("backward", iteration)

            output.register_hook(backward_fault)
        return output

    def before_optimizer_step(self) -> None:
        self.injector.at("optimizer", self.iteration + 1)

    # -- snapshots by global name --------------------------------------------------------------

    def take_snapshot(self, iteration: int, consumed_samples: int) -> None:
        self.snapshots.after_step(
            iteration, self.objects.optimizer, self.objects.scheduler, consumed_samples,
            tensors=named_shard(self.objects, self.tp_rank), adam_step=adam_step(self.objects))
        self.injector.at("snapshot", iteration)

    def train_step(self):
        self._step_started = time.perf_counter()
        if self.detector is not None:
            self._stage_timer.restart()
            self._layers_timer.restart()
        self._nan_output = self.injector.at("forward", self.iteration + 1)
        return super().train_step()

    def step_report(self) -> torch.Tensor:
        """Blocks of one value per launch rank: the ranks asking to join, then (with a straggler
        detector) each stage's time to the gradient reduction, its forward time and the part of
        it spent in transformer layers."""
        size = self.monitor.job_size
        report = torch.zeros(size if self.detector is None else 4 * size, dtype=torch.float64)
        report[list(self.monitor.waiting_to_join())] = 1.0
        if self.detector is not None and self.tp_rank == 0:
            report[size + self.rank] = self._pipeline_done - self._step_started
            report[2 * size + self.rank] = self._stage_timer.total_s
            report[3 * size + self.rank] = self._layers_timer.total_s
        return report

    def _follow_report(self, report: torch.Tensor) -> None:
        """Act on the step's summed reports: the same on every stage holder."""
        joined_flags, *stage_times = report.view(-1, self.monitor.job_size)
        joined = frozenset(int(rank) for rank in torch.nonzero(joined_flags).flatten())
        if self.iteration >= self.args.train_iters:
            return
        try:
            if joined:
                self._change_layout(lambda: self._plan_growth(joined), joined=joined)
            elif self.detector is not None:
                self._follow_stragglers(*stage_times)
        except (RuntimeError, FailureDetected) as error:
            self.recover(error)

    def _follow_stragglers(self, pipeline_s: torch.Tensor, forward_s: torch.Tensor,
                           layers_s: torch.Tensor) -> None:
        """Re-deal the micro-batches when a replica is persistently slow, or move layers off a
        slow stage where that pays instead (:mod:`.stragglers`)."""
        leaders = {stage.ranks[0] for r in self.layout.replicas for stage in r.stages}
        self.detector.observe(
            self.layout, {rank: float(pipeline_s[rank]) for rank in leaders},
            {rank: StageCompute(float(layers_s[rank]), float(forward_s[rank] - layers_s[rank]))
             for rank in leaders})
        decision = self.detector.proposal(self.layout)
        if decision is None:
            moved = self.detector.layer_proposal(self.layout)
            if moved is not None:
                self._change_layout(lambda: (moved.layout, self.governor.plan),
                                    reason=moved.reason, predicted_gain=moved.predicted_gain)
            return
        self.detector.reset()
        self.layout = decision.layout
        self.replica = self.layout.replica_by_index()[self.layout.position(self.rank)[0]]
        self.metrics.write("rebalance", iteration=self.iteration, reason=decision.reason,
                           layout=self.layout.to_json(), predicted_gain=decision.predicted_gain)
        if self.is_logger:
            log(f" rebalanced after iteration {self.iteration}: {decision.reason}; micro-batches "
                f"per replica now {[r.num_microbatches for r in self.layout.replicas]}, predicted "
                f"{decision.predicted_gain:.2f}x faster")

    # -- the loop ------------------------------------------------------------------------------

    @property
    def is_active(self) -> bool:
        """Whether this rank holds a stage (a spare does not)."""
        return self.rank in self.layout.active_ranks()

    def ensure_initial_snapshot(self) -> None:
        """Snapshot the state before the first step of this rank, if not held yet."""
        if (self.rank, self.iteration) not in self.snapshots.store.held():
            self._snapshot_now()

    def _snapshot_now(self) -> None:
        """Snapshot the current state and settle it at once: the next failure rolls back to it."""
        self.take_snapshot(self.iteration, self.consumed_samples)
        self.snapshots.settle()

    def advance(self) -> StepResult | None:
        """Try the next iteration; on a failure, recover (which may roll back) instead. The
        step's result, or ``None`` if a recovery ran."""
        try:
            self.monitor.raise_if_failed()
            result = self.train_step()
            self.monitor.raise_if_failed()
        except (RuntimeError, FailureDetected) as error:
            self.recover(error)
            return None
        if not math.isfinite(result.lm_loss):
            self.nonfinite_loss = result.lm_loss
            error = NonFiniteLoss(f"lm loss is {result.lm_loss} at iteration {self.iteration + 1}")
            self.monitor.report_error(error)  # every rank has the same loss: nothing to wait for
            self.recover(error)
            return None
        gbs = len(result.sample_ids)
        self.iteration += 1
        self.consumed_samples += gbs
        if self._pending is not None:
            self._record_recovery(result.step_time_s)
        if self.reruns and self.iteration >= self.rerun_iteration:
            if self.nonfinite_loss is not None and self.is_logger:
                log(f" iteration {self.iteration} had lm loss {self.nonfinite_loss}; run again "
                    f"from its snapshot it has {result.lm_loss:.6E}: the non-finite loss did not "
                    "reproduce (a transient fault or a faulty device), so training goes on")
            self.reruns, self.nonfinite_loss = 0, None
        self._record(result, gbs, energy_j=self.governor.energy_j(result.step_time_s))
        self._follow_report(result.reported)
        return result

    def train(self, on_iteration=None) -> None:
        self.ensure_initial_snapshot()
        while self.iteration < self.args.train_iters and self.is_active:
            if self.advance() is not None and on_iteration is not None:
                on_iteration(self)

    # -- recovery ------------------------------------------------------------------------------

    def recover(self, error: BaseException) -> None:
        """Steps 1-5 of the module docstring; a failure during them starts them again.

        An error is never taken as proof that nobody failed: this rank first waits (at most
        ``MonitorConfig.evidence_timeout_s``) for a failure to account for it. Without one, the
        error is this rank's own: the others are told, the agreement fails nobody and the
        iteration is re-run from its snapshot, at most ``--elastic-max-step-retries`` times
        (once for a non-finite loss) before :class:`StepFailed`. Raises
        :class:`CannotContinue` when the job store is lost or the state is gone."""
        raised_at = time.time()
        while True:
            if not self.monitor.explains(error):
                log(f" rank {self.rank}: {type(error).__name__}: {error}; no rank failed, so "
                    "the iteration runs again from its snapshot")
            if self.monitor.store_lost:
                address = f"{os.environ.get(STORE_ADDR_ENV)}:{os.environ.get(STORE_PORT_ENV)}"
                raise CannotContinue(f"lost the job store at {address} "
                                     f"({self.monitor.store_lost})")
            try:
                self._recover_once(error, raised_at)
                return
            except (RuntimeError, FailureDetected) as again:
                if isinstance(again, (CannotContinue, StepFailed)):
                    raise
                error = again

    def _recover_once(self, error: BaseException, raised_at: float) -> None:
        attempted = self.iteration + 1
        self.injector.at("recovery", attempted)
        noticed = time.time()
        self.monitor.report_error(error)
        # A hang is older than its detection by the heartbeat timeout.
        timeout_s = self.monitor.config.heartbeat_timeout_s
        evidence = [self.monitor.failure.time] + [
            s.time - (timeout_s if s.cause == HEARTBEAT else 0.0)
            for s in self.monitor.suspects().values()]
        # One record for a recovery however many failures interrupt it.
        times = self._pending = self._pending or RecoveryTimes(
            failure_at=min(evidence + [raised_at]), noticed_at=noticed)
        decision = agree(self.store, self.monitor)
        suspects = self.monitor.suspects()
        if decision.joined:  # a grow was committed before the failure: it is the next one's
            if not times.failed_ranks:
                self._pending = None
            timeout = timedelta(seconds=self.monitor.config.agreement_timeout_s)
            self._follow_change(relayout.committed_plan(self.store, decision.generation, timeout))
            return
        # A replacement that died while joining is a member of the generation, not yet of the
        # layout: it counts as failed too.
        members = set(self.layout.known_ranks()) | set(self.monitor.members)
        self.monitor.advance(decision)
        times.agreed_at = time.time()
        failed = members - set(decision.survivors)
        times.failed_ranks = sorted(set(times.failed_ranks) | failed)
        # A death is dated and described by the launcher that saw it (this rank may have learnt
        # the decision first); a hang by the first rank that noticed it.
        deaths = {d.rank: d for d in read_deaths(self.store) if d.rank in failed}
        for rank in failed:
            suspicion = suspects.get(rank)
            times.causes[rank] = (deaths[rank].describe() if rank in deaths
                                  else suspicion.detail if suspicion
                                  else "declared failed by another rank")
        times.failure_at = min([times.failure_at, *(d.time for d in deaths.values()),
                                *self._announced_at(decision)])
        failed &= self.layout.known_ranks()
        self.lost |= failed
        if not failed:
            notice = self._round_notice(decision)
            times.rerun_cause = (f"rank {notice['rank']}: {notice['detail']}" if notice
                                 else "an error with no rank failing")
        # Every connection was shut down to unblock the training thread: re-create all groups
        # of the new layout, each by its own members only. An interrupted recovery may have
        # left the groups on a layout the trainer never reached.
        grouped = self.registry.layout
        old_lists, ungrouped = member_lists(group_specs(grouped)), failed - grouped.known_ranks()
        try:
            new_layout, clocks = self._plan(self.layout, failed)
        except PlanError as plan_error:
            self._stop_with_checkpoint(str(plan_error), failed, decision, old_lists, ungrouped,
                                       times)
        except StateLostError as lost:
            raise CannotContinue(str(lost)) from None
        times.planned_at = time.time()
        self.registry.edit(failed - ungrouped, new_layout, EditMode.INPLACE, broken=old_lists,
                           generation=decision.generation, abort=self.monitor.failure_detected)
        times.edited_at = time.time()
        self._restore(decision, new_layout, times)
        if not failed:
            self._count_rerun(times, attempted)
        self.governor.apply(clocks, new_layout)
        if not self.is_active:  # a spare runs no step to record the recovery with
            self._pending = None
        if self.detector is not None:
            self.detector.reset(planned=new_layout)

    def _stop_with_checkpoint(self, reason: str, failed: set[int], decision: Decision,
                              old_lists, ungrouped: set[int], times: RecoveryTimes) -> None:
        """Gather the rollback iteration's state into the checkpoint layout, save it, stop."""
        layout = checkpoint_layout(self.layout, failed)
        if layout is None:
            raise CannotContinue(f"{reason}; no stage has a tensor-parallel group left whole, so "
                                 "the survivors cannot save a checkpoint either")
        self.registry.edit(failed - ungrouped, layout, EditMode.INPLACE, broken=old_lists,
                           generation=decision.generation)
        self._restore(decision, layout, times)
        raise CannotContinue(self._save_rollback_state(reason, times.rolled_back_to))

    def _save_rollback_state(self, reason: str, iteration: int) -> str:
        """Save the restored state of ``iteration``; ``reason`` with where it went."""
        directory = self.save_checkpoint(self.args.save or os.path.abspath(RESCUE_DIRECTORY))
        return (f"{reason}. The state of iteration {iteration} is saved in {directory}: resume "
                f"with --load {os.path.dirname(directory)}")

    def _count_rerun(self, times: RecoveryTimes, attempted: int) -> None:
        """Count a recovery that failed nobody while iteration ``attempted`` ran; past the
        limit, save the state it restored and stop every member with :class:`StepFailed`."""
        self.reruns += 1
        self.rerun_iteration = max(self.rerun_iteration, attempted)
        limit = 1 if self.nonfinite_loss is not None else self.args.elastic_max_step_retries
        if self.reruns <= limit:
            return
        if self.nonfinite_loss is not None:
            reason = (f"lm loss is {self.nonfinite_loss} at iteration {self.rerun_iteration}, "
                      f"again when re-run from the snapshot of iteration {times.rolled_back_to}: "
                      "it reproduces, so the data or the hyper-parameters are at fault")
        else:
            reason = (f"iteration {self.rerun_iteration} failed {self.reruns} times with no rank "
                      f"failing ({times.rerun_cause}); --elastic-max-step-retries "
                      f"{self.args.elastic_max_step_retries}")
        raise StepFailed(self._save_rollback_state(reason, times.rolled_back_to),
                         announce=self.is_logger)

    def save_checkpoint(self, root: str) -> str:
        """Save the active ranks' state under ``root`` with ``dist_checkpointing``; returns the
        checkpoint directory. Every member of the job calls this.

        ``dist_checkpointing`` coordinates on the default process group. When that group still
        counts failed ranks or spares, the active ranks first re-form it among themselves (a
        ``full`` edit) and rebuild their objects on the new groups, from their own state; the
        spares wait for the save and take no part in the job afterwards.
        """
        actives = sorted(self.layout.active_ranks())
        saved_key = f"rt/gen{self.registry.generation}/saved"
        if self.rank not in actives:
            while not self.store.check([saved_key]):
                if self.monitor.failure_detected.is_set():
                    raise CannotContinue("a rank failed while the survivors saved a checkpoint")
                time.sleep(0.05)
            return self.store.get(saved_key).decode()
        if self.registry.world_members != frozenset(actives):
            self._reform_default_group()
        directory = save_checkpoint(root, self.objects,
                                    TrainingProgress(self.iteration, self.consumed_samples))
        if self.rank == actives[0]:
            self.store.set(saved_key, directory)
        return directory

    def _reform_default_group(self) -> None:
        held, step = named_shard(self.objects, self.tp_rank), adam_step(self.objects)
        scheduler = self.objects.scheduler.state_dict()
        self.objects = self.stages = self.p2p = None
        leaving = set(self.layout.known_ranks() - self.layout.active_ranks())
        self.layout = Layout(self.layout.num_layers, self.layout.replicas)
        self.registry.edit(leaving, self.layout, EditMode.FULL)
        self._build_objects()
        needs = needed_pieces(self.objects, self.tp_rank)
        load_pieces(self.objects, needs, [held[piece.key] for piece in needs], step)
        self.objects.scheduler.load_state_dict(scheduler)

    def _build_objects(self) -> None:
        """This rank's Megatron objects for ``self.layout`` on the registry's groups, their
        parameters left for a restore to fill."""
        self.objects = build_stage_objects(self.args, self.layout, self.registry, self.model_factory,
                                           self.backend.device(), initialize=False)
        self.pg_collection = self.objects.schedule_groups
        self._bind()

    def _round_notice(self, decision: Decision) -> dict | None:
        """The failure notice of the first rank that announced the round ``decision`` ends."""
        key = round_key(decision.generation - 1)
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _announced_at(self, decision: Decision) -> list[float]:
        """When the first rank to notice the failure dates it (a hang: its last heartbeat)."""
        notice = self._round_notice(decision)
        if notice is None:
            return []
        timeout_s = self.monitor.config.heartbeat_timeout_s
        return [notice["time"] - (timeout_s if notice["cause"] == HEARTBEAT else 0.0)]

    def _plan(self, base: Layout, failed: set[int]) -> tuple[Layout, ClockPlan]:
        """The layout (and clocks) that continues ``base`` without ``failed``."""
        # Plans start from a deal of the micro-batches fixed by the replicas alone: a failure
        # in the all-reduce of the step that re-dealt them may leave ranks on either deal.
        total = base.global_num_microbatches
        count = len(base.replicas)
        old = Layout(base.num_layers, tuple(
            Replica(r.index, r.stages, tuple(range(k, total, count)))
            for k, r in enumerate(base.replicas)), base.spares)
        policy = self.args.elastic_policy
        if policy == "elaswave":
            plan = plan_recovery(old, failed, self.cost, PlanOptions(dvfs=True))
            return plan.layout, plan.clocks
        layout = plan_replica_drop(old, failed, keep_global_batch=policy == "reroute")
        return layout, nominal_clock_plan(self.cost, layout, len(layout.spares), PowerModel())

    # -- layout changes at a step boundary ------------------------------------------------------

    def _change_layout(self, plan: Callable[[], tuple[Layout, ClockPlan]], *,
                       joined: frozenset[int] = frozenset(), reason: str = "",
                       predicted_gain: float = 1.0) -> None:
        """Switch to the layout ``plan()`` gives after this iteration, taking ``joined`` in
        (every stage holder calls this alike; the lowest alone plans and commits the change,
        :mod:`.relayout`)."""
        self.snapshots.settle()  # the change starts from this iteration's snapshots
        generation = self.monitor.generation
        if self.is_logger:
            layout, clocks = plan()
            members = tuple(sorted(set(self.monitor.members) | joined))
            decision = Decision(generation + 1, members, (), tuple(sorted(joined)))
            relayout.commit(self.store, LayoutChange(decision, layout, self.state_layout,
                                                     self.iteration, clocks, time.time(),
                                                     reason, predicted_gain))
        change = relayout.wait_for_plan(self.store, generation + 1, self.monitor.failure_detected)
        if change is None:  # a failure's decision ended the generation instead
            self.monitor.raise_if_failed()
        self._follow_change(change)

    def _plan_growth(self, joined: frozenset[int]) -> tuple[Layout, ClockPlan]:
        """The failure-free layout when every rank it uses is back, else a plan for it without
        the ranks still missing."""
        complete = failure_free_layout(self.args)
        missing = set(complete.known_ranks() - self.layout.known_ranks() - joined)
        if not missing:
            return complete, nominal_clock_plan(self.cost, complete, 0, PowerModel())
        try:
            return self._plan(complete, missing)
        except PlanError:  # the joiners wait as spares until more ranks are back
            layout = self.layout
            return Layout(layout.num_layers, layout.replicas,
                          tuple(sorted({*layout.spares, *joined}))), self.governor.plan

    def _follow_change(self, plan: LayoutChange) -> None:
        """A member's part in a layout change: the next generation's groups (all of them anew
        when ranks join, else only those that change), then the common part."""
        self.monitor.advance(plan.decision)
        if plan.decision.joined:
            self.registry.grow(plan.layout, plan.decision.generation,
                               abort=self.monitor.failure_detected)
        else:
            self.registry.edit((), plan.layout, EditMode.INPLACE,
                               generation=plan.decision.generation)
        self.complete_change(plan)

    def complete_change(self, plan: LayoutChange) -> None:
        """Restore the state of the step boundary into ``plan``'s layout and carry on; members
        and joiners alike, once the groups of ``plan`` exist."""
        edited = time.time()
        times = RecoveryTimes(failure_at=plan.announced_at, noticed_at=plan.announced_at,
                              agreed_at=plan.announced_at, planned_at=plan.announced_at,
                              edited_at=edited)
        self._restore(plan.decision, plan.layout, times)
        self.governor.apply(plan.clocks, plan.layout)
        if self.detector is not None:  # a grow is planned; moved layers keep the planned counts
            self.detector.reset(planned=plan.layout if plan.decision.joined else None)
        total = times.migrated_at - plan.announced_at
        phases = dict(total_s=total, comm_s=edited - plan.announced_at,
                      rebuild_s=times.rebuilt_at - edited,
                      migrate_s=times.migrated_at - times.rebuilt_at,
                      bytes_moved=times.bytes_moved, layout=plan.layout.to_json())
        if not plan.decision.joined:
            self.metrics.write("rebalance", iteration=self.iteration, reason=plan.reason,
                               predicted_gain=plan.predicted_gain, **phases)
            if self.is_logger:
                log(f" rebalanced after iteration {self.iteration}: {plan.reason}; predicted "
                    f"{plan.predicted_gain:.2f}x faster ({total:.2f} s, "
                    f"{times.bytes_moved / 1e6:.1f} MB moved)")
            return
        self.metrics.write("grow", iteration=self.iteration, joined_ranks=list(plan.decision.joined),
                           clocks=[list(replica) for replica in plan.clocks.clocks], **phases)
        if self.is_logger:
            log(f" ranks {list(plan.decision.joined)} joined after iteration {self.iteration} in "
                f"{total:.2f} s (groups {edited - plan.announced_at:.2f}, rebuild "
                f"{times.rebuilt_at - edited:.2f}, migrate {times.migrated_at - times.rebuilt_at:.2f}; "
                f"{times.bytes_moved / 1e6:.1f} MB moved); {len(plan.layout.active_ranks())} ranks "
                f"hold stages, micro-batches per replica "
                f"{[r.num_microbatches for r in plan.layout.replicas]}")

    # -- state ----------------------------------------------------------------------------------

    def _rollback_iteration(self, prefix: str, members: list[int]) -> int:
        """The newest iteration whose state survives whole: every surviving stage holder has
        its own snapshot of it and every failed one has a replica on some survivor."""
        self.store.set(f"{prefix}/held/{self.rank}", json.dumps(self.snapshots.store.held()))
        keys = [f"{prefix}/held/{member}" for member in members]
        wait_for_keys(self.store, keys, timedelta(seconds=self.monitor.config.agreement_timeout_s),
                      self.monitor.failure_detected)
        everything = {m: {tuple(x) for x in json.loads(self.store.get(k))} for m, k in zip(members, keys)}
        holders = self.state_layout.active_ranks()
        candidates = None
        for rank in holders:
            mine = ({i for r, i in everything[rank] if r == rank} if rank in everything
                    else {i for held_by in everything.values() for r, i in held_by if r == rank})
            candidates = mine if candidates is None else candidates & mine
        if not candidates:
            raise CannotContinue("no iteration has a complete set of surviving snapshots "
                                 f"after ranks {sorted(self.lost)} failed")
        return max(candidates)

    def _restore(self, decision: Decision, layout: Layout, times: RecoveryTimes) -> None:
        prefix = f"rt/gen{decision.generation}/restore"
        members = sorted(layout.known_ranks())
        self.snapshots.discard()
        iteration = self._rollback_iteration(prefix, members)
        # What this rank serves: its own shard if it held one, and the failed ranks' replicas.
        serves = {self.rank} if self.rank in self.state_layout.active_ranks() else set()
        held: dict[str, torch.Tensor] = {}
        state = None
        for rank, snapshot_iteration in self.snapshots.store.held():
            if snapshot_iteration == iteration and rank in serves | self.lost:
                tensors, snapshot_state = self.snapshots.store.restore(rank, iteration)
                held.update(tensors)
                state = snapshot_state if rank == self.rank or state is None else state
        active = self.rank in layout.active_ranks()
        state = self._share_state(prefix, layout, state)
        if active and state is None:
            raise CannotContinue(f"rank {self.rank} holds no snapshot of iteration {iteration}")
        # Drop the old objects before building new ones: their groups are gone.
        self.objects = self.stages = self.p2p = None
        self.layout = layout
        if active:
            self._build_objects()
        times.rebuilt_at = time.time()
        needs = needed_pieces(self.objects, self.tp_rank) if active else []
        values, moved = migrate(
            held, needs, rank=self.rank, members=members, store=self.store,
            prefix=f"{prefix}/migrate", group=self.registry.group(Role.MEMBERS),
            timeout=timedelta(seconds=self.monitor.config.collective_timeout_s),
            failure=self.monitor.failure_detected)
        times.bytes_moved += moved
        times.rolled_back_to = iteration
        if active:
            self.iteration, self.consumed_samples = state["iteration"], state["consumed_samples"]
            load_pieces(self.objects, needs, values, state["adam_step"])
            self.objects.scheduler.load_state_dict(state["scheduler"])
            # Only Megatron's stateful streams need this; layout-invariant ones are keyed.
            restore_rng_states(state["rng"])
        self._commit_restore(prefix, members, layout)
        if active:
            # The snapshots held so far stay: named globally, they serve any later layout, and a
            # failure before the new ones are replicated still finds its state in them.
            self.snapshots = StepSnapshots(layout, self.rank, self.snapshots.store.config,
                                           group=self.registry.group(Role.WORLD),
                                           store=self.snapshots.store)
            self._snapshot_now()
        times.migrated_at = time.time()
        if self.is_logger and self.metrics.path is None:
            self.metrics = MetricsWriter(self.args.elastic_metrics_file)
        # Every rank holds the same records back; the one with the file writes them.
        self.write_records(up_to=iteration)
        if not self.is_logger and self.metrics.path is not None:  # a lower rank is back
            self.metrics.close()
            self.metrics = MetricsWriter(None)

    def _commit_restore(self, prefix: str, members: list[int], layout: Layout) -> None:
        """Wait until every member has restored, then take ``layout`` as the one whose state
        the ranks hold. A failure before every member got here interrupts them all alike, so
        the next recovery starts from the same view of the state on every rank."""
        self.store.set(f"{prefix}/restored/{self.rank}", "")
        wait_for_keys(self.store, [f"{prefix}/restored/{member}" for member in members],
                      timedelta(seconds=self.monitor.config.agreement_timeout_s),
                      self.monitor.failure_detected)
        self.state_layout, self.lost = layout, set()

    def _share_state(self, prefix: str, layout: Layout, state: dict | None) -> dict | None:
        """The small state (iteration, schedule, Adam step, RNG) for a rank that held no stage
        when it was taken (a replacement, or a spare back at work): the lowest holder of each
        TP rank publishes its own when the new layout has such ranks."""
        newcomers = layout.active_ranks() - self.state_layout.active_ranks()
        if not newcomers:
            return state
        holders = sorted(self.state_layout.active_ranks() - self.lost)
        position = self.state_layout.position(self.rank)
        if position is not None and self.rank == min(
                r for r in holders if self.state_layout.position(r)[2] == position[2]):
            self.store.set(f"{prefix}/state/tp{position[2]}", pickle.dumps(state))
        if state is not None or self.rank not in newcomers:
            return state
        key = f"{prefix}/state/tp{layout.position(self.rank)[2]}"
        wait_for_keys(self.store, [key], timedelta(seconds=self.monitor.config.agreement_timeout_s),
                      self.monitor.failure_detected)
        return pickle.loads(self.store.get(key))

    def _record_recovery(self, first_step_s: float) -> None:
        times, self._pending = self._pending, None
        total = times.migrated_at + first_step_s - times.failure_at
        self.metrics.write(
            "recovery",
            iteration=self.iteration,
            failed_ranks=times.failed_ranks,
            causes={str(rank): times.causes[rank] for rank in times.failed_ranks},
            detect_s=times.noticed_at - times.failure_at,
            agree_s=times.agreed_at - times.noticed_at,
            plan_s=times.planned_at - times.agreed_at,
            comm_s=times.edited_at - times.planned_at,
            rebuild_s=times.rebuilt_at - times.edited_at,
            migrate_s=times.migrated_at - times.rebuilt_at,
            first_step_s=first_step_s,
            total_s=total,
            bytes_moved=times.bytes_moved,
            rolled_back_to=times.rolled_back_to,
            rerun_cause=times.rerun_cause,
            layout=self.layout.to_json(),
            clocks=[list(replica) for replica in self.governor.plan.clocks],
            dvfs=self.governor.backend.name,
        )
        if self.is_logger:
            causes = "; ".join(f"{rank}: {times.causes[rank]}" for rank in times.failed_ranks)
            what = (f"the failure of ranks {times.failed_ranks} ({causes})" if times.failed_ranks
                    else f"an error with no rank failing ({times.rerun_cause})")
            log(f" recovered from {what}: rolled "
                f"back to iteration {times.rolled_back_to}, re-ran iteration {self.iteration} on "
                f"{len(self.layout.active_ranks())} ranks in {total:.2f} s (detect "
                f"{times.noticed_at - times.failure_at:.2f}, agree "
                f"{times.agreed_at - times.noticed_at:.2f}, plan {times.planned_at - times.agreed_at:.2f}, "
                f"groups {times.edited_at - times.planned_at:.2f}, rebuild "
                f"{times.rebuilt_at - times.edited_at:.2f}, migrate "
                f"{times.migrated_at - times.rebuilt_at:.2f}, first step {first_step_s:.2f}; "
                f"{times.bytes_moved / 1e6:.1f} MB moved)")


def build_elastic_trainer(args: argparse.Namespace, backend: DeviceBackend, rank: int,
                          world_size: int, vocab_size: int, train_source: MicrobatchSource,
                          valid_source: MicrobatchSource | None, *,
                          model_factory: ModelFactory | None = None,
                          **trainer_fields) -> ElasticTrainer:
    """Groups from the registry, the stage objects of the failure-free layout, the monitor.
    ``model_factory`` builds the chunks (default: from the flags); ``trainer_fields`` are passed
    on to :class:`ElasticTrainer`."""
    store = connect_store(timeout=timedelta(minutes=args.distributed_timeout_minutes))
    config = MonitorConfig(heartbeat_timeout_s=args.elastic_heartbeat_timeout)
    timeout = timedelta(seconds=config.collective_timeout_s)
    layout = failure_free_layout(args)
    registry = GroupRegistry(layout, rank, store=store, backend=backend.dist_backend, timeout=timeout)
    seed_random_generators(args.seed, registry.process_group_collection())
    model_factory = model_factory or ModelFactory.from_flags(args, vocab_size)
    objects = build_stage_objects(args, layout, registry, model_factory, backend.device())
    monitor = FailureMonitor(store, rank, Decision.initial(world_size), config, job_size=world_size)
    snapshots = StepSnapshots(layout, rank, snapshot_config(args, backend),
                              group=registry.group(Role.WORLD))
    parts = _runtime_parts(args, backend, rank, vocab_size, config, model_factory)
    parts["governor"].apply(nominal_clock_plan(parts["cost"], layout, 0, PowerModel()), layout)
    return ElasticTrainer(
        args=args, objects=objects, pg_collection=objects.schedule_groups, backend=backend,
        layout=layout, train_source=train_source, valid_source=valid_source,
        metrics=MetricsWriter(args.elastic_metrics_file if rank == 0 else None), rank=rank,
        snapshots=snapshots, registry=registry, monitor=monitor, store=store, **parts,
        **trainer_fields)


def failure_free_layout(args: argparse.Namespace) -> Layout:
    """The layout Megatron builds for the job's flags."""
    return Layout.megatron(tp=args.tensor_model_parallel_size,
                           pp=args.pipeline_model_parallel_size, dp=args.data_parallel_size,
                           num_layers=args.num_layers,
                           num_microbatches=args.global_batch_size // args.micro_batch_size)


def _runtime_parts(args: argparse.Namespace, backend: DeviceBackend, rank: int, vocab_size: int,
                   config: MonitorConfig, model_factory: ModelFactory) -> dict:
    """The trainer's model factory, planner costs, clock governor, fault injection and
    straggler handling, from the flags."""
    return dict(
        model_factory=model_factory,
        cost=cost_model(args, vocab_size, backend),
        governor=DvfsGovernor(clock_backend(args.elastic_dvfs, backend.device().index or 0,
                                            args.elastic_dvfs_command), rank),
        injector=FaultInjector(args.elastic_inject_failure, rank,
                               hang_s=3 * config.heartbeat_timeout_s),
        slowdowns=tuple(args.elastic_inject_slowdown),
        detector=(StragglerDetector(RebalanceConfig(
            window=args.elastic_rebalance_window, min_gain=args.elastic_rebalance_min_gain,
            slow_stage_factor=args.elastic_slow_stage_factor))
                  if args.elastic_rebalance_window else None),
    )


def join_elastic_job(args: argparse.Namespace, backend: DeviceBackend, rank: int,
                     world_size: int, vocab_size: int, train_source: MicrobatchSource,
                     valid_source: MicrobatchSource | None) -> ElasticTrainer:
    """A replacement's trainer: ask to join, wait until the job takes this rank in at a step
    boundary, form the grown generation's groups with the members and receive the state.
    Raises :class:`~.relayout.JobFinished` if the job ends first."""
    store = connect_store(timeout=timedelta(minutes=args.distributed_timeout_minutes))
    config = MonitorConfig(heartbeat_timeout_s=args.elastic_heartbeat_timeout)
    log(f" rank {rank} asks to rejoin the running job")
    relayout.request_join(store, rank)
    plan = relayout.wait_for_acceptance(store, rank)
    monitor = FailureMonitor(store, rank, plan.decision, config, job_size=world_size,
                             skip_recorded_deaths=True)
    monitor.start()  # the members watch this rank's heartbeat from the plan on
    registry = GroupRegistry.joining(plan.layout, rank, store=store,
                                     backend=backend.dist_backend,
                                     timeout=timedelta(seconds=config.collective_timeout_s),
                                     generation=plan.decision.generation,
                                     abort=monitor.failure_detected)
    if rank in plan.layout.active_ranks():  # its stage may span several layer groups
        seed_random_generators(args.seed,
                               registry.process_group_collection(registry.layer_groups()[0]))
    trainer = ElasticTrainer(
        args=args, objects=None, pg_collection=None, backend=backend, layout=plan.state_layout,
        train_source=train_source, valid_source=valid_source, metrics=MetricsWriter(None),
        rank=rank, iteration=plan.iteration,
        snapshots=StepSnapshots(plan.state_layout, rank, snapshot_config(args, backend)),
        registry=registry, monitor=monitor, store=store,
        **_runtime_parts(args, backend, rank, vocab_size, config,
                         ModelFactory.from_flags(args, vocab_size)))
    trainer.complete_change(plan)
    return trainer



def run_elastic(trainer: ElasticTrainer) -> None:
    """Train to the end through failures; a spare serves recoveries and takes part in grows
    meanwhile. No rank leaves before every member of the job is done, since any of them may
    still need its state."""
    while True:
        if trainer.rank in trainer.layout.active_ranks():
            trainer.train()
        outcome = _wait_for_the_others(trainer)
        if outcome is None:
            if trainer.args.save:
                directory = trainer.save_checkpoint(trainer.args.save)
                if trainer.is_logger:
                    log(f" saved checkpoint at iteration {trainer.iteration} to {directory}")
            return
        if isinstance(outcome, LayoutChange):
            try:
                trainer._follow_change(outcome)
                continue
            except (RuntimeError, FailureDetected) as error:
                outcome = error
        trainer.recover(outcome)


def _wait_for_the_others(trainer: ElasticTrainer) -> LayoutChange | RuntimeError | None:
    """Wait until every member has finished (``None``), ranks join (their plan) or a failure is
    noticed (an error to recover from)."""
    generation = trainer.monitor.generation
    trainer.store.set(f"rt/gen{generation}/done/{trainer.rank}", "")
    done = [f"rt/gen{generation}/done/{member}" for member in sorted(trainer.layout.known_ranks())]
    while not trainer.store.check(done):
        if trainer.monitor.failure_detected.is_set():
            return RuntimeError("a rank failed while this one waited for the others")
        if (plan := relayout.published_plan(trainer.store, generation + 1)) is not None:
            return plan
        time.sleep(0.05)
    trainer.store.set(relayout.FINISHED_KEY, "")
    return None
