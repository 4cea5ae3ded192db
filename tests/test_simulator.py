"""Discrete-event pipeline simulator: schedule orders and closed-form step times."""

import json
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_elaswave.planner.frequency import PowerModel
from megatron_elaswave.simulator import ReplicaWork, predict_step, simulate_pipeline
from megatron_elaswave.simulator.schedule import microbatch_group_size, stage_order


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(0, 12), st.sampled_from([1, 2, 3]))
def test_every_stage_runs_each_pass_once_forward_first(stages, microbatches, chunks):
    if chunks > 1 and microbatches < stages:  # the interleaved schedule needs one per stage
        microbatches = 0
    simulate_pipeline([1.0] * stages, [2.0] * stages, microbatches, num_chunks=chunks)
    for s in range(stages):
        order = stage_order(s, stages, microbatches, chunks)
        assert Counter(order) == Counter(
            {(f, m, c): 1 for f in (True, False) for m in range(microbatches) for c in range(chunks)}
        )
        for m in range(microbatches):
            for c in range(chunks):
                assert order.index((True, m, c)) < order.index((False, m, c))


def test_1f1b_warmup_depth():
    order = stage_order(1, 4, 8)
    # Stage 1 of 4: two warm-up forwards, then one forward and one backward alternate.
    assert [op.forward for op in order[:6]] == [True, True, True, False, True, False]


@pytest.mark.parametrize("stages, microbatches, chunks",
                         [(2, 4, 2), (2, 5, 2), (4, 8, 2), (4, 6, 3), (3, 7, 2)])
def test_interleaved_order_is_megatron_cores(stages, microbatches, chunks):
    """Each stage runs what Megatron-Core's interleaved schedule runs, in its order, with the
    micro-batch group size the trainer sets (all micro-batches in one group when the pipeline
    size does not divide them): its warm-up forwards, then one forward and one backward at a
    time, then the remaining backwards, walking the schedule table (backwards with the chunks
    reversed)."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    group = microbatch_group_size(microbatches, stages)
    table = schedules.get_schedule_table(microbatches, chunks, group)

    def forward(k: int) -> tuple:
        return (True, table[k][0], table[k][1])

    def backward(k: int) -> tuple:
        return (False, table[k][0], chunks - 1 - table[k][1])

    for s in range(stages):
        pipeline = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: stages, rank=lambda: s),
                                   virtual_pipeline_model_parallel_size=chunks)
        total, _, warmup, remaining = schedules.get_pp_rank_microbatches(
            microbatches, chunks, group, p2p_communicator=pipeline)
        megatron = [forward(k) for k in range(warmup)]
        for k in range(remaining):
            megatron += [forward(k + warmup), backward(k)]
        megatron += [backward(k) for k in range(remaining, total)]
        assert stage_order(s, stages, microbatches, chunks) == megatron


def test_interleaved_needs_a_micro_batch_per_stage():
    with pytest.raises(ValueError, match="at least 4 micro-batches"):
        stage_order(0, 4, 3, 2)


@pytest.mark.parametrize("stages, microbatches", [(1, 5), (4, 8), (4, 2), (8, 32)])
def test_1f1b_uniform_stages_match_the_closed_form(stages, microbatches):
    result = simulate_pipeline([1.0] * stages, [2.0] * stages, microbatches)
    assert result.makespan_s == pytest.approx((microbatches + stages - 1) * 3.0)
    expected_bubble = (stages - 1) / (microbatches + stages - 1)
    assert result.bubble_fraction == pytest.approx(expected_bubble)


@pytest.mark.parametrize("chunks", [2, 4])
def test_interleaving_divides_the_bubble_by_the_chunk_count(chunks):
    result = simulate_pipeline([1.0] * 4, [2.0] * 4, 16, num_chunks=chunks)
    assert result.makespan_s == pytest.approx(16 * 3.0 + 3 * 3.0 / chunks)


def test_slowest_stage_paces_the_pipeline_and_sends_add_latency():
    result = simulate_pipeline([1.0, 3.0, 1.0], [2.0, 6.0, 2.0], 10)
    # Stage 0's first forward, the slowest stage's n passes, stage 0's last backward; the stage
    # after the bottleneck works in its shadow.
    assert result.makespan_s == pytest.approx(1 + 9 * 10 + 2)
    delayed = simulate_pipeline([1.0, 3.0, 1.0], [2.0, 6.0, 2.0], 10, send_s=0.5)
    assert delayed.makespan_s >= result.makespan_s + 4 * 0.5


def test_predict_step_combines_replicas_and_energy():
    power = PowerModel(static_w=100.0, dynamic_w=200.0, exponent=3.0)
    replica = ReplicaWork((1.0, 1.0), (2.0, 2.0), (2, 2), (1.0, 1.0), 4, send_s=0.0, sync_s=1.0)
    slow = ReplicaWork((1.0, 1.0), (2.0, 2.0), (2, 2), (0.5, 0.5), 2, send_s=0.0, sync_s=0.5)
    step = predict_step(
        [replica, slow], micro_batch_size=2, tokens_per_microbatch=10, idle_devices=3, power=power
    )
    assert step.step_time_s == pytest.approx(5 * 3.0 + 1.0)
    assert step.tokens_per_s == pytest.approx(6 * 10 / 16.0)
    assert step.samples_per_step == 12
    busy_energy = 2 * 2 * 200.0 * 12.0 + 2 * 2 * 200.0 * 0.125 * 6.0
    assert step.energy_j == pytest.approx((3 + 8) * 100.0 * 16.0 + busy_energy)
    assert step.bubble_fraction == pytest.approx(1 - (4 * 12.0 + 4 * 6.0) / (8 * 16.0))


def test_simulate_cli_prints_tables_and_json():
    result = subprocess.run(
        [sys.executable, "-m", "megatron_elaswave.simulate", "schedules", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["schedules"]
    bubbles = {(r["schedule"], r["microbatches"]): r["bubble_fraction"] for r in rows}
    assert bubbles[("interleaved v=4", 32)] < bubbles[("interleaved v=2", 32)] < bubbles[("1f1b", 32)]
    bad = subprocess.run(
        [sys.executable, "-m", "megatron_elaswave.simulate", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown scenario" in bad.stderr
