"""Entry point of ``scripts/pretrain_gpt.py``: set up one rank and train.

Bad input is reported as one line (``pretrain_gpt.py: error: ...``) with exit code 2, before
any training state exists; nothing here prints a traceback for a user mistake.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_elaswave.device import DeviceUnavailableError, resolve_device_backend

from .arguments import ArgumentError, parse_args

EXIT_BAD_INPUT = 2

# Warnings megatron-core and torch print on every rank that a user cannot act on.
_KNOWN_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "Warning: tp_group is None",
)


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job, as the launcher (or torchrun) told it."""

    rank: int
    world_size: int
    local_rank: int


def report_error(message: str, rank: int) -> None:
    """One line on stderr, from rank 0 only (every rank fails the same checks)."""
    if rank == 0:
        print(f"pretrain_gpt.py: error: {message}", file=sys.stderr, flush=True)


def pretrain(argv: Sequence[str] | None = None) -> int:
    info = RankInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )
    try:
        args = parse_args(argv, info.world_size)
        backend = resolve_device_backend(args.elastic_device)
    except (ArgumentError, DeviceUnavailableError) as error:
        report_error(str(error), info.rank)
        return EXIT_BAD_INPUT
    half = {"--bf16": torch.bfloat16, "--fp16": torch.float16}
    flag = "--bf16" if args.bf16 else "--fp16" if args.fp16 else None
    if flag and not backend.supports_dtype(half[flag]):
        report_error(f"{flag} needs a CUDA or NPU device; on {backend.name} train in fp32 "
                     f"(drop {flag})", info.rank)
        return EXIT_BAD_INPUT
    # Imported here so that flag errors come back before megatron-core is loaded.
    cuda_hints = () if backend.name == "cuda" else ("CUDA_DEVICE_MAX_CONNECTIONS",)
    for message in _KNOWN_WARNINGS + cuda_hints:
        warnings.filterwarnings("ignore", message=f".*{re.escape(message)}")
    from megatron_elaswave import patches
    from megatron_elaswave.layout import Layout
    from megatron_elaswave.metrics import MetricsWriter

    from .checkpoint import CheckpointError, TrainingProgress, load_checkpoint, save_checkpoint
    from .data import DataError, MicrobatchSource, build_datasets, load_tokenizer, padded_vocab_size
    from .distributed import init_default_group, init_model_parallel, shutdown
    from .loop import Trainer, log
    from megatron_elaswave.snapshot import SnapshotConfig

    from .snapshots import StepSnapshots
    from .profiling import CostProfiler, device_description, write_profile
    from .model import (
        batched_p2p_is_safe,
        build_model_chunks,
        seed_random_generators,
        transformer_config,
        wrap_and_optimize,
    )

    try:
        patches.install(backend)
        tokenizer = load_tokenizer(args)
    except (patches.UnsupportedMegatronVersion, ValueError) as error:
        report_error(str(error), info.rank)
        return EXIT_BAD_INPUT

    init_default_group(info, backend, args.distributed_timeout_minutes)
    try:
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        pg_collection = init_model_parallel(tp, pp, args.virtual_pipeline_model_parallel_size,
                                            args.distributed_timeout_minutes)
        seed_random_generators(args.seed, pg_collection)
        config = transformer_config(args, batched_p2p_is_safe(args, backend.dist_backend))
        vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, tp)
        chunks = build_model_chunks(args, config, vocab_size, pg_collection, backend.device())
        objects = wrap_and_optimize(args, config, chunks, pg_collection)
        train_set, valid_set = build_datasets(args, tokenizer)
        num_microbatches = args.global_batch_size // args.micro_batch_size
        layout = Layout.megatron(tp=tp, pp=pp, dp=args.data_parallel_size,
                                 num_layers=args.num_layers, num_microbatches=num_microbatches)
        trainer = Trainer(
            args=args,
            objects=objects,
            pg_collection=pg_collection,
            backend=backend,
            layout=layout,
            train_source=MicrobatchSource(train_set, args.micro_batch_size),
            valid_source=MicrobatchSource(valid_set, args.micro_batch_size)
            if valid_set is not None and len(valid_set) else None,
            metrics=MetricsWriter(args.elastic_metrics_file if info.rank == 0 else None),
            rank=info.rank,
            snapshots=StepSnapshots(layout, info.rank,
                                    SnapshotConfig(replicas=args.elastic_snapshot_replicas))
            if args.elastic_snapshots else None,
        )
        if args.load:
            progress = load_checkpoint(args.load, objects)
            trainer.iteration, trainer.consumed_samples = progress.iteration, progress.consumed_samples
            if info.rank == 0:
                log(f" loaded checkpoint from {args.load} at iteration {progress.iteration}")

        def save(trainer: Trainer) -> None:
            progress = TrainingProgress(trainer.iteration, trainer.consumed_samples)
            directory = save_checkpoint(args.save, objects, progress)
            if info.rank == 0:
                log(f" saved checkpoint at iteration {trainer.iteration} to {directory}")

        profiler = CostProfiler(chunks, backend, measure=bool(args.elastic_profile_out))

        def after_iteration(trainer: Trainer) -> None:
            profiler.recording = True  # the first iteration is warm-up
            if args.save and args.save_interval and trainer.iteration % args.save_interval == 0:
                save(trainer)

        trainer.train(on_iteration=after_iteration)
        if args.elastic_profile_out:
            write_profile(args.elastic_profile_out, profiler, pg_collection, args,
                          device_description(backend))
        if args.save and not (args.save_interval and trainer.iteration % args.save_interval == 0):
            save(trainer)
        trainer.metrics.close()
    except (CheckpointError, DataError) as error:
        report_error(str(error), info.rank)
        return EXIT_BAD_INPUT
    finally:
        shutdown()
    return 0


def main() -> None:
    sys.exit(pretrain(sys.argv[1:]))
