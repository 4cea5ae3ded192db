"""MoE routing and dispatch without Transformer Engine or CUDA:
``megatron.core.transformer.moe.moe_utils``.

Checked against megatron-core 0.16.1 and 0.19.2.

1. megatron-core 0.16.1 imports ``te_general_gemm`` only where Transformer Engine imports, and
   its fallback leaves the name undefined: the router's gating linear then raises ``NameError:
   name 'te_general_gemm' is not defined`` on its first forward. 0.19 defines it as ``None``
   there, which selects the plain matmul; this patch does the same where the name is missing.
2. ``maybe_move_tensor_to_cpu(tensor, as_numpy=True)`` converts only CUDA tensors: off CUDA the
   alltoall dispatcher's split sizes stay tensors, which ``all_to_all_single`` refuses. Off CUDA
   a host tensor asked for as numpy comes back as numpy, as it would from the device.
3. The MoE loss metrics of an elastic job are reduced over the job's ranks
   (:func:`register_job_wide_reduction`), and those of a broken iteration are discarded before
   it runs again (:func:`discard_aux_losses`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .interfaces import DeviceBackend
from .registry import PatchRegistry

MODULE = "megatron.core.transformer.moe.moe_utils"


def host_tensors_as_numpy(move: Callable) -> Callable:
    """``maybe_move_tensor_to_cpu`` that also hands a host tensor over as numpy where asked."""

    @functools.wraps(move)
    def move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move_to_cpu


def register(registry: PatchRegistry, backend: DeviceBackend) -> None:
    """Define ``te_general_gemm`` as ``None`` where the import fallback forgot it; off CUDA,
    split sizes on the host as numpy."""
    registry.define(f"{MODULE}.te_general_gemm", None)
    if backend.name != "cuda":
        registry.register_wrapper(f"{MODULE}.maybe_move_tensor_to_cpu", host_tensors_as_numpy)


def _sum_over_job(values: torch.Tensor, divisor: int,
                  sum_over_job: Callable[[torch.Tensor], None]) -> None:
    sum_over_job(values)
    values /= divisor


def register_job_wide_reduction(registry: PatchRegistry, *, active: Callable[[], bool],
                                sum_over_job: Callable[[torch.Tensor], None],
                                parallel_sizes: Callable[[], tuple[int, int]],
                                num_layers: Callable[[], int]) -> None:
    """While ``active()``, reduce the MoE metrics Megatron logs (the load-balancing and z-losses)
    by ``sum_over_job`` (a sum over every rank that trains) instead of over ``parallel_state``'s
    pipeline, tensor and data-parallel groups; ``parallel_sizes()`` gives the job's launch
    ``(tensor, data)`` parallel sizes, which Megatron-LM's calculator keeps, and ``num_layers()``
    the layers a metric has a value for, multi-token prediction layers included.

    Megatron's value of a metric is the sum over the ranks of its micro-batches' values, over
    the data-parallel size where it averages over data-parallel ranks, and over the tensor
    parallel size where it does not sum over tensor-parallel ranks (the z-loss). After a failure
    the replicas differ in depth and in how many micro-batches they run, and a rank's
    ``parallel_state`` groups no longer pair the ranks that hold each layer; but the job's ranks
    still run the global batch's micro-batches between them, each MoE layer's once per
    tensor-parallel rank. (megatron-core 0.16.1 logs a metric it reduces over no group, the
    z-loss, as one replica's; here it is the mean over the replicas.)

    megatron-core 0.16.1 reduces in ``reduce_aux_losses_tracker_across_ranks`` (a dict per
    metric, ``reduce_group_has_dp``); 0.19 in ``MoEMetricsTracker._sync_metrics`` (``MetricEntry``,
    ``needs_dp_avg``). 0.16.1's routers record a metric over the decoder's and the multi-token
    prediction layers, while Megatron-LM's log line starts it, on a rank that recorded none, over
    the decoder's alone: such a record is padded with zeros to one length on every rank."""

    def divisor(summed_over_tp: bool, averaged_over_dp: bool) -> int:
        tp, dp = parallel_sizes()
        return (1 if summed_over_tp else tp) * (dp if averaged_over_dp else 1)

    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:
        moe_logging = None

    if moe_logging is not None and hasattr(moe_logging, "MoEMetricsTracker"):
        def job_wide_sync(sync):
            @functools.wraps(sync)
            def sync_metrics(self, metric_names, pg_collection=None):
                if not active():
                    return sync(self, metric_names, pg_collection)
                for name in metric_names:
                    if name in self._metrics:
                        entry = self._metrics[name]
                        _sum_over_job(entry.values,
                                      divisor(entry.reduce_group is not None, entry.needs_dp_avg),
                                      sum_over_job)
            return sync_metrics

        registry.register_wrapper(f"{moe_logging.__name__}.MoEMetricsTracker._sync_metrics",
                                  job_wide_sync)
        return

    def job_wide_reduce(reduce):
        @functools.wraps(reduce)
        def reduce_across_ranks(track_names=None, pg_collection=None):
            from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

            if not active():
                return reduce(track_names, pg_collection)
            tracker = get_moe_layer_wise_logging_tracker()
            for name in list(tracker) if track_names is None else track_names:
                entry = tracker[name]
                missing = num_layers() - entry["values"].numel()
                if missing > 0:
                    entry["values"] = torch.cat([entry["values"],
                                                 entry["values"].new_zeros(missing)])
                grouped = entry.get("reduce_group") is not None
                _sum_over_job(entry["values"],
                              divisor(grouped, grouped and not entry.get("reduce_group_has_dp")),
                              sum_over_job)
        return reduce_across_ranks

    registry.register_wrapper(f"{MODULE}.reduce_aux_losses_tracker_across_ranks", job_wide_reduce)


def discard_aux_losses() -> None:
    """Zero the MoE loss metrics recorded so far (those of an iteration a failure broke, which
    is run again)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
        return
    get_moe_metrics_tracker().clear()


MOE_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
              "z_loss")
"""The loss metrics megatron-core's routers record, one value per layer."""


def recorded_losses(num_layers: int) -> tuple[torch.Tensor, tuple[bool, ...]]:
    """This rank's MoE loss metrics of the step: one row per name of :data:`MOE_LOSSES`, one
    column per layer, each the sum over this rank's micro-batches (zeros where it recorded none),
    and, per name, whether Megatron sums it over the data-parallel ranks rather than averaging
    (the global aux loss, reduced over a group with data parallelism already)."""
    rows = torch.zeros(len(MOE_LOSSES), num_layers, dtype=torch.float64)
    summed_over_data_parallel = []
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        entries = {name: (entry["values"], entry.get("reduce_group_has_dp", False))
                   for name, entry in get_moe_layer_wise_logging_tracker().items()}
    else:
        entries = {name: (entry.values, not entry.needs_dp_avg)
                   for name, entry in get_moe_metrics_tracker().metrics.items()}
    for row, name in enumerate(MOE_LOSSES):
        values, has_dp = entries.get(name, (None, name == "global_load_balancing_loss"))
        if values is not None:
            rows[row, :values.numel()] = values.detach().double().cpu()[:num_layers]
        summed_over_data_parallel.append(has_dp)
    return rows, tuple(summed_over_data_parallel)
