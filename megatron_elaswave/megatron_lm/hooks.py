"""What the ``--elastic`` hooks in Megatron-LM's loop call into: the runtime's side of them.

The hooks themselves (``megatron_elaswave.patches.megatron_lm_elastic``) know Megatron-LM: which
globals to wrap, its arguments and what ``train()`` expects back. :class:`ElasticHooks` is the
:class:`~megatron_elaswave.patches.megatron_lm_elastic.ElasticRuntime` they are handed: it adds
and checks the ``--elastic*`` flags, starts this rank's :class:`~.job.MegatronLMJob`, passes
iterations and evaluations to it, and ends the process with one line and the worker's exit
status (:mod:`megatron_elaswave.training.exit_status`) when the run cannot go on.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Callable, NoReturn

import torch.distributed as dist

from megatron_elaswave import dropout_rng
from megatron_elaswave.device import DeviceBackend
from megatron_elaswave.patches import PatchRegistry, register_layout_invariant_rng
from megatron_elaswave.patches.megatron_lm_elastic import DefaultGroupRedirect
from megatron_elaswave.store import REJOIN_ENV
from megatron_elaswave.training import exit_status
from megatron_elaswave.training.arguments import ArgumentError, add_elastic_args, validate_elastic

if TYPE_CHECKING:
    from megatron_elaswave.training.loop import StepResult

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
        self.distributed = DefaultGroupRedirect(lambda: self.job.world_group if self.job else None)

    # -- launch and flags ----------------------------------------------------------------------

    def check_launch(self) -> None:
        if os.environ.get(REJOIN_ENV) == "1":
            exit_with(exit_status.BAD_INPUT, "a replacement worker cannot join a Megatron-LM run "
                      "(its initialisation is collective over the first world): start the job "
                      "without --rejoin", every_rank=True)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_elastic_args(parser)

    def arguments_parsed(self, args: argparse.Namespace) -> None:
        overridden = self.backend.keep_survivors_alive()
        if overridden and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f" note: {overridden}", flush=True)

    def check_arguments(self, args: argparse.Namespace) -> None:
        try:
            validate_elastic(args, dist.get_world_size())
        except ArgumentError as error:
            self.refuse(str(error))

    def refuse(self, message: str) -> NoReturn:
        exit_with(exit_status.BAD_INPUT, message)

    # -- the job -------------------------------------------------------------------------------

    def start(self, args: argparse.Namespace, *, tokenizer, transformer_config: Callable,
              model_provider: Callable, scheduler: Callable,
              forward_step_func: Callable) -> tuple[list, object, object]:
        """Start this rank's job (:meth:`.MegatronLMJob.start`, whose arguments Megatron-LM's
        side provides), with the layout-invariant dropout RNG if asked for; the objects of
        ``train()``."""
        from megatron_elaswave.training.checkpoint import CheckpointError

        from .job import MegatronLMJob, UnsupportedModel

        if args.elastic_rng == "invariant":
            registry = PatchRegistry()
            register_layout_invariant_rng(registry, self.backend, dropout_rng)
            registry.apply()
            dropout_rng.set_seed(args.seed)
        try:
            self.job = MegatronLMJob.start(
                args, self.backend, rank=dist.get_rank(), world_size=dist.get_world_size(),
                tokenizer=tokenizer, transformer_config=transformer_config,
                model_provider=model_provider, scheduler=scheduler,
                forward_step_func=forward_step_func)
        except (UnsupportedModel, CheckpointError) as error:  # every rank refuses alike
            self.refuse(str(error))
        return self.job.objects()

    def evaluation_splits(self) -> tuple[EvaluationSplit | None, EvaluationSplit | None]:
        return self.job.evaluation_splits()

    def train_step(self, iteration: int) -> StepResult | None:
        from megatron_elaswave.training.migration import StateLost
        from megatron_elaswave.training.recovery import CannotContinue, cannot_continue_line

        try:
            return self.job.train_step(iteration)
        except (CannotContinue, StateLost) as error:
            self.job.finish_saves()  # what there is to resume from is known before it is said
            # Every survivor reaches the same verdict; each says it, since rank 0 may be gone.
            exit_with(exit_status.CANNOT_CONTINUE,
                      cannot_continue_line(error, self.job.trainer.args.save), every_rank=True,
                      prefix="")

    def swap_into(self, model: list, optimizer: object, scheduler: object) -> None:
        self.job.swap_into(model, optimizer, scheduler)

    @property
    def num_active_ranks(self) -> int:
        return self.job.num_active_ranks

    @property
    def consumed_samples(self) -> int:
        return self.job.consumed_samples

    def evaluate(self, split: EvaluationSplit) -> float | None:
        return self.job.evaluate(split)

    def resumed_at(self) -> tuple[int, int, float]:
        return self.job.resumed_at

    def save_checkpoint(self, iteration: int, floating_point_operations: float) -> None:
        self.job.save(iteration, floating_point_operations)

    def finish_saves(self) -> None:
        self.job.finish_saves()


def exit_with(code: int, message: str, *, every_rank: bool = False,
              prefix: str = "error: ") -> NoReturn:
    """End this process with ``code`` after one line on stderr (from rank 0 only, unless
    ``every_rank``: every rank fails the same checks)."""
    if every_rank or not dist.is_initialized() or dist.get_rank() == 0:
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "megatron-lm"
        print(f"{script}: {prefix}{message}", file=sys.stderr, flush=True)
    sys.exit(code)
