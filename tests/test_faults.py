"""Fault injection specs and what each kind does, in one process (no signal sent)."""

from __future__ import annotations

import time

import pytest

from megatron_elaswave.runtime.faults import FailureSpecError, FaultInjector, InjectedError, InjectedFailure


def test_specs_parse_every_kind_and_refuse_unknown_ones():
    assert InjectedFailure.parse("rank=3,iteration=4,phase=backward,kind=poison") == \
        InjectedFailure(3, 4, "backward", "poison")
    assert InjectedFailure.parse("rank=0,iteration=1").kind == "kill"
    with pytest.raises(FailureSpecError, match="kind must be one of kill, hang, raise, poison, nan"):
        InjectedFailure.parse("rank=0,iteration=1,kind=explode")
    assert InjectedFailure.parse("rank=1,iteration=3,phase=checkpoint,kind=delay,seconds=2.5") \
        == InjectedFailure(1, 3, "checkpoint", "delay", seconds=2.5)
    for spec in ("rank=1,iteration=3,kind=delay", "rank=1,iteration=3,seconds=1",
                 "rank=1,iteration=3,kind=delay,seconds=-1"):
        with pytest.raises(FailureSpecError, match="kind=delay takes seconds=S"):
            InjectedFailure.parse(spec)


def test_a_delay_sleeps_once_where_it_is_due():
    injector = FaultInjector([InjectedFailure(1, 2, "checkpoint", "delay", seconds=0.2)],
                             rank=1, hang_s=1.0)
    started = time.monotonic()
    assert injector.at("checkpoint", 2) is False
    assert time.monotonic() - started >= 0.2
    started = time.monotonic()
    injector.at("checkpoint", 2)
    assert time.monotonic() - started < 0.2 and not injector.armed


def test_a_raise_fires_once_a_poison_every_time_and_a_nan_is_left_to_the_caller():
    injector = FaultInjector([InjectedFailure(1, 2, "forward", "raise"),
                              InjectedFailure(1, 3, "forward", "poison"),
                              InjectedFailure(1, 4, "forward", "nan"),
                              InjectedFailure(0, 2, "forward", "kill")], rank=1, hang_s=1.0)
    assert injector.at("forward", 1) is False
    with pytest.raises(InjectedError, match="raise failure of rank 1 in the forward of iteration 2"):
        injector.at("forward", 2)
    assert injector.at("forward", 2) is False  # a transient fault: the re-run passes
    for _ in range(3):
        with pytest.raises(InjectedError, match="poison"):
            injector.at("forward", 3)
    assert injector.at("forward", 4) is True
    assert injector.at("forward", 4) is False
    assert injector.armed  # the poison stays
