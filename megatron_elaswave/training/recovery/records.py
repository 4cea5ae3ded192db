"""What an elastic job says about its recoveries and layout changes: one metrics record each and,
on the logger rank, one log line with the time of every phase."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_elaswave.layout import Layout
from megatron_elaswave.metrics import MetricsWriter
from megatron_elaswave.planner.frequency import ClockPlan

from ..step.loop import log


def split_held_records(records: list[dict], *, iteration: int, up_to: int | None,
                       written: int | None) -> tuple[list[dict], list[dict]]:
    """The iteration records a rank held back, split into those it writes now and those it
    keeps. ``iteration`` is the rank's current iteration; ``up_to`` the rollback's (records after
    it are dropped: those iterations run again), or ``None`` at a step's end; ``written`` the
    last iteration in the metrics file when this rank logs, ``None`` when another rank does.

    The logger writes what it has not written yet. Every other rank keeps what the logger may
    not have written, so that whichever rank logs after a failure writes it: at a step's end the
    records of the last two iterations (the logger took part in this step, so it wrote the ones
    before), in a recovery every record up to the rollback (another failure may interrupt the
    recovery before the logger writes them)."""
    if up_to is not None:
        records = [r for r in records if r["iteration"] <= up_to]
    if written is not None:
        return [r for r in records if r["iteration"] > written], []
    if up_to is None:
        records = [r for r in records if r["iteration"] >= iteration - 1]
    return [], records


@dataclass
class RecoveryTimes:
    """Wall-clock marks of one recovery (or layout change) on this rank (``time.time()``)."""

    failure_at: float
    noticed_at: float
    agreed_at: float = 0.0
    planned_at: float = 0.0
    edited_at: float = 0.0
    rebuilt_at: float = 0.0
    migrated_at: float = 0.0
    failed_ranks: list[int] = field(default_factory=list)
    causes: dict[int, str] = field(default_factory=dict)
    """Why each failed rank was excluded."""
    bytes_moved: int = 0
    rolled_back_to: int = 0
    rerun_cause: str = ""
    """With no failed rank: the error that made the iteration run again."""

    @property
    def phases(self) -> str:
        return (f"groups {self.edited_at - self.planned_at:.2f}, rebuild "
                f"{self.rebuilt_at - self.edited_at:.2f}, migrate "
                f"{self.migrated_at - self.rebuilt_at:.2f}")


def schedule_note(layout: Layout, virtual_stages: int) -> str:
    """What a log line says of the replicas of a job with ``virtual_stages`` per stage that run
    1F1B in ``layout`` (those whose stages changed), or nothing."""
    one_chunk = [r.index for r in layout.replicas if r.virtual_stages == 1]
    if virtual_stages == 1 or not one_chunk:
        return ""
    return f"; replicas {one_chunk} run 1F1B, their stages changed"


def write_recovery(metrics: MetricsWriter, times: RecoveryTimes, *, iteration: int,
                   first_step_s: float, layout: Layout, clocks: ClockPlan, dvfs: str,
                   announce: bool, virtual_stages: int = 1) -> None:
    """The ``recovery`` record of a recovery whose re-run iteration ``iteration`` took
    ``first_step_s``; with ``announce``, its log line (which names the replicas that lost
    their ``virtual_stages``)."""
    total = times.migrated_at + first_step_s - times.failure_at
    metrics.write(
        "recovery",
        iteration=iteration,
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
        layout=layout.to_json(),
        clocks=[list(replica) for replica in clocks.clocks],
        dvfs=dvfs,
    )
    if not announce:
        return
    causes = "; ".join(f"{rank}: {times.causes[rank]}" for rank in times.failed_ranks)
    what = (f"the failure of ranks {times.failed_ranks} ({causes})" if times.failed_ranks
            else f"an error with no rank failing ({times.rerun_cause})")
    log(f" recovered from {what}: rolled back to iteration {times.rolled_back_to}, re-ran "
        f"iteration {iteration} on {len(layout.active_ranks())} ranks in {total:.2f} s (detect "
        f"{times.noticed_at - times.failure_at:.2f}, agree {times.agreed_at - times.noticed_at:.2f}, "
        f"plan {times.planned_at - times.agreed_at:.2f}, {times.phases}, first step "
        f"{first_step_s:.2f}; {times.bytes_moved / 1e6:.1f} MB moved)"
        f"{schedule_note(layout, virtual_stages)}")


def write_change(metrics: MetricsWriter, times: RecoveryTimes, *, iteration: int, layout: Layout,
                 joined: tuple[int, ...], clocks: ClockPlan, reason: str, predicted_gain: float,
                 announce: bool) -> None:
    """The record of a layout change at a step boundary: a ``grow`` when ranks ``joined``,
    else a ``rebalance`` that moved layers; with ``announce``, its log line."""
    total = times.migrated_at - times.planned_at
    phases = dict(total_s=total, comm_s=times.edited_at - times.planned_at,
                  rebuild_s=times.rebuilt_at - times.edited_at,
                  migrate_s=times.migrated_at - times.rebuilt_at,
                  bytes_moved=times.bytes_moved, layout=layout.to_json())
    moved = f"{times.bytes_moved / 1e6:.1f} MB moved"
    if not joined:
        metrics.write("rebalance", iteration=iteration, reason=reason,
                      predicted_gain=predicted_gain, **phases)
        if announce:
            log(f" rebalanced after iteration {iteration}: {reason}; predicted "
                f"{predicted_gain:.2f}x faster ({total:.2f} s, {moved})")
        return
    metrics.write("grow", iteration=iteration, joined_ranks=list(joined),
                  clocks=[list(replica) for replica in clocks.clocks], **phases)
    if announce:
        log(f" ranks {list(joined)} joined after iteration {iteration} in {total:.2f} s "
            f"({times.phases}; {moved}); {len(layout.active_ranks())} ranks hold stages, "
            f"micro-batches per replica {[r.num_microbatches for r in layout.replicas]}")


def write_redeal(metrics: MetricsWriter, *, iteration: int, layout: Layout, reason: str,
                 predicted_gain: float, announce: bool) -> None:
    """The ``rebalance`` record of micro-batches re-dealt after ``iteration``; with
    ``announce``, its log line."""
    metrics.write("rebalance", iteration=iteration, reason=reason, layout=layout.to_json(),
                  predicted_gain=predicted_gain)
    if announce:
        log(f" rebalanced after iteration {iteration}: {reason}; micro-batches per replica now "
            f"{[r.num_microbatches for r in layout.replicas]}, predicted "
            f"{predicted_gain:.2f}x faster")
