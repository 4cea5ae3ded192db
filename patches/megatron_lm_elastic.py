"""``--elastic`` in Megatron-LM's training loop: the hooks in ``megatron.training.training``.

Checked against Megatron-LM core_v0.16.1 and core_v0.19.x (``megatron/training/arguments.py``:
``parse_args``; ``megatron/training/initialize.py``: ``initialize_megatron``;
``megatron/training/training.py``: ``pretrain``, ``setup_model_and_optimizer``,
``get_optimizer_param_scheduler``, ``get_megatron_optimizer_config``, ``update_train_iters``,
``build_train_valid_test_data_iterators``, ``train_step``, ``training_log``, ``train``,
``evaluate``, ``evaluate_and_print_results``, ``disable_forward_pre_hook``,
``save_checkpoint_and_time``, ``checkpoint_and_decide_exit`` and the calls of
``save_checkpoint`` and ``maybe_finalize_async_save``; ``megatron/training/global_vars.py``: the
TensorBoard and W&B writers; ``megatron/core/timers.py``;
``megatron/core/num_microbatches_calculator.py``; ``megatron/training/dist_signal_handler.py``);
the 0.19 line was run, core_v0.16.1 read. Each hook is looked up by ``pretrain`` or ``train()``
as a module global at call time. Without ``--elastic`` every hook calls through. With it, the
hooks call into the elastic run only through the :class:`ElasticRuntime` handed to
:func:`register` (built by the runtime's Megatron-LM wing, ``megatron_elaswave.megatron_lm``).
Where the two releases differ, a function named for the difference reads what the installed
Megatron-LM has.

1. ``parse_args``: the ``--elastic*`` flags join Megatron-LM's parser (beside the script's own
   ``extra_args_provider``). core_v0.16.1 parses inside ``pretrain`` (``initialize_megatron``),
   core_v0.19's ``pretrain_gpt.py`` before it (``parse_and_validate_args``); both call
   ``parse_args``. ``pretrain`` keeps the script's ``forward_step`` for the elastic job.
   ``initialize_megatron``: a replacement worker (``elaswave-run --rejoin``) skips its collective
   parts (``skip_mpu_initialization``); core_v0.19's ``pretrain`` then gets an empty
   ``pg_collection`` instead of reading ``parallel_state``'s groups, which it has none of yet.
2. ``setup_model_and_optimizer``: with ``--elastic`` the flags are checked, the elastic job starts
   (a replacement joins the running one instead, and ``train()`` starts at its iteration)
   (its chunks built by the script's own model provider, or, where core_v0.19's script passes
   none, by the builder of its config container's model: :func:`model_provider_of`; its
   optimizers from Megatron-LM's optimizer config: :func:`optimizer_config_of`) and
   ``train()`` gets its list of chunks, ``ChainedOptimizer`` and LR schedule. Megatron-LM's rerun
   state machine is disabled: the job re-runs broken iterations itself, and the machine's re-runs
   replay Megatron-LM's data iterators and agree over the first world. ``--train-samples`` sets
   the iterations (``update_train_iters``) and the LR schedule is built sample-based whenever
   the job builds one (:func:`lr_schedule_from_flags`); the global batch follows megatron-core's
   micro-batch calculator, a ramp-up included (:func:`global_batch_size_at`).
3. ``build_train_valid_test_data_iterators``: the job deals each global batch itself, so
   ``train()`` gets placeholders and ``do_train``/``do_valid``/``do_test`` from the job's splits.
4. ``train_step``: one more iteration of the job, through failures. Then ``train()``'s locals
   take the current objects in place, and ``args.consumed_train_samples`` is set so that the
   increment ``train()`` adds next (data-parallel size x micro-batch size x micro-batches, which
   is not the global batch once replicas differ) lands on the exact count. The micro-batch
   calculator is never changed: ``train()`` asserts its count never goes down. A rank left
   without a stage returns ``should_exit`` once the job is done; one that a later layout uses
   again returns at once until ``train()``'s count reaches the job's, taking part in none of
   the log lines (``training_log`` returns at once), evaluations and saves
   (``save_checkpoint_and_time`` does nothing) of the iterations it missed, so that from then
   on it does the iteration-numbered work of ``train()`` on the same iterations as the other
   ranks. core_v0.19's keyword arguments
   (``pg_collection``, ``p2p_communicator``) pass through without ``--elastic``.
5. ``evaluate``: the job's evaluation of the split the placeholder names, through failures.
6. Megatron-LM's own collectives on the default group (timer barriers and gathers, the last
   rank's log line, ``print_datetime``) would wait for failed ranks: the ``torch.distributed``
   that ``megatron.training.training``, ``megatron.training.utils`` (core_v0.19: its
   ``common_utils`` and ``log_utils``) and ``megatron.core.timers`` see sends them, and rank
   queries, to the job's group of active ranks instead; one that fails because a peer failed
   returns without its result (:class:`DefaultGroupRedirect`), and ``training_log``,
   ``evaluate_and_print_results`` and ``disable_forward_pre_hook`` return as if done
   (:meth:`_ElasticLoop.between_steps`): the next ``train_step`` recovers. ``is_last_rank``
   (which rank prints the log line and writes TensorBoard and W&B) asks the redirect: Megatron-LM
   compares the global rank (``megatron.core``'s ``safe_get_rank``) with the redirected world's
   size, which after a failure no rank matches. After each
   ``train_step`` the TensorBoard and W&B writers move to the rank that logs
   (:func:`keep_writers_on_logging_rank`). The MoE load-balancing losses of its log line are
   summed over the job's active ranks (:func:`.moe_utils.register_job_wide_reduction`), and so
   are its multi-token prediction losses (:func:`.multi_token_prediction.register_job_wide_reduction`).
7. ``training_log``: core_v0.19's ``train()`` reads the model-parallel groups of its first chunk
   once, before the loop, and ``training_log`` reduces the learning rate over them each
   iteration; after a recovery those groups are destroyed. With ``--elastic`` it gets none and
   falls back to ``parallel_state``'s, which the job keeps current (:func:`logs_over_pg_collection`).
   Its "first iteration" (a log line with timer barriers) is the job's first only, not a
   replacement's first after it joined.
8. ``save_checkpoint`` (as ``megatron.training.training`` calls it: every ``--save-interval``,
   on ``--exit-signal-handler``'s SIGTERM, at ``--exit-duration-in-mins`` and at the end): the
   job saves the iteration from its snapshots in the background; ``maybe_finalize_async_save``
   with ``blocking`` (before ``train()`` exits, and at the end of ``pretrain``) waits for those
   saves. ``--load`` is the job's too (``setup_model_and_optimizer`` above), and the
   ``torch.distributed`` of ``megatron.training.dist_signal_handler`` is redirected like the loop
   modules', so that the SIGTERM flags are gathered over the active ranks.
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import os
import sys
import types
from typing import Any, Callable, NoReturn, Protocol

import torch
import torch.distributed as dist

from . import moe_utils, multi_token_prediction
from .interfaces import DeviceBackend
from .megatron_lm import training_utils_modules
from .registry import PatchRegistry

TRAINING = "megatron.training.training"
ARGUMENTS = "megatron.training.arguments"
GLOBAL_VARS = "megatron.training.global_vars"
WANDB_RUN = "wandb_run_id"
"""The name under which the first logging rank shares its W&B run's id (:meth:`ElasticRuntime.share`)."""
SIGNAL_HANDLER = "megatron.training.dist_signal_handler"


def loop_modules() -> tuple[str, ...]:
    """The Megatron-LM modules whose default-group collectives go to the job's active ranks
    (``megatron.training.utils`` is a package in core_v0.19: :func:`.training_utils_modules`)."""
    return (TRAINING, *training_utils_modules())


def model_provider_of(arguments: dict[str, Any]) -> Callable | None:
    """The model provider of ``setup_model_and_optimizer``'s bound ``arguments``, as the elastic
    job calls it (``pre_process``, ``post_process``, ``config``, ``pg_collection``).

    core_v0.16.1's ``pretrain`` passes the script's ``model_provider_func``. core_v0.19's
    ``pretrain_gpt.py`` passes none but a config container (``cfg_container``) whose model config
    names its builder (``megatron.training.models``): each chunk is then that builder's model on a
    copy of the model config holding the chunk's transformer config. None: neither is there.
    """
    provider = arguments.get("model_provider_func")
    if provider is not None:
        return provider
    model_config = getattr(arguments.get("cfg_container"), "model", None)
    if model_config is None:
        return None
    builder_cls = model_config.get_builder_cls()

    def build_chunk(*, pre_process: bool, post_process: bool, config: Any, pg_collection: Any):
        chunk_config = copy.copy(model_config)
        chunk_config.transformer = config
        return builder_cls(chunk_config).build_model(
            pg_collection, pre_process=pre_process, post_process=post_process)

    return build_chunk


def optimizer_config_of(args: argparse.Namespace) -> tuple[Any, Any]:
    """The optimizer config and parameter-group overrides Megatron-LM's
    ``setup_model_and_optimizer`` builds from ``args`` (``get_megatron_optimizer_config``), without
    the timers it then gives the config: the elastic job steps one optimizer per layer group, as
    many as a rank holds, and the timers' barriers would pair different steps of different
    ranks."""
    return sys.modules[TRAINING].get_megatron_optimizer_config(args)


def forward_step_on_current_layout(forward_step_func: Callable) -> Callable:
    """The script's ``forward_step``, called where this rank's replica has a single stage with
    ``args.pipeline_model_parallel_size`` 1, and where it runs without virtual stages with
    ``parallel_state``'s virtual pipeline size and ``args.virtual_pipeline_model_parallel_size``
    unset.

    ``get_batch_on_this_tp_rank`` (``megatron.training.utils`` in core_v0.16.1; megatron-core's,
    given the flag by ``pretrain_gpt.py``, in core_v0.19) keeps every field of a micro-batch only
    where that size is 1, and otherwise those of ``parallel_state``'s first or last stage
    (core_v0.19 drops the labels on the first stage even on the rank that read them). After a
    recovery a replica may have fewer stages than the flag says: one stage is both. A replica
    that a recovery re-partitions runs 1F1B: its stage has no ``vp_stage``, which
    ``is_pipeline_first_stage`` would otherwise require; core_v0.19's ``get_batch`` builds a
    config from ``args``, which must not pair a layout string's virtual stages with another
    count.
    """

    @functools.wraps(forward_step_func)
    def forward_step(data_iterator, model, *args, **kwargs):
        from megatron.core import parallel_state
        from megatron.training import get_args

        margs = get_args()
        launched = margs.pipeline_model_parallel_size, margs.virtual_pipeline_model_parallel_size
        virtual = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            margs.pipeline_model_parallel_size = 1
        if getattr(model, "vp_stage", None) is None:
            parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
            margs.virtual_pipeline_model_parallel_size = None
        try:
            return forward_step_func(data_iterator, model, *args, **kwargs)
        finally:
            margs.pipeline_model_parallel_size, margs.virtual_pipeline_model_parallel_size = launched
            parallel_state.set_virtual_pipeline_model_parallel_world_size(virtual)

    return forward_step


def global_batch_size_at(consumed_samples: int) -> int:
    """The global batch size of the iteration after ``consumed_samples``, on Megatron's schedule:
    constant, or growing by ``--rampup-batch-size`` (core_v0.16.1) or
    ``--step-batch-size-schedule`` (core_v0.19). ``train()`` sets the same before every
    ``train_step`` from ``args.consumed_train_samples``."""
    from megatron.core.num_microbatches_calculator import (
        get_current_global_batch_size,
        update_num_microbatches,
    )

    update_num_microbatches(consumed_samples, consistency_check=False)
    return get_current_global_batch_size()


def lr_schedule_from_flags(get_optimizer_param_scheduler: Callable,
                           args: argparse.Namespace) -> Callable:
    """Megatron-LM's ``get_optimizer_param_scheduler`` as Megatron-LM builds it, whenever the job
    builds one (again after a recovery, to load the snapshot's state into).

    It tells iteration-based from sample-based training (``--train-samples``, ``--lr-*-samples``)
    by ``args.train_iters`` being unset; the elastic job sets it from ``--train-samples`` before
    building the first scheduler (``update_train_iters``), so it is hidden while one is built."""

    @functools.wraps(get_optimizer_param_scheduler)
    def build(optimizer):
        iterations = args.train_iters
        if args.train_samples:
            args.train_iters = None
        try:
            return get_optimizer_param_scheduler(optimizer)
        finally:
            args.train_iters = iterations

    return build


def logs_over_pg_collection(training_log: Callable) -> bool:
    """Whether ``training_log`` reduces over the ``pg_collection`` ``train()`` read from its first
    model chunk before the loop (core_v0.19) rather than over ``parallel_state``'s groups."""
    return "pg_collection" in inspect.signature(training_log).parameters


_UNSUPPORTED = (
    ("use_legacy_models", "--use-legacy-models (it trains megatron-core's GPTModel: drop it)"),
    ("sft", "--sft (it trains GPT pretraining data)"),
    ("fim_data", "--fim-data (it trains GPT pretraining data)"),
    # A hybrid model (HybridModel, MambaModel): the layer groups know GPTModel's layers.
    ("hybrid_override_pattern", "--hybrid-override-pattern (it trains GPTModel)"),
    ("hybrid_layer_pattern", "--hybrid-layer-pattern (it trains GPTModel)"),
    ("hybrid_attention_ratio", "--hybrid-attention-ratio (it trains GPTModel)"),
    ("hybrid_mlp_ratio", "--hybrid-mlp-ratio (it trains GPTModel)"),
)
"""Megatron-LM flags an elastic run does not support: (attribute, what to tell the user)."""

_UNSUPPORTED_CHECKPOINTING = (
    ("non_persistent_save_interval", "--non-persistent-save-interval"),
)
"""Megatron-LM's checkpoint flags an elastic run does not support (``--save``, ``--load``,
``--save-interval``, ``--async-save``, ``--exit-signal-handler``, ``--exit-duration-in-mins``,
``--finetune``, ``--no-load-optim``, ``--no-load-rng``, ``--no-save-optim`` and
``--no-save-rng`` it does)."""


class StepResult(Protocol):
    """What ``train_step`` reports of one iteration of the elastic job."""

    @property
    def lm_loss(self) -> float: ...

    @property
    def skipped(self) -> bool: ...

    @property
    def grad_norm(self) -> float | None: ...


class ElasticRuntime(Protocol):
    """What the hooks call into: the elastic run of this process. ``refuse`` and a failed check
    end the process with one line."""

    distributed: types.ModuleType
    """The ``torch.distributed`` Megatron-LM's loop modules see (a :class:`DefaultGroupRedirect`
    to the job's active ranks)."""

    rejoining: bool
    """Whether this worker replaces a dead one and joins the running job."""

    def check_rejoin(self, args: argparse.Namespace) -> None:
        """End a replacement that Megatron-LM's loop cannot take in (one line)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the ``--elastic*`` flags."""

    def check_arguments(self, args: argparse.Namespace) -> None:
        """Validate the ``--elastic*`` flags."""

    def arguments_parsed(self, args: argparse.Namespace) -> None:
        """Megatron-LM parsed ``args`` (``--elastic`` given), before it creates a process group."""

    def refuse(self, message: str) -> NoReturn:
        """End the process: ``message`` says what Megatron-LM's loop cannot do elastically."""

    def start(self, args: argparse.Namespace, *, tokenizer: Any,
              transformer_config: Callable[[], Any], model_provider: Callable,
              scheduler: Callable, optimizer_config: Callable[[], tuple[Any, Any]],
              forward_step_func: Callable,
              global_batch_size_at: Callable[[int], int]) -> tuple[list, Any, Any]:
        """Start the elastic job (collective), or join the running one where
        :attr:`rejoining`; the chunks, optimizer and LR schedule of ``train()``.
        ``optimizer_config()`` is Megatron-LM's optimizer config and parameter-group overrides,
        ``global_batch_size_at(consumed_samples)`` Megatron's batch size schedule."""

    def evaluation_splits(self) -> tuple[Any, Any]:
        """The placeholders of ``train()``'s validation and test iterators (None: no split)."""

    def train_step(self, iteration: int) -> StepResult | None:
        """Complete iteration ``iteration + 1`` through failures; None on a rank left without a
        stage once the job is done."""

    def swap_into(self, model: list, optimizer: Any, scheduler: Any) -> None:
        """Make the objects ``train()`` holds the current ones, in place."""

    @property
    def num_active_ranks(self) -> int: ...

    @property
    def consumed_samples(self) -> int: ...

    @property
    def iteration(self) -> int:
        """Iterations the job has done (a replacement joins after some)."""

    def evaluate(self, split: Any) -> float | None:
        """Mean per-token loss on the split a placeholder names (None: nothing to report),
        through failures."""

    def survives(self, error: BaseException) -> bool:
        """Whether ``error``, raised between steps, comes from a failed rank that the next step
        recovers from (waits a bounded time for the evidence); ``False``: it is this rank's."""

    @property
    def logs(self) -> bool:
        """Whether this rank prints Megatron-LM's log line: the last of the active ranks."""

    @property
    def catching_up(self) -> bool:
        """Whether ``train()`` on this rank is behind the job's iteration (a layout used it
        again after it held no stage): its ``train_step`` calls did nothing, and it writes no
        log line until it is in step."""

    def share(self, name: str, value: str | None = None) -> str | None:
        """Publish ``value`` under ``name`` for every rank of the job (``None``: read what was
        published, ``None`` if nothing was)."""

    def resumed_at(self) -> tuple[int, int, float]:
        """The iteration, consumed samples and floating-point operations of the checkpoint
        ``--load`` resumed (zeros without one)."""

    def save_checkpoint(self, iteration: int, floating_point_operations: float) -> None:
        """Save the state after ``iteration`` under ``--save``, in the background."""

    def finish_saves(self) -> None:
        """Return once this rank's saves are written (and committed, where it commits them)."""


class DefaultGroupRedirect(types.ModuleType):
    """``torch.distributed`` in which a collective or rank query without a group uses
    ``world()`` (while it returns a group), and a broadcast's ``src`` is a rank of that group.

    A collective that fails where ``survives(error)`` (a peer failed: the next step recovers)
    returns ``None`` instead of raising, its tensors left as they were: Megatron-LM's timers and
    log lines between steps go on without the failed rank. Where ``world()`` returns
    :attr:`OUTSIDE` (a rank that holds no stage), collectives without a group do nothing and
    the rank queries answer as in a group of this rank alone (rank 0 of 1: Megatron's timers
    index their gathers by them)."""

    OUTSIDE = object()
    """What ``world()`` returns on a rank outside the group of the ranks that hold a stage."""

    _GROUPED = ("barrier", "all_reduce", "all_gather", "all_gather_into_tensor",
                "_all_gather_base", "all_gather_object", "get_rank", "get_world_size")
    _QUERIES = ("get_rank", "get_world_size")

    def __init__(self, world: Callable[[], dist.ProcessGroup | None],
                 survives: Callable[[BaseException], bool] = lambda error: False) -> None:
        super().__init__("torch.distributed", dist.__doc__)
        self._world = world
        self._survives = survives
        for name in self._GROUPED:
            function = self._in_world(getattr(dist, name))
            setattr(self, name, function if name in self._QUERIES else self._surviving(function))

    def __getattr__(self, name: str):
        return getattr(dist, name)

    def _group(self, group):
        world = self._world()
        if world is not None and (group is None or group is dist.GroupMember.WORLD):
            return world
        return group

    def _in_world(self, function: Callable) -> Callable:
        signature = inspect.signature(function)
        outside = {"get_rank": 0, "get_world_size": 1}.get(function.__name__)

        @functools.wraps(function)
        def in_world(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs)
            bound.arguments["group"] = self._group(bound.arguments.get("group"))
            if bound.arguments["group"] is self.OUTSIDE:
                return outside
            return function(*bound.args, **bound.kwargs)

        return in_world

    def _surviving(self, function: Callable) -> Callable:
        @functools.wraps(function)
        def surviving(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except Exception as error:
                if self._survives(error):
                    return None
                raise

        return surviving

    def is_last_rank(self) -> bool:
        """Megatron-LM's ``is_last_rank`` over ``world()``: the rank that prints the log line
        and writes TensorBoard and W&B (never one outside it)."""
        if self._world() is self.OUTSIDE:
            return False
        return self.get_rank() == self.get_world_size() - 1

    def broadcast(self, tensor, src=None, group=None, async_op=False, group_src=None):
        target = self._group(group)
        if target is self.OUTSIDE:
            return None
        if target is not group and src is not None:
            src, group_src = None, src
        return self._surviving(dist.broadcast)(tensor, src=src, group=target, async_op=async_op,
                                               group_src=group_src)


def torch_with_distributed(base: types.ModuleType, distributed: types.ModuleType) -> types.ModuleType:
    """A stand-in for ``base`` (``torch`` or a stand-in of it) with ``distributed`` replaced."""
    proxy = types.ModuleType("torch", torch.__doc__)
    proxy.__dict__.update(vars(base))
    proxy.distributed = distributed
    proxy.__getattr__ = lambda name: getattr(torch, name)
    return proxy


class _ElasticLoop:
    """The hooks, and the script's ``forward_step`` that ``pretrain`` was given."""

    def __init__(self, backend: DeviceBackend, runtime: ElasticRuntime) -> None:
        self.backend = backend
        self.runtime = runtime
        self.forward_step_func: Callable | None = None

    # -- 1. flags and pretrain -----------------------------------------------------------------

    def parse_args(self, parse_args: Callable) -> Callable:
        signature = inspect.signature(parse_args)

        @functools.wraps(parse_args)
        def with_elastic_args(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            extra = bound.arguments.get("extra_args_provider")

            def extra_args_provider(parser):
                parser = extra(parser) if extra is not None else parser
                self.runtime.add_arguments(parser)
                return parser

            bound.arguments["extra_args_provider"] = extra_args_provider
            parsed = parse_args(*bound.args, **bound.kwargs)
            if getattr(parsed, "elastic", False):
                self.runtime.arguments_parsed(parsed)
            return parsed

        return with_elastic_args

    def pretrain(self, pretrain: Callable) -> Callable:
        signature = inspect.signature(pretrain)

        @functools.wraps(pretrain)
        def elastic_pretrain(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            self.forward_step_func = bound.arguments["forward_step_func"]
            if (self.runtime.rejoining and "pg_collection" in signature.parameters
                    and bound.arguments.get("pg_collection") is None):
                # core_v0.19 reads parallel_state's groups before setup_model_and_optimizer,
                # where a replacement has none yet; the elastic job's steps and evaluations
                # use their own, so train() gets an empty collection to pass along.
                from megatron.core.process_groups_config import ProcessGroupCollection

                bound.arguments["pg_collection"] = ProcessGroupCollection()
            return pretrain(*bound.args, **bound.kwargs)

        return elastic_pretrain

    def initialize_megatron(self, initialize: Callable) -> Callable:
        @functools.wraps(initialize)
        def elastic_initialize(*args, **kwargs):
            from megatron.training import get_args

            if not self.runtime.rejoining:
                return initialize(*args, **kwargs)
            # A replacement forms no first world: it joins the running job's groups when the
            # job takes it in (setup_model_and_optimizer).
            kwargs["skip_mpu_initialization"] = True
            result = initialize(*args, **kwargs)
            self.runtime.check_rejoin(get_args())
            return result

        return elastic_initialize

    # -- 2. model and optimizer ----------------------------------------------------------------

    def setup_model_and_optimizer(self, setup: Callable) -> Callable:
        signature = inspect.signature(setup)

        @functools.wraps(setup)
        def elastic_setup(*args, **kwargs):
            from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine
            from megatron.training import get_args, get_tokenizer
            from megatron.training.arguments import core_transformer_config_from_args

            margs = get_args()
            if not margs.elastic:
                return setup(*args, **kwargs)
            sys.modules[TRAINING].update_train_iters(margs)  # --train-samples: the iterations
            self._check(margs)
            model_provider = model_provider_of(signature.bind(*args, **kwargs).arguments)
            if model_provider is None:
                self.runtime.refuse("--elastic in Megatron-LM's loop needs a model provider or a "
                                    "model config to build the chunks with")
            # The job re-runs broken iterations itself; the state machine's re-runs would replay
            # Megatron-LM's data iterators and agree over the first world.
            get_rerun_state_machine().set_mode(RerunMode.DISABLED)
            objects = self.runtime.start(
                margs, tokenizer=get_tokenizer(),
                transformer_config=lambda: core_transformer_config_from_args(margs),
                model_provider=model_provider,
                scheduler=lr_schedule_from_flags(
                    sys.modules[TRAINING].get_optimizer_param_scheduler, margs),
                optimizer_config=lambda: optimizer_config_of(margs),
                forward_step_func=forward_step_on_current_layout(self.forward_step_func),
                global_batch_size_at=global_batch_size_at)
            # train() starts where the job is: after a --load, or some iterations in for a
            # replacement.
            (margs.iteration, margs.consumed_train_samples,
             margs.num_floating_point_operations_so_far) = self.runtime.resumed_at()
            wandb_writer = sys.modules[GLOBAL_VARS]._GLOBAL_WANDB_WRITER
            if wandb_writer is not None:  # a later logging rank goes on with this run
                self.runtime.share(WANDB_RUN, wandb_writer.run.id)
            return objects

        return elastic_setup

    def _check(self, args) -> None:
        self.runtime.check_arguments(args)
        for name, flag in _UNSUPPORTED + _UNSUPPORTED_CHECKPOINTING:
            if getattr(args, name, None):
                self.runtime.refuse(f"--elastic in Megatron-LM's loop does not support {flag}")
        unsupported_mtp = multi_token_prediction.unsupported_mtp_model(args)
        if unsupported_mtp is not None:
            self.runtime.refuse(f"--elastic in Megatron-LM's loop does not support {unsupported_mtp}")
        if args.mtp_num_layers and args.pipeline_model_parallel_layout:
            self.runtime.refuse(
                "--elastic in Megatron-LM's loop does not support --mtp-num-layers with "
                "--pipeline-model-parallel-layout: the script's get_batch finds the prediction "
                "layers' stage in that layout by pipeline rank, which a re-partition changes; "
                "give the split with --decoder-first/last-pipeline-num-layers instead")
        if args.save and getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
            self.runtime.refuse(f"--elastic saves in the torch_dist format, not --ckpt-format "
                                f"{args.ckpt_format}")
        if args.context_parallel_size > 1:
            self.runtime.refuse("--elastic in Megatron-LM's loop does not support "
                                "--context-parallel-size > 1: a failed rank's sequence shards "
                                "are not resharded; use --tensor-model-parallel-size or "
                                "--pipeline-model-parallel-size for the memory instead")
        if args.elastic_device not in (None, "auto", self.backend.name):
            self.runtime.refuse(f"--elastic-device {args.elastic_device}: this run is on "
                                f"{self.backend.name}")

    # -- 3. data -------------------------------------------------------------------------------

    def build_data_iterators(self, build: Callable) -> Callable:
        @functools.wraps(build)
        def elastic_iterators(*args, **kwargs):
            from megatron.training import get_args

            margs = get_args()
            if not margs.elastic:
                return build(*args, **kwargs)
            validation, test = self.runtime.evaluation_splits()
            margs.do_train = True
            margs.do_valid = validation is not None
            margs.do_test = test is not None
            return iter(()), validation, test

        return elastic_iterators

    # -- 4. one iteration ----------------------------------------------------------------------

    def train_step(self, train_step: Callable) -> Callable:
        @functools.wraps(train_step)
        def elastic_train_step(forward_step_func, data_iterator, model, optimizer,
                               opt_param_scheduler, config, forward_backward_func, iteration=None,
                               **kwargs):
            from megatron.core import parallel_state
            from megatron.core.num_microbatches_calculator import get_num_microbatches
            from megatron.training import get_args

            args = get_args()
            if not args.elastic:
                return train_step(forward_step_func, data_iterator, model, optimizer,
                                  opt_param_scheduler, config, forward_backward_func,
                                  iteration=iteration, **kwargs)
            result = self.runtime.train_step(iteration)
            self.runtime.swap_into(model, optimizer, opt_param_scheduler)
            keep_writers_on_logging_rank(args, self.runtime)
            # args.data_parallel_size stays the micro-batch calculator's: Megatron-LM reports the
            # global batch as its product with the micro-batch size and count.
            args.world_size = self.runtime.num_active_ranks
            if result is None:  # no stage here any more, and the job is done
                return {}, 0, False, True, 0, None, None, 0
            args.consumed_train_samples = self.runtime.consumed_samples - (
                parallel_state.get_data_parallel_world_size() * args.micro_batch_size
                * get_num_microbatches())
            loss = {"lm loss": torch.tensor(result.lm_loss)}
            return loss, int(result.skipped), False, False, 0, result.grad_norm, None, 0

        return elastic_train_step

    def training_log(self, training_log: Callable) -> Callable:
        over_pg_collection = logs_over_pg_collection(training_log)
        signature = inspect.signature(training_log)

        @functools.wraps(training_log)
        def elastic_training_log(*args, **kwargs):
            from megatron.training import get_args

            if not get_args().elastic:
                return training_log(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            if self.runtime.catching_up:  # nothing was done here to log, or to count
                return bound.arguments["report_memory_flag"]
            if over_pg_collection:
                bound.arguments["pg_collection"] = None  # parallel_state's: the current groups
            if bound.arguments.get("is_first_iteration"):
                # core_v0.19 logs (with timer barriers, and without resetting its sums) after
                # train()'s first iteration: the job's first after its start or --load, not a
                # replacement's first after it joined.
                bound.arguments["is_first_iteration"] = (
                    bound.arguments["iteration"] == self.runtime.resumed_at()[0] + 1)
            return training_log(*bound.args, **bound.kwargs)

        return elastic_training_log

    def between_steps(self, fallback: Callable[[dict[str, Any]], Any]) -> Callable:
        """A wrapper of one of ``train()``'s steps between iterations (its log line, its
        evaluation) that survives a failed rank: where the step raises because a peer failed
        (:meth:`ElasticRuntime.survives`), it returns ``fallback(its bound arguments)`` instead
        and ``train()`` goes on to the next ``train_step``, which recovers. Without
        ``--elastic`` it calls through."""

        def wrap(function: Callable) -> Callable:
            signature = inspect.signature(function)

            @functools.wraps(function)
            def surviving(*args, **kwargs):
                from megatron.training import get_args

                if not get_args().elastic:
                    return function(*args, **kwargs)
                try:
                    return function(*args, **kwargs)
                except Exception as error:
                    if not self.runtime.survives(error):
                        raise
                    return fallback(signature.bind(*args, **kwargs).arguments)

            return surviving

        return wrap

    # -- 8. checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, save_checkpoint: Callable) -> Callable:
        signature = inspect.signature(save_checkpoint)

        @functools.wraps(save_checkpoint)
        def elastic_save_checkpoint(*args, **kwargs):
            from megatron.training import get_args

            if not get_args().elastic:
                return save_checkpoint(*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            self.runtime.save_checkpoint(bound["iteration"],
                                         bound["num_floating_point_operations_so_far"])
            return None

        return elastic_save_checkpoint

    def save_checkpoint_and_time(self, save: Callable) -> Callable:
        """Megatron-LM's save with its parameter sync, timers and memory report: nothing on a
        rank catching up (it holds no state of the iteration saved; the others saved it)."""
        @functools.wraps(save)
        def elastic_save_and_time(*args, **kwargs):
            from megatron.training import get_args

            if get_args().elastic and self.runtime.catching_up:
                return None
            return save(*args, **kwargs)

        return elastic_save_and_time

    def maybe_finalize_async_save(self, finalize: Callable) -> Callable:
        @functools.wraps(finalize)
        def elastic_finalize(*args, blocking: bool = False, **kwargs):
            from megatron.training import get_args

            if not get_args().elastic:
                return finalize(*args, blocking=blocking, **kwargs)
            if blocking:  # before an exit: the saves in flight are written
                self.runtime.finish_saves()
            return None

        return elastic_finalize

    # -- 5. evaluation -------------------------------------------------------------------------

    def evaluate(self, evaluate: Callable) -> Callable:
        @functools.wraps(evaluate)
        def elastic_evaluate(forward_step_func, data_iterator, *args, **kwargs):
            from megatron.training import get_args

            if not get_args().elastic:
                return evaluate(forward_step_func, data_iterator, *args, **kwargs)
            if isinstance(data_iterator, list):  # one per virtual stage, all the same split
                data_iterator = data_iterator[0]
            loss = self.runtime.evaluate(data_iterator)
            return ({"lm loss": torch.tensor(loss)} if loss is not None else {}), None, False

        return elastic_evaluate


def _elastic_run() -> bool:
    """Whether Megatron-LM's loop runs with ``--elastic`` (its arguments parsed, and given)."""
    global_vars = sys.modules.get(GLOBAL_VARS)
    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    return bool(getattr(args, "elastic", False))


def _args() -> argparse.Namespace:
    """Megatron-LM's parsed arguments."""
    return sys.modules[GLOBAL_VARS].get_args()


def _launch_parallel_sizes() -> tuple[int, int]:
    """Megatron-LM's tensor and data-parallel sizes of the launch, which its micro-batch
    calculator keeps whatever the job's layout."""
    args = _args()
    return args.tensor_model_parallel_size, args.data_parallel_size


def keep_writers_on_logging_rank(args: argparse.Namespace, runtime: ElasticRuntime) -> None:
    """Megatron-LM's TensorBoard and W&B writers (``megatron.training.global_vars``), which
    Megatron-LM opens on the last rank only, live on the rank that prints the log line now:
    after a failure of the last rank the new last rank opens them (TensorBoard in the same
    ``--tensorboard-dir``, W&B resuming the same run), and a rank that no longer logs (the
    replaced rank is back) closes its own."""
    if not runtime.logs:
        close_writers()
        return
    global_vars = sys.modules[GLOBAL_VARS]
    if global_vars._GLOBAL_TENSORBOARD_WRITER is None and getattr(args, "tensorboard_dir", None):
        from torch.utils.tensorboard import SummaryWriter

        global_vars._GLOBAL_TENSORBOARD_WRITER = SummaryWriter(
            log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)
    if global_vars._GLOBAL_WANDB_WRITER is None and getattr(args, "wandb_project", None):
        import wandb

        save_dir = args.wandb_save_dir or os.path.join(args.save or ".", "wandb")
        os.makedirs(save_dir, exist_ok=True)
        wandb.init(dir=save_dir, name=args.wandb_exp_name, project=args.wandb_project,
                   config=vars(args), id=runtime.share(WANDB_RUN), resume="allow",
                   **({"entity": args.wandb_entity} if args.wandb_entity else {}))
        global_vars._GLOBAL_WANDB_WRITER = wandb


def close_writers(exit_code: int | None = None) -> None:
    """Flush and close Megatron-LM's TensorBoard and W&B writers where this rank has them: on a
    rank that no longer logs, and before a process ends without its exit handlers (the W&B run
    then marked with ``exit_code``)."""
    global_vars = sys.modules.get(GLOBAL_VARS)
    if global_vars is None:
        return
    writer = global_vars._GLOBAL_TENSORBOARD_WRITER
    if writer is not None:
        writer.close()
        global_vars._GLOBAL_TENSORBOARD_WRITER = None
    wandb_writer = global_vars._GLOBAL_WANDB_WRITER
    if wandb_writer is not None:
        wandb_writer.finish(exit_code=exit_code)
        global_vars._GLOBAL_WANDB_WRITER = None


def register(registry: PatchRegistry, backend: DeviceBackend, runtime: ElasticRuntime) -> None:
    """Register the hooks, calling into ``runtime``, and, on CUDA, the default-group redirect of
    the loop modules (off CUDA :mod:`.megatron_lm` puts the redirect into its device-mapped
    ``torch``)."""
    loop = _ElasticLoop(backend, runtime)
    registry.register_wrapper(f"{ARGUMENTS}.parse_args", loop.parse_args)
    for target in (f"{TRAINING}.pretrain", "megatron.training.pretrain"):
        registry.register_wrapper(target, loop.pretrain)
    registry.register_wrapper("megatron.training.initialize.initialize_megatron",
                              loop.initialize_megatron)
    registry.register_wrapper(f"{TRAINING}.setup_model_and_optimizer",
                              loop.setup_model_and_optimizer)
    registry.register_wrapper(f"{TRAINING}.build_train_valid_test_data_iterators",
                              loop.build_data_iterators)
    registry.register_wrapper(f"{TRAINING}.train_step", loop.train_step)
    registry.register_wrapper(f"{TRAINING}.training_log", loop.training_log)
    registry.register_wrapper(f"{TRAINING}.training_log", loop.between_steps(
        lambda arguments: arguments["report_memory_flag"]))
    registry.register_wrapper(f"{TRAINING}.evaluate", loop.evaluate)
    for step in ("evaluate_and_print_results", "disable_forward_pre_hook"):
        registry.register_wrapper(f"{TRAINING}.{step}", loop.between_steps(lambda arguments: None))
    registry.register_wrapper(f"{TRAINING}.save_checkpoint", loop.save_checkpoint)
    registry.register_wrapper(f"{TRAINING}.save_checkpoint_and_time",
                              loop.save_checkpoint_and_time)
    registry.register_wrapper(f"{TRAINING}.maybe_finalize_async_save",
                              loop.maybe_finalize_async_save)
    distributed = runtime.distributed
    # Megatron-LM asks torch.distributed's own rank (megatron.core's safe_get_rank) whether it
    # is the last of the redirected world; the logging rank is the last of the job's ranks.
    registry.register(f"{training_utils_modules()[0]}.is_last_rank", distributed.is_last_rank)
    moe_utils.register_job_wide_reduction(
        registry, active=_elastic_run, sum_over_job=lambda values: distributed.all_reduce(values),
        parallel_sizes=_launch_parallel_sizes,
        num_layers=lambda: _args().num_layers + (_args().mtp_num_layers or 0))
    multi_token_prediction.register_job_wide_reduction(
        registry, active=_elastic_run, sum_over_job=lambda values: distributed.all_reduce(values),
        parallel_sizes=_launch_parallel_sizes, num_layers=lambda: _args().mtp_num_layers,
        device=backend.device)
    if backend.name == "cuda":
        for module in loop_modules():
            registry.register(f"{module}.torch", torch_with_distributed(torch, distributed))
    registry.register("megatron.core.timers.torch", torch_with_distributed(torch, distributed))
    registry.register(f"{SIGNAL_HANDLER}.torch", torch_with_distributed(torch, distributed))
    registry.register("megatron.core.timers.dist_all_gather_func",
                      distributed.all_gather_into_tensor)
