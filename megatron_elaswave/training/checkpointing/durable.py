"""Durable checkpoints of an elastic job, written in the background from the per-step snapshots.

With ``--save`` (and ``--save-interval``) every rank that holds a stage writes, at the end of
each saved iteration, the state its own snapshot of that iteration holds: the fp32 main
parameters and Adam moments of its ZeRO shard, already in host memory and checksummed. Nothing is
copied from the device for it and no process group is used: the step goes on while a thread of
the rank writes. A save goes as follows (:class:`DurableCheckpoints`):

1. At the step boundary each rank that holds a stage pins its snapshot of the iteration (its
   payload is not reused while it is written; :meth:`~megatron_elaswave.runtime.snapshot.SnapshotStore.pin`)
   and hands a :class:`SaveRequest` to its writer thread: the snapshot, where each element of it
   goes in the checkpoint (from the live model's ``sharded_state_dict``, which names tensors
   the same way in every layout) and, on the lowest of those ranks (the *finaliser*), what is not
   sharded (``common.pt``: the iteration, the LR schedule, the optimizer's parameter groups, the
   arguments Megatron-LM checks).
2. The writer checks the snapshot's checksums, then writes the main parameters (cast to the
   model's dtype: the weights Megatron writes), ``param``, ``exp_avg`` and ``exp_avg_sq`` of its
   shard as the boxes that the shard's flat ranges cover, into its own directory
   ``rank<r>`` of ``<save>/iter_<iteration>.partial-g<generation>``; it then says so in the store.
3. The finaliser waits for every writer, merges their indexes into one, checks that every tensor
   is covered exactly, writes the index and reads it back as a loader does, writes
   ``common.pt`` and ``metadata.json``, renames the directory to
   ``<save>/iter_<iteration>`` and only then writes ``latest_checkpointed_iteration.txt``
   (atomically, by rename). A checkpoint the tracker names is therefore always complete.

Every save resolves, whatever process dies when:

* When a writer *process* fails before its part is written, the survivors abandon the save after
  their recovery (:meth:`DurableCheckpoints.abandon_saves_of`): its outcome key in the store
  becomes ``abandoned`` unless the finaliser already took it to ``committing``, after which every
  part is on storage and the save completes, by the finaliser or, if the finaliser is the rank
  that failed, by the lowest surviving writer. At the end of the job, :meth:`~DurableCheckpoints.finish`
  does the same for a writer that dies then, so that no survivor waits on a save nobody will
  finish.
* When a *write* fails (storage full, a path that cannot be created, a bug), it is tried again
  after a transient storage error (``EIO``, ``EAGAIN``, ``ESTALE``...; :attr:`DurableConfig.retries`
  times), else the save is abandoned and its error recorded in the store. The job then stops in
  one line naming the error and the last complete checkpoint
  (:attr:`DurableCheckpoints.failed`, :meth:`~DurableCheckpoints.first_failure`), or trains on
  with a warning under ``--elastic-save-failures warn``; either way a final or preemption save
  that was not written ends the job with a non-zero status.

An abandoned save leaves a ``.partial`` directory, which the next committed save removes; the
tracker still names the last complete checkpoint. Commits of different saves are serialised by a
lock in the store, and the tracker only moves forward over the checkpoints of this job (a run
before it that used the same ``--save`` is overwritten, as Megatron does).

Store keys (:mod:`megatron_elaswave.launch.keys`): ``rt/ckpt/<iteration>-g<generation>/part/<rank>`` (a
writer's part is on storage), ``rt/ckpt/<iteration>-g<generation>/outcome`` (``committing``,
``committed`` or ``abandoned``, first written with ``compare_set``),
``rt/ckpt/<iteration>-g<generation>/error`` (why a write failed), ``rt/ckpt/failed`` (the first
save of the job that failed) and ``rt/ckpt/lock`` (the save that commits, empty when none).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import queue
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megatron_elaswave.errors import first_line
from megatron_elaswave.launch.keys import (
    ABANDONED,
    CHECKPOINT_FAILED_KEY,
    CHECKPOINT_LATEST_KEY,
    CHECKPOINT_LOCK_KEY,
    COMMITTED,
    COMMITTING,
    checkpoint_key,
    committed_iteration_key,
)
from megatron_elaswave.launch.store import read_if_set
from megatron_elaswave.patches.dist_checkpointing import (
    Box,
    Segment,
    merge_parts,
    optimizer_state_prefix,
    segment_boxes,
    write_common,
    write_expected,
    write_index,
    write_part,
)
from megatron_elaswave.runtime.snapshot import PendingSnapshot, SnapshotStore
from megatron_elaswave.waiting import wait_until

from .checkpoint import CheckpointError, checkpoint_dir, resume_hint, write_tracker
from ..step.loop import log
from ..step.migration import BUFFER, Piece

_POLL_S = 0.05
"""The longest pause between two looks at the store while a save waits for its writers, the
commit lock or the job's verdict."""

TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ESTALE,
                              errno.ETIMEDOUT, errno.ENOLCK, errno.ECONNRESET})
"""Storage errors that a write may not meet again (a network file system's hiccup): the write
is retried. Anything else (no space, no permission, a path under a file) fails the save."""

MAX_IN_FLIGHT = 2
"""Saves one rank writes or holds queued at once (each pins a snapshot copy): one written, one
waiting; a third waits at the step boundary."""

_T = TypeVar("_T")


class SaveFailed(RuntimeError):
    """A durable checkpoint could not be written: the job stops (or, ending, exits non-zero)."""


@dataclass
class SaveName:
    """Which save: what every writer knows of it until it is resolved."""

    root: str
    """``--save``."""
    iteration: int
    generation: int
    """The layout version the snapshots were taken in; with the iteration, names the save."""
    writers: tuple[int, ...]
    """Launch ranks that write a part: every rank that held a stage."""

    @property
    def save_id(self) -> str:
        return f"{self.iteration}-g{self.generation}"

    @property
    def directory(self) -> str:
        """Where the parts are written until the save commits."""
        return f"{checkpoint_dir(self.root, self.iteration)}.partial-g{self.generation}"

    @property
    def finaliser(self) -> int:
        return min(self.writers)

    def key(self, what: str) -> str:
        return checkpoint_key(self.save_id, what)


@dataclass
class SaveRequest(SaveName):
    """One save, as one of its writers takes part in it (module docstring)."""

    snapshot: PendingSnapshot
    """This rank's snapshot of ``iteration``, pinned until the request is done."""
    pieces: list[tuple[str, tuple[Segment, ...]]]
    """Each snapshot tensor this rank writes (by key, :class:`~megatron_elaswave.training.step.migration.Piece`) and where its
    parameter's elements go."""
    objects: dict[str, Any]
    """``ShardedObject`` data this rank writes, by unique key."""
    common: dict | None = None
    """``common.pt``, on the finaliser (the lowest writer) only."""
    with_optimizer: bool = True
    """Whether the optimizer's state is written (not with ``--no-save-optim``)."""
    expected: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Every tensor this rank's stage puts in the checkpoint, whoever writes its elements, by
    key with its global shape: the finaliser checks that the parts cover each exactly."""
    requested_at: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> SaveName:
        return SaveName(self.root, self.iteration, self.generation, self.writers)

    def boxes(self) -> list[Box]:
        """What this rank writes, from its snapshot: the model weights (the main parameters
        cast to the model's dtype) and the three optimizer tensors of every piece (without
        :attr:`with_optimizer`, none), and the trained buffers it writes (the routers' expert
        biases)."""
        tensors = self.snapshot.snapshot.tensors
        boxes = []
        for key, segments in self.pieces:
            piece = Piece.parse(key)
            values = tensors[key].reshape(-1)
            for segment in segments:
                if piece.kind == BUFFER:  # a trained buffer: the model's own, no optimizer state
                    boxes += segment_boxes(segment, piece.start, values,
                                           dtype=segment.placement.dtype)
                    continue
                if self.with_optimizer:
                    boxes += segment_boxes(segment, piece.start, values,
                                           key_prefix=optimizer_state_prefix(piece.kind))
                if piece.kind == "param":
                    boxes += segment_boxes(segment, piece.start, values,
                                           dtype=segment.placement.dtype)
        return boxes


def expected_tensors(segments: dict[int, tuple[Segment, ...]],
                     pieces: list[tuple[str, tuple[Segment, ...]]],
                     with_optimizer: bool = True) -> dict[str, tuple[int, ...]]:
    """What a rank's stage puts in the checkpoint (:attr:`SaveRequest.expected`): the weights of
    every parameter and trained buffer it holds (``segments``), and (``with_optimizer``) the
    optimizer's tensors of every parameter of which it owns a piece (``pieces``): a parameter's
    elements are each owned by one rank of its data-parallel group, so their union names them
    all."""
    expected = {segment.placement.key: segment.placement.global_shape
                for held in segments.values() for segment in held}
    for key, held in pieces:
        kind = Piece.parse(key).kind
        if kind != BUFFER and with_optimizer:
            expected.update((optimizer_state_prefix(kind) + segment.placement.key,
                             segment.placement.global_shape) for segment in held)
    return expected


@dataclass(frozen=True)
class DurableConfig:
    """How an elastic job's durable checkpoints are written."""

    rank: int
    """This worker's launch rank."""
    timeout_s: float
    """How long the finaliser waits for every writer's part, and for the commit lock, before
    it abandons the save."""
    retries: int = 2
    """How often a write that met a transient storage error (:data:`TRANSIENT_ERRNOS`) is tried
    again before the save fails."""
    retry_backoff_s: float = 1.0
    """The wait before the first retry; each further one waits twice as long."""


@dataclass(frozen=True)
class SaveFailure:
    """A save that could not be written."""

    iteration: int
    reason: str
    """``rank <r>: <error class>: <message>``, from the first rank that failed it."""

    def line(self, root: str) -> str:
        return (f"the checkpoint of iteration {self.iteration} could not be written "
                f"({self.reason}); {resume_hint(root)}")


class DurableCheckpoints:
    """This rank's writer of durable checkpoints: a thread that takes :class:`SaveRequest`\\ s in
    order (module docstring). ``store_factory`` makes the thread its own client of the job
    store; ``store`` is the training thread's, ``snapshots`` the store of the snapshots the
    requests pin; ``dead()`` the launch ranks known dead (a writer among them never finishes its
    part); ``inject(phase, iteration)`` runs between a part's write and its report (phase
    ``checkpoint``) and between a save's ``committing`` and its rename (``commit``), for fault
    injection."""

    def __init__(self, config: DurableConfig, store, store_factory: Callable[[], Any],
                 snapshots: SnapshotStore, dead: Callable[[], Collection[int]] = frozenset,
                 inject: Callable[[str, int], Any] = lambda phase, iteration: None) -> None:
        self.config = config
        self.store = store
        self._store_factory = store_factory
        self._snapshots = snapshots
        self._dead = dead
        self._inject = inject
        self._queue: queue.Queue[SaveRequest | None] = queue.Queue()
        self._pending: dict[str, SaveRequest] = {}
        """Requests queued or being written, by save id."""
        self._unresolved: dict[str, SaveName] = {}
        """Each save this rank took part in whose outcome it has not seen committed or
        abandoned, by save id."""
        self._failures: dict[str, SaveFailure] = {}
        """The saves this rank took part in that could not be written, by save id."""
        self._outcomes: dict[str, str] = {}
        """The outcome of each save this rank took part in, once resolved."""
        self._last: str | None = None
        """The save this rank submitted last."""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    # -- the training thread ------------------------------------------------------------------

    def submit(self, request: SaveRequest) -> None:
        """Queue ``request``; its snapshot is pinned until it is done. Waits first while
        :data:`MAX_IN_FLIGHT` saves are written or queued here: each pins a snapshot copy in host
        memory, which storage slower than the save interval would otherwise grow without bound
        (a save whose writer is dead does not hold it up)."""
        while True:
            with self._lock:
                in_flight = [request.name for request in self._pending.values()]
            if len(in_flight) < MAX_IN_FLIGHT:
                break
            self._resolve_saves_of_the_dead(in_flight)
            with self._idle:
                self._idle.wait(_POLL_S)
        self._snapshots.pin(request.snapshot.snapshot)
        with self._lock:
            self._pending[request.save_id] = request
            self._unresolved[request.save_id] = request.name
            self._last = request.save_id
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elaswave-checkpoint-writer",
                                            daemon=True)
            self._thread.start()
        self._queue.put(request)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Return once every request submitted so far is done (written, and committed or
        abandoned on the finaliser); ``False`` if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def finish(self, timeout_s: float) -> None:
        """Return once every save this rank took part in is written here and committed or
        abandoned by the job, or after ``timeout_s``: what there is to resume from is then
        known. A save whose writer is dead (:meth:`abandon_saves_of`) does not hold it up."""
        def resolved() -> bool:
            with self._lock:
                unresolved = list(self._unresolved.values())
            self._resolve_saves_of_the_dead(unresolved)
            with self._lock:
                return not self._pending and not self._unresolved

        wait_until(resolved, timeout_s, max_pause_s=_POLL_S)

    def _resolve_saves_of_the_dead(self, names: list[SaveName]) -> None:
        """Note each of ``names`` the job has resolved, and resolve each that a writer known
        dead (``dead()``) holds up."""
        dead = frozenset(self._dead())
        for name in names:
            failed = dead.intersection(name.writers)
            if not self._resolved(name.save_id, self.store) and failed:
                self._resolve_failed_writers(self.store, name, failed)

    @property
    def failed(self) -> SaveFailure | None:
        """The first save this rank took part in that could not be written, as far as it knows."""
        with self._lock:
            return next(iter(self._failures.values()), None)

    @property
    def failing(self) -> SaveFailure | None:
        """The latest save this rank took part in that could not be written, unless a later one
        was committed since, as far as this rank knows."""
        with self._lock:
            if not self._failures:
                return None
            failure = max(self._failures.values(), key=lambda failure: failure.iteration)
            committed = [_iteration_of(save_id)
                         for save_id, outcome in self._outcomes.items() if outcome == COMMITTED]
        return None if committed and max(committed) > failure.iteration else failure

    def first_failure(self) -> SaveFailure | None:
        """The first save of the job that could not be written, as the job store says (the same
        on every rank)."""
        if not self.store.check([CHECKPOINT_FAILED_KEY]):
            return self.failed
        save_id = self.store.get(CHECKPOINT_FAILED_KEY).decode()
        reason = self.store.get(checkpoint_key(save_id, "error")).decode()
        return SaveFailure(_iteration_of(save_id), reason)

    def last_save_failure(self, iteration: int) -> SaveFailure | None:
        """After :meth:`finish`: why this rank's save of ``iteration`` (the final or preemption
        save) is not committed, or ``None`` if it is, or if the last save this rank took part in
        is of another iteration (a rank left without a stage writes none)."""
        with self._lock:
            save_id = self._last
        if save_id is None or _iteration_of(save_id) != iteration:
            return None
        self._resolved(save_id, self.store)
        with self._lock:
            outcome = self._outcomes.get(save_id)
            failure = self._failures.get(save_id)
        if outcome == COMMITTED:
            return None
        error = read_if_set(self.store, checkpoint_key(save_id, "error"))
        if error is not None:  # the first rank that failed it says, on every rank
            return SaveFailure(iteration, error.decode())
        if failure is not None:
            return failure
        return SaveFailure(iteration, "a rank that wrote it failed" if outcome == ABANDONED
                           else f"not committed within {self.config.timeout_s:g} s")

    def _resolved(self, save_id: str, store) -> bool:
        """Whether the job committed or abandoned ``save_id`` (then it is forgotten here, and
        why it failed remembered)."""
        outcome = read_if_set(store, checkpoint_key(save_id, "outcome"))
        outcome = None if outcome is None else outcome.decode()
        if outcome not in (COMMITTED, ABANDONED):
            return False
        error = read_if_set(store, checkpoint_key(save_id, "error")) if outcome == ABANDONED \
            else None
        reason = None if error is None else error.decode()
        with self._lock:
            name = self._unresolved.pop(save_id, None)
            self._outcomes[save_id] = outcome
            if reason is not None and save_id not in self._failures and name is not None:
                self._failures[save_id] = SaveFailure(name.iteration, reason)
        return True

    def abandon_saves_of(self, failed: set[int] | frozenset[int]) -> None:
        """After a recovery from the failure of ``failed``: abandon every save this rank took
        part in that one of them writes and that is not resolved yet, unless its finaliser
        already commits it (then every part is on storage: the lowest surviving writer completes
        the commit of a finaliser among ``failed``). A commit lock a failed finaliser held is
        released."""
        with self._lock:
            unresolved = dict(self._unresolved)
        for save_id, name in unresolved.items():
            if not failed.isdisjoint(name.writers) and not self._resolved(save_id, self.store):
                self._resolve_failed_writers(self.store, name, failed)

    def _resolve_failed_writers(self, store, name: SaveName, failed: Collection[int]) -> None:
        """Resolve ``name``, some of whose writers (``failed``) are gone (:meth:`abandon_saves_of`)."""
        outcome = store.compare_set(name.key("outcome"), "", ABANDONED).decode()
        if name.finaliser in failed:
            if outcome == COMMITTING:
                survivors = [writer for writer in name.writers if writer not in failed]
                if survivors and self.config.rank == min(survivors):
                    self._commit_for(store, name, name.finaliser)
            else:
                store.compare_set(CHECKPOINT_LOCK_KEY, name.save_id, "")
        self._resolved(name.save_id, store)

    def close(self) -> None:
        """Stop the thread once the requests queued are done."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    # -- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        store = self._store_factory()
        while (request := self._queue.get()) is not None:
            try:
                self._write(store, request)
            except BaseException as error:  # torch's CheckpointException is no Exception
                self._fail(store, request.name, error)
            finally:
                self._snapshots.unpin(request.snapshot.snapshot)
                with self._idle:
                    del self._pending[request.save_id]
                    self._idle.notify_all()
            with self._lock:  # forget the saves the job has resolved since
                earlier = [save_id for save_id in self._unresolved if save_id not in self._pending]
            for save_id in earlier:
                self._resolved(save_id, store)

    def _fail(self, store, name: SaveName, error: BaseException) -> None:
        """Abandon ``name`` for ``error`` and say why in the store: the job stops (or warns) on
        it at its next step boundary."""
        error = _explained(_unwrapped(error), name.root)
        what = f"{type(error).__name__}: {first_line(error)}"
        reason = f"rank {self.config.rank}: {what}"
        with self._lock:
            self._failures.setdefault(name.save_id, SaveFailure(name.iteration, reason))
        log(f" rank {self.config.rank}: the checkpoint of iteration {name.iteration} could not "
            f"be written ({what})")
        try:
            store.compare_set(name.key("error"), "", reason)
            store.compare_set(CHECKPOINT_FAILED_KEY, "", name.save_id)
            if store.compare_set(name.key("outcome"), "", ABANDONED).decode() == COMMITTING:
                store.compare_set(name.key("outcome"), COMMITTING, ABANDONED)
            store.compare_set(CHECKPOINT_LOCK_KEY, name.save_id, "")
        except Exception:  # the store is gone: the failure monitor stops the job on it
            pass

    def _retrying(self, action: Callable[[], _T], what: str) -> _T:
        """``action()``, tried again after a transient storage error (:attr:`DurableConfig.retries`
        times, :attr:`DurableConfig.retry_backoff_s` and then twice as long each time); raises
        its last error, or at once one that is not transient."""
        wait = self.config.retry_backoff_s
        for attempt in itertools.count():
            try:
                return action()
            except BaseException as error:
                if attempt >= self.config.retries or not _transient(error):
                    raise
                log(f" rank {self.config.rank}: {what} failed ({type(error).__name__}: "
                    f"{first_line(error)}); trying again in {wait:g} s")
                time.sleep(wait)
                wait *= 2
        raise AssertionError("unreachable")

    def _abandoned(self, store, request: SaveName) -> bool:
        return read_if_set(store, request.key("outcome")) == ABANDONED.encode()

    def _write(self, store, request: SaveRequest) -> None:
        request.snapshot.wait()
        if self._abandoned(store, request):
            return
        request.snapshot.snapshot.verify()  # never write state that does not match its checksums
        part = f"rank{self.config.rank}"

        def write() -> None:
            shutil.rmtree(os.path.join(request.directory, part), ignore_errors=True)
            write_part(request.directory, part, request.boxes(), request.objects)
            write_expected(request.directory, part, request.expected)

        self._retrying(write, f"writing the checkpoint of iteration {request.iteration}")
        self._inject("checkpoint", request.iteration)
        store.set(request.key(f"part/{self.config.rank}"), "")
        if self.config.rank == request.finaliser:
            self._finalise(store, request)

    def _finalise(self, store, request: SaveRequest) -> None:
        """Wait for every part, index them and commit (module docstring)."""
        parts = [request.key(f"part/{writer}") for writer in request.writers]
        deadline = time.monotonic() + self.config.timeout_s
        if not wait_until(lambda: store.check(parts) or self._abandoned(store, request),
                          self.config.timeout_s, max_pause_s=_POLL_S):
            raise TimeoutError(f"not every writer wrote its part within "
                               f"{self.config.timeout_s:g} s")
        if not store.check(parts):
            log(f" the checkpoint of iteration {request.iteration} is abandoned: a rank that "
                f"wrote it failed")
            shutil.rmtree(request.directory, ignore_errors=True)
            return

        def index() -> None:
            merged = merge_parts(request.directory,
                                 [f"rank{writer}" for writer in request.writers])
            if merged.gaps:
                raise RuntimeError(f"the parts do not add up: {'; '.join(merged.gaps[:3])}")
            write_common(request.directory, request.common)
            write_index(request.directory, merged)
            _remove_other_parts(request)
            _sync_directory(request.directory)

        self._retrying(index, f"indexing the checkpoint of iteration {request.iteration}")
        lock, held = request.save_id, False

        def locked_or_abandoned() -> bool:
            nonlocal held
            held = store.compare_set(CHECKPOINT_LOCK_KEY, "", lock).decode() == lock
            return held or self._abandoned(store, request)

        if not wait_until(locked_or_abandoned, deadline - time.monotonic(), max_pause_s=_POLL_S):
            raise TimeoutError("another checkpoint held the commit lock")
        if not held:  # abandoned while another save held the lock
            return
        if store.compare_set(request.key("outcome"), "", COMMITTING).decode() != COMMITTING:
            store.compare_set(CHECKPOINT_LOCK_KEY, lock, "")
            shutil.rmtree(request.directory, ignore_errors=True)
            return
        self._inject("commit", request.iteration)
        self._commit_for(store, request.name, requested_at=request.requested_at)

    def _commit_for(self, store, name: SaveName, failed_finaliser: int | None = None,
                    requested_at: float | None = None) -> None:
        """Move the checkpoint of ``name`` (indexed, ``committing``, its lock held) into place,
        for its finaliser (which asked for it at ``requested_at``) or for ``failed_finaliser``;
        the save is committed, or failed."""
        # What this job committed before, as opposed to a run that used the same --save.
        ours = store.check([committed_iteration_key(name.iteration)])
        latest = read_if_set(store, CHECKPOINT_LATEST_KEY)
        latest = None if latest is None else int(latest.decode())
        try:
            directory = self._retrying(
                lambda: _commit(name, keep_existing=ours,
                                move_tracker=latest is None or name.iteration >= latest),
                f"committing the checkpoint of iteration {name.iteration}")
        except BaseException as error:
            self._fail(store, name, error)
            return
        store.set(committed_iteration_key(name.iteration), "")
        store.set(CHECKPOINT_LATEST_KEY, str(max(name.iteration, latest or 0)))
        store.set(name.key("outcome"), COMMITTED)
        store.compare_set(CHECKPOINT_LOCK_KEY, name.save_id, "")
        for writer in name.writers:  # read by the finaliser only, which is done with them
            store.delete_key(name.key(f"part/{writer}"))
        _remove_abandoned_partials(name)
        how = (f"its commit completed for rank {failed_finaliser}, which failed"
               if failed_finaliser is not None else
               f"written in the background in {time.monotonic() - requested_at:.2f} s")
        log(f" saved checkpoint at iteration {name.iteration} to {directory} ({how})")


def check_save_directory_is_shared(save: str, group, *, rank: int, node: int, nodes: int,
                                   first_on_node: bool) -> None:
    """Raise :class:`~.checkpoint.CheckpointError` on every rank unless each node sees what the
    next one writes under ``save``: every node writes its ranks' parts of a durable checkpoint
    there, and one rank merges them, so a directory local to each node (or a relative path
    from different working directories) would leave every checkpoint incomplete. Collective over
    ``group`` (every rank of the job); the first rank of each node writes and reads one file."""
    if nodes <= 1:
        return
    # Not from torch's generator: a job with --save draws the same random numbers as without.
    token = torch.tensor([secrets.randbits(62) if rank == 0 else 0])
    dist.all_reduce(token, group=group)

    def probe(of_node: int) -> str:
        return os.path.join(save, f".elaswave-node{of_node}-{int(token)}")

    written = True
    if first_on_node:
        try:
            with open(probe(node), "w", encoding="utf-8"):
                pass
        except OSError:
            written = False  # said below by the next node, which cannot see it
    dist.barrier(group=group)
    blind = first_on_node and not os.path.exists(probe((node + 1) % nodes))
    reader = torch.tensor([node + 1 if blind else 0])
    dist.all_reduce(reader, op=dist.ReduceOp.MAX, group=group)
    if first_on_node and written:
        with contextlib.suppress(OSError):
            os.remove(probe(node))
    if int(reader):
        blind_node = int(reader) - 1
        raise CheckpointError(
            f"--save {save} is not shared between the nodes: node {blind_node} does not see "
            f"what node {(blind_node + 1) % nodes} wrote there; every node writes its part of "
            "each checkpoint: give --save a path on a file system all nodes share")


def _iteration_of(save_id: str) -> int:
    """The iteration of a save id (:attr:`SaveName.save_id`)."""
    return int(save_id.split("-g")[0])


def _unwrapped(error: BaseException) -> BaseException:
    """The error torch's ``CheckpointException`` wraps (its first rank's), else ``error``."""
    failures = getattr(error, "failures", None)  # rank -> (error, traceback)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, BaseException):
            return _unwrapped(first)
    return error


def _explained(error: BaseException, root: str) -> BaseException:
    """``error``, or the full file system under ``root`` that caused it: ``torch.save`` reports
    running out of space as an error of its zip writer (``unexpected pos 704 vs 598``) that
    names no cause."""
    if isinstance(error, OSError):
        return error
    try:
        full = os.statvfs(root).f_bavail == 0
    except OSError:
        return error
    if not full:
        return error
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({type(error).__name__}: "
                                 f"{first_line(error)})")


def _transient(error: BaseException) -> bool:
    """Whether ``error`` is, or wraps, a storage error a retry may not meet
    (:data:`TRANSIENT_ERRNOS`); torch's ``CheckpointException`` holds each rank's error."""
    seen, todo = set(), [error]
    while todo:
        current = todo.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in TRANSIENT_ERRNOS:
            return True
        failures = getattr(current, "failures", None)  # rank -> (error, traceback)
        if isinstance(failures, dict):
            todo += [failure[0] if isinstance(failure, tuple) else failure
                     for failure in failures.values()]
        todo += [current.__cause__, current.__context__]
    return False


def _remove_other_parts(request: SaveName) -> None:
    """Parts of an earlier attempt at the same save by ranks that do not write this one."""
    wanted = {f"rank{writer}" for writer in request.writers}
    for entry in os.listdir(request.directory):
        if entry.startswith("rank") and entry not in wanted:
            shutil.rmtree(os.path.join(request.directory, entry), ignore_errors=True)


def _commit(request: SaveName, *, keep_existing: bool, move_tracker: bool) -> str:
    """Rename the complete directory into place and, if ``move_tracker``, name it in the
    tracker. A checkpoint of the same iteration already in place is kept if ``keep_existing``
    (this job committed it: a save of an iteration run again after a rollback holds the same
    state), else replaced (a run before this one used the same ``--save``: as Megatron, the new
    run's checkpoint and tracker win). Done again after any step of it, it completes it (a
    finaliser that died in the middle)."""
    final = checkpoint_dir(request.root, request.iteration)
    if os.path.exists(request.directory):  # not renamed into place yet
        if os.path.exists(final):
            if keep_existing:
                shutil.rmtree(request.directory, ignore_errors=True)
                return final
            trash = f"{final}.replaced-g{request.generation}"
            os.rename(final, trash)
            os.rename(request.directory, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(request.directory, final)
        _sync_directory(request.root)
    if move_tracker:
        write_tracker(request.root, request.iteration)
    return final


def _remove_abandoned_partials(request: SaveName) -> None:
    """The ``.partial`` directories of the saves of earlier iterations: abandoned (the writers
    take saves in order, so none is still written) or left by a job that was killed."""
    prefix = "iter_"
    for entry in os.listdir(request.root):
        name, dot, rest = entry.partition(".")
        if (entry.startswith(prefix) and dot and rest.startswith(("partial-", "replaced-"))
                and name[len(prefix):].isdigit() and int(name[len(prefix):]) < request.iteration):
            shutil.rmtree(os.path.join(request.root, entry), ignore_errors=True)


def _sync_directory(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
