"""Noticing the job's alerts at the cost of one counter read per node and poll.

The writer of something every rank must read (a launcher recording a death, a monitor announcing
a failure or a heartbeat silence, a replacement asking to join) raises an alert after its write
(:func:`megatron_elaswave.launch.store.raise_alert`): it bumps the count ``rt/alerts``, one key whatever
the size of the job. Each node's launcher reads that count every 50 ms and relays it to its
workers in a local file (:class:`AlertRelay`; :data:`NODE_ALERTS_ENV` names it); an
:class:`AlertListener` of each rank reads the file every ``poll_interval_s`` and calls back when
the count moved. A rank learns of a death within two poll intervals, and a quiet job costs the
store one read of one key per node and poll. A listener without a launcher's file (a process not
started by ``elaswave-run``) reads the count in the store itself.

(The listener once waited in the store for a key of its own, which every alert then had to set
for every rank: two writes per rank and alert, and a wait that only its own key could end. A
blocking wait on one shared key cannot be ended by one listener alone, and a TCPStore wait that
times out logs two warnings, so the count is polled.)
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_elaswave.launch.keys import ALERT_COUNT_KEY

if TYPE_CHECKING:
    from torch.distributed import Store

    from megatron_elaswave.launch.guarded_store import GuardedStore

DEFAULT_POLL_INTERVAL_S = 0.05
NODE_ALERTS_ENV = "ELASWAVE_NODE_ALERTS"
"""The file in which a node's launcher keeps the alert count it last read from the store."""


def write_relayed_count(path: str, count: int) -> None:
    """What a launcher does after reading the alert count: readers see the old or the new count,
    never a partial write."""
    partial = f"{path}.partial"
    with open(partial, "w") as out:
        out.write(str(count))
    os.replace(partial, path)


class AlertListener:
    """Calls ``on_alert()`` on a thread of its own after the alerts of the job, from
    :meth:`start` until :meth:`stop`; alerts close together may make one call.

    Guarantees:

    * An alert raised after :meth:`start` returned is followed by a call within
      ``poll_interval_s`` (plus the launcher's relay, one store round trip and 50 ms, while it
      runs).
    * :meth:`stop` returns once the thread has ended: within a poll interval, or within
      ``stop_timeout_s`` if the store does not answer. A process that exits without stopping its
      listener stops it on the way out.
    * If the store's connection fails before :meth:`stop`, ``on_lost(error)`` is called once
      and the listener ends.
    """

    def __init__(self, store: Store, *, on_alert: Callable[[], None],
                 on_lost: Callable[[RuntimeError], None], stop_timeout_s: float, name: str,
                 poll_interval_s: float = DEFAULT_POLL_INTERVAL_S) -> None:
        """``store`` is cloned: the listener reads the count on a connection of its own, or in
        the file of :data:`NODE_ALERTS_ENV` when the launcher relays it."""
        self._store = store.clone()
        self._relayed = os.environ.get(NODE_ALERTS_ENV)
        self._stop_timeout_s = stop_timeout_s
        self._poll_interval_s = poll_interval_s
        self._on_alert = on_alert
        self._on_lost = on_lost
        self._seen = 0
        """The alert count last read."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._listen, name=name, daemon=True)

    def start(self) -> None:
        """Start listening (once): an alert raised after this returns is not missed."""
        if self._thread.is_alive() or self._stopping.is_set():
            return
        self._seen = self._store.add(ALERT_COUNT_KEY, 0)
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(self._stop_timeout_s)

    def _listen(self) -> None:
        try:
            while not self._stopping.wait(self._poll_interval_s):
                count = self._read_count()
                if count > self._seen:
                    self._seen = count
                    self._on_alert()
        except RuntimeError as error:
            if not self._stopping.is_set():
                self._on_lost(error)

    def _read_count(self) -> int:
        if self._relayed is None:
            return self._store.add(ALERT_COUNT_KEY, 0)
        try:
            with open(self._relayed) as relayed:
                return int(relayed.read())
        except (OSError, ValueError):  # not written yet
            return 0


class AlertRelay:
    """Hands the job's alert count to this node's workers in a file, which their alert
    listeners read instead of the store (:mod:`megatron_elaswave.launch.alerts`): one read per
    node and poll, not per worker."""

    def __init__(self, store: GuardedStore) -> None:
        self._store = store
        self._dir = tempfile.mkdtemp(prefix="elaswave-node-")
        self.path = os.path.join(self._dir, "alerts")
        """The file the workers read the count in (:data:`NODE_ALERTS_ENV`)."""
        self._seen = -1

    def relay(self) -> None:
        """Read the job's alert count, and write it to :attr:`path` if it moved."""
        count = self._store.call(lambda store: store.add(ALERT_COUNT_KEY, 0))
        if count is not None and count != self._seen:
            write_relayed_count(self.path, count)
            self._seen = count

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
