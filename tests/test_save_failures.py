"""Saves that fail are loud, and every save resolves (``training/checkpointing/durable.py``).

In one process: the writers of a save (one :class:`DurableCheckpoints` per rank, over one job
store) with a storage error put in their way, and a finaliser that stops in the middle of its
commit. Then real jobs, faults from outside: a ``--save`` that cannot be created, and a file
system filled up under a running job (a small tmpfs), which stops in one line naming the error
and the last complete checkpoint, or with ``--elastic-save-failures warn`` trains to the end and
exits non-zero because its final save was not written, in this project's script and in
Megatron-LM's loop; and the finaliser SIGKILLed once its save is marked committing, whose commit
a survivor completes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from harness import free_port, launch, launch_nodes
from megatron_elaswave.launch.keys import (
    ABANDONED,
    CHECKPOINT_LOCK_KEY,
    COMMITTED,
    checkpoint_key,
)
from megatron_elaswave.training.checkpointing import durable
from megatron_elaswave.training.setup import exit_status
from megatron_elaswave.training.checkpointing.checkpoint import latest_complete
from megatron_elaswave.training.checkpointing.durable import (
    DurableCheckpoints,
    DurableConfig,
    SaveRequest,
)
from test_durable_checkpoints import MEGATRON_LM_ITERS, TRAIN_ITERS, flags, is_complete
from test_megatron_adaptor import TRAINING_SCRIPT, megatron_lm_flags, needs_megatron_lm
from test_pretrain_gpt import PRETRAIN, text_data  # noqa: F401  (fixture)

ITERATION = 4


class Snapshot:
    """What a request pins: nothing to write beyond its objects, checksums that hold."""

    tensors: dict = {}

    def verify(self) -> None:
        pass


class Taken:
    snapshot = Snapshot()

    def wait(self) -> None:
        pass


class NoPins:
    def pin(self, snapshot) -> None:
        pass

    def unpin(self, snapshot) -> None:
        pass


def writers(root: Path, ranks: tuple[int, ...], *, dead=frozenset, retries: int = 2):
    """One writer per rank over one job store, and the request each submits for iteration 4."""
    store = dist.HashStore()
    checkpoints = {rank: DurableCheckpoints(
        DurableConfig(rank=rank, timeout_s=30, retries=retries, retry_backoff_s=0.01), store,
        lambda: store, NoPins(), dead=dead) for rank in ranks}
    requests = {rank: SaveRequest(
        root=str(root), iteration=ITERATION, generation=0, writers=ranks, snapshot=Taken(),
        pieces=[], objects={f"object{rank}": rank},
        common={"iteration": ITERATION} if rank == min(ranks) else None) for rank in ranks}
    return store, checkpoints, requests


def outcome(store, request: SaveRequest) -> str:
    key = request.key("outcome")
    return store.get(key).decode() if store.check([key]) else ""


def failing_writes(monkeypatch, errors: list[BaseException], part: str = "rank0") -> list[str]:
    """``write_part`` of ``part`` raises each of ``errors`` in turn, then writes; the parts it
    was asked for."""
    calls, write = [], durable.write_part

    def write_part(directory, name, boxes, objects):
        calls.append(name)
        if name == part and errors:
            raise errors.pop(0)
        write(directory, name, boxes, objects)

    monkeypatch.setattr(durable, "write_part", write_part)
    return calls


def test_a_transient_storage_error_is_written_again_and_the_save_commits(
        tmp_path, monkeypatch, capsys):
    eio = OSError(errno.EIO, "Input/output error")
    # torch's CheckpointException is a BaseException that holds each rank's error.
    calls = failing_writes(monkeypatch, [eio, CheckpointException("write failed", {0: (eio, [])})])
    store, checkpoints, requests = writers(tmp_path, (0,))
    checkpoints[0].submit(requests[0])
    assert checkpoints[0].wait(60)
    assert calls == ["rank0"] * 3
    assert outcome(store, requests[0]) == COMMITTED
    assert latest_complete(str(tmp_path))[0] == ITERATION
    assert checkpoints[0].failed is None and checkpoints[0].last_save_failure(ITERATION) is None
    assert capsys.readouterr().out.count("trying again in") == 2


def test_a_committed_save_leaves_its_outcome_in_the_store_and_not_its_parts(tmp_path):
    """The keys each writer sets for its part are read by the finaliser alone: a job that saves
    every few hundred iterations for weeks must not keep one key per rank and save."""
    store, checkpoints, requests = writers(tmp_path, (0, 1))
    for rank in (1, 0):
        checkpoints[rank].submit(requests[rank])
    assert all(checkpoints[rank].wait(60) for rank in (0, 1))
    assert outcome(store, requests[0]) == COMMITTED
    assert not any(store.check([requests[0].key(f"part/{rank}")]) for rank in (0, 1))


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   CheckpointException("write failed", {0: (OSError(
                                       errno.EACCES, "Permission denied"), [])})],
                         ids=["no-space", "checkpoint-exception"])
def test_a_save_that_cannot_be_written_is_abandoned_and_says_why_on_every_rank(
        tmp_path, monkeypatch, error):
    calls = failing_writes(monkeypatch, [error], part="rank1")
    store, checkpoints, requests = writers(tmp_path, (0, 1))
    for rank in (1, 0):  # rank 1 fails; the finaliser then gives up waiting for its part
        checkpoints[rank].submit(requests[rank])
    started = time.monotonic()
    for rank in (0, 1):
        assert checkpoints[rank].wait(60)
        checkpoints[rank].finish(60)
    assert time.monotonic() - started < 10  # not the 30 s the finaliser would wait for parts
    assert calls.count("rank1") == 1  # nothing worth trying again
    assert outcome(store, requests[0]) == ABANDONED
    assert latest_complete(str(tmp_path)) is None
    for rank in (0, 1):
        failure = checkpoints[rank].first_failure()
        assert failure.iteration == ITERATION
        assert re.match(r"rank 1: (OSError|PermissionError): \[Errno ", failure.reason)  # unwrapped
        assert checkpoints[rank].last_save_failure(ITERATION) == failure
        line = failure.line(str(tmp_path))
        assert line.startswith(f"the checkpoint of iteration {ITERATION} could not be written ")
        assert line.endswith(f"no complete checkpoint in {tmp_path} yet")
    assert checkpoints[1].failed is not None  # the rank that failed knows at once



@pytest.mark.parametrize("free_blocks", [0, 1000])
def test_torch_saves_unexplained_error_on_a_full_file_system_is_said_as_one(
        tmp_path, monkeypatch, free_blocks):
    """``torch.save`` meets a full disk with an error of its zip writer that names no cause;
    the line says the file system is full where it is, and the error as it came otherwise."""
    zip_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    failing_writes(monkeypatch, [zip_error])
    statvfs = os.statvfs
    monkeypatch.setattr(durable.os, "statvfs", lambda path: type(
        "Usage", (), {"f_bavail": free_blocks, "f_blocks": statvfs(path).f_blocks})())
    _, checkpoints, requests = writers(tmp_path, (0,))
    checkpoints[0].submit(requests[0])
    assert checkpoints[0].wait(60)
    reason = checkpoints[0].first_failure().reason
    if free_blocks:
        assert reason == f"rank 0: RuntimeError: {zip_error}"
    else:
        assert reason == (f"rank 0: OSError: [Errno {errno.ENOSPC}] No space left on device "
                          f"(RuntimeError: {zip_error})")

def test_the_commit_of_a_finaliser_that_stops_is_completed_by_the_lowest_survivor(
        tmp_path, monkeypatch, capsys):
    """Rank 0 finalises the save of iteration 4 and stops for good once it is marked committing
    (as a SIGKILL leaves it); rank 1 completes the commit when it learns of the failure, rank 2
    only sees it resolved."""
    stopped, release = threading.Event(), threading.Event()
    commit = durable._commit

    def stops_on_the_writer_thread(name, **how):
        if threading.current_thread().name == "elaswave-checkpoint-writer":
            stopped.set()
            release.wait()
            raise SystemExit  # never returns into the save: the process is gone
        return commit(name, **how)

    monkeypatch.setattr(durable, "_commit", stops_on_the_writer_thread)
    store, checkpoints, requests = writers(tmp_path, (0, 1, 2))
    for rank in (1, 2, 0):
        checkpoints[rank].submit(requests[rank])
    assert stopped.wait(60)
    assert outcome(store, requests[0]) == "committing"
    assert latest_complete(str(tmp_path)) is None
    for rank in (2, 1):
        checkpoints[rank].abandon_saves_of(frozenset({0}))
    assert outcome(store, requests[0]) == COMMITTED
    assert store.get(CHECKPOINT_LOCK_KEY).decode() == ""
    saved, directory = latest_complete(str(tmp_path))
    assert saved == ITERATION and is_complete(Path(directory))
    assert "its commit completed for rank 0, which failed" in capsys.readouterr().out
    for rank in (1, 2):
        checkpoints[rank].finish(5)
        assert checkpoints[rank].last_save_failure(ITERATION) is None
    release.set()


def test_the_end_of_the_job_does_not_wait_on_a_save_whose_writer_is_dead(tmp_path):
    """Rank 1 dies before it writes its part, after the job's last recovery: rank 0 (the
    finaliser) would wait 30 s for the part; it abandons the save as soon as its failure
    monitor has the death, and says the final save was not written."""
    dead: set[int] = set()
    store, checkpoints, requests = writers(tmp_path, (0, 1), dead=lambda: dead)
    checkpoints[0].submit(requests[0])
    dead.add(1)
    started = time.monotonic()
    checkpoints[0].finish(60)
    assert time.monotonic() - started < 10
    assert outcome(store, requests[0]) == ABANDONED
    failure = checkpoints[0].last_save_failure(ITERATION)
    assert failure is not None and failure.reason == "a rank that wrote it failed"
    assert checkpoints[0].last_save_failure(ITERATION - 1) is None  # not its last save
    assert store.check([checkpoint_key(requests[0].save_id, "outcome")])


def test_a_save_that_comes_due_while_two_are_in_flight_waits_for_the_oldest(
        tmp_path, monkeypatch):
    """Storage slower than the save interval: the third save waits at the step boundary until
    the first is written, so no more than two snapshot copies are pinned at once."""
    release, writing = threading.Event(), []
    write = durable.write_part

    def slow_write(directory, part, boxes, objects):
        writing.append(directory)
        release.wait()
        write(directory, part, boxes, objects)

    monkeypatch.setattr(durable, "write_part", slow_write)
    store = dist.HashStore()
    checkpoints = DurableCheckpoints(DurableConfig(rank=0, timeout_s=30), store, lambda: store,
                                     NoPins())

    def request(iteration: int) -> SaveRequest:
        return SaveRequest(root=str(tmp_path), iteration=iteration, generation=0, writers=(0,),
                           snapshot=Taken(), pieces=[], objects={}, common={})

    checkpoints.submit(request(2))
    checkpoints.submit(request(4))
    third = threading.Thread(target=checkpoints.submit, args=(request(6),))
    third.start()
    third.join(1.0)
    assert third.is_alive()  # held at the step boundary
    release.set()
    third.join(30)
    assert not third.is_alive()
    assert checkpoints.wait(60)
    assert latest_complete(str(tmp_path))[0] == 6


def test_a_reused_save_directory_is_overwritten_as_megatron_does(tmp_path):
    """A run before this one saved up to iteration 8 under the same ``--save``; this job, started
    afresh, saves iteration 4: its checkpoint replaces the old one of that iteration and the
    tracker names it, though the old run got further."""
    from megatron_elaswave.training.checkpointing.checkpoint import checkpoint_dir, write_tracker

    for iteration in (4, 8):
        old = Path(checkpoint_dir(str(tmp_path), iteration))
        old.mkdir(parents=True)
        (old / "from-the-old-run").write_text("")
    write_tracker(str(tmp_path), 8)
    store, checkpoints, requests = writers(tmp_path, (0,))
    checkpoints[0].submit(requests[0])
    assert checkpoints[0].wait(60)
    saved, directory = latest_complete(str(tmp_path))
    assert saved == ITERATION and is_complete(Path(directory))
    assert not (Path(directory) / "from-the-old-run").exists()


# -- real jobs --------------------------------------------------------------------------------


ERROR_LINE = re.compile(r"error: the checkpoint of iteration (\d+) could not be written \((.*)\); "
                        r"(.*)")


@pytest.fixture
def small_file_system(tmp_path):
    """A 64 MiB tmpfs, unmounted after the test; skipped where mounting is not allowed."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(mount: Path) -> None:
    """Write to ``mount`` until it is full."""
    with open(mount / "filler", "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * (1 << 20))
                handle.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC


def run_until_the_disk_fills(command: list[str], save: Path, mount: Path, log: Path,
                             timeout_s: float) -> tuple[str, tuple[str, str, str]]:
    """Launch ``command`` on four ranks, fill ``mount`` once the checkpoint of iteration 2 is
    complete under ``save``, and wait for it to end with exit status 4: its output, and the one
    error line every rank printed (its iteration, reason and what to resume from)."""
    with launch(command, 4, master_port=free_port(), log_path=log) as job:
        job.wait_for(lambda: (latest_complete(str(save)) or (0,))[0] >= 2, timeout_s,
                     "the checkpoint of iteration 2")
        fill(mount)
        returncode, output = job.wait(timeout_s)
    assert returncode == exit_status.SAVE_FAILED, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    errors = {match.groups() for match in map(ERROR_LINE.search, output.splitlines()) if match}
    assert len(errors) == 1, output[-4000:]  # every rank says the same line, each on its own
    return output, errors.pop()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_save_that_cannot_be_created_is_refused_before_training(text_data, tmp_path):  # noqa: F811
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    save = not_a_directory / "checkpoints"
    with launch([PRETRAIN, *flags(text_data), "--save", str(save)], 4, master_port=free_port(),
                log_path=tmp_path / "job.log") as job:
        returncode, output = job.wait(90)
    assert returncode == exit_status.BAD_INPUT, output[-3000:]
    lines = [line for line in output.splitlines() if "error:" in line]
    assert lines == [f"pretrain_gpt.py: error: --save {save} cannot be written: Not a directory "
                     f"({save})"], output[-3000:]
    assert "Traceback" not in output


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_save_directory_the_nodes_do_not_share_is_refused_before_training(text_data,  # noqa: F811
                                                                           tmp_path):
    """Two nodes whose launchers run in different directories, ``--save checkpoints`` relative:
    each node would write its parts into a directory of its own, as with a node-local disk, and
    no checkpoint would ever be whole. Refused in one line before the first iteration, status 2
    on both nodes. The same nodes with a directory they share save a whole checkpoint."""

    def two_nodes(save: str, *extra: str) -> list[tuple[int, str]]:
        with contextlib.ExitStack() as stack:
            nodes = launch_nodes(stack, [PRETRAIN, *flags(text_data), "--save", save, *extra], 2,
                                 master_port=free_port(), log_dir=tmp_path, node_dirs=dirs)
            return [node.wait(150) for node in nodes]

    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for directory in dirs:
        directory.mkdir()
    shared = tmp_path / "shared"
    assert [code for code, _ in two_nodes(str(shared), "--train-iters", "2")] == [0, 0]
    assert is_complete(shared / "iter_0000002")
    results = two_nodes("checkpoints")
    output = "\n".join(output for _, output in results)
    assert [code for code, _ in results] == [exit_status.BAD_INPUT] * 2, output[-4000:]
    lines = [line for line in output.splitlines() if "error:" in line]
    assert lines == ["pretrain_gpt.py: error: --save checkpoints is not shared between the "
                     "nodes: node 1 does not see what node 0 wrote there; every node writes its "
                     "part of each checkpoint: give --save a path on a file system all nodes "
                     "share"], output[-4000:]
    assert "Traceback" not in output and "iteration" not in output
    assert all(not list((directory / "checkpoints").iterdir()) for directory in dirs)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["stop", "warn"])
def test_a_file_system_that_fills_up_under_the_job_is_said_in_one_line_with_a_nonzero_exit(
        text_data, tmp_path, small_file_system, policy):  # noqa: F811
    """Saves every 2 iterations on a 64 MiB tmpfs, filled from outside once the checkpoint of
    iteration 2 is complete. ``stop``: the job stops at the next step boundary after the save of
    iteration 4 fails, in one line naming the error and the checkpoint of iteration 2 (complete),
    with exit status 4. ``warn``: it trains to the end, warning at each save, and exits 4
    because its final save was not written."""
    save = small_file_system / "checkpoints"
    command = [PRETRAIN, *flags(text_data), "--save", str(save), "--save-interval", "2",
               "--elastic-save-failures", policy]
    output, (iteration, reason, resume) = run_until_the_disk_fills(
        command, save, small_file_system, tmp_path / "job.log", 180)
    assert "No space left on device" in reason
    saved, directory = latest_complete(str(save))
    assert is_complete(Path(directory))
    assert resume == (f"the last complete checkpoint is iteration {saved} in {directory}: "
                      f"resume with --load {save}")
    iterations = [int(n) for n in re.findall(r"iteration\s+(\d+)/", output)]
    if policy == "stop":
        assert saved == 2 and int(iteration) == 4
        assert max(iterations, default=0) <= 6, "the job trained on after the failed save"
    else:
        assert int(iteration) == TRAIN_ITERS
        assert "training goes on (--elastic-save-failures warn)" in output


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@needs_megatron_lm
def test_megatron_lms_loop_stops_in_one_line_when_its_file_system_fills_up(
        tmp_path, small_file_system):
    """Megatron-LM's loop under ``--elastic`` (TP1 x PP2 x DP2), saving every 2 iterations on a
    tmpfs filled from outside once iteration 2 is saved: one line, exit status 4, the checkpoint
    of iteration 2 named and complete."""
    save = small_file_system / "checkpoints"
    command = ["-m", "megatron_elaswave.run_megatron_lm", str(TRAINING_SCRIPT),
               *megatron_lm_flags(1, 2, MEGATRON_LM_ITERS), "--untie-embeddings-and-output-weights",
               "--elastic", "--save", str(save), "--save-interval", "2"]
    _, (iteration, reason, resume) = run_until_the_disk_fills(
        command, save, small_file_system, tmp_path / "job.log", 240)
    assert int(iteration) >= 4 and "No space left on device" in reason
    saved, directory = latest_complete(str(save))
    assert saved == 2 and is_complete(Path(directory))
    assert resume.startswith(f"the last complete checkpoint is iteration 2 in {directory}")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_finaliser_killed_once_its_save_is_committing_has_its_commit_completed(
        text_data, tmp_path):  # noqa: F811
    """Rank 0, the finaliser, is SIGKILLed once the checkpoint of iteration 4 is indexed and
    marked committing: rank 1 completes the commit, the job trains to the end and exits 0."""
    save = tmp_path / "checkpoints"
    command = [PRETRAIN, *flags(text_data), "--save", str(save), "--save-interval", "4",
               "--elastic-inject-failure", "rank=0,iteration=4,phase=commit"]
    with launch(command, 4, master_port=free_port(), log_path=tmp_path / "job.log") as job:
        returncode, output = job.wait(240)
    assert returncode == 0, output[-4000:]
    assert re.search(r"saved checkpoint at iteration 4 to \S+ \(its commit completed for "
                     r"rank 0, which failed\)", output), output[-4000:]
    assert latest_complete(str(save))[0] == TRAIN_ITERS
    assert not [entry for entry in os.listdir(save) if entry.startswith("iter_0000004.")]
