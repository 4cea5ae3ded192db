"""Layout-invariant dropout at run time: which logical coordinates are running now, and the seeds
of the random streams an op at those coordinates draws from.

Megatron seeds dropout per pipeline and tensor rank and advances its generators statefully, so
moving a layer to another pipeline stage, or a micro-batch to another replica, changes masks.
With ``--elastic-rng invariant`` (the default with ``--elastic``) the training loop tells this
module where it is, and the patches in ``megatron_elaswave.patches.transformer_layer`` and
``...language_model_embedding`` reseed Megatron's two streams right before each transformer layer
and the embedding run::

    dropout_rng.set_seed(args.seed)            # once
    dropout_rng.set_iteration(iteration)       # before each training step
    dropout_rng.set_microbatch(microbatch_id)  # before each micro-batch's forward, on every stage

The streams of Megatron-Core, and what each is keyed by (:func:`stream_seeds`):

* the **default** device generator: hidden dropout after attention and after the MLP, and the
  embedding dropout. These act on activations every tensor-parallel rank holds in full, so the
  seed is the same on every TP rank: ``op_seed(seed, iteration, microbatch, layer,
  HIDDEN_DROPOUT_ATTN | EMBEDDING_DROPOUT, REPLICATED)``;
* the tracker's **model-parallel** stream (``get_cuda_rng_tracker()``, ``'model-parallel-rng'``):
  attention dropout on this rank's heads (and, with sequence parallelism, everything the layer
  or embedding masks, since Megatron then runs it inside that stream). The seed differs per TP
  rank: ``op_seed(seed, iteration, microbatch, layer, ATTENTION_DROPOUT | EMBEDDING_DROPOUT,
  tp_rank)``;
* in an MoE layer, the tracker's **expert-parallel** stream (``'expert-parallel-rng'``: the
  random logits of a router's forced load balancing) is keyed like the model-parallel one, by
  ``EXPERT_ROUTING`` and the TP rank whose tokens the router sees; its input jitter draws from
  the default stream.

``op_seed`` is :func:`megatron_elaswave.planner.rng.op_seed` (pure, stable across processes and
machines). The layer number is the global 0-based one (multi-token prediction layers after
the decoder's); the embedding uses ``EMBEDDING_LAYER``, and the embedding lookup of a multi-token
prediction layer its layer number with the embedding's site.
Site names only name a stream: the default stream of layer ``l`` serves its two hidden dropouts
in the order Megatron calls them, so it is keyed by the first. The embedding draws from exactly
one of its two streams (the model-parallel one only with sequence parallelism), so its two seeds
may coincide on TP rank 0.

Guarantee: for a fixed ``--seed``, the dropout masks of transformer layer ``l`` (or of the
embedding) in micro-batch ``m`` of iteration ``i`` on TP rank ``t`` do not depend on the pipeline
stage that holds the layer, on the replica (data-parallel rank) that runs the micro-batch, on the
number of stages or replicas, or on the order in which the schedule runs micro-batches. Two runs
with the same TP size, seed and global batch therefore draw identical masks whatever their
pipeline and data-parallel layout. Limits (see ``docs/rng.md``): the TP size must be the same
(masks of sharded tensors are per shard), full activation recompute is refused, CUDA-graph RNG
trackers are not keyed, and masks differ from stock Megatron's.

This module does not import Megatron-Core (or torch): it is plain state and arithmetic.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from megatron_elaswave.planner.rng import (
    ATTENTION_DROPOUT,
    EMBEDDING_DROPOUT,
    EMBEDDING_LAYER,
    EXPERT_ROUTING,
    HIDDEN_DROPOUT_ATTN,
    REPLICATED,
    op_seed,
)

__all__ = [
    "EMBEDDING_LAYER",
    "DropoutPosition",
    "NotPositioned",
    "StreamSeeds",
    "current",
    "position",
    "reset",
    "set_iteration",
    "set_microbatch",
    "set_seed",
    "stream_seeds",
]


class NotPositioned(RuntimeError):
    """A keyed op ran before the training loop said which seed, iteration or micro-batch runs."""


@dataclass(frozen=True)
class StreamSeeds:
    """The seeds of Megatron's random streams for one layer (or the embedding) on one rank."""

    default: int
    """For the default device generator; the same on every TP rank."""
    model_parallel: int
    """For the tracker's ``'model-parallel-rng'`` stream; differs per TP rank."""
    expert: int
    """For the tracker's ``'expert-parallel-rng'`` stream (an MoE layer's); differs per TP
    rank, whose tokens its router sees."""


@dataclass
class DropoutPosition:
    """What the training loop has set: the run's seed and the micro-batch being computed."""

    seed: int | None = None
    iteration: int | None = None
    microbatch: int | None = None

    def stream_seeds(self, layer: int, tp_rank: int, *, embedding: bool = False) -> StreamSeeds:
        """Seeds for global layer ``layer`` (0-based, or ``EMBEDDING_LAYER``) on ``tp_rank``;
        with ``embedding``, those of an embedding lookup that layer makes (a multi-token
        prediction layer's, of the shifted tokens)."""
        missing = [name for name in ("seed", "iteration", "microbatch") if getattr(self, name) is None]
        if missing:
            raise NotPositioned(
                f"layout-invariant dropout RNG is installed but no {', '.join(missing)} was set: "
                "call megatron_elaswave.runtime.dropout_rng.set_seed / set_iteration / set_microbatch "
                "before the forward pass (or train with --elastic-rng megatron)")
        coordinates = (self.seed, self.iteration, self.microbatch, layer)
        if layer == EMBEDDING_LAYER or embedding:
            default_site = model_parallel_site = EMBEDDING_DROPOUT
        else:
            default_site, model_parallel_site = HIDDEN_DROPOUT_ATTN, ATTENTION_DROPOUT
        return StreamSeeds(
            default=op_seed(*coordinates, default_site, REPLICATED),
            model_parallel=op_seed(*coordinates, model_parallel_site, tp_rank),
            expert=op_seed(*coordinates, EXPERT_ROUTING, tp_rank),
        )


_POSITION = DropoutPosition()


def current() -> DropoutPosition:
    """The process-wide position the patches read."""
    return _POSITION


def _check(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def set_seed(seed: int) -> None:
    """The run's ``--seed``; set once, before training."""
    _POSITION.seed = _check("seed", seed)


def set_iteration(iteration: int) -> None:
    """The training step about to run (any fixed numbering; the loop uses the 1-based one)."""
    _POSITION.iteration = _check("iteration", iteration)


def set_microbatch(microbatch: int) -> None:
    """The global id of the micro-batch whose forward runs next on this rank (all stages)."""
    _POSITION.microbatch = _check("microbatch", microbatch)


@contextlib.contextmanager
def position(iteration: int, microbatch: int) -> Iterator[DropoutPosition]:
    """Set iteration and micro-batch for the block, then restore the previous ones."""
    saved = (_POSITION.iteration, _POSITION.microbatch)
    set_iteration(iteration)
    set_microbatch(microbatch)
    try:
        yield _POSITION
    finally:
        _POSITION.iteration, _POSITION.microbatch = saved


def reset() -> None:
    """Forget seed, iteration and micro-batch (keyed ops then raise :class:`NotPositioned`)."""
    _POSITION.seed = _POSITION.iteration = _POSITION.microbatch = None


def stream_seeds(layer: int, tp_rank: int, *, embedding: bool = False) -> StreamSeeds:
    """:meth:`DropoutPosition.stream_seeds` of the current position."""
    return _POSITION.stream_seeds(layer, tp_rank, embedding=embedding)
