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
   is covered exactly, writes ``common.pt`` and ``metadata.json``, renames the directory to
   ``<save>/iter_<iteration>`` and only then writes ``latest_checkpointed_iteration.txt``
   (atomically, by rename). A checkpoint the tracker names is therefore always complete.

When a writer fails before its part is written, the survivors abandon the save after their
recovery (:meth:`DurableCheckpoints.abandon_saves_of`): its outcome key in the store becomes
``abandoned`` unless the finaliser already took it to ``committing``, after which every part is on
storage and the save completes. An abandoned save leaves a ``.partial`` directory, which the next
committed save removes; the tracker still names the last complete checkpoint. Commits of
different saves are serialised by a lock in the store, and the tracker only moves forward.

Store keys (:mod:`megatron_elaswave.launch.keys`): ``rt/ckpt/<iteration>-g<generation>/part/<rank>`` (a
writer's part is on storage), ``rt/ckpt/<iteration>-g<generation>/outcome`` (``committing``,
``committed`` or ``abandoned``, first written with ``compare_set``) and ``rt/ckpt/lock`` (the save
that commits, empty when none).
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_elaswave.launch.keys import CHECKPOINT_LOCK_KEY, checkpoint_key
from megatron_elaswave.patches.dist_checkpointing import (
    Box,
    Segment,
    merge_parts,
    optimizer_state_prefix,
    segment_boxes,
    write_common,
    write_index,
    write_part,
)
from megatron_elaswave.runtime.snapshot import PendingSnapshot, SnapshotStore

from .checkpoint import checkpoint_dir, latest_complete, write_tracker
from .loop import log
from .migration import BUFFER, Piece

ABANDONED = "abandoned"
COMMITTING = "committing"
COMMITTED = "committed"

_POLL_S = 0.05


@dataclass
class SaveRequest:
    """One save, as one of its writers takes part in it (module docstring)."""

    root: str
    """``--save``."""
    iteration: int
    generation: int
    """The layout version the snapshots were taken in; with the iteration, names the save."""
    writers: tuple[int, ...]
    """Launch ranks that write a part: every rank that held a stage."""
    snapshot: PendingSnapshot
    """This rank's snapshot of ``iteration``, pinned until the request is done."""
    pieces: list[tuple[str, tuple[Segment, ...]]]
    """Each snapshot tensor this rank writes (by key, :class:`~.migration.Piece`) and where its
    parameter's elements go."""
    objects: dict[str, Any]
    """``ShardedObject`` data this rank writes, by unique key."""
    common: dict | None = None
    """``common.pt``, on the finaliser (the lowest writer) only."""
    requested_at: float = field(default_factory=time.monotonic)

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

    def boxes(self) -> list[Box]:
        """What this rank writes, from its snapshot: the model weights (the main parameters
        cast to the model's dtype) and the three optimizer tensors of every piece, and the
        trained buffers it writes (the routers' expert biases)."""
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
                boxes += segment_boxes(segment, piece.start, values,
                                       key_prefix=optimizer_state_prefix(piece.kind))
                if piece.kind == "param":
                    boxes += segment_boxes(segment, piece.start, values,
                                           dtype=segment.placement.dtype)
        return boxes


@dataclass(frozen=True)
class DurableConfig:
    """How an elastic job's durable checkpoints are written."""

    rank: int
    """This worker's launch rank."""
    timeout_s: float
    """How long the finaliser waits for every writer's part, and for the commit lock, before
    it abandons the save."""


class DurableCheckpoints:
    """This rank's writer of durable checkpoints: a thread that takes :class:`SaveRequest`\\ s in
    order (module docstring). ``store_factory`` makes the thread its own client of the job
    store; ``store`` is the training thread's, ``snapshots`` the store of the snapshots the
    requests pin; ``before_publishing(iteration)`` runs between a part's write and its report
    (fault injection)."""

    def __init__(self, config: DurableConfig, store, store_factory: Callable[[], Any],
                 snapshots: SnapshotStore,
                 before_publishing: Callable[[int], Any] = lambda iteration: None) -> None:
        self.config = config
        self.store = store
        self._store_factory = store_factory
        self._snapshots = snapshots
        self._before_publishing = before_publishing
        self._queue: queue.Queue[SaveRequest | None] = queue.Queue()
        self._pending: dict[str, SaveRequest] = {}
        """Requests queued or being written, by save id."""
        self._unresolved: dict[str, tuple[int, ...]] = {}
        """The writers of each save this rank took part in whose outcome it has not seen
        committed or abandoned, by save id."""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    # -- the training thread ------------------------------------------------------------------

    def submit(self, request: SaveRequest) -> None:
        """Queue ``request``; its snapshot is pinned until it is done."""
        self._snapshots.pin(request.snapshot.snapshot)
        with self._lock:
            self._pending[request.save_id] = request
            self._unresolved[request.save_id] = request.writers
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
        abandoned by the job (the finaliser commits; a failed writer's saves are abandoned), or
        after ``timeout_s``: what there is to resume from is then known."""
        deadline = time.monotonic() + timeout_s
        self.wait(timeout_s)
        with self._lock:
            unresolved = sorted(self._unresolved)
        for save_id in unresolved:
            while time.monotonic() < deadline and not self._resolved(save_id, self.store):
                time.sleep(_POLL_S)

    def _resolved(self, save_id: str, store) -> bool:
        """Whether the job committed or abandoned ``save_id`` (then it is forgotten here)."""
        key = checkpoint_key(save_id, "outcome")
        if not (store.check([key]) and store.get(key).decode() in (COMMITTED, ABANDONED)):
            return False
        with self._lock:
            self._unresolved.pop(save_id, None)
        return True

    def abandon_saves_of(self, failed: set[int] | frozenset[int]) -> None:
        """After a recovery from the failure of ``failed``: abandon every save this rank took
        part in that one of them writes and that is not resolved yet, unless its finaliser
        already commits it (then every part is on storage). A commit lock a failed finaliser
        held is released."""
        with self._lock:
            unresolved = dict(self._unresolved)
        for save_id, writers in unresolved.items():
            if failed.isdisjoint(writers) or self._resolved(save_id, self.store):
                continue
            self.store.compare_set(checkpoint_key(save_id, "outcome"), "", ABANDONED)
            if min(writers) in failed:
                self.store.compare_set(CHECKPOINT_LOCK_KEY, save_id, "")
            self._resolved(save_id, self.store)

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
            except Exception as error:  # the job goes on; this save is abandoned
                store.compare_set(checkpoint_key(request.save_id, "outcome"), "", ABANDONED)
                log(f" rank {self.config.rank}: the checkpoint of iteration {request.iteration} "
                    f"is abandoned ({type(error).__name__}: {error})")
            finally:
                self._snapshots.unpin(request.snapshot.snapshot)
                with self._idle:
                    del self._pending[request.save_id]
                    self._idle.notify_all()
            with self._lock:  # forget the saves the job has resolved since
                earlier = [save_id for save_id in self._unresolved if save_id not in self._pending]
            for save_id in earlier:
                self._resolved(save_id, store)

    def _abandoned(self, store, request: SaveRequest) -> bool:
        key = checkpoint_key(request.save_id, "outcome")
        return store.check([key]) and store.get(key).decode() == ABANDONED

    def _write(self, store, request: SaveRequest) -> None:
        request.snapshot.wait()
        if self._abandoned(store, request):
            return
        request.snapshot.snapshot.verify()  # never write state that does not match its checksums
        part = f"rank{self.config.rank}"
        shutil.rmtree(os.path.join(request.directory, part), ignore_errors=True)
        write_part(request.directory, part, request.boxes(), request.objects)
        self._before_publishing(request.iteration)
        store.set(checkpoint_key(request.save_id, f"part/{self.config.rank}"), "")
        if self.config.rank == request.finaliser:
            self._finalise(store, request)

    def _finalise(self, store, request: SaveRequest) -> None:
        """Wait for every part, index them and commit (module docstring)."""
        outcome_key = checkpoint_key(request.save_id, "outcome")
        parts = [checkpoint_key(request.save_id, f"part/{writer}") for writer in request.writers]
        deadline = time.monotonic() + self.config.timeout_s
        while not store.check(parts):
            if self._abandoned(store, request):
                log(f" the checkpoint of iteration {request.iteration} is abandoned: a rank "
                    f"that wrote it failed")
                shutil.rmtree(request.directory, ignore_errors=True)
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every writer wrote its part within "
                                   f"{self.config.timeout_s:g} s")
            time.sleep(_POLL_S)
        merged = merge_parts(request.directory, [f"rank{writer}" for writer in request.writers])
        if merged.gaps:
            raise RuntimeError(f"the parts do not cover {merged.gaps[:3]}")
        write_common(request.directory, request.common)
        write_index(request.directory, merged)
        _remove_other_parts(request)
        _sync_directory(request.directory)
        lock = request.save_id
        while store.compare_set(CHECKPOINT_LOCK_KEY, "", lock).decode() != lock:
            if self._abandoned(store, request):
                return
            if time.monotonic() > deadline:
                raise TimeoutError("another checkpoint held the commit lock")
            time.sleep(_POLL_S)
        try:
            if store.compare_set(outcome_key, "", COMMITTING).decode() != COMMITTING:
                shutil.rmtree(request.directory, ignore_errors=True)
                return
            directory = _commit(request)
            store.set(outcome_key, COMMITTED)
        finally:
            store.compare_set(CHECKPOINT_LOCK_KEY, request.save_id, "")
        _remove_abandoned_partials(request)
        log(f" saved checkpoint at iteration {request.iteration} to {directory} (written in the "
            f"background in {time.monotonic() - request.requested_at:.2f} s)")


def _remove_other_parts(request: SaveRequest) -> None:
    """Parts of an earlier attempt at the same save by ranks that do not write this one."""
    wanted = {f"rank{writer}" for writer in request.writers}
    for entry in os.listdir(request.directory):
        if entry.startswith("rank") and entry not in wanted:
            shutil.rmtree(os.path.join(request.directory, entry), ignore_errors=True)


def _commit(request: SaveRequest) -> str:
    """Rename the complete directory into place and move the tracker to it (never backwards).
    A checkpoint of the same iteration that the tracker names already is kept."""
    final = checkpoint_dir(request.root, request.iteration)
    latest = latest_complete(request.root)
    if os.path.exists(final):
        if latest is not None and latest[0] == request.iteration:
            shutil.rmtree(request.directory, ignore_errors=True)
            return final
        trash = f"{final}.replaced-g{request.generation}"
        os.rename(final, trash)
        os.rename(request.directory, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(request.directory, final)
    _sync_directory(request.root)
    if latest is None or request.iteration >= latest[0]:
        write_tracker(request.root, request.iteration)
    return final


def _remove_abandoned_partials(request: SaveRequest) -> None:
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
