"""A rank that dies before the job can recover from it: every worker stops in one line and the
job ends, instead of waiting for the dead rank in a rendezvous or a collective.

With ``--elastic`` that is before every rank holds its first snapshot; without it, any time (as
torchrun stops the survivors). Ranks are SIGKILLed from outside the job at moments the test
reads from it.
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from torch.distributed import TCPStore

from harness import free_port, launch
from megatron_elaswave.launch.keys import FINISHED_KEY, START_VERDICT_KEY, started_key
from megatron_elaswave.launch.store import WorkerDeath, record_death
from megatron_elaswave.metrics import read_metrics
from megatron_elaswave.training.setup.startup import STARTED, StartupWatch
from test_pretrain_gpt import PRETRAIN, text_data  # noqa: F401  (fixture)
from test_step_failures import NPROC, elastic, flags

VICTIM = 3
STOP_BOUND_S = 60
"""A stopped job ends well within this after the kill: nothing waits for a timeout."""


def death_of(rank: int) -> WorkerDeath:
    return WorkerDeath(rank=rank, local_rank=rank, node_rank=0, pid=None, exit_code=None,
                       signal="SIGKILL", cause="signal", time=time.time())


def watch(store: TCPStore, rank: int, stops: list) -> StartupWatch:
    return StartupWatch(store, rank, 2, exit_status=3,
                        reason=lambda death: f"rank {death.rank} {death.describe()}",
                        stop=lambda line, status: stops.append((line, status)))


def test_a_death_before_every_rank_is_ready_stops_each_and_one_after_is_left_to_the_monitors():
    """Two ranks in one process: rank 1 marks itself ready; a death recorded after both are
    stops neither; a death recorded first (a fresh job) stops both with the same line."""
    store = TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10))
    stops: list = []
    with watch(store, 0, stops) as first, watch(store, 1, stops) as second:
        ready = threading.Thread(target=second.wait_until_started, args=(timedelta(seconds=10),))
        ready.start()
        first.wait_until_started(timedelta(seconds=10))
        ready.join()
        record_death(store, death_of(1))
        time.sleep(0.5)  # the watch would have read the death at its alert
    assert stops == [] and store.get(START_VERDICT_KEY).decode() == STARTED

    store = TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10))
    with watch(store, 0, stops), watch(store, 1, stops):
        record_death(store, death_of(1))
        deadline = time.monotonic() + 5
        while len(stops) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert stops == [("rank 1 killed by SIGKILL", 3)] * 2
    assert store.get(FINISHED_KEY).decode() == "rank 1 killed by SIGKILL"


def iterations_done(metrics: Path) -> int:
    try:
        return len(read_metrics(str(metrics), "iteration")) if metrics.exists() else 0
    except ValueError:  # a record half written
        return 0


def stop_lines(output: str) -> list[str]:
    return [line for line in output.splitlines()
            if line.startswith(("pretrain_gpt.py: cannot continue:", "pretrain_gpt.py: error:"))]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("moment, launcher_args", [
    ("spawned", ()),
    ("building", ()),
    # Started at once: with a delay, the survivors may have stopped the job first, and the
    # launcher then starts no replacement (nothing is left to join).
    ("spawned", ("--rejoin", "--rejoin-delay", "0")),
], ids=["spawned", "building", "spawned-with-rejoin"])
def test_a_rank_killed_while_an_elastic_job_starts_stops_every_worker_in_one_line(
        text_data, tmp_path, moment, launcher_args):  # noqa: F811
    """Rank 3 is SIGKILLed as soon as its launcher has published it (before the default group
    forms), or once the default group has formed (megatron-core creates its groups and builds
    the model); with ``--rejoin`` its replacement, started at once, asks to join a job that is
    stopping and must leave too."""
    with launch([PRETRAIN, *elastic(text_data)], NPROC, master_port=free_port(),
                launcher_args=launcher_args, log_path=tmp_path / "job.log") as job:
        job.worker_pids()
        store = job.store()
        if moment == "building":
            # Forming a group writes an address per member in the store: once the default
            # group's are there, the job is past its rendezvous. The rest of the start takes
            # a fraction of a second, so poll often.
            published = store.num_keys()
            job.wait_for(lambda: store.num_keys() >= published + NPROC, 120,
                         "the default group to form", poll_s=0.002)
        assert not store.check([START_VERDICT_KEY]), "the job started before the kill"
        job.kill_worker(VICTIM)
        killed_at = time.monotonic()
        job.wait_for(lambda: store.check([FINISHED_KEY]), STOP_BOUND_S, "the stop")
        verdict = store.get(START_VERDICT_KEY).decode()
        finished = store.get(FINISHED_KEY).decode()
        victim_was_ready = store.check([started_key(VICTIM)])
        returncode, output = job.wait(STOP_BOUND_S)
        assert time.monotonic() - killed_at < STOP_BOUND_S
    assert returncode == 128 + signal.SIGKILL, output[-4000:]
    expected = (f"pretrain_gpt.py: cannot continue: rank {VICTIM} killed by SIGKILL while the job "
                "started, before it held a snapshot to recover from; launch it again; no "
                "checkpoint was saved (no --save)")
    assert stop_lines(output) == [expected] * (NPROC - 1), output[-4000:]
    assert verdict == finished == expected.removeprefix("pretrain_gpt.py: ")
    assert "Traceback" not in output, output[-4000:]
    assert not victim_was_ready
    if launcher_args:
        assert f"the job stopped ({verdict}) before rank {VICTIM} could rejoin it" in output, \
            output[-4000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_without_elastic_a_rank_killed_in_training_stops_every_worker_in_one_line(
        text_data, tmp_path):  # noqa: F811
    """Megatron's path survives nothing: the launcher keeps the survivors running, so they stop
    themselves, each with one line naming the dead rank, once it dies after iteration 2."""
    metrics = tmp_path / "plain.jsonl"
    with launch([PRETRAIN, *flags(text_data), "--elastic-metrics-file", str(metrics)], NPROC,
                master_port=free_port(), log_path=tmp_path / "job.log") as job:
        job.wait_for(lambda: iterations_done(metrics) >= 2, 180, "iteration 2")
        job.kill_worker(VICTIM)
        killed_at = time.monotonic()
        returncode, output = job.wait(STOP_BOUND_S)
        assert time.monotonic() - killed_at < STOP_BOUND_S
    assert returncode == 128 + signal.SIGKILL, output[-4000:]
    expected = (f"pretrain_gpt.py: error: rank {VICTIM} killed by SIGKILL; without --elastic the "
                "job stops with it")
    assert stop_lines(output) == [expected] * (NPROC - 1), output[-4000:]
    assert "Traceback" not in output, output[-4000:]
