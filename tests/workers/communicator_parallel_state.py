"""Megatron's ``parallel_state`` from the group registry, compared with ``initialize_model_parallel``.

Usage: communicator_parallel_state.py OUT_DIR (4 ranks: TP2 x PP2 x DP1)

Every rank reads ``parallel_state``'s getters after ``initialize_model_parallel(2, 2)``, destroys
Megatron's groups, builds a ``GroupRegistry`` for the same grid, installs its collection with
``install_process_groups`` and reads the getters again. It writes both readings, and whether each
group getter returns the registry's own group object, to ``OUT_DIR/rank<r>.json``.
"""

import json
import os
import sys
from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_elaswave.launch.store import connect_store
from megatron_elaswave.layout import Layout
from megatron_elaswave.patches.parallel_state import install_process_groups
from megatron_elaswave.runtime.communicator import GroupRegistry, Role

TP, PP = 2, 2

GROUP_GETTERS = {
    "tp": ps.get_tensor_model_parallel_group,
    "pp": ps.get_pipeline_model_parallel_group,
    "mp": ps.get_model_parallel_group,
    "dp": ps.get_data_parallel_group,
    "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
    "cp": ps.get_context_parallel_group,
    "tp_dp": ps.get_tensor_and_data_parallel_group,
    "tp_cp": ps.get_tensor_and_context_parallel_group,
    "embd": lambda: ps.get_embedding_group(check_initialized=False),
    "pos_embd": lambda: ps.get_position_embedding_group(check_initialized=False),
    "expt_tp": ps.get_expert_tensor_parallel_group,
    "tp_ep": ps.get_expert_tensor_and_model_parallel_group,
    "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group,
    "expt_dp": ps.get_expert_data_parallel_group,
    "intra_dist_opt": ps.get_intra_distributed_optimizer_instance_group,
}

VALUE_GETTERS = {
    name: getattr(ps, name)
    for name in (
        "model_parallel_is_initialized", "get_tensor_model_parallel_world_size",
        "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank",
        "get_pipeline_model_parallel_world_size", "get_pipeline_model_parallel_rank",
        "get_pipeline_model_parallel_first_rank", "get_pipeline_model_parallel_last_rank",
        "get_pipeline_model_parallel_next_rank", "get_pipeline_model_parallel_prev_rank",
        "is_pipeline_first_stage", "is_pipeline_last_stage", "is_rank_in_embedding_group",
        "is_rank_in_position_embedding_group", "get_data_parallel_world_size",
        "get_data_parallel_rank", "get_data_parallel_src_rank", "get_context_parallel_world_size",
        "get_context_parallel_rank", "get_context_parallel_global_ranks",
        "get_model_parallel_src_rank", "get_expert_model_parallel_world_size",
        "get_expert_tensor_parallel_world_size", "get_expert_data_parallel_world_size",
    )
}


def reading() -> dict:
    """Every getter's answer; groups as their member lists."""
    values = {name: getter() for name, getter in VALUE_GETTERS.items()}
    for name, getter in GROUP_GETTERS.items():
        group = getter()
        values[f"{name}_ranks"] = None if group is None else dist.get_process_group_ranks(group)
    values["memory_buffer"] = ps.get_global_memory_buffer() is not None
    return values


def main() -> None:
    out_dir = sys.argv[1]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = connect_store(timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=30))
    ps.initialize_model_parallel(TP, PP, create_gloo_process_groups=False)
    from_megatron = reading()
    ps.destroy_model_parallel()

    layout = Layout.megatron(tp=TP, pp=PP, dp=world_size // (TP * PP), num_layers=4, num_microbatches=2)
    registry = GroupRegistry(layout, rank, store=store)
    pg_collection = registry.process_group_collection()
    install_process_groups(pg_collection)
    from_registry = reading()
    same_groups = {
        "tp": ps.get_tensor_model_parallel_group() is registry.group(Role.TP),
        "pp": ps.get_pipeline_model_parallel_group() is registry.group(Role.PP),
        "mp": ps.get_model_parallel_group() is registry.group(Role.MP),
        "dp": ps.get_data_parallel_group() is registry.group(Role.DP),
        "intra_dist_opt": ps.get_intra_distributed_optimizer_instance_group() is registry.group(Role.WORLD),
        "pg_collection_tp": pg_collection.tp is registry.group(Role.TP),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
        json.dump({"from_megatron": from_megatron, "from_registry": from_registry,
                   "same_groups": same_groups}, out)
    dist.barrier(group=registry.group(Role.WORLD))
    registry.destroy()


if __name__ == "__main__":
    main()
