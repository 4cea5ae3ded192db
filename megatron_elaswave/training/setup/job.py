"""One rank's part of a training job: build everything on megatron-core, then train."""

from __future__ import annotations

import argparse
import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_elaswave import patches
from megatron_elaswave.device import DeviceBackend
from megatron_elaswave.launch.keys import FINISHED_KEY
from megatron_elaswave.launch.config import REJOIN_ENV, STORE_ADDR_ENV
from megatron_elaswave.launch.store import connect_store
from megatron_elaswave.metrics import MetricsWriter
from megatron_elaswave.patches.dist_checkpointing import background_saves
from megatron_elaswave.runtime import dropout_rng

from . import exit_status

from ..checkpointing.checkpoint import (
    MegatronLayout,
    TrainingProgress,
    load_checkpoint,
    resume_hint,
    save_checkpoint,
)
from ..step.data import MicrobatchSource, build_datasets, load_tokenizer, padded_vocab_size
from .distributed import init_default_group, init_model_parallel, shutdown
from ..checkpointing.durable import SaveFailed
from ..recovery.elastic import run_elastic
from .elastic_setup import build_elastic_trainer, join_elastic_job
from ..recovery.planning import failure_free_layout
from ..recovery.relayout import JobFinished, JobStopped
from ..step.loop import Trainer, log
from ..step.migration import StateLost
from ..step.model import (
    batched_p2p_is_safe,
    build_model_chunks,
    seed_random_generators,
    transformer_config,
    wrap_and_optimize,
)
from .profiling import CostProfiler, device_description, write_profile
from ..recovery.outcomes import CannotContinue, StepFailed
from ..step.snapshots import StepSnapshots, snapshot_config
from .startup import StartupWatch
from ..step.stopping import StopConditions, describe
from ..step.writers import ScalarWriters


class CannotRejoin(RuntimeError):
    """A replacement worker was started for a job that cannot take it in."""


class StopTraining(Exception):
    """Every rank stops before ``--train-iters`` (:mod:`.stopping`)."""


def stop_code(stop: StopConditions) -> int:
    """Why the job stops, the same on every rank: the first reason of the lowest rank that has
    one (a collective over the default group)."""
    codes = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    codes[dist.get_rank()] = stop.code()
    dist.all_reduce(codes)
    return next((int(code) for code in codes.tolist() if code), 0)


def build_trainer(args: argparse.Namespace, backend: DeviceBackend, rank: int, tokenizer) -> Trainer:
    """Process groups, model chunks, DDP, optimizer, data and the failure-free layout."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    pg_collection = init_model_parallel(tp, pp, args.virtual_pipeline_model_parallel_size,
                                        args.distributed_timeout_minutes,
                                        ep=args.expert_model_parallel_size,
                                        etp=args.expert_tensor_parallel_size)
    seed_random_generators(args.seed, pg_collection)
    config = transformer_config(args, batched_p2p_is_safe(args, backend.dist_backend))
    vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, tp)
    args.padded_vocab_size = vocab_size  # as Megatron-LM's: the throughput counts its FLOPs
    chunks = build_model_chunks(args, config, vocab_size, pg_collection, backend.device())
    objects = wrap_and_optimize(args, config, chunks, pg_collection)
    train_set, valid_set = build_datasets(args, tokenizer)
    layout = failure_free_layout(args)
    snapshots = None
    if args.elastic_snapshots:
        # Snapshots are host memory: on NCCL or HCCL their replicas go over a gloo group.
        host_group = None if backend.dist_backend == "gloo" else dist.new_group(backend="gloo")
        snapshots = StepSnapshots(layout, rank, snapshot_config(args), group=host_group)
    return Trainer(
        args=args,
        objects=objects,
        pg_collection=pg_collection,
        backend=backend,
        layout=layout,
        train_source=MicrobatchSource(train_set, args.micro_batch_size),
        valid_source=MicrobatchSource(valid_set, args.micro_batch_size) if valid_set else None,
        metrics=MetricsWriter(args.elastic_metrics_file if rank == 0 else None),
        rank=rank,
        snapshots=snapshots,
        writers=ScalarWriters.for_logging_rank(args, None) if rank == 0 else None,
    )


def megatron_layout_of(trainer: Trainer) -> MegatronLayout | None:
    """How the trainer's objects correspond to Megatron-LM's own (:class:`MegatronLayout`):
    exactly without ``--elastic``; with it, in the failure-free layout of one chunk per stage
    (no virtual stages, contiguous ZeRO shards), as Megatron-LM's rank of the same position."""
    args = trainer.args
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if not args.elastic:
        return MegatronLayout(tp, pp)
    if args.virtual_pipeline_model_parallel_size or args.elastic_zero != "contiguous":
        return None
    _, stage, tp_rank = trainer.layout.position(trainer.rank)
    return MegatronLayout(tp, pp, model_parallel_rank=stage * tp + tp_rank)


def resume(trainer: Trainer, root: str) -> TrainingProgress:
    """Load the latest checkpoint under ``root`` into the trainer (collective)."""
    args = trainer.args
    progress = load_checkpoint(root, trainer.objects, megatron_layout_of(trainer),
                               load_optimizer=not getattr(args, "no_load_optim", False),
                               finetune=getattr(args, "finetune", False))
    trainer.iteration, trainer.consumed_samples = progress.iteration, progress.consumed_samples
    if trainer.rank == 0:
        log(f" loaded checkpoint from {root} at iteration {progress.iteration}")
    return progress


def elastic_train_job(args: argparse.Namespace, backend: DeviceBackend, rank: int,
                      world_size: int, tokenizer, *, rejoining: bool = False,
                      startup: StartupWatch | None = None) -> None:
    """``--elastic``: train to ``--train-iters`` through failures of other ranks; a replacement
    (``rejoining``) first joins the running job. ``startup`` is closed once every rank holds its
    first snapshot: from then on a failure is recovered from."""
    vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                   args.tensor_model_parallel_size)
    args.padded_vocab_size = vocab_size
    train_set, valid_set = build_datasets(args, tokenizer)
    sources = (MicrobatchSource(train_set, args.micro_batch_size),
               MicrobatchSource(valid_set, args.micro_batch_size) if valid_set else None)
    if rejoining:
        try:
            trainer = join_elastic_job(args, backend, rank, world_size, vocab_size, *sources)
        except JobFinished as finished:
            log(f" {finished}; exiting")
            if isinstance(finished, JobStopped):
                raise
            return
    else:
        trainer = build_elastic_trainer(args, backend, rank, world_size, vocab_size, *sources)
        if rank == 0:
            trainer.writers = ScalarWriters.for_logging_rank(args, trainer.store)
        if args.load:
            resume(trainer, args.load)
        trainer.ensure_initial_snapshot()
        if startup is not None:
            startup.wait_until_started(timedelta(minutes=args.distributed_timeout_minutes))
    trainer.stop_conditions.install()
    with trainer.monitor:
        try:
            run_elastic(trainer)
            # Within the monitor: a writer that dies now is seen, not waited on.
            trainer.durable.finish(trainer.durable.config.timeout_s)
            if failure := trainer.durable.last_save_failure(trainer.iteration):
                raise SaveFailed(failure.line(args.save))
        except (CannotContinue, StateLost, StepFailed, SaveFailed) as stopped:
            with contextlib.suppress(RuntimeError):  # a lost job store is what stopped it
                trainer.store.set(FINISHED_KEY, str(stopped) or type(stopped).__name__)
                # What there is to resume from is known before every survivor says it.
                trainer.durable.finish(trainer.durable.config.timeout_s)
            raise
        finally:
            trainer.governor.backend.close()
            if trainer.writers is not None:
                trainer.writers.close()
    trainer.durable.close()
    trainer.metrics.close()


def train_job(args: argparse.Namespace, backend: DeviceBackend, rank: int, local_rank: int,
              world_size: int) -> None:
    """Join the job, train to ``--train-iters`` with the checkpoints and profile asked for."""
    layout_invariant_rng = args.elastic_rng == "invariant"
    patches.install(backend, dropout_seeds=dropout_rng if layout_invariant_rng else None)
    dropout_rng.set_seed(args.seed)
    tokenizer = load_tokenizer(args)
    rejoining = os.environ.get(REJOIN_ENV) == "1"
    if args.elastic and (overridden := backend.keep_survivors_alive()) and rank == 0:
        log(f" note: {overridden}")
    if rejoining and not args.elastic:
        raise CannotRejoin("this worker was started again to rejoin the job, but the job does "
                           "not run with --elastic: its survivors stopped with the failure")
    if rejoining:
        backend.set_device(local_rank)  # the default group is formed with the members
        try:
            elastic_train_job(args, backend, rank, world_size, tokenizer, rejoining=True)
        finally:
            shutdown(destroy_default_group=False)
        return
    with watch_startup(args, rank, world_size) as startup:
        try:
            init_default_group(rank, world_size, local_rank, backend,
                               args.distributed_timeout_minutes)
            if args.elastic:
                try:
                    elastic_train_job(args, backend, rank, world_size, tokenizer, startup=startup)
                finally:
                    shutdown(destroy_default_group=False)
                return
            train_without_elastic(args, backend, rank, tokenizer)
        except RuntimeError as error:
            if startup is not None:
                startup.stop_if_a_rank_died(error)
            raise


def watch_startup(args: argparse.Namespace, rank: int,
                  world_size: int) -> contextlib.AbstractContextManager[StartupWatch | None]:
    """Under ``elaswave-run``, a watch that stops this worker in one line when another rank dies
    before the job can recover from it: before every rank holds its first snapshot with
    ``--elastic``, at any time without (as torchrun stops the survivors)."""
    if STORE_ADDR_ENV not in os.environ or world_size == 1:
        return contextlib.nullcontext()
    if args.elastic:
        status, reason = exit_status.CANNOT_CONTINUE, lambda death: (
            f"cannot continue: rank {death.rank} {death.describe()} while the job started, "
            f"before it held a snapshot to recover from; launch it again; "
            f"{resume_hint(args.save or args.load)}")
    else:
        status, reason = exit_status.PEER_FAILED, lambda death: (
            f"error: rank {death.rank} {death.describe()}; without --elastic the job stops with it")
    store = connect_store(timeout=timedelta(minutes=args.distributed_timeout_minutes))
    return StartupWatch(store, rank, world_size, exit_status=status, reason=reason)


def train_without_elastic(args: argparse.Namespace, backend: DeviceBackend, rank: int,
                          tokenizer) -> None:
    """Megatron's own path: no failure is survived."""
    trainer = None
    try:
        trainer = build_trainer(args, backend, rank, tokenizer)
        objects = trainer.objects
        if args.load:
            resume(trainer, args.load)
        stop = StopConditions(on_signal=args.exit_signal_handler,
                              duration_mins=args.exit_duration_in_mins)
        stop.install()
        saved_at = None
        background = background_saves() if args.async_save else None

        def save() -> None:
            nonlocal saved_at
            progress = TrainingProgress(trainer.iteration, trainer.consumed_samples)
            directory = save_checkpoint(args.save, objects, progress, args, background)
            saved_at = trainer.iteration
            if rank == 0:
                done = "scheduled" if background is not None else "saved"
                log(f" {done} checkpoint at iteration {trainer.iteration} to {directory}")

        chunks = [ddp.module for ddp in objects.model]
        profiler = CostProfiler(chunks, backend, measure=bool(args.elastic_profile_out))

        def after_iteration(trainer: Trainer) -> None:
            profiler.recording = True  # the first iteration is warm-up
            if background is not None:
                background.maybe_finalize_async_calls(blocking=False)
            if args.save and args.save_interval and trainer.iteration % args.save_interval == 0:
                save()
            if stop.armed:
                code = stop_code(stop)
                if code:
                    if rank == 0:
                        log(f" stopping after iteration {trainer.iteration}: "
                            f"{describe(code, args.exit_duration_in_mins)}")
                    raise StopTraining

        try:
            trainer.train(on_iteration=after_iteration)
        except StopTraining:
            pass
        if args.elastic_profile_out:
            write_profile(args.elastic_profile_out, profiler, trainer.pg_collection, args,
                          device_description(backend))
        if args.save and saved_at != trainer.iteration:
            save()
        if background is not None:
            background.close()  # finalises the saves in flight first
        trainer.metrics.close()
        if trainer.writers is not None:
            trainer.writers.close()
    finally:
        if trainer is not None and trainer.snapshots is not None:
            trainer.snapshots.discard()  # no exchange of replicas in flight as the groups go
        shutdown()
