"""One failure never loses state, however close it lands to a layer move.

Two ranks are made slow (``--elastic-inject-slowdown``), one in each replica, so that layers move
in both replicas at a step boundary: every layer group, and with it every optimizer shard, is cut
anew. Then one rank fails: killed by itself at the most fragile moment (``phase=relayout``: every
rank has restored its state into the moved layout and some are snapshotting it there), SIGKILLed
from outside while the layout changes (the members pause once the change is in the store), or
SIGKILLed from outside as soon as the job reports the move, each rank in turn. With one snapshot
copy (the default) the survivors must always recover and finish on the failure-free trajectory.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from megatron_elaswave.launch.keys import change_key
from megatron_elaswave.metrics import read_metrics
from megatron_elaswave.training.recovery.relayout import RELAYOUT_DELAY_ENV
from test_elastic import FOLLOW_STRAGGLERS, TRAIN_ITERS, assert_on_trajectory, run
from test_pretrain_gpt import PRETRAIN, model_flags, text_data  # noqa: F401  (fixture)
from harness import free_port, launch

pytestmark = pytest.mark.multiprocess


def tied_flags(data_prefix: str, pipeline: int) -> list[str]:
    """Megatron's defaults (tied embeddings), 8 layers, dropout, GBS 16 on ``pipeline`` stages
    of one rank in two replicas; stragglers are not followed."""
    return [*model_flags(data_prefix, num_layers=8, train_iters=TRAIN_ITERS, global_batch_size=16,
                         hidden_dropout=0.1, attention_dropout=0.1,
                         pipeline_model_parallel_size=pipeline),
            "--elastic", "--use-distributed-optimizer", "--elastic-rebalance-window", "0"]


def moving_flags(data_prefix: str, pipeline: int) -> list[str]:
    """:func:`tied_flags` where the first stage of replica 0 and the last of replica 1 compute
    four times as slowly from iteration 2: slow in four iterations of the first five, layers
    move in both replicas after iteration 5."""
    last = 2 * pipeline - 1
    return [*tied_flags(data_prefix, pipeline), *FOLLOW_STRAGGLERS,
            "--elastic-inject-slowdown", "rank=0,factor=4,iteration=2",
            "--elastic-inject-slowdown", f"rank={last},factor=4,iteration=2"]


@pytest.fixture(scope="module")
def reference(text_data, tmp_path_factory):  # noqa: F811
    """The failure-free trajectory: layout-invariant, so one run serves every layout."""
    iterations, recoveries, _ = run(tmp_path_factory.mktemp("reference"), "reference",
                                    tied_flags(text_data, pipeline=2), nproc=4)
    assert not recoveries
    return iterations


def moves(tmp_path: Path, name: str) -> list[dict]:
    """The rebalance records that moved layers in every replica."""
    return [record for record in read_metrics(str(tmp_path / f"{name}.jsonl"), "rebalance")
            if record["reason"].count("its stages now hold") == 2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [pytest.param(3, marks=pytest.mark.sweep),
                                    pytest.param(5, marks=pytest.mark.quick),
                                    pytest.param(6, marks=pytest.mark.sweep)])
def test_a_rank_killed_as_layers_move_in_both_replicas_loses_no_state(
        text_data, reference, tmp_path, victim):  # noqa: F811
    """TP1 x PP4 x DP2, tied embeddings: layers move in both replicas after iteration 5, and the
    victim SIGKILLs itself once every rank has restored its state into the moved layout, while
    the others snapshot it there. The moved layout's snapshots are then incomplete; those taken
    before the move are still whole and restore iteration 5."""
    flags = [*moving_flags(text_data, pipeline=4),
             "--elastic-inject-failure", f"rank={victim},iteration=6,phase=relayout"]
    iterations, recoveries, output = run(tmp_path, "moved", flags)
    assert f"rank {victim} kill in the relayout of iteration 6" in output, output[-4000:]
    assert [r["failed_ranks"] for r in recoveries] == [[victim]]
    assert recoveries[0]["rolled_back_to"] == 5
    assert "cannot continue" not in output
    assert_on_trajectory(reference, iterations)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [1, pytest.param(2, marks=pytest.mark.sweep)])
def test_a_rank_killed_while_the_layout_changes_is_recovered_at_once(
        text_data, reference, tmp_path, victim):  # noqa: F811
    """TP1 x PP2 x DP2: the members pause for 2 s once the layer move is committed to the store;
    the test SIGKILLs a rank from outside as soon as it reads the change there. The survivors
    take the committed change for what came first and the failure for the next generation's:
    the recovery waits for no agreement timeout."""
    metrics = tmp_path / "changing.jsonl"
    with launch([PRETRAIN, *moving_flags(text_data, pipeline=2), "--elastic-metrics-file",
                 str(metrics)], 4, master_port=free_port(), log_path=tmp_path / "changing.log",
                env={RELAYOUT_DELAY_ENV: "2"}) as job:
        job.wait_for(lambda: job.store().check([change_key(1)]), 120, "a committed layout change")
        job.kill_worker(victim)
        returncode, output = job.wait(240)
    assert returncode == 0, output[-4000:]
    iterations = read_metrics(str(metrics), "iteration")
    recoveries = read_metrics(str(metrics), "recovery")
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1))
    assert [r["failed_ranks"] for r in recoveries] == [[victim]], output[-4000:]
    assert recoveries[0]["agree_s"] < 2.0, recoveries
    assert_on_trajectory(reference, iterations)


@pytest.mark.timeout(600)
@pytest.mark.sweep
def test_each_rank_in_turn_killed_as_soon_as_a_layer_move_is_reported(
        text_data, reference, tmp_path):  # noqa: F811
    """TP1 x PP2 x DP2: for each rank in turn, a new run is SIGKILLed from outside as soon as
    its log reports that layers moved in both replicas."""
    for victim in range(4):
        metrics = tmp_path / f"victim{victim}.jsonl"
        with launch([PRETRAIN, *moving_flags(text_data, pipeline=2), "--elastic-metrics-file",
                     str(metrics)], 4, master_port=free_port(),
                    log_path=tmp_path / f"victim{victim}.log") as job:
            job.wait_for(lambda: "rebalanced after iteration" in job.output(), 120,
                         "a layer move", poll_s=0.01)
            job.kill_worker(victim, signal.SIGKILL)
            returncode, output = job.wait(240)
        assert returncode == 0, output[-4000:]
        assert moves(tmp_path, f"victim{victim}"), output[-4000:]
        iterations = read_metrics(str(metrics), "iteration")
        assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1))
        assert [r["failed_ranks"] for r in read_metrics(str(metrics), "recovery")] == [[victim]]
        assert_on_trajectory(reference, iterations)
