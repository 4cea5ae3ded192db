"""What ranks read from each other and from the job store runs no code (``runtime/wire.py``)."""

from __future__ import annotations

import os
import pickle
import random

import numpy
import pytest
import torch

from megatron_elaswave.runtime import wire
from megatron_elaswave.runtime.snapshot import tensor_layout


class RunsCode:
    """A payload that would run a command if a plain ``pickle.loads`` read it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_snapshots_small_state_and_layout_round_trip():
    state = {"iteration": 7, "consumed_samples": 112, "scheduler": {"max_lr": 1e-3, "num_steps": 7},
             "rng": {"python": random.getstate(), "numpy": numpy.random.get_state(),
                     "torch": torch.get_rng_state().numpy().tobytes()},
             "adam_step": 7.0, "owners": frozenset({1, 2}), "shape": torch.Size([2, 3])}
    layout = tensor_layout({"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)})
    got_state, got_layout = wire.loads(wire.dumps((state, layout)))
    assert got_layout == layout
    assert got_state["rng"]["numpy"][0] == "MT19937"
    numpy.testing.assert_array_equal(got_state["rng"]["numpy"][1], state["rng"]["numpy"][1])
    assert {k: v for k, v in got_state.items() if k != "rng"} == \
        {k: v for k, v in state.items() if k != "rng"}


def test_a_payload_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    payload = pickle.dumps({"state": RunsCode(str(marker))})
    with pytest.raises(wire.UnsafePayload, match=r"refused to load (posix|os)\.system"):
        wire.loads(payload)
    assert not marker.exists()
    with pytest.raises(wire.UnsafePayload, match="refused to load torch._utils"):
        wire.loads(pickle.dumps(torch.zeros(2)))  # a tensor's storage is loaded by torch.load
