"""megatron-core's pipeline schedules run on explicit process groups.

Checked against megatron-core 0.16.1 and 0.19.2.

Both releases take the pipeline communicator and the process groups as keyword arguments of the
schedule (``p2p_communicator``, ``pg_collection``) and pick the schedule from the pipeline and
virtual-pipeline sizes; nothing is read from ``parallel_state`` when both are given.
"""

from __future__ import annotations

import functools
from typing import Callable

from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig


def forward_backward_on(pg_collection: ProcessGroupCollection, config: TransformerConfig,
                        virtual_pipeline_model_parallel_size: int | None) -> Callable[..., list]:
    """Megatron's forward-backward schedule for ``pg_collection``'s pipeline, bound to a pipeline
    communicator over ``pg_collection.pp`` and to ``pg_collection``: call it with the schedule's
    other keyword arguments (``forward_step_func``, ``data_iterator``, ``model``, ...)."""
    schedule = get_forward_backward_func(pp_size=pg_collection.pp.size(),
                                         vp_size=virtual_pipeline_model_parallel_size)
    return functools.partial(schedule,
                             p2p_communicator=P2PCommunicator(pp_group=pg_collection.pp,
                                                              config=config),
                             pg_collection=pg_collection)
