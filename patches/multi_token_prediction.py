"""Multi-token prediction in an elastic job: ``megatron.core.transformer.multi_token_prediction``.

Checked against megatron-core 0.16.1 and 0.19.2.

With the layout-invariant dropout RNG, a ``MultiTokenPredictionLayer``'s embedding lookup of the
shifted tokens is keyed by that layer's place in the model, after the decoder's layers
(:func:`register_keyed_lookups`; its transformer layer is keyed so by :mod:`.transformer_layer`).
0.16.1 and 0.19.2 both number the layer ``layer_number`` from 1 among the prediction layers.

Each multi-token prediction layer records its loss per micro-batch in
``MTPLossLoggingHelper.tracker`` (0.16.1: ``values``; 0.19.2: ``loss_values``, with the
acceptance counts ``correct_values`` and ``total_values``); to log them Megatron averages the
losses over ``parallel_state``'s data-parallel group and sums the counts over it, and
Megatron-LM's log line divides by its micro-batch count. After a failure the replicas run
different numbers of micro-batches and that group no longer pairs the holders of the last stage,
so the metrics are summed over the job's ranks instead, before ``track_mtp_metrics`` (in both
releases) logs them (:func:`register_job_wide_reduction`). A
broken iteration's values are discarded before it runs again (:func:`discard_mtp_losses`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .language_model_embedding import looked_up_by
from .registry import PatchRegistry

MODULE = "megatron.core.transformer.multi_token_prediction"
HELPER = f"{MODULE}.MTPLossLoggingHelper"
_LOSSES = ("loss_values", "values")
"""The tracker's per-layer loss sums: 0.19.2's name, 0.16.1's."""
_COUNTS = ("correct_values", "total_values")
"""0.19.2's per-layer acceptance counts."""


def _tracker() -> dict:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    return MTPLossLoggingHelper.tracker


def register_job_wide_reduction(registry: PatchRegistry, *, active: Callable[[], bool],
                                sum_over_job: Callable[[torch.Tensor], None],
                                parallel_sizes: Callable[[], tuple[int, int]],
                                num_layers: Callable[[], int],
                                device: Callable[[], torch.device]) -> None:
    """While ``active()``, reduce the metrics Megatron logs by ``sum_over_job`` (a sum over every
    rank that trains, which each rank joins: one without the layers with zeros of
    ``num_layers()`` on ``device()``) before ``MTPLossLoggingHelper.track_mtp_metrics`` logs
    them, and leave Megatron's own reduction no group to reduce over; ``parallel_sizes()`` gives
    the job's launch ``(tensor, data)`` parallel sizes, which Megatron-LM's micro-batch
    calculator keeps.

    Every tensor-parallel rank of the last stage records the same values, so the job-wide sum
    is divided by the tensor-parallel size, and the losses also by the data-parallel size (the
    average Megatron takes): the result is Megatron's whatever the layout."""

    def job_wide(track):
        @functools.wraps(track)
        def track_over_job(*args, **kwargs):
            if active():
                tracker = _tracker()
                tp, dp = parallel_sizes()
                for key in _recorded_keys():
                    if key not in tracker:
                        tracker[key] = torch.zeros(num_layers(), device=device())
                    sum_over_job(tracker[key])
                    tracker[key] /= tp * dp if key in _LOSSES else tp
                tracker["reduce_group"] = tracker["avg_group"] = None
            return track(*args, **kwargs)
        return track_over_job

    registry.register_wrapper(f"{HELPER}.track_mtp_metrics", job_wide)


def _recorded_keys() -> tuple[str, ...]:
    """The tracker's per-layer records of the installed megatron-core."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if hasattr(MTPLossLoggingHelper, "reduce_metrics_in_tracker"):
        return (_LOSSES[0],) + _COUNTS
    return (_LOSSES[1],)


def unsupported_mtp_model(args) -> str | None:
    """Why the model of Megatron-LM's flags ``args`` cannot have multi-token prediction layers
    here (``None`` where it can): megatron-core keeps two copies of what the last stage's layers
    share with the first stage's embedding equal only for an untied word embedding. Tied, the
    last stage allocates an output weight it never uses and cannot checkpoint; with learned
    absolute positions, its copy has position embeddings of its own, which no layout change could
    keep apart from the first stage's."""
    if not getattr(args, "mtp_num_layers", None):
        return None
    if not getattr(args, "untie_embeddings_and_output_weights", False):
        return ("--mtp-num-layers with tied embeddings (megatron-core cannot checkpoint the "
                "output weight it allocates on the last stage and never uses): add "
                "--untie-embeddings-and-output-weights, as DeepSeek-V3 trains")
    if getattr(args, "position_embedding_type", None) == "learned_absolute":
        return ("--mtp-num-layers with --position-embedding-type learned_absolute (the last "
                "stage's copy of the embedding has position embeddings of its own): use "
                "--position-embedding-type rope, as DeepSeek-V3 trains")
    return None


def register_keyed_lookups(registry: PatchRegistry) -> None:
    """Key each multi-token prediction layer's embedding lookup by the layer (see above)."""
    def keyed(forward):
        @functools.wraps(forward)
        def forward_with_keyed_lookup(self, *args, **kwargs):
            with looked_up_by(self.config.num_layers + self.layer_number - 1):
                return forward(self, *args, **kwargs)
        return forward_with_keyed_lookup

    registry.register_wrapper(f"{MODULE}.MultiTokenPredictionLayer.forward", keyed)


def recorded_mtp_losses(num_layers: int) -> torch.Tensor:
    """This rank's multi-token prediction losses of the step, one per layer, each the sum over
    this rank's micro-batches (zeros where it recorded none)."""
    sums = torch.zeros(num_layers, dtype=torch.float64)
    tracker = _tracker()
    for key in _LOSSES:
        if key in tracker:
            sums[:tracker[key].numel()] = tracker[key].detach().double().cpu()[:num_layers]
    return sums


def discard_mtp_losses() -> None:
    """Zero the metrics recorded so far (those of an iteration a failure broke, which is run
    again)."""
    tracker = _tracker()
    for key in _LOSSES + _COUNTS:
        if key in tracker:
            tracker[key].zero_()
