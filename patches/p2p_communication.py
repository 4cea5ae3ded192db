"""Pipeline point-to-point operations on the pipeline's own group, waited for with its op timeout,
each send holding its buffer until it is waited for.

Checked against megatron-core 0.16.1 and 0.19.2
(``megatron/core/pipeline_parallel/p2p_communication.py``, and ``schedules.py``'s order of a
send and the free of its tensor) and torch 2.13.

A gloo send or receive that is waited for without a timeout waits as long as its group's
connections were given when the group was created: torch's ``ProcessGroup.set_timeout`` changes
the timeout of the collectives but not that of point-to-point operations (measured with torch
2.13: a group created with 1 s and set to 10 s fails a receive after 1 s). The elastic runtime
creates the groups of a recovery with a short creation timeout, so that a member dying in the
middle cannot hold the others long, and then sets their op timeout; megatron-core's pipeline
functions ``_batched_p2p_ops`` and ``_p2p_ops`` return requests that the schedules wait for
with ``req.wait()``. Wrapped here, their requests wait with the group's op timeout instead.
Other backends are left as they are.

Unbatched operations (``batch_p2p_comm=False``, which the interleaved schedule needs on gloo
with two stages) between the two ranks of a two-stage pipeline go half over the default group
in megatron-core, to overlap the two directions on NCCL. An elastic job's default group is the
first generation's, with the ranks that failed since (a survivor was seen waiting on it for a
dead peer until the op timeout), not a group the recovery builds. Here both directions use the
pipeline group, posted in megatron-core's order (the even rank sends first), which pairs each
send with its receive on every backend.

The interleaved schedule of megatron-core 0.16.1 with ``overlap_p2p_comm`` (Megatron-LM's
default with virtual pipeline stages) frees an activation (``deallocate_output_tensor``) right
after posting its send, before waiting for it: the send then reads freed memory, and the next
stage receives whatever was allocated there since (measured on gloo: every such send corrupted;
Megatron-LM's loop saw a NaN loss in its second iteration). 0.19 waits for the send first. Here
an unbatched send's request holds the sent tensor's storage until it is waited for, which makes
the early free harmless on every backend and keeps the overlap; a batched send is waited for
where it is posted.
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


class _Request:
    """A point-to-point request whose ``wait()`` waits at most ``timeout`` (``None``: as its
    backend does) and which keeps ``buffer`` (a send's storage) alive until then."""

    def __init__(self, request: dist.Work, timeout: timedelta | None,
                 buffer: torch.UntypedStorage | None = None) -> None:
        self._request = request
        self._timeout = timeout
        self._buffer = buffer

    def wait(self, *args: Any) -> Any:
        result = self._request.wait(*args) if args else _wait(self._request, self._timeout)
        self._buffer = None
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def _on_pipeline_group(p2p_ops):
    @functools.wraps(p2p_ops)
    def p2p_ops_on_pipeline_group(*, tensor_send_prev, tensor_recv_prev, tensor_send_next,
                                  tensor_recv_next, group: dist.ProcessGroup,
                                  prev_pipeline_rank: int, next_pipeline_rank: int):
        if group.size() != 2:  # megatron-core uses the pipeline group alone
            return p2p_ops(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,
                           tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next,
                           group=group, prev_pipeline_rank=prev_pipeline_rank,
                           next_pipeline_rank=next_pipeline_rank)
        sends = {"send_next": (tensor_send_next, next_pipeline_rank),
                 "send_prev": (tensor_send_prev, prev_pipeline_rank)}
        receives = {"recv_prev": (tensor_recv_prev, prev_pipeline_rank),
                    "recv_next": (tensor_recv_next, next_pipeline_rank)}
        if group.rank() % 2 == 0:
            order = ("send_next", "recv_prev", "send_prev", "recv_next")
        else:
            order = ("recv_prev", "send_next", "recv_next", "send_prev")
        requests = {}
        for name in order:
            if name in sends and sends[name][0] is not None:
                requests[name] = dist.isend(tensor=sends[name][0], dst=sends[name][1], group=group)
            elif name in receives and receives[name][0] is not None:
                requests[name] = dist.irecv(tensor=receives[name][0], src=receives[name][1],
                                            group=group)
        return requests

    return p2p_ops_on_pipeline_group


def _bounded_holding_sends(p2p_ops):
    @functools.wraps(p2p_ops)
    def p2p_ops_bounded_holding_sends(*args, group: dist.ProcessGroup, **kwargs):
        requests = p2p_ops(*args, group=group, **kwargs)
        timeout = op_timeout(group)
        if isinstance(requests, dict):  # unbatched: named, and waited for by the schedule
            sent = {"send_next": kwargs.get("tensor_send_next"),
                    "send_prev": kwargs.get("tensor_send_prev")}
            return {name: _Request(request, timeout, _storage(sent.get(name)))
                    for name, request in requests.items()}
        if timeout is None:
            return requests
        return [_Request(request, timeout) for request in requests]

    return p2p_ops_bounded_holding_sends


def _storage(tensor: torch.Tensor | None) -> torch.UntypedStorage | None:
    return None if tensor is None else tensor.untyped_storage()


def register(registry: PatchRegistry) -> None:
    registry.register_wrapper(BATCHED, _bounded_holding_sends)
    registry.register_wrapper(UNBATCHED, _on_pipeline_group)
    registry.register_wrapper(UNBATCHED, _bounded_holding_sends)
