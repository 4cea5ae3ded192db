"""The order in which one pipeline stage runs its forward and backward passes.

Both schedules follow Megatron-Core's ``forward_backward_pipelining_*`` functions:

* 1F1B: stage ``s`` of ``P`` runs ``min(P - s - 1, n)`` warm-up forwards, then alternates one
  forward and one backward, then drains the remaining backwards;
* interleaved (``v`` model chunks per stage): forwards walk the chunks in groups of ``g``
  micro-batches (:func:`microbatch_group_size`), backwards walk them in reverse chunk order;
  stage ``s`` warms up with ``(P - s - 1) * 2 + (v - 1) * g`` forwards (at most ``n * v``).
"""

from __future__ import annotations

from typing import NamedTuple


class Op(NamedTuple):
    """One pass of one micro-batch through one model chunk of a stage."""

    forward: bool
    microbatch: int
    chunk: int


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[Op]:
    """1F1B order of one stage."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    ops = [Op(True, m, 0) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        ops.append(Op(True, warmup + i, 0))
        ops.append(Op(False, i, 0))
    ops.extend(Op(False, m, 0) for m in range(num_microbatches - warmup, num_microbatches))
    return ops


def microbatch_group_size(num_microbatches: int, num_stages: int) -> int:
    """Megatron-Core's ``microbatch_group_size_per_vp_stage`` for a pipeline of ``num_stages``
    running ``num_microbatches``: the pipeline size, as Megatron sets it, when it divides the
    micro-batches; else all of them in one group (the interleaved schedule refuses a last group
    smaller than the pipeline, which a replica's re-dealt count can leave)."""
    return num_stages if num_microbatches % num_stages == 0 else num_microbatches


def interleaved(stage: int, num_stages: int, num_microbatches: int, num_chunks: int) -> list[Op]:
    """Interleaved 1F1B order of one stage holding ``num_chunks`` model chunks: Megatron-Core's
    schedule table with :func:`microbatch_group_size`. Raises ``ValueError`` for 1 to
    ``num_stages - 1`` micro-batches, which Megatron-Core refuses to run interleaved."""
    if 0 < num_microbatches < num_stages:
        raise ValueError(f"the interleaved schedule needs at least {num_stages} micro-batches "
                         f"(one per stage), not {num_microbatches}")
    group = microbatch_group_size(num_microbatches, num_stages)
    table = [(microbatch, chunk)
             for first in range(0, num_microbatches, group)
             for chunk in range(num_chunks)
             for microbatch in range(first, min(first + group, num_microbatches))]
    total = len(table)

    def virtual(k: int, forward: bool) -> Op:
        microbatch, chunk = table[k]
        return Op(forward, microbatch, chunk if forward else num_chunks - 1 - chunk)

    warmup = min((num_stages - stage - 1) * 2 + (num_chunks - 1) * group, total)
    ops = [virtual(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        ops.append(virtual(warmup + i, True))
        ops.append(virtual(i, False))
    ops.extend(virtual(k, False) for k in range(total - warmup, total))
    return ops


def stage_order(stage: int, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> list[Op]:
    """The schedule of one stage: 1F1B for one chunk, interleaved for more."""
    if num_chunks == 1:
        return one_f_one_b(stage, num_stages, num_microbatches)
    return interleaved(stage, num_stages, num_microbatches, num_chunks)
