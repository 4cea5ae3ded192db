"""The commit of a state restore: every member takes the new layout, or none does, whenever a
failure is noticed (ranks in threads over one store)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_elaswave.launch.store import WaitInterrupted
from megatron_elaswave.training.recovery.restore import RestoreRound
from megatron_elaswave.waiting import wait_until

MEMBERS = (0, 1, 2)


def restore_round(store: dist.Store, rank: int, *, timeout_s: float = 30.0,
                  failure_noticed: bool = False,
                  exchange: dist.Store | None = None) -> RestoreRound:
    abort = threading.Event()
    if failure_noticed:
        abort.set()
    return RestoreRound(store, store if exchange is None else exchange, generation=3, rank=rank,
                        members=MEMBERS, timeout=timedelta(seconds=timeout_s), abort=abort)


class HostGone(dist.Store):
    """A generation's store whose host died: every request fails as ``HostedStore``'s do."""

    def add(self, key: str, amount: int) -> int:
        raise WaitInterrupted("the store of generation 3 went down with its host")


def outcome(restore: RestoreRound) -> str:
    try:
        restore.commit()
    except WaitInterrupted:
        return "abandoned"
    return "committed"


def test_a_failure_noticed_after_every_member_restored_does_not_undo_the_commit():
    store = dist.HashStore()
    with ThreadPoolExecutor(2) as pool:
        others = [pool.submit(outcome, restore_round(store, rank)) for rank in (1, 2)]
        prefix = restore_round(store, 0).prefix
        assert wait_until(lambda: store.add(f"{prefix}/restored", 0) == 2, 30)  # 1 and 2
        late = outcome(restore_round(store, 0, failure_noticed=True))
        assert [future.result(timeout=30) for future in others] == ["committed", "committed"]
    assert late == "committed"


def test_a_member_that_restores_after_another_abandoned_does_not_commit():
    # Rank 0 notices a failure while rank 2 is still restoring; rank 2 then restores and finds
    # every member's key set: it must follow rank 0, or the next recovery would start from two
    # views of which layout holds the state.
    store = dist.HashStore()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(outcome, restore_round(store, 1))
        assert outcome(restore_round(store, 0, failure_noticed=True)) == "abandoned"
        assert outcome(restore_round(store, 2)) == "abandoned"
        assert waiting.result(timeout=30) == "abandoned"


@pytest.mark.parametrize("failure_noticed", [False, True])
def test_a_member_that_never_restores_leaves_the_others_uncommitted(failure_noticed):
    store = dist.HashStore()
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(outcome, restore_round(store, rank, timeout_s=0.5,
                                                      failure_noticed=failure_noticed))
                   for rank in (0, 1)]
        assert [future.result(timeout=30) for future in futures] == ["abandoned", "abandoned"]


def test_a_member_that_loses_the_generations_store_follows_the_commit_of_the_others():
    # The members count themselves in the generation's store, and the outcome is in the job
    # store: a member that counted, then lost the store's host before it saw the count whole,
    # must take the commit that the others made, not a view of its own.
    job_store, exchange = dist.HashStore(), dist.HashStore()
    prefix = restore_round(job_store, 2).prefix
    exchange.add(f"{prefix}/restored", 1)  # rank 2 counted itself, then its host died
    with ThreadPoolExecutor(2) as pool:
        others = [pool.submit(outcome, restore_round(job_store, rank, exchange=exchange))
                  for rank in (0, 1)]
        assert [future.result(timeout=30) for future in others] == ["committed", "committed"]
    assert outcome(restore_round(job_store, 2, exchange=HostGone())) == "committed"


def test_a_member_that_loses_the_generations_store_before_counting_abandons_the_restore():
    job_store, exchange = dist.HashStore(), dist.HashStore()
    with ThreadPoolExecutor(2) as pool:
        others = [pool.submit(outcome, restore_round(job_store, rank, timeout_s=0.5,
                                                     exchange=exchange))
                  for rank in (0, 1)]
        assert outcome(restore_round(job_store, 2, exchange=HostGone())) == "abandoned"
        assert [future.result(timeout=30) for future in others] == ["abandoned", "abandoned"]
