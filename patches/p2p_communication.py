"""Pipeline point-to-point waits bounded by their group's op timeout, not its creation timeout.

Checked against megatron-core 0.16.1 and 0.19.2
(``megatron/core/pipeline_parallel/p2p_communication.py``) and torch 2.13.

A gloo send or receive that is waited for without a timeout waits as long as its group's
connections were given when the group was created: torch's ``ProcessGroup.set_timeout`` changes
the timeout of the collectives but not that of point-to-point operations (measured with torch
2.13: a group created with 1 s and set to 10 s fails a receive after 1 s). The elastic runtime
creates the groups of a recovery with a short creation timeout, so that a member dying in the
middle cannot hold the others long, and then sets their op timeout; megatron-core's pipeline
functions ``_batched_p2p_ops`` and ``_p2p_ops`` return requests that the schedules wait for
with ``req.wait()``. Wrapped here, their requests wait with the group's op timeout instead.
Other backends are left as they are.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .registry import PatchRegistry

BATCHED = "megatron.core.pipeline_parallel.p2p_communication._batched_p2p_ops"
UNBATCHED = "megatron.core.pipeline_parallel.p2p_communication._p2p_ops"


def op_timeout(group: dist.ProcessGroup | None) -> timedelta | None:
    """The op timeout of ``group``'s gloo backend (the default group when ``None``), or
    ``None`` where the group has none (another backend)."""
    try:
        group = group if group is not None else dist.distributed_c10d._get_default_group()
        return group._get_backend(torch.device("cpu")).options._timeout
    except (RuntimeError, ValueError, AttributeError):
        return None


def wait(request: dist.Work, group: dist.ProcessGroup | None) -> None:
    """Wait for a point-to-point ``request`` of ``group`` up to the group's op timeout."""
    _wait(request, op_timeout(group))


def _wait(request: dist.Work, timeout: timedelta | None) -> Any:
    return request.wait() if timeout is None else request.wait(timeout)


class _BoundedRequest:
    """A request whose ``wait()`` waits at most ``timeout``."""

    def __init__(self, request: dist.Work, timeout: timedelta) -> None:
        self._request = request
        self._timeout = timeout

    def wait(self, *args: Any) -> Any:
        return self._request.wait(*args) if args else _wait(self._request, self._timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def _bounded(p2p_ops):
    @functools.wraps(p2p_ops)
    def p2p_ops_bounded_by_op_timeout(*args, group: dist.ProcessGroup, **kwargs):
        requests = p2p_ops(*args, group=group, **kwargs)
        timeout = op_timeout(group)
        if timeout is None:
            return requests
        if isinstance(requests, dict):
            return {name: _BoundedRequest(r, timeout) for name, r in requests.items()}
        return [_BoundedRequest(r, timeout) for r in requests]

    return p2p_ops_bounded_by_op_timeout


def register(registry: PatchRegistry) -> None:
    registry.register_wrapper(BATCHED, _bounded)
    registry.register_wrapper(UNBATCHED, _bounded)
