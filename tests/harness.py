"""Run ``elaswave-run`` jobs from tests, look inside them, and clean up whatever happens.

A job is started with :func:`launch` and used as a context manager::

    script = [worker_script("survivor.py"), str(tmp_path), "1"]
    with launch(script, nproc_per_node=3, master_port=free_port()) as job:
        pids = job.worker_pids()
        job.kill_worker(1)
        deaths = job.wait_for_deaths(1, timeout=10)
        returncode, output = job.wait(timeout=30)

The launcher runs in a session of its own (its workers share its process group), with stdout
and stderr captured to a file. Leaving the ``with`` block kills the whole process group if it is
still running, and prints the captured output when the block raised, so a failing test shows
what the launcher and its workers said. Waits never hang: each has a timeout, and a launcher
that exits while a test waits for something from it fails the test with its output.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from torch.distributed import Store, TCPStore

from megatron_elaswave.launch.etcd_address import EtcdAddress
from megatron_elaswave.launch.rendezvous import accepts_connections
from megatron_elaswave.launch.store import WorkerDeath, read_deaths, read_worker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from etcd_cluster import EtcdCluster, etcd_missing  # noqa: E402

WORKERS_DIR = Path(__file__).resolve().parent / "workers"
STORE_TIMEOUT = timedelta(seconds=30)
_POLL_INTERVAL_S = 0.05


def free_port() -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


MEGATRON_WORKERS = frozenset({
    "collective_abandon.py", "communicator_parallel_state.py", "default_group_redirect.py",
    "imports_megatron_core.py", "megatron_lm_record.py", "p2p_early_free.py", "p2p_wait.py",
})
"""The worker scripts of ``tests/workers`` that import megatron-core (directly or through the
project's patches). The others import torch alone: their launchers preload only that
(:func:`launch`), where preloading megatron-core's GPT stack would cost every launch seconds of
CPU that no worker uses."""


_ONCE: dict[object, object] = {}


def once(key: object, compute: Callable[[], object]) -> object:
    """``compute()``, run the first time ``key`` is asked for in the test session: a job or a
    data set that fixtures of several modules need (a module-scoped fixture imported into
    another module runs again there)."""
    if key not in _ONCE:
        _ONCE[key] = compute()
    return _ONCE[key]


def worker_script(name: str) -> str:
    """Absolute path of a worker script in ``tests/workers``."""
    return str(WORKERS_DIR / name)


def is_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie waiting to be reaped counts as ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, interval: float = _POLL_INTERVAL_S
) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


class LaunchedJob:
    """One running ``elaswave-run`` process (one node of a job) and what tests need from it."""

    def __init__(
        self,
        process: subprocess.Popen,
        *,
        node_rank: int,
        nproc_per_node: int,
        master_port: int,
        output_path: Path,
        owns_output: bool,
        etcd: EtcdAddress | None = None,
    ) -> None:
        self.process = process
        self.node_rank = node_rank
        self.nproc_per_node = nproc_per_node
        self.master_port = master_port
        self.etcd = etcd
        """The job's namespace, when its store is on etcd."""
        self.output_path = output_path
        self._owns_output = owns_output
        self._store: Store | None = None

    @property
    def pid(self) -> int:
        """Process id of the launcher (also its process group id)."""
        return self.process.pid

    @property
    def ranks(self) -> range:
        """Global ranks of this launcher's workers."""
        first = self.node_rank * self.nproc_per_node
        return range(first, first + self.nproc_per_node)

    def output(self) -> str:
        """Everything the launcher (and workers without ``--log-dir``) wrote so far."""
        return self.output_path.read_text(errors="replace")

    def wait(self, timeout: float) -> tuple[int, str]:
        """Wait for the launcher to exit; returns ``(returncode, output)``.

        On timeout, kills the whole process group and fails the test with the output.
        """
        try:
            returncode = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(
                f"elaswave-run (node {self.node_rank}) still running after {timeout:g} s; "
                f"output:\n{self.output()}"
            )
        return returncode, self.output()

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str,
                 poll_s: float = _POLL_INTERVAL_S) -> None:
        """Poll ``condition`` every ``poll_s`` until it holds; fail the test, with the output,
        after ``timeout`` seconds or as soon as the launcher exits."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.process.poll() is not None:
                pytest.fail(
                    f"elaswave-run (node {self.node_rank}) exited with {self.process.returncode} "
                    f"while the test waited for {what}; output:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                pytest.fail(
                    f"timed out after {timeout:g} s waiting for {what}; output:\n{self.output()}"
                )
            time.sleep(poll_s)

    def store(self, timeout: float = 30.0) -> Store:
        """A client of the job store (connected on first use)."""
        if self._store is None and self.etcd is not None:
            from megatron_elaswave.launch.etcd_store import EtcdStore

            self._store = EtcdStore(self.etcd, STORE_TIMEOUT)
        if self._store is None:
            address = ("127.0.0.1", self.master_port)
            self.wait_for(lambda: accepts_connections(address), timeout, "the job store")
            self._store = TCPStore(*address, is_master=False, timeout=STORE_TIMEOUT)
        return self._store

    def worker_pids(self, timeout: float = 30.0) -> dict[int, int]:
        """``{rank: pid}`` of this launcher's workers, once all are spawned."""
        store = self.store(timeout)
        records = {}

        def all_spawned() -> bool:
            for rank in self.ranks:
                if rank not in records and (record := read_worker(store, rank)) is not None:
                    records[rank] = record
            return len(records) == len(self.ranks)

        self.wait_for(all_spawned, timeout, f"workers {list(self.ranks)} to be spawned")
        return {rank: record.pid for rank, record in records.items()}

    def kill_worker(self, rank: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to the worker of ``rank`` (one of :attr:`ranks`); returns its pid."""
        pid = self.worker_pids()[rank]
        os.kill(pid, sig)
        return pid

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the launcher only (not its workers)."""
        self.process.send_signal(sig)

    def deaths(self, start: int = 0) -> list[WorkerDeath]:
        """The job's death records, read from its store."""
        return read_deaths(self.store(), start)

    def wait_for_deaths(self, count: int, timeout: float = 10.0) -> list[WorkerDeath]:
        """Wait until at least ``count`` deaths are recorded; returns them all."""
        self.wait_for(lambda: len(self.deaths()) >= count, timeout, f"{count} death records")
        return self.deaths()

    def kill(self) -> None:
        """SIGKILL the launcher's whole process group and reap the launcher."""
        if self.process.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()

    def close(self) -> None:
        self.kill()
        self._store = None
        if self._owns_output:
            self.output_path.unlink(missing_ok=True)

    def __enter__(self) -> LaunchedJob:
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if exc_type is not None:
            print(f"--- output of elaswave-run (node {self.node_rank}) ---\n{self.output()}")
        self.close()


def launch(
    args: Sequence[str],
    nproc_per_node: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master_port: int,
    launcher_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_path: str | os.PathLike | None = None,
    etcd: str | None = None,
    run_id: str = "none",
    cwd: str | os.PathLike | None = None,
) -> LaunchedJob:
    """Start ``python -m megatron_elaswave.launch.run ... *args`` in a session of its own, in
    the directory ``cwd`` (default: this one).

    ``args`` is the script and its arguments; ``launcher_args`` are extra launcher flags (a
    worker script of ``tests/workers`` that imports torch alone gets ``--preload=torch`` unless
    they name a ``--preload``);
    ``etcd`` (a ``--store`` URL) keeps the job store on that cluster, under ``run_id``.
    Workers get ``OMP_NUM_THREADS=1`` unless ``env`` says otherwise. Output goes to
    ``log_path``, or to a temporary file removed when the job is closed.
    """
    script = Path(args[0]) if args else None
    if (script is not None and script.parent == WORKERS_DIR and script.name not in MEGATRON_WORKERS
            and not any(arg.startswith("--preload") for arg in launcher_args)):
        launcher_args = ("--preload=torch", *launcher_args)
    command = [
        sys.executable,
        "-m",
        "megatron_elaswave.launch.run",
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        "--master-addr=127.0.0.1",
        f"--master-port={master_port}",
        f"--run-id={run_id}",
        *([f"--store={etcd}"] if etcd else []),
        *launcher_args,
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if log_path is None:
        descriptor, name = tempfile.mkstemp(prefix="elaswave-run-", suffix=".log")
        os.close(descriptor)
        output_path, owns_output = Path(name), True
    else:
        output_path, owns_output = Path(log_path), False
    with open(output_path, "wb") as output:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            cwd=cwd,
        )
    return LaunchedJob(
        process,
        node_rank=node_rank,
        nproc_per_node=nproc_per_node,
        master_port=master_port,
        output_path=output_path,
        owns_output=owns_output,
        etcd=None if etcd is None else EtcdAddress.parse(etcd, run_id),
    )


def launch_nodes(
    stack: contextlib.ExitStack,
    args: Sequence[str],
    nproc_per_node: int,
    *,
    master_port: int,
    log_dir: str | os.PathLike,
    node_args: Sequence[Sequence[str]] = ((), ()),
    etcd: str | None = None,
    node_dirs: Sequence[str | os.PathLike] | None = None,
) -> list[LaunchedJob]:
    """Start one launcher per node of a job on this machine, ``len(node_args)`` of them, node
    ``n`` with the extra launcher flags ``node_args[n]``, in the directory ``node_dirs[n]``
    (default: this one) and its output in ``log_dir/node<n>.log``. Each is entered on
    ``stack``, so it is closed with it. ``etcd`` keeps the job store on that cluster (under a
    run id of the job's own)."""
    run_id = f"test-{uuid.uuid4().hex[:12]}" if etcd else "none"
    return [
        stack.enter_context(launch(args, nproc_per_node, nnodes=len(node_args), node_rank=node,
                                   master_port=master_port, launcher_args=extra,
                                   log_path=Path(log_dir) / f"node{node}.log", etcd=etcd,
                                   run_id=run_id, cwd=node_dirs[node] if node_dirs else None))
        for node, extra in enumerate(node_args)
    ]
