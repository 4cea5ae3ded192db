"""The order of one iteration's bookkeeping in :meth:`ElasticTrainer.advance`, on a stand-in
trainer: a failure noticed as the step returns, after the step snapshotted the iteration,
must not lose the iteration's record (a recovery may roll back to exactly that iteration)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest

from megatron_elaswave.training.recovery.elastic import ElasticTrainer


def stand_in_trainer(failure_noticed_after_the_step: bool) -> mock.MagicMock:
    trainer = mock.MagicMock()
    trainer.iteration, trainer.consumed_samples = 4, 64
    trainer._joining = frozenset()
    trainer.recovery.pending = None
    trainer.recovery.retries.completed.return_value = None
    trainer.saves_itself = True
    trainer.train_step.return_value = SimpleNamespace(
        lm_loss=5.25, sample_ids=list(range(64, 80)), step_time_s=0.1, reported=None)
    checks = [None, RuntimeError("rank 1 failed")] if failure_noticed_after_the_step else None
    trainer.monitor.raise_if_failed.side_effect = checks
    trainer.recorded_at = []
    trainer._record.side_effect = lambda result, gbs, **extra: trainer.recorded_at.append(
        (trainer.iteration, gbs))
    return trainer


@pytest.mark.parametrize("rolled_back_to", [5, 4])
def test_a_failure_noticed_as_the_step_returns_keeps_the_iterations_record_then_recovers(
        rolled_back_to):
    """The recovery rolls back to the iteration just done (its result stands, for Megatron-LM's
    log line of it) or to the one before (it runs again)."""
    trainer = stand_in_trainer(failure_noticed_after_the_step=True)
    trainer.recover.side_effect = lambda error: setattr(trainer, "iteration", rolled_back_to)
    result = ElasticTrainer.advance(trainer)
    assert result is (trainer.train_step.return_value if rolled_back_to == 5 else None)
    assert trainer.recorded_at == [(5, 16)]
    assert trainer.consumed_samples == 80
    trainer.recover.assert_called_once()
    assert str(trainer.recover.call_args.args[0]) == "rank 1 failed"
    # Nothing that would start after the iteration: no save, no layout change.
    trainer._save_if_due.assert_not_called()
    trainer._follow_report.assert_not_called()


def test_without_a_failure_the_iteration_is_recorded_saved_and_followed():
    trainer = stand_in_trainer(failure_noticed_after_the_step=False)
    result = ElasticTrainer.advance(trainer)
    assert result is trainer.train_step.return_value
    assert trainer.recorded_at == [(5, 16)]
    trainer.recover.assert_not_called()
    trainer._save_if_due.assert_called_once()
    trainer._follow_report.assert_called_once()


def test_a_failure_during_the_step_records_nothing():
    trainer = stand_in_trainer(failure_noticed_after_the_step=False)
    trainer.train_step.side_effect = RuntimeError("a peer failed in a collective")
    assert ElasticTrainer.advance(trainer) is None
    assert trainer.recorded_at == [] and trainer.iteration == 4
    trainer.recover.assert_called_once()
