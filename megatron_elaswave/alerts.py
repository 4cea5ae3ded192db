"""Waiting for the job's alerts without polling the store.

The writer of something every rank must read (a launcher recording a death, a monitor announcing
a failure) raises an alert after its write (:func:`megatron_elaswave.store.raise_alert`): it bumps
the count ``rt/alerts`` to ``n``, then sets ``rt/alerts/<n>/<rank>`` for every launch rank in one
round trip. An :class:`AlertListener` of each rank waits in the store for its key of the next
alert, so that a quiet job costs the store nothing but the watchers' heartbeats.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from megatron_elaswave.keys import ALERT_COUNT_KEY, alert_key

if TYPE_CHECKING:
    from torch.distributed import Store

_NO_TIMEOUT = timedelta(days=365)


class AlertListener:
    """Calls ``on_alert()`` on a thread of its own after the alerts of the job, from
    :meth:`start` until :meth:`stop`; alerts close together may make one call.

    Guarantees:

    * An alert raised after :meth:`start` returned is followed by a call, as soon as the
      listener's key is set; if the alert's writer died between its count and its keys, the
      call comes with the next alert, whose writer sets them too.
    * :meth:`stop` returns once the thread has ended: at once, or within ``stop_timeout_s`` if
      the store does not answer. A process that exits without stopping its listener stops it on
      the way out (a wait in the store that ends while the interpreter finalizes aborts the
      process).
    * If the store's connection fails before :meth:`stop`, ``on_lost(error)`` is called once
      and the listener ends.
    """

    def __init__(self, store: Store, rank: int, *, on_alert: Callable[[], None],
                 on_lost: Callable[[RuntimeError], None], stop_timeout_s: float,
                 name: str) -> None:
        """``rank`` is this process's launch rank; ``store`` is cloned twice: one connection
        waits, the other ends the wait."""
        self._rank = rank
        self._waiting_store = store.clone()
        # A wait that timed out would log two warnings: it ends at its key or with the store.
        self._waiting_store.set_timeout(_NO_TIMEOUT)
        self._waking_store = store.clone()
        self._stop_timeout_s = stop_timeout_s
        self._on_alert = on_alert
        self._on_lost = on_lost
        self._seen = 0
        """The alert count last read: the listener waits for its key of the next alert."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._listen, name=name, daemon=True)

    def start(self) -> None:
        """Start listening (once): an alert raised after this returns is not missed."""
        if self._thread.is_alive() or self._stopping.is_set():
            return
        self._seen = self._waking_store.add(ALERT_COUNT_KEY, 0)
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._stopping.set()
        if not self._thread.is_alive():
            return
        try:  # the key the thread waits on is this rank's alone
            self._waking_store.set(alert_key(self._seen + 1, self._rank), "")
        except RuntimeError:
            pass  # the store is lost, and the wait with it
        self._thread.join(self._stop_timeout_s)

    def _listen(self) -> None:
        store = self._waiting_store
        try:
            while not self._stopping.is_set():
                key = alert_key(self._seen + 1, self._rank)
                store.wait([key])
                count = store.add(ALERT_COUNT_KEY, 0)
                if count > self._seen:
                    self._seen = count
                    self._on_alert()
                elif not self._stopping.is_set():
                    store.delete_key(key)  # set by a stopped listener of this rank, not an alert
        except RuntimeError as error:
            if not self._stopping.is_set():
                self._on_lost(error)
