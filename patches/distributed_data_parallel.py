"""Megatron's ``DistributedDataParallel`` of one model chunk, on every supported release.

Checked against megatron-core 0.16.1 and 0.19.2.

From 0.19, DDP under the distributed optimizer expects the parameter layout precomputed by
``DistributedOptimizer.compute_full_param_layout`` (and warns on every rank that builds one
without). :func:`distributed_data_parallel` passes the layout DDP would compute itself: the same
parameters, data-parallel sizes (the expert data-parallel one for experts) and bucketing, so the
buffers are the same as 0.16.1's.

:func:`share_bucket_groups` puts the buckets of several DDPs into one of Megatron's bucket groups
(``_ParamAndGradBucketGroup``, built as ``partition_buckets`` builds one for the buffers of one
DDP); both releases sync a DDP's gradients and parameters through ``DDP.bucket_groups`` alone.
"""

from __future__ import annotations

import inspect

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from torch import nn

_TAKES_PARAM_LAYOUT = "full_param_layout" in inspect.signature(DistributedDataParallel).parameters
_LAYOUT_TAKES_EXPERT_SIZE = _TAKES_PARAM_LAYOUT and "expert_data_parallel_world_size" in \
    inspect.signature(DistributedOptimizer.compute_full_param_layout).parameters


def distributed_data_parallel(config: TransformerConfig, ddp_config: DistributedDataParallelConfig,
                              module: nn.Module, pg_collection: ProcessGroupCollection,
                              disable_bucketing: bool = False) -> DistributedDataParallel:
    """``DistributedDataParallel(config, ddp_config, module, disable_bucketing, pg_collection)``,
    with the distributed optimizer's parameter layout where the release takes one.

    The layout is precomputed only without gradient-reduce overlap (one bucket per buffer, as
    every job here runs); with overlap DDP's bucket sizes depend on its pipeline rank, and DDP
    computes the layout itself.
    """
    layout = {}
    if (_TAKES_PARAM_LAYOUT and ddp_config.use_distributed_optimizer
            and not ddp_config.overlap_grad_reduce):
        params = [p for p in module.parameters() if p.requires_grad]
        expert_size = {}
        if _LAYOUT_TAKES_EXPERT_SIZE and hasattr(pg_collection, "intra_expt_dp"):
            expert_size["expert_data_parallel_world_size"] = pg_collection.intra_expt_dp.size()
        layout["full_param_layout"] = DistributedOptimizer.compute_full_param_layout(
            params, None, pg_collection.intra_dp_cp.size(), ddp_config, **expert_size)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                   disable_bucketing=disable_bucketing,
                                   pg_collection=pg_collection, **layout)


def share_bucket_groups(chunks: list[DistributedDataParallel]) -> None:
    """Give the chunks that reduce over one data-parallel group one bucket group over all their
    buckets, so that their gradient reduce-scatter and their parameter all-gather are one
    coalesced collective each (``torch.distributed._coalescing_manager``) instead of one per chunk.

    The shared group is kept by the last of ``chunks`` that reduces over it and taken from the
    others, and it syncs every one of them: the gradients when that chunk's are synced, the
    parameters when that chunk's optimizer has stepped. So the chunks' gradients must be synced,
    and their optimizers stepped, in the order of ``chunks`` (a ``ChainedOptimizer`` over their
    optimizers in that order). The optimizers' shards are unchanged: each bucket is still split
    over the group as before. Raises ``ValueError`` for chunks without the distributed optimizer
    or whose gradient reduction overlaps the backward pass (bucket groups synced one by one as
    their gradients are ready).
    """
    shared: dict[object, list[tuple[DistributedDataParallel, _ParamAndGradBucketGroup]]] = {}
    for chunk in chunks:
        if chunk.ddp_config.overlap_grad_reduce or not chunk.ddp_config.use_distributed_optimizer:
            raise ValueError("only chunks under the distributed optimizer that reduce their "
                             "gradients at the step can share bucket groups")
        for bucket_group in chunk.bucket_groups:
            group = bucket_group.intra_distributed_optimizer_instance_group
            shared.setdefault(group, []).append((chunk, bucket_group))
    for group, members in shared.items():
        if len(members) == 1:
            continue
        owner, first = members[-1][0], members[0][1]
        merged = _ParamAndGradBucketGroup(
            [bucket for _, bucket_group in members for bucket in bucket_group.buckets],
            first.ddp_config, group, first.intra_distributed_optimizer_instance_size)
        for chunk, bucket_group in members:
            chunk.bucket_groups.remove(bucket_group)
            for param in bucket_group.params:
                chunk.param_to_bucket_group[param] = merged
        owner.bucket_groups.append(merged)
