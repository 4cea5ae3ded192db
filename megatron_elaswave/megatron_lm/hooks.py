"""What the ``--elastic`` hooks in Megatron-LM's loop call into: the runtime's side of them.

The hooks themselves (``megatron_elaswave.patches.megatron_lm_elastic``) know Megatron-LM: which
globals to wrap, its arguments and what ``train()`` expects back. :class:`ElasticHooks` is the
:class:`~megatron_elaswave.patches.megatron_lm_elastic.ElasticRuntime` they are handed: it adds
and checks the ``--elastic*`` flags, starts this rank's :class:`~.job.MegatronLMJob`, passes
iterations and evaluations to it, and ends the process with one line and the worker's exit
status (:mod:`megatron_elaswave.training.setup.exit_status`) when the run cannot go on.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Callable, NoReturn

import torch.distributed as dist

from megatron_elaswave.device import DeviceBackend
from megatron_elaswave.launch.config import REJOIN_ENV
from megatron_elaswave.patches import PatchRegistry, register_layout_invariant_rng
from megatron_elaswave.patches.megatron_lm_elastic import DefaultGroupRedirect, close_writers
from megatron_elaswave.runtime import dropout_rng
from megatron_elaswave.training.setup import exit_status
from megatron_elaswave.training.arguments import ArgumentError, add_elastic_args, validate_elastic

if TYPE_CHECKING:
    from megatron_elaswave.training.step.loop import StepResult

    from .job import EvaluationSplit, MegatronLMJob


class ElasticHooks:
    """The elastic job of this process, once started, and what the hooks need to start it.

    The job's modules are imported only when an elastic run starts: they import megatron-core's
    optimizer, which warns about Transformer Engine and Apex on stderr, and a run without
    ``--elastic`` (or one refused in one line) needs none of them.
    """

    def __init__(self, backend: DeviceBackend) -> None:
        self.backend = backend
        self.job: MegatronLMJob | None = None
        self.rejoining = os.environ.get(REJOIN_ENV) == "1"
        """Whether this worker replaces a dead one (``elaswave-run --rejoin``): it joins the
        running job instead of forming the first world."""
        self.distributed = DefaultGroupRedirect(self._world, survives=self.survives)

    def _world(self):
        if self.job is not None:
            return self.job.world_group
        # A replacement is alone until the job takes it in: Megatron-LM's set-up collectives
        # (its timers and barriers) do nothing on it.
        return DefaultGroupRedirect.OUTSIDE if self.rejoining else None

    # -- launch and flags ----------------------------------------------------------------------

    def check_rejoin(self, args: argparse.Namespace) -> None:
        """End a replacement that Megatron-LM's loop cannot take in, in one line."""
        if not args.elastic:
            exit_with(exit_status.BAD_INPUT, "this worker was started again to rejoin the job, "
                      "but the job does not run with --elastic: its survivors stopped with the "
                      "failure", every_rank=True)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_elastic_args(parser)

    def arguments_parsed(self, args: argparse.Namespace) -> None:
        overridden = self.backend.keep_survivors_alive()
        if overridden and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f" note: {overridden}", flush=True)

    def check_arguments(self, args: argparse.Namespace) -> None:
        try:
            validate_elastic(args, args.world_size, init_default="megatron")
        except ArgumentError as error:
            self.refuse(str(error))

    def refuse(self, message: str) -> NoReturn:
        exit_with(exit_status.BAD_INPUT, message)

    # -- the job -------------------------------------------------------------------------------

    def start(self, args: argparse.Namespace, *, tokenizer, transformer_config: Callable,
              model_provider: Callable, scheduler: Callable, optimizer_config: Callable,
              forward_step_func: Callable,
              global_batch_size_at: Callable[[int], int]) -> tuple[list, object, object]:
        """Start this rank's job, or join the running one as a replacement
        (:meth:`.MegatronLMJob.start`, whose arguments Megatron-LM's side provides), with the
        layout-invariant dropout RNG if asked for; the objects of ``train()``. A replacement
        that finds the job over ends here: with status 0 if it finished, 3 if its survivors
        stopped."""
        from megatron_elaswave.training.checkpointing.checkpoint import CheckpointError
        from megatron_elaswave.training.step.data import DataError
        from megatron_elaswave.training.recovery.relayout import JobFinished, JobStopped, JoinInterrupted

        from .job import MegatronLMJob, UnsupportedModel

        if args.elastic_rng == "invariant":
            registry = PatchRegistry()
            register_layout_invariant_rng(registry, self.backend, dropout_rng)
            registry.apply()
            dropout_rng.set_seed(args.seed)
        try:
            self.job = MegatronLMJob.start(
                args, self.backend, rank=args.rank, world_size=args.world_size,
                tokenizer=tokenizer, transformer_config=transformer_config,
                model_provider=model_provider, scheduler=scheduler,
                optimizer_config=optimizer_config, forward_step_func=forward_step_func,
                global_batch_size_at=global_batch_size_at, join=self.rejoining)
        except (UnsupportedModel, DataError, CheckpointError) as error:  # every rank refuses alike
            self.refuse(str(error))
        except JobFinished as finished:
            print(f" {finished}; exiting", flush=True)
            sys.exit(exit_status.CANNOT_CONTINUE if isinstance(finished, JobStopped) else 0)
        except JoinInterrupted as interrupted:
            exit_with(exit_status.JOIN_INTERRUPTED, str(interrupted), every_rank=True, prefix="")
        return self.job.objects()

    def evaluation_splits(self) -> tuple[EvaluationSplit | None, EvaluationSplit | None]:
        return self.job.evaluation_splits()

    def train_step(self, iteration: int) -> StepResult | None:
        from megatron_elaswave.training.checkpointing.durable import SaveFailed
        from megatron_elaswave.training.step.migration import StateLost
        from megatron_elaswave.training.recovery.outcomes import (
            CannotContinue,
            StepFailed,
            cannot_continue_line,
        )

        try:
            return self.job.train_step(iteration)
        except (CannotContinue, StateLost) as error:
            self.job.finish_saves()  # what there is to resume from is known before it is said
            # Every survivor reaches the same verdict; each says it, since rank 0 may be gone.
            exit_with(exit_status.CANNOT_CONTINUE,
                      cannot_continue_line(error, self.job.trainer.args.save), every_rank=True,
                      prefix="")
        except StepFailed as error:  # the iteration's own error; every member stops with it
            self.job.finish_saves()
            exit_with(exit_status.STEP_FAILED, str(error) if error.announce else None,
                      every_rank=True)
        except SaveFailed as error:  # every member knows it at the same iteration
            self.job.finish_saves()
            exit_with(exit_status.SAVE_FAILED, str(error), every_rank=True)

    def swap_into(self, model: list, optimizer: object, scheduler: object) -> None:
        self.job.swap_into(model, optimizer, scheduler)

    @property
    def num_active_ranks(self) -> int:
        return self.job.num_active_ranks

    @property
    def consumed_samples(self) -> int:
        return self.job.consumed_samples

    @property
    def iteration(self) -> int:
        return self.job.iteration

    def evaluate(self, split: EvaluationSplit) -> float | None:
        from megatron_elaswave.training.step.migration import StateLost
        from megatron_elaswave.training.recovery.outcomes import CannotContinue

        try:
            return self.job.evaluate(split)
        except (CannotContinue, StateLost) as error:
            exit_with(exit_status.CANNOT_CONTINUE, f"cannot continue: {error}", every_rank=True,
                      prefix="")

    def survives(self, error: BaseException) -> bool:
        return self.job is not None and not self.job.finished and self.job.explains(error)

    @property
    def logs(self) -> bool:
        return self.job is not None and self.job.logs_megatron_lm_line

    @property
    def catching_up(self) -> bool:
        return self.job is not None and self.job.catching_up

    def share(self, name: str, value: str | None = None) -> str | None:
        return self.job.share(name, value)

    def resumed_at(self) -> tuple[int, int, float]:
        return self.job.resumed_at

    def save_checkpoint(self, iteration: int, floating_point_operations: float) -> None:
        self.job.save(iteration, floating_point_operations)

    def finish_saves(self) -> None:
        """Before Megatron-LM's loop exits: the saves in flight are written, and the job ends
        non-zero where its last one (the final or preemption save) was not."""
        self.job.finish_saves()
        trainer = self.job.trainer
        if trainer.args.save and (
                failure := trainer.durable.last_save_failure(trainer.iteration)) is not None:
            exit_with(exit_status.SAVE_FAILED, failure.line(trainer.args.save), every_rank=True)


def exit_with(code: int, message: str | None, *, every_rank: bool = False,
              prefix: str = "error: ") -> NoReturn:
    """End this process with ``code`` after one line on stderr where there is a ``message``
    (from rank 0 only, unless ``every_rank``: every rank fails the same checks), Megatron-LM's
    writers closed.

    The interpreter is not finalized: a job that stops has threads still waiting in collectives
    of its process groups, whose teardown may abort the process (``std::terminate``) and turn
    the status into SIGABRT's."""
    if message is not None and (every_rank or not dist.is_initialized() or dist.get_rank() == 0):
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "megatron-lm"
        # One write: the workers of a node share their launcher's output.
        sys.stderr.write(f"{script}: {prefix}{message}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    close_writers(code)
    os._exit(code)
