"""The elastic job inside Megatron-LM's own loop (``pretrain`` -> ``train`` -> ``train_step``).

Megatron-LM's ``train()`` keeps the model, the optimizer and the data iterator in local
variables and calls ``train_step`` once per iteration. :class:`MegatronLMJob` is what its hooks
(``megatron_elaswave.patches.megatron_lm_elastic``, through :mod:`.hooks`) drive; it guarantees
that

* the model chunks are built by the script's own model provider with Megatron-LM's transformer
  config, one chunk per layer group (:mod:`megatron_elaswave.training.step.layer_groups`), from the
  random state Megatron-LM's initialisation left, and initialised by Megatron
  (``--elastic-init megatron``, the default here) or layout-invariantly; their optimizers take
  Megatron-LM's optimizer config and its parameter-group overrides;
* each micro-batch's loss is normalised as Megatron-LM's schedules normalise it: by its own
  token count and the global batch's micro-batch count (the mean of the micro-batches' means),
  or, with ``--calculate-per-token-loss``, by the global batch's token count;
* every ``train_step`` call ends with one more iteration done than before, re-running any
  iteration a failure broke after the survivors resharded
  (:class:`~megatron_elaswave.training.recovery.elastic.ElasticTrainer`); the script's ``forward_step``
  runs on the micro-batches the layout deals to the replica;
* :meth:`~MegatronLMJob.swap_into` makes ``train()``'s list of chunks and optimizer the current
  ones in place after a layout change, since ``train()`` never looks them up again;
* the default process group of Megatron-LM's own collectives (timers, logging) can be pointed at
  :attr:`~MegatronLMJob.world_group`, the group of the ranks that hold a stage;
* ``--load`` resumes the latest checkpoint before the first snapshot, whatever layout saved it
  (none under ``--load`` yet: training starts from scratch, as in Megatron-LM), and each save
  Megatron-LM's loop asks for (:meth:`~MegatronLMJob.save`) is written from the snapshots in the
  background (:mod:`megatron_elaswave.training.checkpointing.durable`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import ChainedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from torch.distributed import ProcessGroup

from megatron_elaswave.device import DeviceBackend
from megatron_elaswave.launch.keys import shared_key
from megatron_elaswave.launch.store import read_if_set
from megatron_elaswave.patches.megatron_lm_elastic import DefaultGroupRedirect
from megatron_elaswave.runtime import dropout_rng
from megatron_elaswave.runtime.communicator import Role
from megatron_elaswave.training.checkpointing.checkpoint import TRACKER_FILE
from megatron_elaswave.training.step.data import MicrobatchSource, gpt_datasets, train_samples
from megatron_elaswave.training.recovery.elastic import ElasticTrainer, run_elastic
from megatron_elaswave.training.setup.elastic_setup import build_elastic_trainer, join_elastic_job
from megatron_elaswave.training.setup.job import resume
from megatron_elaswave.training.step.layer_groups import ModelFactory
from megatron_elaswave.training.step.loop import log
from megatron_elaswave.training.step.loop import StepResult
from megatron_elaswave.training.step.snapshots import restore_rng_states, rng_states
from megatron_elaswave.training.step.stopping import StopConditions


class UnsupportedModel(TypeError):
    """The script's model provider built something other than a ``GPTModel``."""


def gpt_chunks(model_provider: Callable) -> Callable:
    """:attr:`ModelFactory.build_chunk` over the script's ``model_provider``; raises
    :class:`UnsupportedModel` for a chunk that is not a ``GPTModel`` (``HybridModel``,
    ``MambaModel``): the layer groups, snapshots and migrations know ``GPTModel``'s layers and
    parameter names."""

    def build_chunk(config, pre_process, post_process, groups):
        chunk = model_provider(pre_process=pre_process, post_process=post_process, config=config,
                               pg_collection=groups)
        if not isinstance(chunk, GPTModel):
            raise UnsupportedModel(f"--elastic trains GPTModel (Megatron-LM's pretrain_gpt.py); "
                                   f"this script builds {type(chunk).__name__}")
        return chunk

    return build_chunk


@dataclass(frozen=True)
class EvaluationSplit:
    """What Megatron-LM's loop holds instead of a validation or test data iterator."""

    name: str


VALIDATION = EvaluationSplit("validation")
TEST = EvaluationSplit("test")


def microbatch_mean(loss_func: Callable) -> Callable:
    """``loss_func`` (the script's: ``(loss, num_tokens, report)`` or ``(loss, report)``) as
    megatron-core's schedules apply it without ``calculate_per_token_loss``: the loss divided by
    its micro-batch's token count (at least 1), which then counts as one. The elastic job
    divides the gradients by the count summed over the global batch, so each micro-batch
    weighs ``1 / global micro-batches``, as in Megatron-LM's loop, however the replicas split
    the global batch."""

    def mean_over_microbatch(output_tensor):
        outputs = loss_func(output_tensor)
        if len(outputs) == 3:
            loss, num_tokens, report = outputs
            loss = loss / torch.clamp(num_tokens, min=1)
        else:  # the loss is a mean already
            loss, report = outputs
        return loss, torch.ones((), dtype=torch.int, device=loss.device), report

    return mean_over_microbatch


def feeding(forward_step_func: Callable, per_token_loss: bool) -> Callable:
    """The script's ``forward_step`` on this loop's micro-batches: each call takes the next
    micro-batch of the replica, keys the dropout masks by its global id, and passes the script an
    iterator over that micro-batch alone (a stage without data does not read it). Unless
    ``per_token_loss``, its loss is each micro-batch's mean (:func:`microbatch_mean`)."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        dropout_rng.set_microbatch(batch["microbatch_id"])
        output, loss_func = forward_step_func(iter((batch,)), model)
        return output, loss_func if per_token_loss else microbatch_mean(loss_func)

    return forward_step


NOTHING_DONE = StepResult(lm_loss=0.0, num_tokens=0, sample_ids=[], grad_norm=None,
                          step_time_s=0.0, skipped=False)
"""What ``train_step`` returns on a rank whose loop is catching up with the job: it took part
in none of those iterations (Megatron-LM's log line is not written meanwhile)."""


class MegatronLMJob:
    """One rank's part of an elastic run driven by Megatron-LM's ``train()`` (module docstring)."""

    def __init__(self, trainer: ElasticTrainer,
                 sources: dict[EvaluationSplit, MicrobatchSource | None],
                 resumed_at: tuple[int, int, float] = (0, 0, 0.0), *, joined: bool = False):
        self.trainer = trainer
        self.sources = sources
        self.resumed_at = resumed_at
        """Iteration, consumed samples and floating-point operations ``--load`` resumed."""
        self.last_result: StepResult | None = None
        self.finished = False
        self.in_loop = not joined
        """Whether this rank runs Megatron-LM's loop in step with the others: a replacement
        does from its first ``train_step`` on, and until then takes no part in the loop's
        collectives (:attr:`world_group`)."""
        self.catching_up = False
        """Whether Megatron-LM's loop on this rank is behind the job's iteration: a layout used
        it again after it held no stage. Until the loop is there, its ``train_step`` calls
        return at once and its log lines, saves, evaluations and collectives do nothing, so
        that the loop's iteration-numbered work falls on the same iterations as on the other
        ranks (:meth:`train_step`)."""
        # train() points this config's gradient finalisation at Megatron's own, once, before the
        # first step; the trainer's (the reduction over layer groups) is given back then.
        self._first_config = trainer.objects.config if trainer.objects is not None else None
        self._finalize = getattr(self._first_config, "finalize_model_grads_func", None)

    @classmethod
    def start(cls, args: argparse.Namespace, backend: DeviceBackend, *, rank: int, world_size: int,
              tokenizer, transformer_config: Callable[[], TransformerConfig],
              model_provider: Callable, scheduler: Callable[[ChainedOptimizer], OptimizerParamScheduler],
              optimizer_config: Callable[[], tuple[OptimizerConfig, dict | None]],
              forward_step_func: Callable, global_batch_size_at: Callable[[int], int],
              join: bool = False) -> MegatronLMJob:
        """Build this rank's stage of the failure-free layout and start the failure monitor
        (collective over the job); with ``join``, a replacement's: ask to join the running job,
        wait until it takes this rank in as an iteration starts, and receive the state (raises
        :class:`~megatron_elaswave.training.recovery.relayout.JobFinished` if the job ends first).

        ``model_provider(pre_process=..., post_process=..., config=..., pg_collection=...)`` is the
        script's (Megatron-LM's ``model_provider`` with its builder), ``scheduler(optimizer)``
        Megatron-LM's LR schedule, ``optimizer_config()`` Megatron-LM's optimizer config and
        parameter-group overrides, ``forward_step_func`` the script's ``forward_step``,
        ``global_batch_size_at(consumed_samples)`` Megatron's batch size schedule (a ramp-up).
        The chunks are built from the random state Megatron-LM's initialisation left.
        """
        megatron_random_state = rng_states()  # the chunks start from it, as in Megatron-LM
        gbs = args.global_batch_size
        eval_samples = args.eval_iters * gbs
        evaluations = args.train_iters // args.eval_interval + 1 if args.eval_interval else 1
        train, valid, test = gpt_datasets(
            args, tokenizer,
            [train_samples(args), evaluations * eval_samples or None, eval_samples or None])

        def source(dataset):
            return MicrobatchSource(dataset, args.micro_batch_size) if dataset is not None else None

        factory = ModelFactory(
            config=transformer_config, build_chunk=gpt_chunks(model_provider), scheduler=scheduler,
            optimizer_config=optimizer_config,
            seed_generators=lambda groups: restore_rng_states(megatron_random_state))
        common = dict(
            model_factory=factory,
            forward_step_func=feeding(forward_step_func, args.calculate_per_token_loss),
            log_iterations=False, defer_joins=True,
            microbatches_at=lambda consumed: global_batch_size_at(consumed) // args.micro_batch_size)
        sources = (source(train), source(valid))
        if join:
            trainer = join_elastic_job(args, backend, rank, world_size, args.padded_vocab_size,
                                       *sources, **common)
        else:
            trainer = build_elastic_trainer(
                args, backend, rank, world_size, args.padded_vocab_size, *sources,
                first_global_batch_size=global_batch_size_at(0), **common)
        # Megatron-LM's loop asks for its saves and stops on its own conditions.
        trainer.saves_itself, trainer.stop_conditions = False, StopConditions()
        # A replacement starts train() where the job is.
        resumed_at = (trainer.iteration, trainer.consumed_samples, 0.0)
        if not join:
            if args.load and os.path.isfile(os.path.join(args.load, TRACKER_FILE)):
                progress = resume(trainer, args.load)
                resumed_at = (progress.iteration, progress.consumed_samples,
                              progress.floating_point_operations)
            elif args.load and rank == 0:
                log(f" no checkpoint in --load {args.load}: training starts from iteration 0")
            trainer.monitor.start()
            trainer.ensure_initial_snapshot()
        return cls(trainer, {VALIDATION: source(valid), TEST: source(test)}, resumed_at,
                   joined=join)

    # -- what Megatron-LM's loop sees ----------------------------------------------------------

    @property
    def world_group(self) -> ProcessGroup | object:
        """The ranks that hold a stage, in launch-rank order (edited in place after failures);
        on a rank outside them, or not yet in step with Megatron-LM's loop,
        :attr:`DefaultGroupRedirect.OUTSIDE`."""
        if not (self.trainer.is_active and self.in_loop and not self.catching_up):
            return DefaultGroupRedirect.OUTSIDE
        return self.trainer.registry.group(Role.WORLD)

    @property
    def num_active_ranks(self) -> int:
        return len(self.trainer.layout.active_ranks())

    @property
    def consumed_samples(self) -> int:
        return self.trainer.consumed_samples

    @property
    def iteration(self) -> int:
        """Iterations done."""
        return self.trainer.iteration

    def evaluation_splits(self) -> tuple[EvaluationSplit | None, EvaluationSplit | None]:
        """What ``train()`` holds for its validation and test iterators (None: no such split)."""
        validation, test = (split if self.sources[split] is not None else None
                            for split in (VALIDATION, TEST))
        return validation, test

    def objects(self) -> tuple[list, ChainedOptimizer, OptimizerParamScheduler]:
        """The chunks, optimizer and LR schedule to hand to ``train()``."""
        objects = self.trainer.objects
        return list(objects.model), objects.optimizer, objects.scheduler

    def swap_into(self, model: list, optimizer: ChainedOptimizer,
                  scheduler: OptimizerParamScheduler) -> None:
        """Make the objects ``train()`` holds the current ones, in place. New chunks take the
        forward pre-hooks (``--overlap-param-gather``) as ``train()`` left the old ones, which
        it turns on and off itself; a spare's list empties (and that of a rank catching up), so
        that ``train()`` syncs no parameters over groups that are gone, or not in step."""
        objects = self.trainer.objects
        if objects is None or self.catching_up:  # no stage, or not in step with it yet
            model[:] = []
            return
        if model and model[0] is not objects.model[0]:
            hooked = bool(getattr(model[0], "remove_forward_pre_hook_handles", None))
            for chunk in objects.model:
                if bool(getattr(chunk, "remove_forward_pre_hook_handles", None)) and not hooked:
                    chunk.disable_forward_pre_hook(param_sync=False)
        model[:] = objects.model
        for held, current in ((optimizer, objects.optimizer), (scheduler, objects.scheduler)):
            if held is not current:
                held.__dict__.update(current.__dict__)

    # -- iterations ----------------------------------------------------------------------------

    def train_step(self, iteration: int) -> StepResult | None:
        """Complete iteration ``iteration + 1`` (``iteration`` are done), through failures. After
        the last iteration, or on a rank left without a stage, wait until every rank is done
        (a spare serves recoveries meanwhile). A spare that a later layout uses again (the
        replacement of its tensor-parallel partner joined, say) goes back to Megatron-LM's loop
        at the job's iteration (:attr:`catching_up`).

        The step's result (:data:`NOTHING_DONE` while catching up); ``None`` on a rank that
        holds no stage when the job is done.
        """
        trainer = self.trainer
        if self.catching_up:
            # Behind the job, the loop takes part in nothing; after the job's last iteration,
            # it ends in step with the others (which take part in its final work with it).
            self.catching_up = (iteration + 1 < trainer.iteration if self.finished
                                else iteration < trainer.iteration)
            if self.catching_up:
                return NOTHING_DONE
            if self.finished:
                return self.last_result
        self.in_loop = True
        if trainer.objects is not None and trainer.objects.config is self._first_config:
            self._first_config.finalize_model_grads_func = self._finalize
        while not self.finished:
            while trainer.is_active and trainer.iteration <= iteration:
                self.last_result = trainer.advance() or self.last_result
            if trainer.is_active and trainer.iteration < trainer.args.train_iters:
                break
            try:
                used_again = run_elastic(trainer, return_when_used=not trainer.is_active)
            except BaseException:
                self.close()
                raise
            if not used_again:
                self.close()
            elif iteration < trainer.iteration < trainer.args.train_iters:
                self.catching_up = True
                return NOTHING_DONE
        if not trainer.is_active:
            return None
        # Used again as the job ended: the loop runs out the iterations it missed.
        self.catching_up = iteration + 1 < trainer.iteration
        return NOTHING_DONE if self.catching_up else self.last_result

    def save(self, iteration: int, floating_point_operations: float) -> None:
        """Save the state after ``iteration`` under ``--save`` in the background (every rank
        calls this after the same iteration; a spare, or a rank catching up, writes nothing)."""
        trainer = self.trainer
        if trainer.objects is None or not trainer.is_active or self.catching_up:
            return
        if trainer.iteration != iteration:
            raise RuntimeError(f"Megatron-LM's loop saves iteration {iteration}, the job is at "
                               f"{trainer.iteration}")
        trainer.save_durably(trainer.args.save, floating_point_operations)

    def finish_saves(self) -> None:
        """Return once this rank's saves are written, and committed or abandoned."""
        durable = self.trainer.durable
        durable.finish(durable.config.timeout_s)

    def evaluate(self, split: EvaluationSplit) -> float | None:
        """Mean per-token loss on ``split`` (``None`` on a spare, a rank catching up or without
        that split), after the iterations done so far, through failures: the survivors recover
        (which may roll back and re-run iterations) and evaluate again on their layout."""
        source = self.sources.get(split)
        trainer, done = self.trainer, self.trainer.iteration
        while source is not None and trainer.is_active and not self.catching_up:
            try:
                trainer.monitor.raise_if_failed()
                # Validation moves on one set of batches per --eval-interval; the test set is
                # read once.
                return trainer.evaluate(source, None if split is VALIDATION else 0)
            except Exception as error:  # whatever its class, as in a step (ElasticTrainer.advance)
                trainer.recover(error)
            while trainer.is_active and trainer.iteration < done:
                trainer.advance()
        return None

    def explains(self, error: BaseException) -> bool:
        """Whether a failed rank accounts for ``error`` (waits a bounded time for the evidence):
        the next step recovers from it."""
        return self.trainer.monitor.explains(error)

    @property
    def logs_megatron_lm_line(self) -> bool:
        """Whether this rank prints Megatron-LM's log line: the last of the ranks that hold a
        stage (Megatron-LM's last rank, over :attr:`world_group`)."""
        trainer = self.trainer
        return (trainer.is_active and not self.catching_up
                and trainer.rank == max(trainer.layout.active_ranks()))

    def share(self, name: str, value: str | None = None) -> str | None:
        """Publish ``value`` under ``name`` in the job store (a value already there stays), or
        read it (``None``: nothing published)."""
        key, store = shared_key(name), self.trainer.store
        if value is not None:
            store.compare_set(key, "", value)
            return None
        raw = read_if_set(store, key)
        return None if raw is None else raw.decode()

    def close(self) -> None:
        """Stop the failure monitor and the clock governor; flush the metrics."""
        if self.finished:
            return
        self.finished = True
        self.trainer.monitor.stop()
        self.trainer.governor.backend.close()
        self.trainer.metrics.close()
