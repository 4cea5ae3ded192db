"""The metrics file: JSON lines, one object per event, written by one rank.

Record shapes (``event`` names the kind) are fixed by the project's interface: ``iteration``,
``recovery``, ``rebalance`` and ``grow``. Every line is flushed when written, so a reader sees
each record as soon as it is complete, even if the job dies afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Iterable, TextIO

ITERATION_FIELDS = (
    "iteration", "lm_loss", "global_batch_size", "consumed_samples", "samples_digest",
    "world_size", "layout", "step_time_s", "cpu_time_s", "grad_norm",
)


def samples_digest(sample_ids: Iterable[int]) -> str:
    """A hash of the ordered global sample ids of one step (-1 marks a missing or doubled one)."""
    hasher = hashlib.sha256()
    for sample_id in sample_ids:
        hasher.update(int(sample_id).to_bytes(8, "little", signed=True))
    return hasher.hexdigest()[:16]


class MetricsWriter:
    """Appends records to a JSON-lines file; a writer with no path writes nothing."""

    def __init__(self, path: str | None) -> None:
        self._file: TextIO | None = None
        self.path = path
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str, event: str | None = None) -> list[dict]:
    """All records of a metrics file, optionally only those of one ``event``."""
    with open(path, encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return [r for r in records if event is None or r["event"] == event]


class MetricsFollower:
    """The records of a metrics file that another process is still writing, read as it grows:
    each :meth:`poll` parses only the lines appended since the previous one, so following a long
    run costs what it writes, not what it has written. A line still being written is left for
    the next poll."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._path = os.fspath(path)
        self._offset = 0
        self.records: list[dict] = []
        """Every complete record read so far, in order."""

    def poll(self) -> list[dict]:
        """:attr:`records`, with those appended since the last call (none while the file does
        not exist)."""
        try:
            with open(self._path, "rb") as handle:
                handle.seek(self._offset)
                appended = handle.read()
        except FileNotFoundError:
            return self.records
        complete = appended[: appended.rfind(b"\n") + 1]
        self._offset += len(complete)
        self.records += [json.loads(line) for line in complete.splitlines() if line.strip()]
        return self.records
