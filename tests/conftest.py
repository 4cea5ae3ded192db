"""Guards for every test: a time limit, and for multi-process tests a check for leftovers.

* **Time limit.** Each test fails after ``DEFAULT_TIMEOUT_S`` seconds, or the number given by
  ``@pytest.mark.timeout(seconds)`` (the pytest-timeout marker, honoured by pytest-timeout
  itself when it is installed). The limit raises in the main thread through ``SIGALRM``, so it
  takes effect when that thread next runs Python code: a call blocked in native code must have
  its own timeout. If the test is still running ``TRACEBACK_AFTER_S`` seconds after its limit,
  the stacks of all threads are written to its captured stderr (``faulthandler``), to show
  where it is stuck.
* **No leftover processes.** Tests marked ``@pytest.mark.multiprocess`` run with a fresh
  ``ELASWAVE_TEST_TOKEN`` in the environment, which every process they start inherits. After
  the test, any process that carries the token or descends from pytest and was not there before
  the test must be gone within ``LEFTOVER_GRACE_S``; survivors are killed and the test fails.
  The token finds them even when they were orphaned or left the process tree.

* **Reverse lookups bounded.** torch names the peer of every ``TCPStore`` connection by a
  reverse DNS lookup, on both ends and, on the server, in its event loop. Where the resolver
  drops bursts of queries (as the CI machines' does), a dropped one stalls that connection,
  or the whole store, for the resolver's timeout (5 s a try). The tests' processes
  give the resolver one attempt of 1 s (``RES_OPTIONS``, unless set), which a start-up of eight
  ranks no longer waits out; what the tests check does not depend on it.

It also provides ``store``: a job store (``TCPStore``) hosted by the test itself, and
``etcd_cluster``: a three-member etcd cluster on loopback ports, stopped after the test (skipped,
with the reason, where etcd or its client is not installed).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import psutil
import pytest
from harness import EtcdCluster, etcd_missing, free_port
from torch.distributed import TCPStore

DEFAULT_TIMEOUT_S = 300.0
TRACEBACK_AFTER_S = 10.0
LEFTOVER_GRACE_S = 3.0
TOKEN_ENV = "ELASWAVE_TEST_TOKEN"
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "multiprocess: starts processes; fails if any outlives the test"
    )
    config.addinivalue_line(
        "markers", "quick: a multi-process test of the fast tier (scripts/test.sh --quick)"
    )
    config.addinivalue_line(
        "markers", "sweep: repeats another test's check at more ranks, layouts or moments "
        "(scripts/test.sh --all); the seeded soak draws such places at random"
    )
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): time limit of the test")


@pytest.fixture(autouse=True)
def _time_limit(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.config.pluginmanager.hasplugin("timeout"):
        yield
        return
    marker = request.node.get_closest_marker("timeout")
    seconds = float(marker.args[0]) if marker else DEFAULT_TIMEOUT_S

    def on_alarm(signum: int, frame: object) -> None:
        pytest.fail(f"test timed out after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds + TRACEBACK_AFTER_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _no_leftover_processes(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    if request.node.get_closest_marker("multiprocess") is None:
        yield
        return
    token = uuid.uuid4().hex
    monkeypatch.setenv(TOKEN_ENV, token)
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    yield
    leftovers = _alive(_started_by_test(token, before))
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.05)
        leftovers = _alive(leftovers)
    if leftovers:
        described = [_describe(process) for process in leftovers]
        for process in leftovers:
            _kill(process)
        pytest.fail(f"processes outlived the test: {'; '.join(described)}")


def _started_by_test(token: str, before: set[int]) -> list[psutil.Process]:
    found = {
        child.pid: child
        for child in psutil.Process().children(recursive=True)
        if child.pid not in before
    }
    for process in psutil.process_iter():
        if process.pid == os.getpid() or process.pid in found:
            continue
        try:
            if process.environ().get(TOKEN_ENV) == token:
                found[process.pid] = process
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return list(found.values())


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running: a zombie has ended, it only waits for its parent to reap it."""
    alive = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            continue
    return alive


def _describe(process: psutil.Process) -> str:
    try:
        return f"pid {process.pid}: {' '.join(process.cmdline())}"
    except psutil.Error:
        return f"pid {process.pid}"


def _kill(process: psutil.Process) -> None:
    try:
        process.kill()
    except psutil.NoSuchProcess:
        pass


@pytest.fixture
def store() -> TCPStore:
    """A job store hosted by the test, on a free port."""
    return TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10))


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    """Three etcd members on 127.0.0.1, killed after the test."""
    missing = etcd_missing()
    try:
        import etcd3gw  # noqa: F401
    except ImportError:
        missing = missing or "the etcd3gw package is not installed"
    if missing:
        pytest.skip(missing)
    with EtcdCluster(3) as cluster:
        yield cluster
