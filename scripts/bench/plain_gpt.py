"""Baseline for the overhead benchmark: GPT training on plain megatron-core.

The loop megatron-core's own examples use (GPTModel, DDP, the distributed optimizer,
``get_forward_backward_func``) on random tokens, with none of the plugin: no layout-invariant
init, no metrics reduction, no patches beyond what the device needs to run at all (off CUDA, the
device compatibility layer; megatron-core cannot run on CPU without it). Each timed step is what
Megatron-LM's ``train_step`` does: zero the gradients, the schedule, the optimizer step, the LR
schedule's step and, on last-stage ranks, the loss summed over the data-parallel group. Rank 0
prints one JSON line per iteration: ``{"iteration": i, "step_time_s": t, "cpu_time_s": c}``,
``c`` being its process's CPU time (all threads) since the line before, as in the metrics file
of ``pretrain_gpt.py``. Launch with ``elaswave-run``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist


def mock_dataset(args):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    from megatron_elaswave.tokenizer import build_tokenizer

    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=args.seq_length, split="1,0,0",
        tokenizer=build_tokenizer("NullTokenizer", vocab_size=args.vocab_size - 1),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,
    )
    sizes = [args.train_iters * args.global_batch_size, None, None]
    return BlendedMegatronDatasetBuilder(MockGPTDataset, sizes, lambda: True, config).build()[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, default in (("tp", 1), ("pp", 2), ("num-layers", 4), ("hidden-size", 256),
                          ("num-attention-heads", 4), ("seq-length", 128), ("micro-batch-size", 2),
                          ("global-batch-size", 16), ("vocab-size", 512), ("train-iters", 20)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    args = parser.parse_args()

    from megatron_elaswave.device import resolve_device_backend

    backend = resolve_device_backend()
    if backend.name != "cuda":
        from megatron_elaswave.patches import PatchRegistry, device_compat, tensor_parallel_random

        compat = PatchRegistry()
        device_compat.register(compat, backend)
        tensor_parallel_random.register(compat, backend)
        compat.apply()
    backend.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend.dist_backend, timeout=datetime.timedelta(minutes=5))

    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(args.tp, args.pp)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp, calculate_per_token_loss=True,
    )
    config.finalize_model_grads_func = finalize_model_grads
    gpt = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size, max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    ).to(backend.device())
    model = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), gpt)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=0.0, use_distributed_optimizer=True),
        [model])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-3, min_lr=0.0, lr_warmup_steps=0,
        lr_decay_steps=args.train_iters * args.global_batch_size, lr_decay_style="linear",
        start_wd=0.0, end_wd=0.0, wd_incr_steps=args.train_iters * args.global_batch_size,
        wd_incr_style="constant")
    forward_backward = get_forward_backward_func()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()
    num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    dataset = mock_dataset(args)

    def batches():
        # Megatron-LM's pretraining sampler: rank d takes slot d of each micro-batch round.
        consumed = 0
        while True:
            first = consumed + dp_rank * args.micro_batch_size
            samples = [dataset[i] for i in range(first, first + args.micro_batch_size)]
            consumed += args.micro_batch_size * dp
            yield (torch.stack([torch.as_tensor(s["tokens"]) for s in samples]),
                   torch.stack([torch.as_tensor(s["position_ids"]) for s in samples]))

    def forward_step(data_iterator, chunk):
        tokens, positions = next(data_iterator)
        output = chunk(tokens, positions, None, labels=tokens)

        def loss_func(output_tensor):
            loss_sum = output_tensor.float().sum()
            num_tokens = torch.tensor(output_tensor.numel(), dtype=torch.int)
            return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}

        return output, loss_func

    data = batches()
    cpu_time = time.process_time()
    for iteration in range(1, args.train_iters + 1):
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=data,
                                  model=[model], num_microbatches=num_microbatches,
                                  seq_length=args.seq_length,
                                  micro_batch_size=args.micro_batch_size, forward_only=False)
        optimizer.step()
        scheduler.step(increment=args.global_batch_size)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            loss = torch.vstack([entry["lm loss"].view(-1) for entry in losses]).sum(dim=0)
            dist.all_reduce(loss, group=parallel_state.get_data_parallel_group(
                with_context_parallel=True))
        backend.synchronize()
        step_time = time.perf_counter() - start
        now = time.process_time()
        step_cpu_time, cpu_time = now - cpu_time, now
        if dist.get_rank() == 0:
            print(json.dumps({"iteration": iteration, "step_time_s": step_time,
                              "cpu_time_s": step_cpu_time}), flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
