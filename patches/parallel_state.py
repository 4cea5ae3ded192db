"""Megatron's ``parallel_state`` globals from groups that already exist.

Checked against megatron-core 0.16.1 and 0.19.2.

``initialize_model_parallel`` cannot run after a death: every rank creates every group of the
whole default world, dead ranks included. :func:`install_process_groups` instead points the
module globals at the groups of a ``ProcessGroupCollection`` (built by the runtime's group
registry), so that Megatron code that still reads the globals sees the same groups as the code
they are passed to explicitly. It creates no group and issues no collective.

After it returns:

* the group getters (``get_tensor_model_parallel_group``, ``get_pipeline_model_parallel_group``,
  ``get_data_parallel_group(with_context_parallel=...)``, ``get_model_parallel_group``,
  ``get_embedding_group``, ``get_position_embedding_group``, ``get_context_parallel_group``,
  ``get_tensor_and_data_parallel_group``, the expert getters, ...) return the collection's groups;
* the rank getters (world sizes, ranks, first/last/next/previous pipeline ranks, source ranks,
  ``is_rank_in_embedding_group``) answer from those groups' member lists;
* the globals that ``destroy_model_parallel`` leaves stale (research notes §1.3) are cleared:
  ``_MPU_DATA_PARALLEL_*``, ``_HYBRID_DP_CP_GROUPS``, ``_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS``,
  ``_EXPERT_MODEL_PARALLEL_RANKS``, and the rank lists of groups the rank is not in;
* a fresh global memory buffer is set.

``parallel_state`` holds one data-parallel group per rank: on a rank that holds several layer
groups, pass the collection of the layer group that global readers should see.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

_GROUPS_FROM_COLLECTION = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_MODEL_PARALLEL_GROUP": "mp",
    "_EMBEDDING_GROUP": "embd",
    "_POSITION_EMBEDDING_GROUP": "pos_embd",
    "_CONTEXT_PARALLEL_GROUP": "cp",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "intra_dp_cp",
    # Context parallelism is 1 where this is used, so TP x DP and TP x DP x CP coincide.
    "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp_cp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "expt_tp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "_EXPERT_DATA_PARALLEL_GROUP": "expt_dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "intra_expt_dp",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "inter_dist_opt",
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "intra_dist_opt",
}
"""``parallel_state`` global -> ``ProcessGroupCollection`` field."""

_GTP_REMAT_GLOBALS = {
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "_DATA_PARALLEL_GROUP",
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT":
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "_EXPERT_DATA_PARALLEL_GROUP",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT":
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP":
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
}
"""megatron-core 0.19's generalized-tensor-parallel variants (absent from 0.16.1) -> the global
each equals with a GTP remat size of 1; 0.19's getters return the variant by default."""

_RANK_LISTS_FROM_GROUPS = {
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "_TENSOR_MODEL_PARALLEL_GROUP",
    "_PIPELINE_GLOBAL_RANKS": "_PIPELINE_MODEL_PARALLEL_GROUP",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "_MODEL_PARALLEL_GROUP",
    "_EMBEDDING_GLOBAL_RANKS": "_EMBEDDING_GROUP",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "_POSITION_EMBEDDING_GROUP",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "_CONTEXT_PARALLEL_GROUP",
    "_DATA_PARALLEL_GLOBAL_RANKS": "_DATA_PARALLEL_GROUP",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "_DATA_PARALLEL_GROUP_WITH_CP",
}
"""Rank-list global -> the group global whose members it lists (``None`` where that is)."""

_STALE_AFTER_DESTROY = {
    "_MPU_DATA_PARALLEL_WORLD_SIZE": None,
    "_MPU_DATA_PARALLEL_RANK": None,
    "_HYBRID_DP_CP_GROUPS": {},
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": None,
    "_EXPERT_MODEL_PARALLEL_RANKS": None,
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": None,
}
"""Globals ``destroy_model_parallel`` does not reset, and the value of a fresh module."""


def install_process_groups(pg_collection: ProcessGroupCollection,
                           virtual_pipeline_model_parallel_size: int | None = None) -> None:
    """Replace every ``parallel_state`` group global by ``pg_collection``'s (module docstring).

    Fields missing from the collection leave their globals ``None``. ``virtual_pipeline_model_
    parallel_size`` is set as ``initialize_model_parallel`` sets it.
    """
    parallel_state.destroy_model_parallel()
    for name, value in _STALE_AFTER_DESTROY.items():
        setattr(parallel_state, name, value)
    for name, field in _GROUPS_FROM_COLLECTION.items():
        setattr(parallel_state, name, getattr(pg_collection, field, None))
    for name, base in _GTP_REMAT_GLOBALS.items():
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, getattr(parallel_state, base))
    for name, group_name in _RANK_LISTS_FROM_GROUPS.items():
        group = getattr(parallel_state, group_name)
        setattr(parallel_state, name, None if group is None else dist.get_process_group_ranks(group))
    if virtual_pipeline_model_parallel_size is not None:
        parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size
    groups = {getattr(parallel_state, name) for name in _GROUPS_FROM_COLLECTION} - {None}
    # update_pg_timeout walks this list; create_group starts it with None for the default group.
    parallel_state._global_process_group_list = [None, *groups]
    parallel_state._set_global_memory_buffer()


@contextlib.contextmanager
def pipeline_position(rank: int, size: int) -> Iterator[None]:
    """Within: ``parallel_state``'s pipeline rank and size answer ``rank`` and ``size``.

    Megatron-LM's model providers pick a model chunk's layer specs by ``parallel_state``'s
    pipeline rank (``get_gpt_decoder_block_spec`` without ``pp_rank``: an MoE model's dense and
    MoE layers); a chunk of a layer group is the ``rank``-th of ``size`` such chunks, whatever
    stage of its replica the rank holds. The overrides ``initialize_model_parallel`` leaves unset
    are unset again after."""
    previous = (parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK,
                parallel_state._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE)
    parallel_state.set_pipeline_model_parallel_rank(rank)
    parallel_state.set_pipeline_model_parallel_world_size(size)
    try:
        yield
    finally:
        (parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK,
         parallel_state._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE) = previous
