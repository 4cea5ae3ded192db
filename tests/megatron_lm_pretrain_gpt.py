"""GPT pretraining in Megatron-LM's own loop, from the ``megatron.training`` package that the
megatron-core wheels ship from 0.19 on, for the adaptor's tests where no Megatron-LM checkout
is at hand.

It does what core_r0.19.0's ``pretrain_gpt.py`` does on the path the tests take (mock data or
Megatron's indexed data, blended by ``--data-path`` weights; no packed sequences, context
parallelism or ModelOpt): arguments parsed
by ``parse_and_validate_args``, the model built by ``pretrain`` from the config container, each
micro-batch read on tensor-parallel rank 0 of a first or last stage (or one that holds
multi-token prediction layers) and broadcast to the others,
the loss summed over unmasked tokens and reported with their count.
"""

from functools import partial

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank as holds_mtp
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_tp_rank
from megatron.training import get_args, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

MODEL_INPUTS = ("tokens", "position_ids", "attention_mask", "labels", "loss_mask")


def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch: nothing on a middle stage without multi-token prediction layers,
    else what tensor-parallel rank 0 read."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    mtp_on_this_rank = holds_mtp(layout=config.pipeline_model_parallel_layout,
                                 mtp_num_layers=config.mtp_num_layers, ignore_virtual=False,
                                 vp_stage=vp_stage)
    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_on_this_rank:
        return {name: None for name in MODEL_INPUTS}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = next(data_iterator) if tp_rank == 0 else {}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=1,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp_on_this_rank,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    return {name: batch.get(name) for name in MODEL_INPUTS}


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1),
                                                    num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    output_tensor = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                          labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output_tensor, partial(loss_func, batch["loss_mask"])


def is_dataset_built_on_rank(vp_stage=None):
    return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)


def train_valid_test_datasets_provider(train_valid_test_num_samples, vp_stage=None):
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split, split=args.split, path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader)
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset if args.mock_data else GPTDataset, train_valid_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage), config).build()


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args(args)),
             train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
