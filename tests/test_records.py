"""Which held-back iteration records a rank writes and which it keeps (the logger may die
before it writes the ones it held back; whichever rank logs next must write them, once)."""

from __future__ import annotations

from megatron_elaswave.training.recovery.records import split_held_records


def record(iteration: int) -> dict:
    return {"iteration": iteration}


def step_end(held: list[dict], iteration: int, written: int | None) -> list[dict]:
    """What a rank holds after the record of ``iteration``: the ``_record`` order of the loop
    (write what was held, then hold the new one); returns what it wrote."""
    wrote, kept = split_held_records(held, iteration=iteration, up_to=None, written=written)
    held[:] = [*kept, record(iteration)]
    return wrote


def test_the_logger_writes_each_record_once_a_step_later():
    held, written, file = [], 0, []
    for iteration in range(1, 6):
        wrote = step_end(held, iteration, written)
        file += [r["iteration"] for r in wrote]
        written = file[-1] if file else 0
    assert file == [1, 2, 3, 4] and held == [record(5)]


def test_the_others_keep_the_two_records_the_logger_may_not_have_written():
    held = []
    for iteration in range(1, 6):
        assert step_end(held, iteration, written=None) == []
    assert held == [record(4), record(5)]


def test_a_record_held_through_an_interrupted_recovery_is_written_by_the_next_logger():
    # Ranks 0 (logging) and 4 finish iteration 1002; rank 0 wrote 1001 and dies holding 1002.
    held = []
    for iteration in range(1000, 1003):
        step_end(held, iteration, written=None)
    # A first recovery rolls back to 1002 and is interrupted before its logger wrote anything:
    # rank 4, not logging in it, keeps what the rollback keeps.
    wrote, held = split_held_records(held, iteration=1002, up_to=1002, written=None)
    assert wrote == [] and held == [record(1001), record(1002)]
    # The next recovery makes rank 4 the logger; the store says 1001 is written.
    wrote, held = split_held_records(held, iteration=1002, up_to=1002, written=1001)
    assert wrote == [record(1002)] and held == []


def test_records_after_the_rollback_are_dropped_they_run_again():
    wrote, held = split_held_records([record(7), record(8), record(9)], iteration=9, up_to=8,
                                     written=6)
    assert wrote == [record(7), record(8)] and held == []
    wrote, held = split_held_records([record(8), record(9)], iteration=9, up_to=8, written=None)
    assert wrote == [] and held == [record(8)]
