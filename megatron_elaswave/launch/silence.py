"""How long each peer's heartbeat has been silent, as seen by a watcher that may itself pause,
and whom each member watches.

A watcher (a worker's failure monitor, a node's launcher) reads its peers' heartbeat counters
every ``interval_s``; its peers are a few neighbours (:func:`ring_neighbours`), not everyone, so
that the reads of the whole job grow with its size, not with its square. A counter that has not
moved since the previous read adds the time between the two reads to that peer's silence, but
never more than ``2 * interval_s`` per read: the rest of a longer gap is the watcher's own
pause. While the watcher was stopped, starved of CPU or waiting on a stalled store, its peers'
beats could not reach it either, so it gives them a fresh window on its return rather than
declaring them all failed at once. A peer that really fell silent is still declared after
``timeout_s`` of the watcher's attentive time.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_elaswave.launch.etcd_store import EtcdStore

if TYPE_CHECKING:
    from torch.distributed import Store


class Heartbeat:
    """A member's heartbeat: a key that it alone writes, a new value at each beat, which its
    watchers compare with the value they read last (:class:`HeartbeatSilence`).

    On etcd a beat overwrites the key: one put, one revision, where an ``add`` would read first
    and keep a token key (:mod:`~megatron_elaswave.launch.etcd_store`); the values count up from
    the wall clock in microseconds, so that a replacement of the member never writes one its
    predecessor left. On a ``TCPStore`` a beat is an ``add``, one request as well, whose answer
    tells the beat at once that the store is gone (a ``set`` is not answered: the first one
    after the store's host died would seem to succeed, and the next would fail with a
    warning of c10d's)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._value = time.time_ns() // 1000

    def beat(self, store: Store) -> None:
        if isinstance(store, EtcdStore):
            self._value += 1
            store.set(self.key, str(self._value))
        else:
            store.add(self.key, 1)


@dataclass
class _Peer:
    counter: int | None = None
    """The counter last read; ``None`` before the first read."""
    silent_s: float = 0.0
    """Silence counted since the counter last moved."""


class HeartbeatSilence:
    """The heartbeat silence of a set of peers.

    Guarantees: a peer is reported only once its counter has stayed the same over reads whose
    gaps, each counted up to ``2 * interval_s``, add up to more than ``timeout_s``; so a pause of
    the watcher alone never gets a peer reported, and a watcher that reads every ``interval_s``
    reports a stopped peer within ``timeout_s + 2 * interval_s`` of its last beat.
    """

    def __init__(self, peers: Iterable[int], *, interval_s: float, timeout_s: float,
                 now: float) -> None:
        """Watch ``peers`` from ``now`` (a monotonic time); raises ``ValueError`` unless
        ``0 < interval_s`` and ``2 * interval_s <= timeout_s``."""
        if not 0 < 2 * interval_s <= timeout_s:
            raise ValueError(f"the heartbeat timeout ({timeout_s:g} s) must be at least twice "
                             f"the interval between reads ({interval_s:g} s), which is positive")
        self._max_counted_s = 2 * interval_s
        self._timeout_s = timeout_s
        self._peers = {peer: _Peer() for peer in peers}
        self._last_read = now

    @property
    def peers(self) -> list[int]:
        """The peers watched, in the order they were added."""
        return list(self._peers)

    def add(self, peer: int) -> None:
        """Watch ``peer`` too, from the next read on (its silence starts at zero)."""
        self._peers[peer] = _Peer()

    def forget(self, peer: int) -> None:
        """Stop watching ``peer`` (it finished, or was declared lost)."""
        self._peers.pop(peer, None)

    def read(self, counters: Mapping[int, int], now: float) -> dict[int, float]:
        """Record the counters read at ``now``; returns ``{peer: seconds of silence}`` for every
        peer silent for more than ``timeout_s``. Peers not watched are ignored; a watched peer
        missing from ``counters`` counts as silent."""
        counted = min(max(0.0, now - self._last_read), self._max_counted_s)
        self._last_read = now
        silent = {}
        for peer, state in self._peers.items():
            counter = counters.get(peer)
            if counter is not None and counter != state.counter:
                state.counter, state.silent_s = counter, 0.0
                continue
            state.silent_s += counted
            if state.silent_s > self._timeout_s:
                silent[peer] = state.silent_s
        return silent


def ring_neighbours(members: Sequence[int], me: int, count: int,
                    skip: Collection[int] = ()) -> list[int]:
    """The ``count`` members that follow ``me`` in ``members``' order, wrapping around, passing
    over those in ``skip`` (found failed already): whom ``me`` watches, so that every member is
    watched by ``count`` others while each reads ``count`` heartbeats, whatever the size of the
    job. ``me`` must be a member."""
    position = members.index(me)
    following = [*members[position + 1:], *members[:position]]
    return [member for member in following if member not in skip][:count]
