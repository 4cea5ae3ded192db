"""The recovery protocol of an elastic trainer: from a failed step to the re-run of it.

On every survivor (``docs/design.md``, section 3):

1. *detect*: the failure monitor notices (launcher death record, heartbeat, or a collective that
   fails) and aborts every in-flight collective, so the training thread unblocks;
2. *agree* through the store on the failed set and the next generation; the decision says why
   and when each rank failed;
3. *plan* the next layout (:mod:`.planning`, a pure function every survivor evaluates alike);
4. *edit* the process groups in place (only their members take part);
5. *restore*: rebuild the Megatron objects of this rank's stage for the new layout, roll back to
   the newest iteration whose snapshots survive and migrate parameters and Adam shards from the
   survivors' snapshots and the failed ranks' replicas (the trainer, with :mod:`.restore`);
6. re-run the broken iteration with the same micro-batch ids.

A failure during any of these starts them again with the union of the failed sets.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from megatron_elaswave.launch.store import store_address
from megatron_elaswave.planner.replan import PlanError
from megatron_elaswave.runtime.agreement import agree
from megatron_elaswave.runtime.communicator import EditMode, group_specs, member_lists

from . import relayout
from ..step.loop import log
from .outcomes import CannotContinue, NonFiniteLoss, StepFailed
from .planning import plan_without
from .records import RecoveryTimes
from .rescue import checkpoint_layout

if TYPE_CHECKING:
    from megatron_elaswave.launch.decisions import Decision

    from .elastic import ElasticTrainer

RESCUE_DIRECTORY = "elaswave-checkpoint"
"""Where the survivors save when they cannot continue and ``--save`` is not given."""


@dataclass
class StepRetries:
    """Bounds the re-runs of an iteration that fails while no rank does: ``max_retries`` for
    an error, once for a non-finite loss."""

    max_retries: int
    """``--elastic-max-step-retries``."""
    count: int = 0
    """Recoveries in which no rank failed since :attr:`iteration` last completed."""
    iteration: int = 0
    """The iteration that failed with no rank failing."""
    nonfinite_loss: float | None = None
    """The non-finite loss that made :attr:`iteration` run again, if that was why."""
    nonfinite_where: str = ""
    """Which ranks' losses were not finite, and their pipelines."""

    def nonfinite(self, loss: float, iteration: int, where: str) -> NonFiniteLoss:
        """Note that ``iteration`` reduced to ``loss``, not finite on the ranks ``where``
        says; the error to recover from."""
        self.nonfinite_loss, self.nonfinite_where = loss, where
        return NonFiniteLoss(f"lm loss is {loss} at iteration {iteration} (not finite: {where})")

    def failed(self, attempted: int, rolled_back_to: int, cause: str) -> str | None:
        """Count a recovery that failed nobody while iteration ``attempted`` ran; past the limit,
        why the job stops, else ``None``."""
        self.count += 1
        self.iteration = max(self.iteration, attempted)
        if self.count <= (1 if self.nonfinite_loss is not None else self.max_retries):
            return None
        if self.nonfinite_loss is not None:
            return (f"lm loss is {self.nonfinite_loss} at iteration {self.iteration}, again when "
                    f"re-run from the snapshot of iteration {rolled_back_to}: it reproduces, so "
                    "the data or the hyper-parameters are at fault")
        return (f"iteration {self.iteration} failed {self.count} times with no rank failing "
                f"({cause}); --elastic-max-step-retries {self.max_retries}")

    def completed(self, iteration: int, loss: float) -> str | None:
        """Forget the re-runs once ``iteration`` reaches the one that failed; what to say if a
        non-finite loss did not reproduce."""
        if not self.count or iteration < self.iteration:
            return None
        said = None
        if self.nonfinite_loss is not None:
            said = (f"iteration {iteration} had lm loss {self.nonfinite_loss}; run again from its "
                    f"snapshot it has {loss:.6E}: the non-finite loss did not reproduce (a "
                    f"transient fault or a faulty device; not finite then: "
                    f"{self.nonfinite_where}), so training goes on")
        self.count, self.nonfinite_loss, self.nonfinite_where = 0, None, ""
        return said


class Recovery:
    """One rank's recoveries: steps 1-5 of the module docstring, on ``trainer``'s parts.

    A recovery's times go into one :class:`~.records.RecoveryTimes` however many failures
    interrupt it; :attr:`pending` holds it until the re-run iteration is recorded."""

    def __init__(self, trainer: ElasticTrainer) -> None:
        self.trainer = trainer
        self.pending: RecoveryTimes | None = None
        self.retries = StepRetries(trainer.args.elastic_max_step_retries)

    def recover(self, error: BaseException) -> None:
        """Recover from ``error``, again after every failure that interrupts the recovery.

        An error is never taken as proof that nobody failed: this rank first waits (at most
        ``MonitorConfig.evidence_timeout_s``) for a failure to account for it. Without one, the
        error is this rank's own: the others are told, the agreement fails nobody and the
        iteration is re-run from its snapshot, at most ``--elastic-max-step-retries`` times
        (once for a non-finite loss) before :class:`StepFailed`. Raises
        :class:`CannotContinue` when the job store is lost, the state is gone, or the recovery
        itself fails with no failure to account for it."""
        monitor = self.trainer.monitor
        raised_at = time.time()
        while True:
            if not monitor.explains(error):
                log(f" rank {self.trainer.rank}: {type(error).__name__}: {error}; no rank "
                    "failed, so the iteration runs again from its snapshot")
            if monitor.store_lost:
                raise CannotContinue(f"lost the job store at {store_address()} "
                                     f"({monitor.store_lost})")
            try:
                self._recover_once(error, raised_at)
                return
            except Exception as again:
                if isinstance(again, (CannotContinue, StepFailed)):
                    raise
                if not monitor.explains(again):  # would fail the same way every time
                    raise CannotContinue(f"the recovery failed with no rank failing "
                                         f"({type(again).__name__}: {again})") from None
                error = again

    def _recover_once(self, error: BaseException, raised_at: float) -> None:
        trainer, monitor = self.trainer, self.trainer.monitor
        attempted = trainer.iteration + 1
        trainer.injector.at("recovery", attempted)
        noticed = time.time()
        monitor.report_error(error)
        times = self.pending = self.pending or RecoveryTimes(
            failure_at=min(raised_at, monitor.failure.time), noticed_at=noticed)
        decision = agree(trainer.store, monitor)
        if decision.relayout:  # a layout change came first: the failure is the next one's
            if not times.failed_ranks:
                self.pending = None
            timeout = timedelta(seconds=monitor.config.agreement_timeout_s)
            trainer.follow_change(relayout.committed_plan(trainer.store, decision.generation,
                                                          timeout))
            return
        # A replacement that died while joining is a member of the generation, not yet of the
        # layout: it counts as failed too.
        members = set(trainer.layout.known_ranks()) | set(monitor.members)
        monitor.advance(decision)
        times.agreed_at = time.time()
        failed = members - set(decision.survivors)
        times.failed_ranks = sorted(set(times.failed_ranks) | failed)
        # A rank excluded by an interrupted attempt keeps the cause that attempt's decision gave.
        for rank in failed:
            if rank in decision.failed or rank not in times.causes:
                times.causes[rank] = decision.cause(rank)
        times.failure_at = min(times.failure_at, decision.failed_at or times.failure_at)
        failed &= trainer.layout.known_ranks()
        trainer.lost |= failed
        trainer.durable.abandon_saves_of(failed)
        if not failed:
            times.rerun_cause = decision.error
        # Every connection was shut down to unblock the training thread: re-create all groups
        # of the new layout, each by its own members only. An interrupted recovery may have
        # left the groups on a layout the trainer never reached.
        grouped = trainer.registry.layout
        old_lists, ungrouped = member_lists(group_specs(grouped)), failed - grouped.known_ranks()
        try:
            new_layout, clocks = plan_without(trainer.layout, failed, trainer.cost,
                                              trainer.args.elastic_policy)
        except PlanError as plan_error:
            self._stop_with_checkpoint(str(plan_error), failed, ungrouped, decision, old_lists,
                                       times)
        times.planned_at = time.time()
        trainer.registry.edit(failed - ungrouped, new_layout, EditMode.INPLACE, broken=old_lists,
                              generation=decision.generation, abort=monitor.failure_detected)
        times.edited_at = time.time()
        trainer.restore(decision.generation, new_layout, times)
        if not failed:
            reason = self.retries.failed(attempted, times.rolled_back_to, times.rerun_cause)
            if reason is not None:
                raise StepFailed(self.save_rollback_state(reason, times.rolled_back_to,
                                                          decision.generation),
                                 announce=trainer.is_logger)
        trainer.governor.apply(clocks, new_layout)
        if not trainer.is_active:  # a spare runs no step to record the recovery with
            self.pending = None
        if trainer.detector is not None:
            trainer.detector.reset(planned=new_layout)

    def _stop_with_checkpoint(self, reason: str, failed: set[int], ungrouped: set[int],
                              decision: Decision, old_lists, times: RecoveryTimes) -> None:
        """Gather the rollback iteration's state into the checkpoint layout, save it, stop."""
        trainer = self.trainer
        layout = checkpoint_layout(trainer.layout, failed)
        if layout is None:
            raise CannotContinue(f"{reason}; no stage has a tensor-parallel group left whole, so "
                                 "the survivors cannot save a checkpoint either")
        trainer.registry.edit(failed - ungrouped, layout, EditMode.INPLACE, broken=old_lists,
                              generation=decision.generation)
        trainer.restore(decision.generation, layout, times)
        raise CannotContinue(self.save_rollback_state(reason, times.rolled_back_to,
                                                      decision.generation))

    def save_rollback_state(self, reason: str, iteration: int, generation: int) -> str:
        """Save the state of ``iteration`` restored in the layout of ``generation`` and wait for
        it; ``reason`` with where it went."""
        root = self.trainer.args.save or os.path.abspath(RESCUE_DIRECTORY)
        directory = self.trainer.save_and_wait(root, iteration, generation)
        return (f"{reason}. The state of iteration {iteration} is saved in {directory}: resume "
                f"with --load {root}")
