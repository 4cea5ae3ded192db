"""Megatron's ``DistributedDataParallel`` of one model chunk, on every supported release.

Checked against megatron-core 0.16.1 and 0.19.2.

From 0.19, DDP under the distributed optimizer expects the parameter layout precomputed by
``DistributedOptimizer.compute_full_param_layout`` (and warns on every rank that builds one
without). :func:`distributed_data_parallel` passes the layout DDP would compute itself: the same
parameters, data-parallel size and bucketing, so the buffers are the same as 0.16.1's.
"""

from __future__ import annotations

import inspect

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from torch import nn

_TAKES_PARAM_LAYOUT = "full_param_layout" in inspect.signature(DistributedDataParallel).parameters


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
        layout["full_param_layout"] = DistributedOptimizer.compute_full_param_layout(
            params, None, pg_collection.intra_dp_cp.size(), ddp_config)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                   disable_bucketing=disable_bucketing,
                                   pg_collection=pg_collection, **layout)
