"""The training loop of ``pretrain_gpt.py``: Megatron-Core schedules, Megatron-LM's log lines,
and one metrics record per iteration.

Loss is normalised per token over the whole global batch (``calculate_per_token_loss``), so the
gradient does not depend on how the batch is split over replicas and micro-batches.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_elaswave.device import DeviceBackend
from megatron_elaswave.layout import Layout
from megatron_elaswave.metrics import MetricsWriter, samples_digest
from megatron_elaswave.patches.moe_utils import MOE_LOSSES, discard_aux_losses, recorded_losses
from megatron_elaswave.patches.multi_token_prediction import discard_mtp_losses, recorded_mtp_losses
from megatron_elaswave.patches.schedules import forward_backward_on
from megatron_elaswave.runtime import dropout_rng
from megatron_elaswave.simulator.schedule import microbatch_group_size

from .data import MicrobatchIds, MicrobatchSource, StepData
from .layer_groups import forward_pre_hooks_on, schedule_no_sync
from .model import TrainingObjects
from .snapshots import StepSnapshots
from .writers import ScalarWriters, gpt_training_flops


def log(message: str) -> None:
    print(message, flush=True)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token loss: (sum of token losses, token count, report) as megatron-core expects."""
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(output_tensor.view(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def stage_of(model) -> torch.nn.Module:
    """The module that knows whether it is a first or last stage: a chunk inside its DDP, or a
    stage of several chunks itself."""
    return model if hasattr(model, "pre_process") else model.module


def forward_step(data_iterator, model):
    stage = stage_of(model)
    batch = next(data_iterator) if data_iterator is not None else None
    if batch is not None:  # layout-invariant dropout: every stage knows the global micro-batch
        dropout_rng.set_microbatch(batch["microbatch_id"])
    # Multi-token prediction layers embed the tokens again, on the last stage.
    embeds = stage.pre_process or getattr(stage, "mtp_process", False)
    tokens = batch["tokens"] if embeds else None
    position_ids = batch["position_ids"] if embeds else None
    labels = batch["labels"] if stage.post_process else None
    loss_mask = batch["loss_mask"] if stage.post_process else None
    # The multi-token prediction losses are masked like the model's.
    output = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


@dataclass
class StepResult:
    """What every rank knows after one iteration (reduced over the job)."""

    lm_loss: float
    num_tokens: int
    sample_ids: list[int]
    grad_norm: float | None
    step_time_s: float
    skipped: bool
    reported: torch.Tensor | None = None
    """The sum over ranks of :meth:`Trainer.step_report`, if any."""
    moe_losses: dict[str, float] = field(default_factory=dict)
    """An MoE model's load-balancing (and z-) losses, as Megatron-LM's log line gives them."""
    mtp_losses: dict[str, float] = field(default_factory=dict)
    """The multi-token prediction layers' losses (``mtp_1 loss``, ...), as Megatron-LM's log line
    gives them."""


@dataclass(frozen=True)
class Reduced:
    """A step's values summed over the job (:meth:`Trainer._reduce`)."""

    loss_sum: float
    num_tokens: int
    sample_ids: list[int]
    """The sample that filled each slot of the global batch (-1: none, or more than one)."""
    reported: torch.Tensor | None
    """The sum of every rank's :meth:`Trainer.step_report`."""
    moe_sums: torch.Tensor | None
    """The sums of the MoE loss metrics (:func:`recorded_losses`), in an MoE model."""
    mtp_sums: torch.Tensor | None
    """The sums of the multi-token prediction losses (:func:`recorded_mtp_losses`), one per
    layer, in a model with such layers."""


@dataclass(frozen=True)
class MoeLosses:
    """Which MoE loss metrics a model records, and how Megatron-LM's log line averages them: the
    sum over every rank and micro-batch, per micro-batch of the global batch, over the MoE
    layers (a metric Megatron sums over data-parallel ranks, times their number)."""

    names: tuple[str, ...]
    """The metrics the routers record, in :data:`MOE_LOSSES` order."""
    num_layers: int
    """Layers of the model, multi-token prediction layers included: the length of each
    metric's record."""
    num_moe_layers: int
    """As Megatron counts them: the decoder's MoE layers and every multi-token prediction
    layer."""
    data_parallel_size: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> "MoeLosses | None":
        """The metrics of ``args`` (Megatron-LM's flags); ``None`` for a dense model."""
        if not getattr(args, "num_experts", None):
            return None
        types = args.moe_router_load_balancing_type
        types = types if isinstance(types, list) else [types]
        coefficients = args.moe_aux_loss_coeff
        coefficients = coefficients if isinstance(coefficients, list) else [coefficients] * len(types)
        recorded = {kind for kind, coefficient in zip(types, coefficients) if coefficient}
        names = [name for kind, name in (("aux_loss", MOE_LOSSES[0]), ("seq_aux_loss", MOE_LOSSES[1]),
                                         ("global_aux_loss", MOE_LOSSES[2])) if kind in recorded]
        if getattr(args, "moe_z_loss_coeff", None):
            names.append(MOE_LOSSES[3])
        pattern = getattr(args, "moe_layer_freq", 1)
        moe_layers = (sum(pattern) if isinstance(pattern, list)
                      else len(range(0, args.num_layers, pattern)))
        mtp_layers = getattr(args, "mtp_num_layers", None) or 0
        return cls(tuple(names), args.num_layers + mtp_layers, moe_layers + mtp_layers,
                   args.data_parallel_size)

    def values(self, sums: torch.Tensor, num_microbatches: int) -> dict[str, float]:
        """Each metric's value from the job-wide sums of :func:`recorded_losses`."""
        values = {}
        for row, name in enumerate(MOE_LOSSES):
            if name in self.names:
                scale = self.data_parallel_size if name == MOE_LOSSES[2] else 1
                values[name] = float(sums[row].sum()) * scale / (
                    num_microbatches * max(self.num_moe_layers, 1))
        return values


@dataclass
class Trainer:
    """Runs iterations on one rank for a fixed layout."""

    args: argparse.Namespace
    objects: TrainingObjects
    pg_collection: ProcessGroupCollection
    backend: DeviceBackend
    layout: Layout
    train_source: MicrobatchSource
    valid_source: MicrobatchSource | None
    metrics: MetricsWriter
    rank: int
    snapshots: StepSnapshots | None = None
    forward_step_func: Callable = forward_step
    """Megatron's ``forward_step(data_iterator, model)``; its iterator yields this loop's
    micro-batches (:class:`StepData`)."""
    log_iterations: bool = True
    """Print Megatron-LM's iteration log line every ``--log-interval`` iterations."""
    writers: ScalarWriters | None = None
    """The TensorBoard and W&B scalars this rank writes while it logs."""
    reduce_group: dist.ProcessGroup | None = None
    """The group over which step results are reduced (every rank that holds a stage)."""
    iteration: int = 0
    consumed_samples: int = 0
    _interval_times: list[float] = field(default_factory=list)
    _cpu_time_recorded: float = field(default_factory=time.process_time)
    """This process's CPU time, all threads, when the last iteration record was made."""
    _unwritten: list[dict] = field(default_factory=list)
    """Iteration records held back by :meth:`_record`."""

    def __post_init__(self) -> None:
        self._bind()

    @functools.cached_property
    def moe_losses(self) -> MoeLosses | None:
        """The MoE loss metrics the model records (``None`` for a dense model)."""
        return MoeLosses.of(self.args)

    @property
    def mtp_num_layers(self) -> int:
        """The model's multi-token prediction layers (0: none)."""
        return getattr(self.args, "mtp_num_layers", None) or 0

    def _bind(self) -> None:
        """Derive what the loop uses from the layout, the objects and the groups; called again
        whenever they change."""
        position = self.layout.position(self.rank)
        assert position is not None, f"rank {self.rank} holds no stage"
        self.replica = self.layout.replica_by_index()[position[0]]
        self.is_data_reporter = position[2] == 0  # one rank of each TP group reports
        self.stages = self.objects.stages
        self.forward_backward = forward_backward_on(
            self.pg_collection, self.objects.config,
            len(self.stages) if len(self.stages) > 1 else None)

    @property
    def is_logger(self) -> bool:
        """One rank logs: the lowest that holds a stage."""
        return self.rank == min(self.layout.active_ranks())

    # -- one step ------------------------------------------------------------------------------

    def _step_data(self, source: MicrobatchSource, consumed: int) -> list[StepData | MicrobatchIds]:
        """Each virtual stage's micro-batches: the data on the first and last pipeline stage
        (every virtual stage of it, as Megatron-LM hands each one a data iterator there, since a
        script's ``get_batch`` may decide by pipeline rank alone), the ids elsewhere."""
        edge = any(stage_of(stage).pre_process or stage_of(stage).post_process
                   for stage in self.stages)
        return [
            StepData(source, consumed, self.replica.microbatch_ids, self.backend.device())
            if edge else MicrobatchIds(self.replica.microbatch_ids)  # ids only, for dropout_rng
            for stage in self.stages
        ]

    def _run_schedule(self, data: list[StepData | MicrobatchIds], forward_only: bool):
        config = self.objects.config
        if len(self.stages) > 1:  # interleaved: the replica's count may have been re-dealt
            config.microbatch_group_size_per_vp_stage = microbatch_group_size(
                self.replica.num_microbatches, self.pg_collection.pp.size())
        # The stage's own chunks, whatever a caller's loop set on the config for the chunks it
        # started with (Megatron-LM's train(), with --overlap-grad-reduce): reductions start as
        # gradients are ready, and parameters are gathered by the chunks' forward pre-hooks.
        config.no_sync_func = schedule_no_sync(self.stages)
        config.grad_sync_func = config.param_sync_func = None
        iterators = [iter(d) if d is not None else None for d in data]
        return self.forward_backward(
            forward_step_func=self.forward_step_func,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.stages,
            num_microbatches=self.replica.num_microbatches,
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
            forward_only=forward_only,
        )

    def _reduce(self, data: list[StepData | MicrobatchIds], losses: list[dict], gbs: int,
                report: torch.Tensor | None = None):
        """One world all-reduce: loss sum, token count, which sample filled each slot, the sum
        of every rank's ``report`` and of its MoE loss metrics and multi-token prediction
        losses, where the model has them."""
        mbs = self.args.micro_batch_size
        tails = []
        if self.moe_losses is not None:
            tails.append(recorded_losses(self.moe_losses.num_layers)[0].flatten())
        if self.mtp_num_layers:
            tails.append(recorded_mtp_losses(self.mtp_num_layers))
        if tails:
            report = torch.cat(([report.double()] if report is not None else []) + tails)
        extra = 0 if report is None else report.numel()
        vector = torch.zeros(2 + 2 * gbs + extra, dtype=torch.float64)
        if report is not None:
            vector[2 + 2 * gbs:] = report
        if self.is_data_reporter and losses:
            totals = torch.stack([entry["lm loss"] for entry in losses]).double().sum(dim=0)
            vector[0:2] += totals.cpu()
        first = next((d for d, s in zip(data, self.stages) if stage_of(s).pre_process), None)
        if self.is_data_reporter and first is not None:
            for microbatch_id, ids in first.served_sample_ids.items():
                for offset, sample_id in enumerate(ids):
                    slot = microbatch_id * mbs + offset
                    vector[2 + slot] += sample_id + 1
                    vector[2 + gbs + slot] += 1
        vector = vector.to(self.backend.device())
        dist.all_reduce(vector, group=self.reduce_group)
        vector = vector.cpu()
        counts = vector[2 + gbs:2 + 2 * gbs]
        ids = [int(v) - 1 if c == 1 else -1 for v, c in zip(vector[2:2 + gbs].tolist(), counts.tolist())]
        reported = vector[2 + 2 * gbs:] if extra else None
        moe_sums = mtp_sums = None
        if self.mtp_num_layers:
            mtp_sums, reported = reported[-self.mtp_num_layers:], reported[:-self.mtp_num_layers]
        if self.moe_losses is not None:
            moe_size = len(MOE_LOSSES) * self.moe_losses.num_layers
            moe_sums = reported[-moe_size:].view(len(MOE_LOSSES), -1)
            reported = reported[:-moe_size]
        if reported is not None and reported.numel() == 0:
            reported = None
        return Reduced(float(vector[0]), int(vector[1]), ids, reported, moe_sums, mtp_sums)

    def train_step(self) -> StepResult:
        # Every holder of a chunk gathers its parameters alike in the forward pre-hooks, whatever
        # a caller's loop turned off (a newcomer's first step among members' rebuilt chunks).
        with forward_pre_hooks_on(self.objects.model):
            return self._train_step()

    def _train_step(self) -> StepResult:
        gbs = self.layout.global_num_microbatches * self.args.micro_batch_size
        start = time.perf_counter()
        discard_aux_losses()  # what a broken attempt at this iteration recorded
        discard_mtp_losses()
        for chunk in self.objects.model:
            chunk.zero_grad_buffer()
        self.objects.optimizer.zero_grad()
        data = self._step_data(self.train_source, self.consumed_samples)
        dropout_rng.set_iteration(self.iteration + 1)  # layout-invariant dropout: this step
        losses = self._run_schedule(data, forward_only=False)
        if self.snapshots is not None:  # the optimizer step writes what the last one holds
            self.snapshots.settle()
        self.before_optimizer_step()
        succeeded, grad_norm, _ = self.objects.optimizer.step()
        self.objects.scheduler.step(increment=gbs)
        reduced = self._reduce(data, losses, gbs, self.step_report(losses))
        lm_loss = reduced.loss_sum / max(reduced.num_tokens, 1)
        moe_losses = ({} if reduced.moe_sums is None else self.moe_losses.values(
            reduced.moe_sums, self.layout.global_num_microbatches))
        # Every tensor-parallel rank of the last stage records each micro-batch's mean.
        mtp_losses = ({} if reduced.mtp_sums is None else {
            f"mtp_{layer + 1} loss": float(total) / (self.args.tensor_model_parallel_size
                                                     * self.layout.global_num_microbatches)
            for layer, total in enumerate(reduced.mtp_sums)})
        # A step whose loss is not finite leaves no snapshot: a rollback goes to the one before.
        if self.snapshots is not None and math.isfinite(lm_loss):
            self.take_snapshot(self.iteration + 1, self.consumed_samples + gbs)
            if self.iteration + 1 >= self.args.train_iters:  # no next step to settle it in
                self.snapshots.settle()
        self.backend.synchronize()
        return StepResult(
            lm_loss=lm_loss,
            num_tokens=reduced.num_tokens,
            sample_ids=reduced.sample_ids,
            grad_norm=float(grad_norm) if grad_norm is not None else None,
            step_time_s=time.perf_counter() - start,
            skipped=not succeeded,
            reported=reduced.reported,
            moe_losses=moe_losses,
            mtp_losses=mtp_losses,
        )

    def before_optimizer_step(self) -> None:
        """Called between the last backward and the optimizer step."""

    def step_report(self, losses: list[dict]) -> torch.Tensor | None:
        """Values of this rank to sum over the job with the step's results (none here);
        ``losses`` are this rank's micro-batch losses as the schedule returned them."""
        return None

    def take_snapshot(self, iteration: int, consumed_samples: int) -> None:
        self.snapshots.after_step(iteration, self.objects.optimizer, self.objects.scheduler,
                                  consumed_samples)

    # -- reporting -----------------------------------------------------------------------------

    def _cpu_time_since_last_record(self) -> float:
        """CPU seconds this process spent, on every thread, since the last iteration record: the
        step's own work and what runs beside it (snapshot exchanges, the failure monitor)."""
        now = time.process_time()
        spent, self._cpu_time_recorded = now - self._cpu_time_recorded, now
        return spent

    def _record(self, result: StepResult, gbs: int, **extra) -> None:
        """The iteration's metrics record (with ``extra`` fields) and, every ``--log-interval``
        iterations, Megatron-LM's log line. The record is held back while :meth:`holds_record`, so
        that none is written for an iteration a rollback may re-run."""
        fields = dict(
            iteration=self.iteration,
            lm_loss=result.lm_loss,
            global_batch_size=gbs,
            consumed_samples=self.consumed_samples,
            samples_digest=samples_digest(result.sample_ids),
            world_size=len(self.layout.active_ranks()),
            layout=self.layout.to_json(),
            step_time_s=result.step_time_s,
            cpu_time_s=self._cpu_time_since_last_record(),
            grad_norm=result.grad_norm,
            **({"moe_losses": result.moe_losses} if result.moe_losses else {}),
            **({"mtp_losses": result.mtp_losses} if result.mtp_losses else {}),
            **({"snapshot_bytes": self.snapshots.bytes_held} if self.snapshots else {}),
            **extra,
        )
        self._interval_times.append(result.step_time_s)
        lr = self.objects.optimizer.param_groups[0]["lr"]
        if self.writers is not None and self.is_logger:
            scalars = {"lm loss": result.lm_loss, "learning-rate": lr, "batch-size": gbs,
                       **result.moe_losses, **result.mtp_losses}
            if result.grad_norm is not None:
                scalars["grad-norm"] = result.grad_norm
            if self.args.log_throughput:
                scalars["throughput"] = self._tflops_per_rank(gbs, result.step_time_s)
            self.writers.write(self.iteration, scalars)
        if self.log_iterations and self.iteration % self.args.log_interval == 0 and self.is_logger:
            elapsed_ms = 1000 * sum(self._interval_times) / len(self._interval_times)
            tokens_per_s = gbs * self.args.seq_length / (elapsed_ms / 1000)
            grad_norm = f"{result.grad_norm:.3f}" if result.grad_norm is not None else "n/a"
            throughput = (f"throughput per GPU (TFLOP/s/GPU): "
                          f"{self._tflops_per_rank(gbs, elapsed_ms / 1000):.3f} | "
                          if self.args.log_throughput else "")
            log(
                f" [{datetime.now():%Y-%m-%d %H:%M:%S}] iteration {self.iteration:8d}/"
                f"{self.args.train_iters:8d} | consumed samples: {self.consumed_samples:12d} | "
                f"elapsed time per iteration (ms): {elapsed_ms:.1f} | {throughput}"
                f"throughput (tokens/s): {tokens_per_s:.0f} | learning rate: {lr:.6E} | "
                f"global batch size: {gbs:5d} | lm loss: {result.lm_loss:.6E} | "
                + "".join(f"{name}: {value:.6E} | " for name, value
                          in (result.moe_losses | result.mtp_losses).items())
                + f"grad norm: {grad_norm} | number of skipped iterations: "
                f"{int(result.skipped):3d} |"
            )
            self._interval_times.clear()
        # Every rank settled the earlier iterations' snapshots before this step's reduction.
        self.write_records()
        self._unwritten.append(fields)
        if not self.holds_record():
            self.write_records()

    def _tflops_per_rank(self, samples: int, seconds: float) -> float:
        """``--log-throughput``: the model's training TFLOP/s per rank that holds a stage, as
        Megatron-LM counts them (:func:`.writers.gpt_training_flops`)."""
        ranks = len(self.layout.active_ranks())
        return gpt_training_flops(self.args, samples) / (max(seconds, 1e-9) * ranks * 1e12)

    def holds_record(self) -> bool:
        """Whether the record of the iteration just done waits for the next step: here while
        its snapshot is pending on this rank."""
        return self.snapshots is not None and self.snapshots.pending

    def write_records(self, up_to: int | None = None) -> None:
        """Write the held-back iteration records, or only those of iterations up to ``up_to``
        (the rollback's: the others are re-run), and forget them."""
        for fields in self._unwritten:
            if up_to is None or fields["iteration"] <= up_to:
                self.metrics.write("iteration", **fields)
        self._unwritten.clear()

    def evaluate(self, source: MicrobatchSource | None = None, evaluation: int | None = None) -> float:
        """Mean per-token loss over ``--eval-iters`` global batches of ``source`` (default: the
        validation set), the ``evaluation``-th such set of batches (default: one per
        ``--eval-interval`` iterations so far)."""
        source = source or self.valid_source
        assert source is not None
        gbs = self.layout.global_num_microbatches * self.args.micro_batch_size
        if evaluation is None:
            evaluation = self.iteration // self.args.eval_interval
        loss_sum = num_tokens = 0.0
        for model in self.objects.model:
            model.eval()
        with torch.no_grad():
            for k in range(self.args.eval_iters):
                consumed = (evaluation * self.args.eval_iters + k) * gbs
                data = self._step_data(source, consumed)
                losses = self._run_schedule(data, forward_only=True)
                reduced = self._reduce(data, losses, gbs)
                loss_sum, num_tokens = loss_sum + reduced.loss_sum, num_tokens + reduced.num_tokens
        for model in self.objects.model:
            model.train()
        loss = loss_sum / max(num_tokens, 1)
        if self.writers is not None and self.is_logger:
            self.writers.write(self.iteration, {"lm loss validation": loss})
        if self.log_iterations and self.is_logger:
            log(f" validation loss at iteration {self.iteration} | lm loss value: {loss:.6E} | "
                f"lm loss PPL: {math.exp(min(loss, 20)):.6E} |")
        return loss

    # -- the loop ------------------------------------------------------------------------------

    def train(self, on_iteration=None) -> None:
        """Train until ``--train-iters``; ``on_iteration(trainer)`` runs after each iteration."""
        while self.iteration < self.args.train_iters:
            result = self.train_step()
            gbs = len(result.sample_ids)
            self.iteration += 1
            self.consumed_samples += gbs
            self._record(result, gbs)
            if not math.isfinite(result.lm_loss):
                raise FloatingPointError(f"lm loss is {result.lm_loss} at iteration {self.iteration}")
            if self.valid_source is not None and self.iteration % self.args.eval_interval == 0:
                self.evaluate()
            if on_iteration is not None:
                on_iteration(self)

