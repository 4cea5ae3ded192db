"""``--elastic`` training: a rank dies, the survivors reshard and re-run the iteration it broke.

:class:`ElasticTrainer` is Megatron's training loop (:class:`~megatron_elaswave.training.step.loop.Trainer`) with what survives
failures attached: per-step snapshots, a failure monitor, a group registry it edits in place,
and a :class:`~.protocol.Recovery`, handed to it, that runs the recovery protocol on a failed
step (agree, plan, edit the groups, restore, re-run). The trainer itself owns the state of the
stage it holds and how that state is restored into a new layout (rollback, share, migrate:
:meth:`restore`).

With ``--save`` the trainer queues a durable checkpoint of every ``--save-interval``-th
iteration, of the last one and of the one after which the job stops early
(``--exit-signal-handler``, ``--exit-duration-in-mins``): each rank writes its own snapshot of it
in the background (:mod:`.durable`). When no layout of the survivors can hold the model, they gather the state of
the rollback iteration into the checkpoint layout (:mod:`.rescue`), save it the same way to
``--save`` (default ``./elaswave-checkpoint``), wait for it and stop with
:class:`~.outcomes.CannotContinue`, naming what is missing and where the checkpoint is;
``--load`` resumes from it in any layout.

A ``recovery`` record with the time of each phase goes into the metrics file (:mod:`.records`).
A rank the new layout does not use (a spare) serves its snapshots and waits, taking part in
later recoveries.

Without a failure, a replica that runs persistently slower gets fewer of the global batch's
micro-batches, or layers move off a stage on a slow device (:mod:`.stragglers`; a ``rebalance``
record says why and the predicted gain). Replacement ranks join at a step boundary
(:mod:`.relayout`; a ``grow`` record), and a job whose lost ranks are all back runs at its
failure-free layout again. :mod:`.elastic_setup` builds the trainer.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from megatron_elaswave.launch.decisions import Decision
from megatron_elaswave.launch.keys import (
    ABANDONED,
    COMMITTED,
    FINISHED_KEY,
    RECORDS_WRITTEN_KEY,
    checkpoint_key,
    done_key,
)
from megatron_elaswave.launch.store import read_if_set
from megatron_elaswave.layout import Layout
from megatron_elaswave.metrics import MetricsWriter
from megatron_elaswave.patches.dist_checkpointing import chunk_placements
from megatron_elaswave.patches.gpt_model import routed_experts, transformer_layers
from megatron_elaswave.planner.cost import CostModel
from megatron_elaswave.planner.dataflow import resize_deal
from megatron_elaswave.planner.frequency import ClockPlan
from megatron_elaswave.planner.zero import survival
from megatron_elaswave.runtime.communicator import EditMode, GroupRegistry, Role
from megatron_elaswave.runtime.dvfs import DvfsGovernor
from megatron_elaswave.runtime.faults import FaultInjector, InjectedSlowdown, slow_down
from megatron_elaswave.runtime.monitor import FailureMonitor
from megatron_elaswave.runtime.world import release_retired
from megatron_elaswave.waiting import wait_until

from . import relayout
from ..checkpointing.checkpoint import TrainingProgress, checkpoint_common, checkpoint_dir
from ..checkpointing.durable import (
    DurableCheckpoints,
    SaveFailed,
    SaveRequest,
    expected_tensors,
)
from ..step.layer_groups import ModelFactory, build_stage_objects
from ..step.loop import StepResult, Trainer, log
from ..step.migration import NamedShard, StateLost, adam_step, load_pieces, migrate, needed_pieces
from .outcomes import CannotContinue
from .planning import plan_growth
from .records import (
    RecoveryTimes,
    split_held_records,
    write_change,
    write_recovery,
    write_redeal,
)
from .relayout import LayoutChange
from .restore import RestoreRound
from ..step.snapshots import StepSnapshots, restore_rng_states
from ..step.stopping import SAVE_FAILED, StopConditions, describe
from .stragglers import ForwardTimer, StageCompute, StepTimes, StragglerDetector
from ..step.writers import ScalarWriters

_END_POLL_S = 0.05
"""The longest pause between two looks at the store while a rank waits, at the end of the run,
for the others or for the outcome of its last save: they wait on steps and writes."""


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
    microbatches_at: Callable[[int], int] | None = None
    """The global batch's micro-batch count after a number of consumed samples, on Megatron's
    batch size schedule (a ramp-up); ``None``: the layout's count throughout."""
    defer_joins: bool = False
    """Take ranks that ask to join in as the next iteration starts, not right after the one
    whose reduction told of them: a loop that runs collectives of its own between iterations
    (Megatron-LM's) has a newcomer take part in them only from its first iteration on."""
    durable: DurableCheckpoints = None
    """This rank's writer of durable checkpoints (``--save``, and the survivors' last one)."""
    saves_itself: bool = True
    """Queue the checkpoints ``--save-interval``, the last iteration and an early stop ask for
    (:meth:`save_durably`); Megatron-LM's loop asks for them itself instead."""
    stop_conditions: StopConditions = None
    """This rank's reasons to stop before ``--train-iters``."""
    recovery_of: Callable[[ElasticTrainer], Any] = None
    """Builds, from this trainer, what runs the recovery protocol on a failed step
    (:class:`~.protocol.Recovery`, which works on the trainer's parts)."""

    def __post_init__(self) -> None:
        self._joining: frozenset[int] = frozenset()
        """With :attr:`defer_joins`: the ranks to take in as the next iteration starts."""
        self._step_started = self._pipeline_done = 0.0
        self._last_change_s = 0.0
        """How long this rank's last layout change at a step boundary took (0 before any)."""
        self._nan_output = False
        self._collected_generation = self.registry.generation
        self._stage_timer = self._layers_timer = None
        if self.rank in self.layout.active_ranks():  # a replacement has no stage before it joins
            super().__post_init__()
        self.state_layout = self.layout
        """The layout whose snapshots the ranks hold: the last one restored."""
        self.lost: set[int] = set()
        """Ranks failed since the state was last restored; their replicas must serve it."""
        self._records_written = 0
        """While this rank logs: the last iteration whose record is in the metrics file."""
        self.stop_conditions = self.stop_conditions or StopConditions()
        self.stopping: str | None = None
        """Why the job stops after the current iteration (every stage holder agrees)."""
        self.recovery = self.recovery_of(self)
        if self.detector is not None:
            self.detector.reset(planned=self.layout)

    def _bind(self) -> None:
        super()._bind()
        self.reduce_group = self.registry.group(Role.WORLD)
        self.tp_rank = self.layout.position(self.rank)[2]
        self._named_shard = NamedShard(self.objects, self.tp_rank)
        finalize = self.objects.config.finalize_model_grads_func

        def timed_finalize(*args, **kwargs):
            """Replicas first wait for each other in the gradient reduction: time up to it."""
            self._pipeline_done = time.perf_counter()
            self.injector.at("allreduce", self.iteration + 1)
            return finalize(*args, **kwargs)

        self.objects.config.finalize_model_grads_func = timed_finalize
        chunks = [ddp.module for ddp in self.objects.model]
        layers = transformer_layers(chunks)
        if self.injector.armed:  # hooks only where a failure is to be injected
            self.objects.model[-1].module.register_forward_hook(self._inject_into_output)
            for experts in routed_experts(layers):
                experts.register_forward_pre_hook(self._inject_between_all_to_alls)
        for slowdown in self.slowdowns:
            if slowdown.rank == self.rank:
                slow_down(layers, slowdown, lambda: self.iteration + 1)
        if self.detector is not None:  # after the slowdown's hooks, so that they count
            self._stage_timer, self._layers_timer = ForwardTimer(chunks), ForwardTimer(layers)

    def _inject_between_all_to_alls(self, module, inputs) -> None:
        """The injected failures of an MoE layer's experts (phase ``alltoall``)."""
        self.injector.at("alltoall", self.iteration + 1)

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
            tensors=self._named_shard.tensors(), adam_step=adam_step(self.objects))
        self.injector.at("snapshot", iteration)

    def train_step(self):
        self._step_started = time.perf_counter()
        if self.detector is not None:
            self._stage_timer.restart()
            self._layers_timer.restart()
        self._nan_output = self.injector.at("forward", self.iteration + 1)
        return super().train_step()

    def evaluate(self, source=None, evaluation: int | None = None) -> float:
        self.injector.at("evaluation", self.iteration)
        return super().evaluate(source, evaluation)

    def step_report(self, losses: list[dict]) -> torch.Tensor:
        """Blocks of one value per launch rank: the ranks asking to join, the loss sum of each
        loss-reporting rank (so that a non-finite loss names where it arose), why each rank asks
        the job to stop (:mod:`.stopping`), then (with a straggler detector) each stage's time to
        the gradient reduction, its forward time, the part of it spent in transformer layers,
        the time from the reduction to now (the optimizer step included) and how long this
        rank's last layout change took."""
        size = self.monitor.job_size
        report = torch.zeros((3 if self.detector is None else 8) * size, dtype=torch.float64)
        report[list(self.monitor.waiting_to_join())] = 1.0
        report[2 * size + self.rank] = self.stop_conditions.code() or (
            SAVE_FAILED if self.args.elastic_save_failures == "stop" and self.durable.failed
            else 0)
        if self.is_data_reporter and losses:
            local_loss = torch.stack([entry["lm loss"][0] for entry in losses]).sum()
            report[size + self.rank] = local_loss.item()
        if self.detector is not None and self.tp_rank == 0:
            report[3 * size + self.rank] = self._pipeline_done - self._step_started
            report[4 * size + self.rank] = self._stage_timer.total_s
            report[5 * size + self.rank] = self._layers_timer.total_s
            report[6 * size + self.rank] = time.perf_counter() - self._pipeline_done
            report[7 * size + self.rank] = self._last_change_s
        return report

    def _nonfinite_losses(self, report: torch.Tensor) -> str:
        """Where the step's loss went non-finite, from its summed reports."""
        replicas = self.layout.replica_by_index()
        where = []
        for rank, loss in enumerate(report.view(-1, self.monitor.job_size)[1].tolist()):
            if not math.isfinite(loss):
                replica = replicas[self.layout.position(rank)[0]]
                pipeline = sorted(r for stage in replica.stages for r in stage.ranks)
                where.append(f"the loss of rank {rank}, last stage of the pipeline of ranks "
                             f"{pipeline}")
        return "; ".join(where)

    def _stop_reason(self, report: torch.Tensor) -> str | None:
        """Why the job stops after this iteration, from the step's summed reports (the lowest
        rank that asked says), or ``None``. Raises :class:`~megatron_elaswave.training.checkpointing.durable.SaveFailed` where a rank's
        checkpoint could not be written (``--elastic-save-failures stop``)."""
        codes = [int(code) for code in report.view(-1, self.monitor.job_size)[2].tolist() if code]
        if SAVE_FAILED in codes:  # whoever catches it finishes the saves still in flight
            raise SaveFailed(self.durable.first_failure().line(self.args.save))
        return describe(codes[0], self.args.exit_duration_in_mins) if codes else None

    def _follow_report(self, report: torch.Tensor) -> None:
        """Act on the step's summed reports: the same on every stage holder."""
        joined_flags, _, _, *stage_times = report.view(-1, self.monitor.job_size)
        joined = frozenset(int(rank) for rank in torch.nonzero(joined_flags).flatten())
        if self.iteration >= self.args.train_iters or self.stopping is not None:
            return
        try:
            if joined and self.defer_joins:
                self._joining = joined
            elif joined:
                self._take_in(joined)
            elif self.detector is not None:
                self._follow_stragglers(*stage_times)
        except Exception as error:
            self.recover(error)

    def _take_in(self, joined: frozenset[int]) -> None:
        """Grow the job by the ranks ``joined`` at this step boundary (every stage holder alike)."""
        self._change_layout(
            lambda: plan_growth(self.args, self.layout, joined, self.cost, self.governor.plan),
            joined=joined)

    def _follow_stragglers(self, pipeline_s: torch.Tensor, forward_s: torch.Tensor,
                           layers_s: torch.Tensor, shared_s: torch.Tensor,
                           change_s: torch.Tensor) -> None:
        """Re-deal the micro-batches when a replica is persistently slow, or move layers off a
        slow stage where that pays instead (:mod:`.stragglers`)."""
        leaders = sorted({stage.ranks[0] for r in self.layout.replicas for stage in r.stages})
        self.detector.observe(
            self.layout, {rank: float(pipeline_s[rank]) for rank in leaders},
            {rank: StageCompute(float(layers_s[rank]), float(forward_s[rank] - layers_s[rank]))
             for rank in leaders},
            # The last replica to reach the reduction waits least in it: its time from there on
            # is the part of the step no deal of micro-batches changes.
            StepTimes(shared_s=min(float(shared_s[rank]) for rank in leaders),
                      change_s=max(float(change_s[rank]) for rank in leaders)))
        decision = self.detector.proposal(self.layout)
        if decision is None:
            moved = self.detector.layer_proposal(self.layout)
            if moved is not None:
                self._change_layout(lambda: (moved.layout, self.governor.plan),
                                    reason=moved.reason, predicted_gain=moved.predicted_gain)
            return
        self.detector.redealt()
        self.layout = decision.layout
        self.replica = self.layout.replica_by_index()[self.layout.position(self.rank)[0]]
        write_redeal(self.metrics, iteration=self.iteration, layout=self.layout,
                     reason=decision.reason, predicted_gain=decision.predicted_gain,
                     announce=self.is_logger)

    def _follow_batch_schedule(self) -> None:
        """Deal the next iteration's global batch at its size on the batch size schedule, in the
        replicas' current proportions: the same on every stage holder, from the consumed samples
        they share (a rollback deals the re-run iterations at their own sizes again)."""
        if self.microbatches_at is None:
            return
        total = self.microbatches_at(self.consumed_samples)
        if total == self.layout.global_num_microbatches:
            return
        ids = resize_deal({r.index: r.num_microbatches for r in self.layout.replicas}, total,
                          self.layout.lockstep_size)
        self.layout = self.layout.with_replicas(
            tuple(dataclasses.replace(r, microbatch_ids=ids[r.index]) for r in self.layout.replicas))
        self.layout.validate()
        self.replica = self.layout.replica_by_index()[self.layout.position(self.rank)[0]]
        if self.detector is not None:  # as after a re-deal: its times are kept per count
            self.detector.redealt()

    # -- the loop ------------------------------------------------------------------------------

    @property
    def is_active(self) -> bool:
        """Whether this rank holds a stage (a spare does not)."""
        return self.rank in self.layout.active_ranks()

    def ensure_initial_snapshot(self) -> None:
        """Snapshot the state before the first step of this rank, if not held yet."""
        if not any(tag[:2] == (self.rank, self.iteration) for tag in self.snapshots.store.held()):
            self._snapshot_now()
            self.say_protection()

    def say_protection(self) -> None:
        """The logging rank says how many copies each snapshot has and which losses the
        layout's placement of them survives (at start and after every layout change)."""
        if not self.is_logger:
            return
        config = self.snapshots.store.config
        own_bytes = sum(t.nbytes for t in self._named_shard.tensors().values())
        held = survival(self.layout, config.replicas, config.ranks_per_node)
        copies = "1 copy" if config.replicas == 1 else f"{config.replicas} copies"
        log(f" snapshots: {copies} of each rank's state ({own_bytes / 1e6:.1f} MB on rank "
            f"{self.rank}, up to {2 * (1 + config.replicas) * own_bytes / 1e6:.1f} MB held there); "
            f"the layout {held.describe()}")

    def _snapshot_now(self) -> None:
        """Snapshot the current state and settle it at once: the next failure rolls back to it."""
        self.take_snapshot(self.iteration, self.consumed_samples)
        self.snapshots.settle()

    def advance(self) -> StepResult | None:
        """Try the next iteration; on a failure, recover (which may roll back) instead. The
        step's result when its iteration stands (also when a failure noticed as the step returned
        was recovered from by rolling back to it), else ``None``. Any exception the step raises,
        whatever its class (a peer's death, or a bad sample's ``ValueError``), goes to the
        recovery, which bounds the re-runs of an iteration that fails with no rank failing."""
        try:
            self.monitor.raise_if_failed()
            if self._joining:
                joined, self._joining = self._joining, frozenset()
                self._take_in(joined)
            self._follow_batch_schedule()
            result = self.train_step()
        except Exception as error:
            self.recover(error)
            return None
        # A non-finite loss is the same on every rank: each takes it as its own error, even when
        # another has already reported it.
        if not math.isfinite(result.lm_loss):
            error = self.recovery.retries.nonfinite(result.lm_loss, self.iteration + 1,
                                                    self._nonfinite_losses(result.reported))
            self.monitor.report_error(error)  # every rank has the same loss: nothing to wait for
            self.recover(error)
            return None
        gbs = len(result.sample_ids)
        self.iteration += 1
        self.consumed_samples += gbs
        if self.recovery.pending is not None:
            times, self.recovery.pending = self.recovery.pending, None
            write_recovery(self.metrics, times, iteration=self.iteration,
                           first_step_s=result.step_time_s, layout=self.layout,
                           clocks=self.governor.plan, dvfs=self.governor.backend.name,
                           announce=self.is_logger,
                           virtual_stages=self.args.virtual_pipeline_model_parallel_size or 1)
        said = self.recovery.retries.completed(self.iteration, result.lm_loss)
        if said is not None and self.is_logger:
            log(f" {said}")
        self._record(result, gbs, energy_j=self.governor.energy_j(result.step_time_s))
        # The step has snapshotted this iteration, and a recovery may roll back to it: its record
        # is held first, so that a failure noticed now does not lose the iteration's log line.
        completed = self.iteration
        try:
            self.monitor.raise_if_failed()
        except Exception as error:
            self.recover(error)
            return result if self.iteration == completed else None
        self.stopping = self._stop_reason(result.reported)
        if self.saves_itself:
            self._save_if_due()
        if self.stopping is not None and self.is_logger:
            log(f" stopping after iteration {self.iteration}: {self.stopping}")
        self._follow_report(result.reported)
        self._release_past_layouts()
        return result

    def _save_if_due(self) -> None:
        """Queue the checkpoint of this iteration if ``--save-interval`` asks for one, it is the
        last, or the job stops after it."""
        interval = self.args.save_interval
        if self.args.save and (
                (interval and self.iteration % interval == 0)
                or self.iteration >= self.args.train_iters or self.stopping is not None):
            self.save_durably(self.args.save)

    def save_durably(self, root: str, floating_point_operations: float = 0.0) -> SaveRequest | None:
        """Queue the durable checkpoint of the iteration this rank's state is at, under
        ``root``, and return it: every rank that holds a stage calls this at the same step
        boundary, each writing its own snapshot of the iteration in the background
        (:mod:`.durable`). A spare writes nothing (``None``)."""
        if not self.is_active:
            return None
        warn = self.args.elastic_save_failures == "warn"
        if warn and self.is_logger and (failure := self.durable.failing) is not None:
            log(f" warning: {failure.line(root)}; training goes on (--elastic-save-failures warn)")
        own = self.snapshots.own_snapshot(self.iteration)
        if own is None:
            raise RuntimeError(f"rank {self.rank} holds no snapshot of iteration "
                               f"{self.iteration} to save")
        segments, objects = {}, {}
        for ddp in self.objects.model:
            placements = chunk_placements(ddp.module)
            segments.update(placements.segments)
            objects.update(placements.objects)
        writers = tuple(sorted(self.layout.active_ranks()))
        common = None
        if self.rank == writers[0]:
            progress = TrainingProgress(self.iteration, self.consumed_samples,
                                        floating_point_operations)
            common = checkpoint_common(self.args, self.objects, progress, len(writers))
        pieces = self._named_shard.pieces_of(segments)
        with_optimizer = not getattr(self.args, "no_save_optim", False)
        request = SaveRequest(root=root, iteration=self.iteration,
                              generation=self.snapshots.version, writers=writers, snapshot=own,
                              pieces=pieces, objects=objects, common=common,
                              with_optimizer=with_optimizer,
                              expected=expected_tensors(segments, pieces, with_optimizer))
        self.durable.submit(request)
        return request

    def _release_past_layouts(self) -> None:
        """Free the process groups of the layouts this rank trained on before, once no
        operation abandoned in a recovery is still inside them: each keeps gloo threads that
        wake a hundred times a second. The past models that hold them are collected on the
        first step after the groups changed: their hooks and the tracebacks of the step they
        failed in hold them in reference cycles."""
        release_retired()
        if self.registry.generation != self._collected_generation:
            self._collected_generation = self.registry.generation
            gc.collect()

    def _writers_follow_logger(self) -> None:
        """The TensorBoard and W&B writers of this loop's own log (not Megatron-LM's, which
        keeps its own) are open on the logging rank alone: the same directory and W&B run go
        on from whichever rank logs now."""
        if self.is_logger and self.writers is None and self.log_iterations:
            self.writers = ScalarWriters.for_logging_rank(self.args, self.store)
        elif not self.is_logger and self.writers is not None:
            self.writers.close()
            self.writers = None

    def write_records(self, up_to: int | None = None) -> None:
        """The logger writes the held-back records it has not written yet and says so in the
        store; every other rank keeps those it may not have written (:func:`split_held_records`)."""
        # A logger stopped and resumed after the others excluded it must not write: the
        # logger of their layout writes the same records.
        if self.metrics.path is not None and self.monitor.excluded():
            return
        logging = self.metrics.path is not None
        to_write, self._unwritten = split_held_records(
            self._unwritten, iteration=self.iteration, up_to=up_to,
            written=self._records_written if logging else None)
        for fields in to_write:
            self.metrics.write("iteration", **fields)
        if to_write:
            self._records_written = to_write[-1]["iteration"]
            self.store.set(RECORDS_WRITTEN_KEY, str(self._records_written))

    def holds_record(self) -> bool:
        """Always: a rank that settled its own snapshot does not know that every other rank has
        (a node lost while its ranks send their replicas rolls the job back past an iteration
        this rank has settled). The next step's reduction tells, or the end of training."""
        return True

    def train(self, on_iteration=None) -> None:
        self.ensure_initial_snapshot()
        while self.iteration < self.args.train_iters and self.is_active and self.stopping is None:
            if self.advance() is not None and on_iteration is not None:
                on_iteration(self)

    # -- recovery ------------------------------------------------------------------------------

    def recover(self, error: BaseException) -> None:
        """Recover from ``error`` (:meth:`.recovery.Recovery.recover`)."""
        self.recovery.recover(error)

    def save_and_wait(self, root: str, iteration: int, generation: int) -> str:
        """Save the state of ``iteration`` that every member has just restored, in the layout of
        ``generation``, under ``root``, and wait until it is committed; returns its directory.
        Every member of the job calls this; the spares only wait. Raises
        :class:`~.outcomes.CannotContinue` when the save is abandoned (a rank failed meanwhile)."""
        if self.is_active:
            self.save_durably(root)
        outcome = checkpoint_key(f"{iteration}-g{generation}", "outcome")
        resolved = {COMMITTED.encode(), ABANDONED.encode()}
        if not wait_until(lambda: read_if_set(self.store, outcome) in resolved,
                          self.durable.config.timeout_s,
                          max_pause_s=_END_POLL_S):
            raise CannotContinue(f"the checkpoint of iteration {iteration} was not saved "
                                 f"within {self.durable.config.timeout_s:g} s")
        if self.store.get(outcome).decode() == ABANDONED:
            raise CannotContinue(f"a rank failed while the survivors saved iteration {iteration}")
        self.durable.wait()
        return checkpoint_dir(root, iteration)

    def _build_objects(self) -> None:
        """This rank's Megatron objects for ``self.layout`` on the registry's groups, their
        parameters left for a restore to fill."""
        self.objects = build_stage_objects(self.args, self.layout, self.registry, self.model_factory,
                                           self.backend.device(), initialize=False)
        self.pg_collection = self.objects.schedule_groups
        self._bind()

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
            decision = Decision(generation + 1, members, (), tuple(sorted(joined)),
                                relayout=True)
            relayout.commit(self.store, LayoutChange(decision, layout, self.state_layout,
                                                     self.iteration, clocks, time.time(),
                                                     reason, predicted_gain))
        change = relayout.wait_for_plan(self.store, generation + 1, self.monitor.failure_detected)
        if change is None:  # a failure's decision ended the generation instead
            self.monitor.raise_if_failed()
        self.follow_change(change)

    def follow_change(self, plan: LayoutChange) -> None:
        """A member's part in a layout change: the next generation's groups (all of them anew
        when ranks join, else only those that change), then the common part."""
        self.monitor.advance(plan.decision)
        relayout.pause_for_tests()
        if plan.decision.joined:
            self.registry.grow(plan.layout, plan.decision.generation,
                               abort=self.monitor.failure_detected)
        else:
            self.registry.edit((), plan.layout, EditMode.INPLACE,
                               generation=plan.decision.generation,
                               abort=self.monitor.failure_detected)
        self.complete_change(plan)

    def complete_change(self, plan: LayoutChange) -> None:
        """Restore the state of the step boundary into ``plan``'s layout and carry on; members
        and joiners alike, once the groups of ``plan`` exist."""
        announced = plan.announced_at
        times = RecoveryTimes(failure_at=announced, noticed_at=announced, agreed_at=announced,
                              planned_at=announced, edited_at=time.time())
        self.restore(plan.decision.generation, plan.layout, times)
        self._last_change_s = times.migrated_at - times.planned_at
        self.governor.apply(plan.clocks, plan.layout)
        if self.detector is not None:  # a grow is planned; moved layers keep the planned counts
            self.detector.reset(planned=plan.layout if plan.decision.joined else None)
        write_change(self.metrics, times, iteration=self.iteration, layout=plan.layout,
                     joined=plan.decision.joined, clocks=plan.clocks, reason=plan.reason,
                     predicted_gain=plan.predicted_gain, announce=self.is_logger)

    # -- state ----------------------------------------------------------------------------------

    def restore(self, generation: int, layout: Layout, times: RecoveryTimes) -> None:
        """Restore the newest state that survives whole into ``layout``, whose groups (of
        ``generation``) exist: roll back, rebuild this rank's objects, migrate the pieces it
        needs, commit once every member has, and snapshot at once. Raises
        :class:`~.outcomes.CannotContinue` when the state is gone."""
        members = tuple(sorted(layout.known_ranks()))
        restore = RestoreRound(
            self.store, self.registry.generation_store, generation, self.rank, members,
            timedelta(seconds=self.monitor.config.agreement_timeout_s),
            self.monitor.failure_detected)
        self.snapshots.discard()
        iteration = restore.rollback_iteration(self.snapshots.store.held(), self.lost)
        self.snapshots.store.forget_after(iteration)
        # This rank serves every snapshot of that iteration it holds: its own and its replicas
        # of others, whatever layout took them. Pieces are named globally and the state of an
        # iteration is the same in every layout, so an older layout's set covers what a newer
        # one, not yet taken or replicated everywhere when a rank failed, lacks.
        held, state = self.snapshots.store.restore_iteration(iteration, self.rank)
        active = self.rank in layout.active_ranks()
        state, self._unwritten = restore.share_state(state, self._unwritten, self.state_layout,
                                                     layout, self.lost)
        if active and state is None:
            raise CannotContinue(f"rank {self.rank} holds no snapshot of iteration {iteration}")
        # Drop the old objects before building new ones: their groups are gone.
        self.objects = self.stages = self.forward_backward = None
        self.layout = layout
        if active:
            self._build_objects()
        times.rebuilt_at = time.time()
        needs = needed_pieces(self.objects, self.tp_rank) if active else []
        try:
            values, moved = migrate(
                held, needs, rank=self.rank, members=list(members),
                store=self.registry.generation_store,
                prefix=f"{restore.prefix}/migrate", group=self.registry.host_group(Role.MEMBERS),
                timeout=timedelta(seconds=self.monitor.config.collective_timeout_s),
                failure=self.monitor.failure_detected)
        except StateLost as lost:  # every member finds the same pieces missing
            raise CannotContinue(str(lost)) from None
        times.bytes_moved += moved
        times.rolled_back_to = iteration
        if active:
            self.iteration, self.consumed_samples = state["iteration"], state["consumed_samples"]
            load_pieces(self.objects, values, state["adam_step"])
            self.objects.scheduler.load_state_dict(state["scheduler"])
            # Only Megatron's stateful streams need this; layout-invariant ones are keyed.
            restore_rng_states(state["rng"])
        restore.commit()
        self.state_layout, self.lost = layout, set()
        self.stopping = None  # the iterations rolled back are run again; a stop is asked again
        self.injector.at("relayout", self.iteration + 1)
        if active:
            # The snapshots held so far stay: named globally, they serve any later layout, and a
            # failure before the new ones are replicated still finds its state in them.
            self.snapshots = StepSnapshots(layout, self.rank, self.snapshots.store.config,
                                           group=self.registry.host_group(Role.WORLD),
                                           store=self.snapshots.store, version=generation)
            self._snapshot_now()
            self.say_protection()
        times.migrated_at = time.time()
        if self.is_logger and self.metrics.path is None:
            self.metrics = MetricsWriter(self.args.elastic_metrics_file)
            written = read_if_set(self.store, RECORDS_WRITTEN_KEY)
            self._records_written = 0 if written is None else int(written)
        elif not self.is_logger and self.metrics.path is not None:  # another rank logs now
            self.metrics.close()
            self.metrics = MetricsWriter(None)
        self._writers_follow_logger()
        # The logger of the new layout writes the records held back that are not yet written.
        self.write_records(up_to=iteration)


def run_elastic(trainer: ElasticTrainer, *, return_when_used: bool = False) -> bool:
    """Train to the end through failures; a spare serves recoveries and takes part in grows
    meanwhile. No rank leaves before every member of the job is done, since any of them may
    still need its state: then returns ``False``.

    With ``return_when_used``, a rank that holds no stage returns ``True`` as soon as a layout
    (a grow, a recovery) gives it one again, at the job's iteration, instead of training here:
    its caller's loop trains it from there (Megatron-LM's loop, which runs its own collectives
    between iterations)."""
    while True:
        if trainer.rank in trainer.layout.active_ranks():
            if return_when_used:
                return True
            trainer.train()
        outcome = _wait_for_the_others(trainer)
        if outcome is None:
            trainer.write_records()  # every member is done: every snapshot is settled
            return False
        if isinstance(outcome, LayoutChange):
            try:
                trainer.follow_change(outcome)
                continue
            except Exception as error:
                outcome = error
        trainer.recover(outcome)


def _wait_for_the_others(trainer: ElasticTrainer) -> LayoutChange | RuntimeError | None:
    """Wait until every member has finished (``None``), ranks join (their plan) or a failure is
    noticed (an error to recover from)."""
    generation = trainer.monitor.generation
    trainer.store.set(done_key(generation, trainer.rank), "")
    done = [done_key(generation, member) for member in sorted(trainer.layout.known_ranks())]
    plan: LayoutChange | None = None

    def ended() -> bool:
        nonlocal plan
        if trainer.store.check(done):
            return True
        plan = relayout.published_plan(trainer.store, generation + 1)
        return plan is not None

    if not wait_until(ended, None, abandon=trainer.monitor.failure_detected,
                      max_pause_s=_END_POLL_S):
        return RuntimeError("a rank failed while this one waited for the others")
    if plan is not None:
        return plan
    trainer.store.set(FINISHED_KEY, "")
    return None
