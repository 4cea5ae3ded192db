"""Entry point of ``scripts/pretrain_gpt.py``: set up one rank and train.

Bad input is reported as one line (``pretrain_gpt.py: error: ...``) with exit code 2, before
any training state exists; nothing here prints a traceback for a user mistake.
"""

from __future__ import annotations

import sys
from typing import Sequence

from megatron_elaswave.device import DeviceUnavailableError, resolve_device_backend
from megatron_elaswave.layout import Layout
from megatron_elaswave.metrics import MetricsWriter

from .arguments import ArgumentError, parse_args
from .distributed import RankInfo, init_default_group, init_model_parallel, shutdown
from .loop import Trainer, report_error

EXIT_BAD_INPUT = 2


def pretrain(argv: Sequence[str] | None = None) -> int:
    info = RankInfo.from_environment()
    try:
        args = parse_args(argv, info.world_size)
        backend = resolve_device_backend(args.elastic_device)
    except (ArgumentError, DeviceUnavailableError) as error:
        report_error(str(error), info.rank)
        return EXIT_BAD_INPUT
    # Imported here so that flag errors come back before megatron-core is loaded.
    from megatron_elaswave import patches

    from .data import MicrobatchSource, build_datasets, load_tokenizer, padded_vocab_size
    from .model import (
        build_model_chunks,
        params_dtype,
        seed_random_generators,
        transformer_config,
        wrap_and_optimize,
    )

    if not backend.supports_dtype(params_dtype(args)):
        flag = "--bf16" if args.bf16 else "--fp16"
        report_error(f"{flag} needs a CUDA or NPU device; on {backend.name} train in fp32 "
                     f"(drop {flag})", info.rank)
        return EXIT_BAD_INPUT
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
        config = transformer_config(args)
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
        )
        trainer.train()
        trainer.metrics.close()
    finally:
        shutdown()
    return 0


def main() -> None:
    sys.exit(pretrain(sys.argv[1:]))
