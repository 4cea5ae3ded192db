"""A launcher's calls to the job store, which mark the store lost instead of raising."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from megatron_elaswave.errors import first_line

if TYPE_CHECKING:
    from torch.distributed import Store


_T = TypeVar("_T")


class GuardedStore:
    """The agent's calls to the job store. A call that fails marks the store lost (its host
    died, or the etcd cluster lost its quorum) instead of raising; every later call is skipped,
    and the supervision loop acts on :attr:`lost`."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.lost: str | None = None
        """Why the job store was lost, once it was."""

    def call(self, call: Callable[[Store], _T]) -> _T | None:
        """Run a store call; ``None`` once the store is gone."""
        if self.lost is not None:
            return None
        try:
            return call(self._store)
        except RuntimeError as error:  # torch.distributed.DistError
            self.lost = first_line(error)
            return None
