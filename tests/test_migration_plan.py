"""The plan of a state migration: made by the lowest member from every member's offer, each
member reading only its own part, and the same transfers a member would plan by itself."""

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_elaswave.launch.store import WaitInterrupted
from megatron_elaswave.planner.zero import assign_waves
from megatron_elaswave.training.step.migration import (
    Piece,
    StateLost,
    _exchange_plan,
    plan_exchanges,
    plan_transfers,
)

TIMEOUT = timedelta(seconds=20)
WEIGHT = "layers.0.weight"


def piece(start: int, end: int, kind: str = "param") -> Piece:
    return Piece(0, WEIGHT, kind, start, end)


# Rank 3 failed: its half of the parameter survives in rank 1's replica of its snapshot.
OFFERS = {
    0: ([piece(0, 50).key], [piece(0, 100)]),
    1: ([piece(0, 50).key, piece(50, 100).key], [piece(0, 100)]),
    2: ([], [piece(0, 100), piece(50, 100, "exp_avg")]),
    4: ([piece(50, 100, "exp_avg").key], [piece(0, 50)]),
}


def test_each_member_gets_the_transfers_it_takes_part_in_in_the_order_of_the_whole_plan():
    transfers = plan_transfers({m: held for m, (held, _) in OFFERS.items()},
                               {m: needs for m, (_, needs) in OFFERS.items()})
    plans = plan_exchanges(OFFERS)
    for member, plan in plans.items():
        assert plan["transfers"] == [list(vars(t).values()) for t in transfers
                                     if member in (t.source, t.target)]
    moved = {(t.source, t.target) for t in transfers if t.source != t.target}
    assert {tuple(pair) for plan in plans.values() for pair in plan["exchanges"]} == moved
    assert len({plan["bytes"] for plan in plans.values()}) == 1


def test_both_ends_of_every_exchange_meet_it_in_the_same_wave_order():
    plans = plan_exchanges(OFFERS)
    sizes = {}
    for t in plan_transfers({m: held for m, (held, _) in OFFERS.items()},
                            {m: needs for m, (_, needs) in OFFERS.items()}):
        if t.source != t.target:
            sizes[(t.source, t.target)] = sizes.get((t.source, t.target), 0) + t.end - t.start
    wave_of = dict(zip(sorted(sizes), assign_waves([(*pair, sizes[pair])
                                                     for pair in sorted(sizes)])))
    for member, plan in plans.items():
        waves = [wave_of[tuple(pair)] for pair in plan["exchanges"]]
        assert waves == sorted(waves) and len(set(waves)) == len(waves), member


def test_a_piece_that_nobody_holds_is_the_same_error_for_every_member():
    offers = {**OFFERS, 4: ([], [piece(0, 50)])}  # the only copy of the exp_avg half is gone
    plans = plan_exchanges(offers)
    errors = {plan["error"] for plan in plans.values()}
    assert len(errors) == 1 and "elements 50-100 of exp_avg" in errors.pop()


def exchange_on_threads(store: dist.Store, offers: dict, failure=None) -> dict:
    outcomes = {}

    def member(rank: int) -> None:
        held, needs = offers[rank]
        try:
            outcomes[rank] = _exchange_plan(store, "m", rank, sorted(offers), held, needs,
                                            TIMEOUT, failure)
        except (StateLost, WaitInterrupted) as error:
            outcomes[rank] = error

    threads = [threading.Thread(target=member, args=(rank,)) for rank in offers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcomes


@pytest.mark.timeout(60)
def test_the_lowest_member_plans_and_the_others_read_one_key_each():
    store = dist.HashStore()
    outcomes = exchange_on_threads(store, OFFERS)
    assert outcomes == plan_exchanges(OFFERS)
    plans = [key for key in (f"m/plan/{r}" for r in range(6)) if store.check([key])]
    assert plans == [f"m/plan/{r}" for r in sorted(OFFERS)]


@pytest.mark.timeout(60)
def test_state_that_nobody_holds_stops_every_member_alike():
    offers = {**OFFERS, 4: ([], [piece(0, 50)])}
    outcomes = exchange_on_threads(dist.HashStore(), offers)
    assert {type(o) for o in outcomes.values()} == {StateLost}
    assert len({str(o) for o in outcomes.values()}) == 1


@pytest.mark.timeout(60)
def test_members_waiting_for_a_planner_that_died_leave_once_the_failure_is_detected():
    offers = {rank: OFFERS[rank] for rank in (1, 2, 4)}  # rank 0, the planner, never offers
    failure = threading.Event()
    threading.Timer(0.3, failure.set).start()
    store = dist.HashStore()
    outcomes = {}
    threads = [threading.Thread(target=lambda r=rank: outcomes.update({r: _catch(
        lambda: _exchange_plan(store, "m", r, [0, 1, 2, 4], *offers[r], TIMEOUT, failure))}))
        for rank in offers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert {type(o) for o in outcomes.values()} == {WaitInterrupted}


def _catch(call):
    try:
        return call()
    except WaitInterrupted as error:
        return error
