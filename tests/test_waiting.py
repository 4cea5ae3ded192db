"""The one wait of the package: ready at once, given up by its event, its deadline or its check."""

import itertools
import threading
import time

import pytest

from megatron_elaswave.waiting import FIRST_PAUSE_S, pauses, wait_until


def test_the_pauses_start_at_a_millisecond_and_double_up_to_their_bound():
    assert list(itertools.islice(pauses(0.01), 6)) == [FIRST_PAUSE_S, 0.002, 0.004, 0.008, 0.01,
                                                       0.01]


def test_a_condition_ready_at_once_is_polled_once():
    calls = []
    assert wait_until(lambda: calls.append(1) or True, 0.0)
    assert calls == [1]


def test_the_wait_ends_with_the_condition():
    ready_after = time.monotonic() + 0.1
    polls = []
    assert wait_until(lambda: polls.append(1) or time.monotonic() >= ready_after, 30)
    assert 1 < len(polls) < 30  # fast polls first, then one every 20 ms at most


def test_the_event_gives_the_wait_up_and_the_deadline_ends_it():
    abandon = threading.Event()
    threading.Timer(0.1, abandon.set).start()
    polls = []
    assert not wait_until(lambda: polls.append(1) and False, 60, abandon=abandon)
    assert abandon.is_set() and polls
    assert not wait_until(lambda: False, 0.05)


def test_a_check_that_raises_ends_the_wait():
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        wait_until(lambda: False, 60, check=interrupted)
