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


def logged(tracker: dict, recorded: list[float] | None) -> dict:
    """What Megatron-LM's log line takes of the tracker (a loss scale of 1), this rank having
    recorded ``recorded`` (``None``: nothing)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if recorded is not None:
        key = "loss_values" if hasattr(MTPLossLoggingHelper, "reduce_metrics_in_tracker") \
            else "values"
        tracker[key] = torch.tensor(recorded)
        tracker["avg_group"] = tracker["reduce_group"] = None
    total: dict = {}
    MTPLossLoggingHelper.track_mtp_metrics(1.0, 1, None, None, total)
    return {name: float(value) for name, value in total.items() if name.endswith(" loss")}


def test_the_losses_are_summed_over_the_job_and_averaged_as_megatron_does(tracker):
    registry = reduction(active=True, ranks=12)
    try:
        # A rank without the layers records nothing and joins the sum with zeros.
        assert logged(tracker, None) == {"mtp_1 loss": 0.0, "mtp_2 loss": 0.0}
        # Twelve ranks of the same values, over TP 2 x DP 3.
        assert logged(tracker, [6.0, 12.0]) == {"mtp_1 loss": 12.0, "mtp_2 loss": 24.0}
    finally:
        registry.remove()


def test_without_elastic_megatron_logs_as_it_does(tracker):
    registry = reduction(active=False, ranks=12)
    try:
        assert logged(tracker, None) == {}  # nothing recorded: nothing logged
        assert logged(tracker, [6.0, 12.0]) == {"mtp_1 loss": 6.0, "mtp_2 loss": 12.0}
    finally:
        registry.remove()
