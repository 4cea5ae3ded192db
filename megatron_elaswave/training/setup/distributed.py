"""Joining the job: the default process group and Megatron's model-parallel groups."""

from __future__ import annotations

import datetime
import os
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_elaswave.device import DeviceBackend
from megatron_elaswave.launch.store import default_group_store


def init_default_group(rank: int, world_size: int, local_rank: int, backend: DeviceBackend,
                       timeout_minutes: float) -> None:
    """Join the job's default process group (a one-rank world without a launcher)."""
    backend.set_device(local_rank)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if (store := default_group_store(timeout)) is not None:  # the job store is on etcd
        dist.init_process_group(backend.dist_backend, store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
    elif "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend.dist_backend, init_method="env://", rank=rank,
                                world_size=world_size, timeout=timeout)
    else:
        if world_size != 1:
            raise RuntimeError("WORLD_SIZE > 1 but no MASTER_ADDR: start the job with elaswave-run")
        dist.init_process_group(backend.dist_backend, store=dist.HashStore(), rank=0,
                                world_size=1, timeout=timeout)


def init_model_parallel(tp: int, pp: int, vpp: int | None, timeout_minutes: float, *,
                        ep: int = 1, etp: int | None = None) -> ProcessGroupCollection:
    """Megatron's groups for a TP x PP x DP grid, with its expert grid of ``ep`` x ``etp``
    (default: the tensor-parallel size), returned as an explicit collection."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=False,
    )
    return ProcessGroupCollection.use_mpu_process_groups()


def shutdown(destroy_default_group: bool = True) -> None:
    """Leave the job. After a failure the default group still counts the dead ranks, and
    destroying it could wait on them: an elastic job leaves it to process exit."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_default_group and dist.is_initialized():
        dist.destroy_process_group()
