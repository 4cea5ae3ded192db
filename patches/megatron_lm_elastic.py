"""``--elastic`` in Megatron-LM's training loop: the hooks in ``megatron.training.training``.

Checked against Megatron-LM ``core_v0.16.1`` (``megatron/training/training.py``: ``pretrain``,
``setup_model_and_optimizer``, ``build_train_valid_test_data_iterators``, ``train_step``,
``train`` and ``evaluate``; ``megatron/core/timers.py``). Each hook is looked up by ``pretrain``
or ``train()`` as a module global at call time. Without ``--elastic`` every hook calls through.

1. ``pretrain``: the ``--elastic*`` flags join Megatron-LM's parser (through its
   ``extra_args_provider``); the script's ``forward_step`` is kept for the elastic job.
2. ``setup_model_and_optimizer``: with ``--elastic`` the flags are checked, the elastic job starts
   (:class:`megatron_elaswave.training.megatron_lm.MegatronLMJob`, whose chunks the script's own
   model provider builds) and ``train()`` gets its list of chunks, ``ChainedOptimizer`` and LR
   schedule. Megatron-LM's rerun state machine is disabled: the job re-runs broken iterations
   itself, and the machine's re-runs replay Megatron-LM's data iterators and agree over the
   first world.
3. ``build_train_valid_test_data_iterators``: the job deals each global batch itself, so
   ``train()`` gets placeholders and ``do_train``/``do_valid``/``do_test`` from the job's splits.
4. ``train_step``: one more iteration of the job, through failures. Then ``train()``'s locals
   take the current objects in place, and ``args.consumed_train_samples`` is set so that the
   increment ``train()`` adds next (data-parallel size x micro-batch size x micro-batches, which
   is not the global batch once replicas differ) lands on the exact count. The micro-batch
   calculator is never changed: ``train()`` asserts its count never goes down. A rank left
   without a stage returns ``should_exit`` once the job is done.
5. ``evaluate``: the job's evaluation of the split the placeholder names.
6. Megatron-LM's own collectives on the default group (timer barriers and gathers, the last
   rank's log line, ``print_datetime``) would wait for failed ranks: the ``torch.distributed``
   that ``megatron.training.training``, ``megatron.training.utils`` and ``megatron.core.timers``
   see sends them, and rank queries, to the job's group of active ranks instead.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import types
from typing import Callable

import torch
import torch.distributed as dist

from megatron_elaswave.store import REJOIN_ENV
from megatron_elaswave.training import exit_status

from . import register_layout_invariant_rng
from .interfaces import DeviceBackend
from .registry import PatchRegistry

TRAINING = "megatron.training.training"
LOOP_MODULES = (TRAINING, "megatron.training.utils")
"""The Megatron-LM modules whose default-group collectives go to the job's active ranks."""

_UNSUPPORTED = (
    ("load", "--load (resume an elastic run with megatron-elaswave's scripts/pretrain_gpt.py)"),
    ("save", "--save (the survivors keep in-memory snapshots; a final checkpoint is not "
             "written from Megatron-LM's loop)"),
    ("overlap_grad_reduce", "--overlap-grad-reduce"),
    ("overlap_param_gather", "--overlap-param-gather"),
    ("rampup_batch_size", "--rampup-batch-size (the global batch is fixed)"),
    ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
    ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
    ("num_experts", "--num-experts"),
    ("use_legacy_models", "--use-legacy-models"),
    ("sft", "--sft"),
    ("fim_data", "--fim-data"),
)
"""Megatron-LM flags an elastic run does not support: (attribute, what to tell the user)."""


class DefaultGroupRedirect(types.ModuleType):
    """``torch.distributed`` in which a collective or rank query without a group uses
    ``world()`` (while it returns a group), and a broadcast's ``src`` is a rank of that group."""

    _GROUPED = ("barrier", "all_reduce", "all_gather", "all_gather_into_tensor",
                "_all_gather_base", "all_gather_object", "get_rank", "get_world_size")

    def __init__(self, world: Callable[[], dist.ProcessGroup | None]) -> None:
        super().__init__("torch.distributed", dist.__doc__)
        self._world = world
        for name in self._GROUPED:
            setattr(self, name, self._in_world(getattr(dist, name)))

    def __getattr__(self, name: str):
        return getattr(dist, name)

    def _group(self, group):
        world = self._world()
        if world is not None and (group is None or group is dist.GroupMember.WORLD):
            return world
        return group

    def _in_world(self, function: Callable) -> Callable:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def in_world(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs)
            bound.arguments["group"] = self._group(bound.arguments.get("group"))
            return function(*bound.args, **bound.kwargs)

        return in_world

    def broadcast(self, tensor, src=None, group=None, async_op=False, group_src=None):
        target = self._group(group)
        if target is not group and src is not None:
            src, group_src = None, src
        return dist.broadcast(tensor, src=src, group=target, async_op=async_op, group_src=group_src)


def torch_with_distributed(base: types.ModuleType, distributed: types.ModuleType) -> types.ModuleType:
    """A stand-in for ``base`` (``torch`` or a stand-in of it) with ``distributed`` replaced."""
    proxy = types.ModuleType("torch", torch.__doc__)
    proxy.__dict__.update(vars(base))
    proxy.distributed = distributed
    proxy.__getattr__ = lambda name: getattr(torch, name)
    return proxy


class ElasticHooks:
    """The elastic job of this process, once started, and what the hooks need to start it."""

    def __init__(self, backend: DeviceBackend) -> None:
        self.backend = backend
        self.job = None
        self.forward_step_func: Callable | None = None
        self.distributed = DefaultGroupRedirect(lambda: self.job.world_group if self.job else None)

    # -- 1. pretrain ---------------------------------------------------------------------------

    def pretrain(self, pretrain: Callable) -> Callable:
        signature = inspect.signature(pretrain)

        @functools.wraps(pretrain)
        def elastic_pretrain(*args, **kwargs):
            if os.environ.get(REJOIN_ENV) == "1":
                _exit_with(exit_status.BAD_INPUT, "a replacement worker cannot join a Megatron-LM run "
                           "(its initialisation is collective over the first world): start the "
                           "job without --rejoin", every_rank=True)
            bound = signature.bind(*args, **kwargs)
            self.forward_step_func = bound.arguments["forward_step_func"]
            extra = bound.arguments.get("extra_args_provider")

            def with_elastic_args(parser):
                from megatron_elaswave.training.arguments import add_elastic_args

                parser = extra(parser) if extra is not None else parser
                add_elastic_args(parser)
                return parser

            bound.arguments["extra_args_provider"] = with_elastic_args
            return pretrain(*bound.args, **bound.kwargs)

        return elastic_pretrain

    # -- 2. model and optimizer ----------------------------------------------------------------

    def setup_model_and_optimizer(self, setup: Callable) -> Callable:
        @functools.wraps(setup)
        def elastic_setup(model_provider_func, model_type, *args, **kwargs):
            from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine
            from megatron.training import get_args, get_tokenizer
            from megatron.training.arguments import core_transformer_config_from_args

            margs = get_args()
            if not margs.elastic:
                return setup(model_provider_func, model_type, *args, **kwargs)
            self._check(margs)
            self._apply_layout_invariant_rng(margs)
            # The job re-runs broken iterations itself; the state machine's re-runs would replay
            # Megatron-LM's data iterators and agree over the first world.
            get_rerun_state_machine().set_mode(RerunMode.DISABLED)
            from megatron_elaswave.training.megatron_lm import MegatronLMJob

            self.job = MegatronLMJob.start(
                margs, self.backend, rank=dist.get_rank(), world_size=dist.get_world_size(),
                tokenizer=get_tokenizer(),
                transformer_config=lambda: core_transformer_config_from_args(margs),
                model_provider=model_provider_func,
                scheduler=sys.modules[TRAINING].get_optimizer_param_scheduler,
                forward_step_func=self.forward_step_func)
            margs.iteration = margs.num_floating_point_operations_so_far = 0  # no --load
            return self.job.objects()

        return elastic_setup

    def _check(self, args) -> None:
        from megatron_elaswave.training.arguments import ArgumentError, validate_elastic

        try:
            validate_elastic(args, dist.get_world_size())
        except ArgumentError as error:
            _exit_with(exit_status.BAD_INPUT, str(error))
        for name, flag in _UNSUPPORTED:
            if getattr(args, name, None):
                _exit_with(exit_status.BAD_INPUT, f"--elastic in Megatron-LM's loop does not support {flag}")
        if args.context_parallel_size > 1:
            _exit_with(exit_status.BAD_INPUT, "--elastic does not support --context-parallel-size > 1")
        if args.data_path and len(args.data_path) > 1:
            _exit_with(exit_status.BAD_INPUT, "--elastic takes one --data-path prefix (no blends)")
        if args.elastic_device not in (None, "auto", self.backend.name):
            _exit_with(exit_status.BAD_INPUT, f"--elastic-device {args.elastic_device}: this run is on "
                       f"{self.backend.name}")

    def _apply_layout_invariant_rng(self, args) -> None:
        if args.elastic_rng != "invariant":
            return
        from megatron_elaswave import dropout_rng

        registry = PatchRegistry()
        register_layout_invariant_rng(registry, self.backend, dropout_rng)
        registry.apply()
        dropout_rng.set_seed(args.seed)

    # -- 3. data -------------------------------------------------------------------------------

    def build_data_iterators(self, build: Callable) -> Callable:
        @functools.wraps(build)
        def elastic_iterators(*args, **kwargs):
            from megatron.training import get_args
            from megatron_elaswave.training.megatron_lm import TEST, VALIDATION

            margs = get_args()
            if not margs.elastic:
                return build(*args, **kwargs)
            margs.do_train = True
            margs.do_valid = self.job.sources[VALIDATION] is not None
            margs.do_test = self.job.sources[TEST] is not None
            return (iter(()), VALIDATION if margs.do_valid else None,
                    TEST if margs.do_test else None)

        return elastic_iterators

    # -- 4. one iteration ----------------------------------------------------------------------

    def train_step(self, train_step: Callable) -> Callable:
        @functools.wraps(train_step)
        def elastic_train_step(forward_step_func, data_iterator, model, optimizer,
                               opt_param_scheduler, config, forward_backward_func, iteration=None):
            from megatron.core import parallel_state
            from megatron.core.num_microbatches_calculator import get_num_microbatches
            from megatron.training import get_args

            from megatron_elaswave.training.recovery import CannotContinue
            from megatron_elaswave.training.migration import StateLost

            args = get_args()
            if not args.elastic:
                return train_step(forward_step_func, data_iterator, model, optimizer,
                                  opt_param_scheduler, config, forward_backward_func,
                                  iteration=iteration)
            try:
                result = self.job.train_step(iteration)
            except (CannotContinue, StateLost) as error:
                # Every survivor reaches the same verdict; each says it, since rank 0 may be gone.
                _exit_with(exit_status.CANNOT_CONTINUE, f"cannot continue: {error}", every_rank=True,
                           prefix="")
            self.job.swap_into(model, optimizer, opt_param_scheduler)
            # args.data_parallel_size stays the micro-batch calculator's: Megatron-LM reports the
            # global batch as its product with the micro-batch size and count.
            args.world_size = self.job.num_active_ranks
            if result is None:  # no stage here any more, and the job is done
                return {}, 0, False, True, 0, None, None, 0
            args.consumed_train_samples = self.job.consumed_samples - (
                parallel_state.get_data_parallel_world_size() * args.micro_batch_size
                * get_num_microbatches())
            loss = {"lm loss": torch.tensor(result.lm_loss)}
            return loss, int(result.skipped), False, False, 0, result.grad_norm, None, 0

        return elastic_train_step

    # -- 5. evaluation -------------------------------------------------------------------------

    def evaluate(self, evaluate: Callable) -> Callable:
        @functools.wraps(evaluate)
        def elastic_evaluate(forward_step_func, data_iterator, *args, **kwargs):
            from megatron.training import get_args

            if not get_args().elastic:
                return evaluate(forward_step_func, data_iterator, *args, **kwargs)
            loss = self.job.evaluate(data_iterator)
            return ({"lm loss": torch.tensor(loss)} if loss is not None else {}), None, False

        return elastic_evaluate


def _exit_with(code: int, message: str, *, every_rank: bool = False,
               prefix: str = "error: ") -> None:
    """End this process with ``code`` after one line on stderr (from rank 0 only, unless
    ``every_rank``: every rank fails the same checks)."""
    if every_rank or not dist.is_initialized() or dist.get_rank() == 0:
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "megatron-lm"
        print(f"{script}: {prefix}{message}", file=sys.stderr, flush=True)
    sys.exit(code)


def register(registry: PatchRegistry, hooks: ElasticHooks) -> None:
    """Register the elastic hooks and, on CUDA, the default-group redirect of the loop modules
    (off CUDA :mod:`.megatron_lm` puts the redirect into its device-mapped ``torch``)."""
    for target in (f"{TRAINING}.pretrain", "megatron.training.pretrain"):
        registry.register_wrapper(target, hooks.pretrain)
    registry.register_wrapper(f"{TRAINING}.setup_model_and_optimizer",
                              hooks.setup_model_and_optimizer)
    registry.register_wrapper(f"{TRAINING}.build_train_valid_test_data_iterators",
                              hooks.build_data_iterators)
    registry.register_wrapper(f"{TRAINING}.train_step", hooks.train_step)
    registry.register_wrapper(f"{TRAINING}.evaluate", hooks.evaluate)
    if hooks.backend.name == "cuda":
        for module in LOOP_MODULES:
            registry.register(f"{module}.torch", torch_with_distributed(torch, hooks.distributed))
    registry.register("megatron.core.timers.torch", torch_with_distributed(torch, hooks.distributed))
    registry.register("megatron.core.timers.dist_all_gather_func",
                      hooks.distributed.all_gather_into_tensor)
