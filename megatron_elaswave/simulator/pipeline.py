"""Discrete-event simulation of one replica's pipeline for one step.

Each stage runs its ops in the order of :mod:`megatron_elaswave.simulator.schedule`, one at a time.
An op starts when its stage is free and its input is there: a forward needs the same micro-batch's
forward on the previous model chunk, a backward the next chunk's backward (or, on the last chunk,
its own forward). An input produced on another stage arrives ``send_s`` after that op ends. Sends
are asynchronous and links are not contended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_elaswave.simulator.schedule import stage_order


@dataclass(frozen=True)
class PipelineResult:
    """Timing of one step of one pipeline."""

    makespan_s: float
    """From the first op's start to the last op's end."""
    busy_s: tuple[float, ...]
    """Per stage: time spent computing."""

    @property
    def bubble_fraction(self) -> float:
        if self.makespan_s == 0:
            return 0.0
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.makespan_s)


def simulate_pipeline(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_microbatches: int,
    *,
    send_s: float = 0.0,
    num_chunks: int = 1,
) -> PipelineResult:
    """Simulate one step. ``forward_s[s]`` and ``backward_s[s]`` are stage ``s``'s times for one
    micro-batch over all its chunks; with ``num_chunks > 1`` each chunk takes an equal share."""
    num_stages = len(forward_s)
    if num_stages == 0 or len(backward_s) != num_stages:
        raise ValueError("forward_s and backward_s need one entry per stage")
    if num_microbatches < 0 or num_chunks < 1 or send_s < 0:
        raise ValueError("num_microbatches and send_s must be non-negative, num_chunks positive")
    if num_microbatches == 0:
        return PipelineResult(0.0, (0.0,) * num_stages)
    orders = [stage_order(s, num_stages, num_microbatches, num_chunks) for s in range(num_stages)]
    last_virtual = num_stages * num_chunks - 1
    done: dict[tuple[bool, int, int], float] = {}  # (forward, micro-batch, virtual stage) -> end
    position = [0] * num_stages
    free_at = [0.0] * num_stages
    busy = [0.0] * num_stages
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for s in range(num_stages):
            order = orders[s]
            while position[s] < len(order):
                op = order[position[s]]
                virtual = op.chunk * num_stages + s
                if op.forward:
                    source = (True, op.microbatch, virtual - 1) if virtual > 0 else None
                else:
                    source = (
                        False if virtual < last_virtual else True,
                        op.microbatch,
                        virtual + 1 if virtual < last_virtual else virtual,
                    )
                if source is not None and source not in done:
                    break
                ready = 0.0
                if source is not None:
                    ready = done[source] + (send_s if source[2] % num_stages != s else 0.0)
                duration = (forward_s[s] if op.forward else backward_s[s]) / num_chunks
                start = max(free_at[s], ready)
                free_at[s] = start + duration
                busy[s] += duration
                done[(op.forward, op.microbatch, virtual)] = free_at[s]
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule deadlocked; this is a bug in the schedule order")
    return PipelineResult(max(free_at), tuple(busy))
