"""Multi-token prediction's patches on their own: which models are refused, and the job-wide
reduction of the losses Megatron-LM's log line gives. (Training with the layers, through
failures, is in ``test_moe.py``.)"""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_elaswave.patches import multi_token_prediction
from megatron_elaswave.patches.registry import PatchRegistry


def model(**flags) -> argparse.Namespace:
    return argparse.Namespace(**{"mtp_num_layers": 1, "untie_embeddings_and_output_weights": True,
                                 "position_embedding_type": "rope", **flags})


def test_only_untied_embeddings_without_learned_positions_are_supported():
    assert multi_token_prediction.unsupported_mtp_model(model()) is None
    assert multi_token_prediction.unsupported_mtp_model(model(mtp_num_layers=None)) is None
    tied = multi_token_prediction.unsupported_mtp_model(model(untie_embeddings_and_output_weights=False))
    assert tied.startswith("--mtp-num-layers with tied embeddings")
    learned = multi_token_prediction.unsupported_mtp_model(
        model(position_embedding_type="learned_absolute"))
    assert learned.startswith("--mtp-num-layers with --position-embedding-type learned_absolute")


@pytest.fixture
def tracker():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    saved = dict(MTPLossLoggingHelper.tracker)
    MTPLossLoggingHelper.tracker.clear()
    yield MTPLossLoggingHelper.tracker
    MTPLossLoggingHelper.tracker.clear()
    MTPLossLoggingHelper.tracker.update(saved)


def reduction(active: bool, ranks: int, num_layers: int = 2) -> PatchRegistry:
    """The job-wide reduction over ``ranks`` ranks that recorded what this one did, at TP 2 and
    DP 3 as launched."""
    registry = PatchRegistry()
    multi_token_prediction.register_job_wide_reduction(
        registry, active=lambda: active, sum_over_job=lambda values: values.mul_(ranks),
        parallel_sizes=lambda: (2, 3), num_layers=lambda: num_layers,
        device=lambda: torch.device("cpu"))
    registry.apply()
    return registry


def losses(tracker: dict) -> torch.Tensor | None:
    """The per-layer losses (0.19.2's ``loss_values``, 0.16.1's ``values``)."""
    return tracker.get("loss_values", tracker.get("values"))


def reduce_tracker() -> None:
    """What Megatron-LM's log line calls to reduce the tracker."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if hasattr(MTPLossLoggingHelper, "reduce_metrics_in_tracker"):
        MTPLossLoggingHelper.reduce_metrics_in_tracker()
    else:
        MTPLossLoggingHelper.reduce_loss_in_tracker()


def test_the_losses_are_summed_over_the_job_and_averaged_as_megatron_does(tracker):
    registry = reduction(active=True, ranks=12)
    try:
        # A rank without the layers records nothing and joins the sum with zeros.
        reduce_tracker()
        assert torch.equal(losses(tracker), torch.zeros(2))
        losses(tracker).copy_(torch.tensor([6.0, 12.0]))
        reduce_tracker()
        # Twelve ranks of the same values, over TP 2 x DP 3.
        assert torch.allclose(losses(tracker), torch.tensor([12.0, 24.0]))
        if "total_values" in tracker:  # 0.19: the counts are summed over DP, not averaged
            assert torch.equal(tracker["total_values"], torch.zeros(2))
    finally:
        registry.remove()


def test_without_elastic_megatron_reduces_as_it_does(tracker):
    registry = reduction(active=False, ranks=12)
    try:
        reduce_tracker()  # no values, no groups: Megatron returns
        assert losses(tracker) is None
    finally:
        registry.remove()
