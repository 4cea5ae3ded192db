"""Build GPT model chunks, DDP, the optimizer and the LR schedule on megatron-core's public API.

Every Megatron object gets its process groups explicitly through a ``ProcessGroupCollection``.

Weights are initialised *layout-invariantly* by default (``--elastic-init invariant``): each
parameter is drawn whole from a generator keyed by ``(seed, global parameter name)`` and then cut
to this rank's tensor-parallel shard. A layer therefore starts with the same values whatever the
TP x PP x DP layout, so runs on different layouts can be compared exactly. With
``--elastic-init megatron`` Megatron's own initialisation stays, drawn from the streams
:func:`seed_random_generators` seeds per pipeline stage and tensor-parallel rank.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
from dataclasses import dataclass

import numpy
import torch
from megatron.core import tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_elaswave.patches.distrib_optimizer import allocate_adam_state
from megatron_elaswave.patches.distributed_data_parallel import distributed_data_parallel
from megatron_elaswave.patches.gpt_model import RESIDUAL_OUTPUT_WEIGHTS, global_parameter_names


@dataclass
class TrainingObjects:
    """What one rank trains: its model chunks (wrapped in DDP), optimizer and LR schedule."""

    config: TransformerConfig
    model: list[DistributedDataParallel]
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler

    @property
    def stages(self) -> list[torch.nn.Module]:
        """What the schedule runs: one module per virtual pipeline stage."""
        return list(self.model)


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def transformer_config(args: argparse.Namespace, batch_p2p_comm: bool) -> TransformerConfig:
    """Megatron's config for ``args``.

    ``batch_p2p_comm`` must be False where two messages between the same pair of ranks can share
    one batch: see :func:`batched_p2p_is_safe`.
    """
    dtype = params_dtype(args)
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        use_cpu_initialization=True,
        # layout_invariant_init overwrites the values, but Megatron's init also marks which
        # weights are tensor-parallel; without it the shards would count as replicated.
        perform_initialization=True,
        # Gradients are normalised by the global token count, so any split of the global batch
        # over replicas and micro-batches gives the same update.
        calculate_per_token_loss=True,
        batch_p2p_comm=batch_p2p_comm,
        add_bias_linear=not args.disable_bias_linear,
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        **moe_config(args),
    )


def moe_config(args: argparse.Namespace) -> dict:
    """The MoE fields of Megatron's config for ``args`` (none for a dense model)."""
    if args.num_experts is None:
        return {}
    return dict(
        num_moe_experts=args.num_experts,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_layer_freq=args.moe_layer_freq,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_router_topk=args.moe_router_topk,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_dtype=args.moe_router_dtype,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
    )


def layer_spec(config: TransformerConfig, pp_rank: int, vp_stage: int | None = None):
    """The local (no Transformer Engine) spec of a chunk's layers: one layer spec for a dense
    model, the chunk's dense and MoE layers' for an MoE model (``--moe-layer-freq``)."""
    if config.num_moe_experts is None:
        return get_gpt_layer_local_spec()
    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage,
                                      pp_rank=pp_rank)


def mtp_block_spec(config: TransformerConfig, pp_rank: int, vp_stage: int | None = None):
    """The spec of the multi-token prediction layers of the chunk at ``pp_rank`` (``None`` where
    it holds none): each of the kind of the model's last layer, as Megatron-LM builds them."""
    if not config.mtp_num_layers:
        return None
    if config.num_moe_experts is None:
        last_layer = get_gpt_layer_local_spec()
    else:
        last_layer = get_gpt_decoder_layer_specs(config, use_transformer_engine=False)[-1]
    return get_gpt_mtp_block_spec(config, last_layer, use_transformer_engine=False,
                                  vp_stage=vp_stage, pp_rank=pp_rank)


def seed_random_generators(seed: int, pg_collection: ProcessGroupCollection) -> None:
    """Megatron-LM's seeding: per pipeline stage for the default generators, plus the
    tensor-parallel tracker states (``model-parallel-rng`` differs per TP rank, the experts'
    per expert-parallel and expert TP rank)."""
    stage_seed = seed + 100 * pg_collection.pp.rank()
    random.seed(stage_seed)
    numpy.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    expert = {name: getattr(pg_collection, field).rank() if hasattr(pg_collection, field) else 0
              for name, field in (("ep_rank", "ep"), ("etp_rank", "expt_tp"))}
    tensor_parallel.model_parallel_cuda_manual_seed(
        stage_seed, tp_rank=pg_collection.tp.rank(), force_reset_rng=True, **expert)


def batched_p2p_is_safe(args: argparse.Namespace, dist_backend: str) -> bool:
    """With two pipeline stages the interleaved schedule batches an activation and a gradient to
    the same peer; gloo pairs such messages by posting order, which differs on the two sides, so
    they would be swapped silently. NCCL matches them correctly; 1F1B never sends two."""
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    return dist_backend == "nccl" or not (interleaved and args.pipeline_model_parallel_size == 2)


def _parameter_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _initial_value(name: str, shape: tuple[int, ...], std: float, num_layers: int, seed: int):
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:
        return torch.ones(shape)
    if name.endswith(RESIDUAL_OUTPUT_WEIGHTS):
        std = std / math.sqrt(2.0 * num_layers)
    generator = torch.Generator().manual_seed(_parameter_seed(seed, name))
    return torch.randn(shape, generator=generator) * std


def place_chunk(chunk: GPTModel, config: TransformerConfig, device: torch.device) -> None:
    """Every parameter of ``chunk`` on ``device`` in the training dtype, as Megatron-LM's
    ``Float16Module`` makes them: torch's norms are created in fp32 whatever ``params_dtype``
    says, and the distributed optimizer reorders a parameter group that mixes dtypes behind its
    own index of it (its main parameters would be restored into the wrong tensors)."""
    chunk.to(device=device, dtype=config.params_dtype)


@torch.no_grad()
def layout_invariant_init(chunk: GPTModel, config: TransformerConfig, seed: int,
                          tp_rank: int, tp_size: int,
                          expert_tp: tuple[int, int] | None = None) -> None:
    """Set every parameter of ``chunk`` from ``(seed, global name)``, sliced to this TP shard
    (an expert's to this rank's expert TP shard: ``expert_tp`` is its ``(rank, size)``, by
    default the tensor-parallel one). Experts are named by their global index, so an expert
    starts the same whichever rank holds it."""
    global_names = global_parameter_names(chunk)
    for local_name, param in chunk.named_parameters():
        name = global_names[local_name]
        rank, size = (tp_rank, tp_size) if getattr(param, "allreduce", True) or expert_tp is None \
            else expert_tp
        shape = list(param.shape)
        sharded = getattr(param, "tensor_model_parallel", False)
        if sharded:
            shape[param.partition_dim] *= size
        value = _initial_value(name, tuple(shape), config.init_method_std, config.num_layers, seed)
        if sharded:
            value = value.chunk(size, dim=param.partition_dim)[rank]
        param.copy_(value)


def build_model_chunks(args: argparse.Namespace, config: TransformerConfig, vocab_size: int,
                       pg_collection: ProcessGroupCollection, device: torch.device) -> list[GPTModel]:
    """One GPTModel per virtual stage of this pipeline rank, initialised as ``--elastic-init``
    says."""
    pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
    vpp = args.virtual_pipeline_model_parallel_size or 1
    tied = not args.untie_embeddings_and_output_weights
    chunks = []
    for vp_stage in range(vpp):
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(config, pp_rank, vp_stage if vpp > 1 else None),
            mtp_block_spec=mtp_block_spec(config, pp_rank, vp_stage if vpp > 1 else None),
            vocab_size=vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pp_rank == 0 and vp_stage == 0,
            post_process=pp_rank == pp_size - 1 and vp_stage == vpp - 1,
            share_embeddings_and_output_weights=tied,
            position_embedding_type=args.position_embedding_type,
            pg_collection=pg_collection,
            vp_stage=vp_stage if vpp > 1 else None,
        )
        place_chunk(chunk, config, device)
        if args.elastic_init == "invariant":
            layout_invariant_init(chunk, config, args.seed, pg_collection.tp.rank(),
                                  pg_collection.tp.size(),
                                  (pg_collection.expt_tp.rank(), pg_collection.expt_tp.size()))
        chunks.append(chunk)
    return chunks


def wrap_and_optimize(args: argparse.Namespace, config: TransformerConfig, chunks: list[GPTModel],
                      pg_collection: ProcessGroupCollection) -> TrainingObjects:
    """DDP per chunk, one Megatron optimizer over all chunks, and Megatron's LR schedule."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    model = [
        distributed_data_parallel(config, ddp_config, chunk, pg_collection,
                                  disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(optimizer_config(args), model, use_gloo_process_groups=False,
                                       pg_collection=pg_collection)
    if args.fp16:
        config.grad_scale_func = optimizer.scale_loss
    scheduler = build_scheduler(args, optimizer)
    return TrainingObjects(config=config, model=model, optimizer=optimizer, scheduler=scheduler)


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype(args),
    )


def build_scheduler(args: argparse.Namespace, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
    """Megatron-LM's LR and weight-decay schedule, stepped in samples (the flags'
    iterations or samples, resolved to samples by ``arguments.validate``)."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_samples,
        lr_decay_steps=args.lr_decay_samples,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_samples or args.train_iters * args.global_batch_size,
        wd_incr_style="constant",
    )


def allocate_optimizer_state(optimizers) -> None:
    """Give fresh torch Adams their (zero) state now rather than at the first step, so that
    loaders and snapshots find every tensor; a zero state at step 0 updates exactly like none."""
    for optimizer in optimizers:
        allocate_adam_state(optimizer.optimizer)
