"""Where a generation's bulk traffic goes: a store that one of its members hosts.

On etcd every request is a round trip through a gateway to a quorum that writes it to disk, and a
recovery makes thousands of them: every member of every new process group publishes its address
and reads its peers', meets them at a barrier, and publishes what snapshot pieces it holds and
needs. None of it matters once the generation has formed. So the job store keeps what must
survive any node (membership, deaths, the agreement and its decision, the restore's outcome), and
the rest goes to a ``TCPStore`` that the generation's lowest member hosts, found through the job
store (:func:`~megatron_elaswave.launch.keys.generation_store_key`), as torchrun's c10d rendezvous
hosts its store on one of the nodes. On a ``TCPStore`` job store (node 0's launcher) the job
store serves as fast, and is used for every generation.

Only gloo groups rendezvous there: they use their store while they form and never after, so a
generation's store is closed two generations later (but that of a default group formed on it,
which ``new_group`` falls back to). NCCL communicators that form on first use would need it
later, when its host may be gone: device backends keep the job store for every generation.

A host that dies takes its generation with it: the death is recorded in the job store like any
other, a survivor's request to the dead store fails (:class:`HostedStore`) and the next generation
has another host. A host that is stopped (SIGSTOP) answers nothing: a request to it waits for the
store's timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from megatron_elaswave.launch.keys import generation_store_key
from megatron_elaswave.launch.store import (
    WaitInterrupted,
    read_when_set,
    serve_store,
    store_listener,
)

if TYPE_CHECKING:
    from torch.distributed import Store

KEPT_GENERATIONS = 2
"""How many generations' stores a rank keeps open: the current one, and the one before for a
member that is still leaving it."""


class HostedStore(dist.Store):
    """A client of the store that one member of ``generation`` hosts. A request that fails
    because the host is gone waits (at most ``timeout``) for ``failure`` to be set, the host's
    death detected, and raises :class:`~megatron_elaswave.launch.store.WaitInterrupted`, as a wait
    that a failure interrupts does: the caller recovers as from any failure."""

    def __init__(self, store: Store, generation: int, host: int,
                 failure: threading.Event | None, timeout: timedelta) -> None:
        super().__init__()
        self._store = store
        self._generation = generation
        self._host = host
        self._failure = failure
        self._timeout = timeout

    def _call(self, method: str, *args):
        try:
            return getattr(self._store, method)(*args)
        except dist.DistError as error:
            if self._failure is not None:
                self._failure.wait(self._timeout.total_seconds())
            raise WaitInterrupted(f"the store of generation {self._generation} went down with "
                                  f"its host, rank {self._host} ({error})") from None

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call("wait", keys, timeout or self._timeout)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._call("multi_get", list(keys))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self._call("multi_set", list(keys), list(values))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout


class GenerationStores:
    """One rank's stores of the generations it takes part in.

    ``host_address`` is this machine's address that the other members can reach, or ``None``
    to use ``job_store`` for every generation. ``timeout`` bounds connecting to a generation's
    store and every request to it.
    """

    def __init__(self, job_store: Store, rank: int, *, host_address: str | None,
                 timeout: timedelta) -> None:
        self._job_store = job_store
        self._rank = rank
        self._host_address = host_address
        self._timeout = timeout
        self._opened: dict[int, Store] = {}
        self._servers: dict[int, Store] = {}
        """The stores this rank hosts; they serve as long as the objects live."""

    def _host(self, generation: int) -> dist.TCPStore:
        """A new store of ``generation`` on a free port, hosted here; raises ``DistError`` when
        it cannot be."""
        try:
            listener = store_listener(self._host_address, 0)
        except OSError as error:
            raise dist.DistError(f"cannot host the store of generation {generation}: "
                                 f"{error.strerror}") from None
        return serve_store(listener, self._host_address, self._timeout)

    @property
    def hosted(self) -> bool:
        """Whether each generation has a store of its own, hosted by one of its members."""
        return self._host_address is not None

    def open(self, generation: int, members: Iterable[int],
             failure: threading.Event | None = None, *, keep: Iterable[int] = ()) -> Store:
        """The store of ``generation``, whose members (this rank among them) call this with the
        same ``members``; the same object for every call of a generation. The lowest member
        hosts it and the others connect. The stores of the generations before the last
        :data:`KEPT_GENERATIONS` are closed, but those of ``keep``. Raises
        :class:`~megatron_elaswave.launch.store.WaitInterrupted` as soon as ``failure`` is set
        while this rank waits for the host to publish its address, or after the timeout."""
        if self._host_address is None:
            return self._job_store
        if generation in self._opened:
            return self._opened[generation]
        host = min(members)
        key = generation_store_key(generation)
        if host == self._rank:
            server = self._host(generation)
            self._servers[generation] = server
            self._job_store.set(key, f"{self._host_address}:{server.port}")
            store = server
        else:
            [raw] = read_when_set(self._job_store, [key], self._timeout, failure)
            address, _, port = raw.decode().rpartition(":")
            try:
                store = dist.TCPStore(address, int(port), is_master=False, timeout=self._timeout)
            except dist.DistError as error:
                if failure is not None:
                    failure.wait(self._timeout.total_seconds())
                raise WaitInterrupted(f"the store of generation {generation} at {address}:{port} "
                                      f"is not reachable ({error})") from None
        opened = self._opened[generation] = HostedStore(store, generation, host, failure,
                                                        self._timeout)
        for old in sorted(set(self._opened) - set(keep))[:-KEPT_GENERATIONS]:  # servers stop
            del self._opened[old]
            self._servers.pop(old, None)
        return opened
