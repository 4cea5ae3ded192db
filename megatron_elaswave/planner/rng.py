"""Layout-invariant randomness: a seed for every stochastic op from its logical coordinates.

Megatron seeds dropout by pipeline and tensor rank and advances the generators statefully, so
moving a layer or a micro-batch changes every later mask. Here each op draws from a generator
seeded by :func:`op_seed` of the op's *logical* coordinates:

    (seed, iteration, global micro-batch id, global layer number, op site, TP shard index)

None of them depends on which rank runs the op, how many stages a replica has or in which order the
micro-batches run, so a layer computes the same masks wherever it runs.

The function is pure and stable across processes, machines and Python versions (it never uses
Python's ``hash()``, which is salted per process). The exact recipe, for reimplementations:

1. key = ``struct.pack("<QQQqQ", seed, iteration, microbatch, layer, tp_shard)`` followed by the
   site name's UTF-8 length as ``"<H"`` and the UTF-8 bytes;
2. digest = BLAKE2b of the key with ``digest_size=8`` and personalisation ``b"elaswave-rng-v1"``;
3. seed = the digest read as a little-endian unsigned integer, in ``[0, 2**64)``, which
   ``torch.Generator.manual_seed`` accepts.

Conventions:

* layers are numbered from 0 across the whole model (as in the layout); the embedding uses
  :data:`EMBEDDING_LAYER`;
* ``tp_shard`` is the tensor-parallel rank where the tensor the op masks is sharded over TP
  (attention dropout on the local heads, sequence-parallel hidden dropout), and
  :data:`REPLICATED` where every TP rank holds the same tensor and must draw the same mask;
* a new site needs a new name in :data:`SITES`; names are part of the key, so renaming one changes
  its masks.
"""

from __future__ import annotations

import hashlib
import struct

ATTENTION_DROPOUT = "attention_dropout"
"""Dropout on the attention probabilities."""
HIDDEN_DROPOUT_ATTN = "hidden_dropout_attn"
"""Dropout after the attention output projection, before the residual add."""
HIDDEN_DROPOUT_MLP = "hidden_dropout_mlp"
"""Dropout after the MLP, before the residual add."""
EMBEDDING_DROPOUT = "embedding_dropout"
"""Dropout on the embedding output."""
EXPERT_ROUTING = "expert_routing"
"""The random draws of an MoE layer's experts' stream (a router's forced load balancing)."""

SITES = frozenset({ATTENTION_DROPOUT, HIDDEN_DROPOUT_ATTN, HIDDEN_DROPOUT_MLP, EMBEDDING_DROPOUT,
                   EXPERT_ROUTING})
"""Every known op site."""

EMBEDDING_LAYER = -1
"""Layer number of ops that belong to the embedding."""
REPLICATED = 0
"""TP shard index for ops on tensors every TP rank holds in full."""

_DOMAIN = b"elaswave-rng-v1"
_UINT64 = 2**64


def op_seed(seed: int, iteration: int, microbatch: int, layer: int, site: str, tp_shard: int) -> int:
    """64-bit seed of one stochastic op (see the module docstring).

    ``seed``, ``iteration``, ``microbatch`` and ``tp_shard`` are non-negative integers below
    ``2**64``; ``layer`` is a layer number ``>= 0`` or :data:`EMBEDDING_LAYER`; ``site`` is one of
    :data:`SITES`.
    """
    for name, value in (
        ("seed", seed),
        ("iteration", iteration),
        ("microbatch", microbatch),
        ("tp_shard", tp_shard),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _UINT64:
            raise ValueError(f"{name} must be an integer in [0, 2**64), got {value!r}")
    if isinstance(layer, bool) or not isinstance(layer, int) or not EMBEDDING_LAYER <= layer < 2**63:
        raise ValueError(f"layer must be an integer >= {EMBEDDING_LAYER}, got {layer!r}")
    if site not in SITES:
        raise ValueError(f"unknown op site {site!r}; known sites: {sorted(SITES)}")
    site_bytes = site.encode("utf-8")
    key = (
        struct.pack("<QQQqQ", seed, iteration, microbatch, layer, tp_shard)
        + struct.pack("<H", len(site_bytes))
        + site_bytes
    )
    digest = hashlib.blake2b(key, digest_size=8, person=_DOMAIN).digest()
    return int.from_bytes(digest, "little")
