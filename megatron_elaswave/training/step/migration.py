"""Optimizer state by global name, and its migration to a new layout as rank-to-rank transfers.

A rank's ZeRO shard is named by layout-independent keys ``t<tp>/<global name>/<start>:<end>/<kind>``:
the TP rank, the parameter's global name (layers numbered over the whole model, experts by their
global index), the range of the flattened parameter this rank owns, and ``param`` (fp32 main
parameter), ``exp_avg`` or ``exp_avg_sq``. State that is not a parameter but changes as the job
trains, the routers' expert biases, is kept whole under the kind ``buffer`` by every holder.
Snapshots store these keys, so any layout can find what it needs in them.

:func:`migrate` guarantees, after a failure, that every survivor ends with the full parameters of
every chunk it now holds and the Adam state of its new shard, taken from the snapshots of one
iteration: its own, those of the other survivors, and the replicas of the failed ranks' snapshots
their buddies hold. Each survivor publishes what it holds and what it needs in the store, in one
key; the lowest survivor reads them all, plans the transfers and publishes to each survivor the
ones it takes part in (one key each: O(N) keys for the job, where every survivor reading every
holding would be N^2). Each pair of ranks then exchanges one packed buffer per direction, in
disjoint waves (:func:`~megatron_elaswave.planner.zero.assign_waves`:
in a wave every rank sends or receives one buffer at most, so no link carries two at once), and
the receiver checks a CRC-32 of every buffer.
"""

from __future__ import annotations

import json
import threading
import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_elaswave.launch.store import read_when_set
from megatron_elaswave.patches.distrib_optimizer import (
    owns,
    set_shard_state,
    shard_range,
    shard_state,
)
from megatron_elaswave.patches.gpt_model import expert_biases, global_parameter_names
from megatron_elaswave.patches.p2p_communication import wait as p2p_wait
from megatron_elaswave.planner.zero import assign_waves


KINDS = ("param", "exp_avg", "exp_avg_sq")
BUFFER = "buffer"


class StateLost(RuntimeError):
    """No survivor holds part of the state the new layout needs."""


class TransferCorrupted(RuntimeError):
    """A migrated buffer does not match the checksum its sender computed."""


@dataclass(frozen=True, order=True)
class Piece:
    """A range of one flattened tensor: ``kind`` of parameter ``name`` at TP rank ``tp``."""

    tp: int
    name: str
    kind: str
    start: int
    end: int

    @property
    def key(self) -> str:
        return f"t{self.tp}/{self.name}/{self.start}:{self.end}/{self.kind}"

    @classmethod
    def parse(cls, key: str) -> Piece:
        tp, rest = key.split("/", 1)
        name, span, kind = rest.rsplit("/", 2)
        start, end = span.split(":")
        return cls(int(tp[1:]), name, kind, int(start), int(end))

    @property
    def numel(self) -> int:
        return self.end - self.start


def _chunk_buffers(objects):
    """``(global name, tensor, whether this rank is the first of the chunk's data-parallel
    group)`` of every trained buffer of every chunk (the routers' expert biases)."""
    for ddp in objects.model:
        first = ddp.dp_cp_group.rank() == 0
        for name, buffer in expert_biases(ddp.module).items():
            yield name, buffer, first


def _chunk_params(objects):
    """``(optimizer, global name, model parameter)`` of every parameter of every chunk (a
    chunk's experts have an optimizer of their own)."""
    optimizers = objects.optimizer.chained_optimizers
    for ddp in objects.model:
        names = global_parameter_names(ddp.module)
        for local_name, param in ddp.module.named_parameters():
            yield next(o for o in optimizers if owns(o, param)), names[local_name], param


class NamedShard:
    """This rank's optimizer shard under layout-independent keys (module docstring).

    The keys are worked out once: they depend only on the chunks and their optimizers, which a
    layout keeps (walking the modules for them took longer than the snapshot's copies)."""

    def __init__(self, objects, tp_rank: int) -> None:
        self._entries = []
        for optimizer, name, param in _chunk_params(objects):
            span = shard_range(optimizer, param)
            if span is not None:  # else this rank owns no element of it
                keys = {kind: Piece(tp_rank, name, kind, span.start, span.stop).key
                        for kind in KINDS}
                self._entries.append((optimizer, param, keys))
        self._buffers, self._first_holder_of = {}, set()
        for name, buffer, first in _chunk_buffers(objects):
            key = Piece(tp_rank, name, BUFFER, 0, buffer.numel()).key
            self._buffers[key] = buffer
            if first:
                self._first_holder_of.add(key)

    def pieces_of(self, params: Mapping[int, object]) -> list[tuple[str, object]]:
        """``(key, params[id(tensor)])`` of every tensor of the shard whose parameter is in
        ``params`` (by ``id``), and of every trained buffer in ``params`` that this rank is the
        first holder of, of its layer's data-parallel holders (every holder has it whole)."""
        pieces = [(key, params[id(param)]) for _, param, keys in self._entries
                  if id(param) in params for key in keys.values()]
        return pieces + [(key, params[id(buffer)]) for key, buffer in self._buffers.items()
                         if key in self._first_holder_of and id(buffer) in params]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The shard's tensors by key: views of the optimizer's own, as they are now."""
        tensors = dict(self._buffers)
        for optimizer, param, keys in self._entries:
            state = shard_state(optimizer, param)
            for kind, key in keys.items():
                tensors[key] = state[kind]
        return tensors


def adam_step(objects) -> float:
    """The Adam step count of this rank's shard (every parameter has taken the same steps)."""
    for optimizer in objects.optimizer.chained_optimizers:
        for state in optimizer.optimizer.state.values():
            if "step" in state:
                return float(state["step"])
    return 0.0


def needed_pieces(objects, tp_rank: int) -> list[Piece]:
    """Full parameters of every chunk, the Adam state of this rank's shard of each, then every
    trained buffer."""
    needs = []
    for optimizer, name, param in _chunk_params(objects):
        needs.append(Piece(tp_rank, name, "param", 0, param.numel()))
        span = shard_range(optimizer, param)
        if span:
            needs += [Piece(tp_rank, name, kind, span.start, span.stop) for kind in KINDS[1:]]
    needs += [Piece(tp_rank, name, BUFFER, 0, buffer.numel())
              for name, buffer, _ in _chunk_buffers(objects)]
    return needs


@dataclass(frozen=True)
class Transfer:
    """Copy ``[start, end)`` of ``source_key`` (held by ``source``) into need ``need`` of ``target``."""

    source: int
    target: int
    source_key: str
    need: int
    start: int
    end: int


def plan_transfers(holdings: Mapping[int, Sequence[str]],
                   needs: Mapping[int, Sequence[Piece]]) -> list[Transfer]:
    """Who sends which range to whom; the same on every rank that evaluates it.

    A rank that holds a range itself copies it locally; otherwise the holder with the fewest
    bytes assigned so far sends it, which spreads the copies over all holders.
    """
    fragments: dict[tuple, list[tuple[Piece, list[int]]]] = defaultdict(list)
    holders: dict[str, list[int]] = defaultdict(list)
    for rank in sorted(holdings):
        for key in holdings[rank]:
            holders[key].append(rank)
    for key in sorted(holders):
        piece = Piece.parse(key)
        fragments[(piece.tp, piece.name, piece.kind)].append((piece, holders[key]))
    load: dict[int, int] = defaultdict(int)
    transfers = []
    for target in sorted(needs):
        for index, need in enumerate(needs[target]):
            covered = need.start
            for fragment, ranks in sorted(fragments[(need.tp, need.name, need.kind)]):
                start, end = max(fragment.start, covered), min(fragment.end, need.end)
                if start >= end or start != covered:
                    continue
                source = target if target in ranks else min(ranks, key=lambda r: (load[r], r))
                if source != target:
                    load[source] += end - start
                transfers.append(Transfer(source, target, fragment.key, index, start, end))
                covered = end
            if covered != need.end:
                found = [(f.start, f.end, ranks) for f, ranks in
                         sorted(fragments[(need.tp, need.name, need.kind)])]
                raise StateLost(
                    f"no survivor holds elements {covered}-{need.end} of {need.kind} of "
                    f"{need.name} (TP rank {need.tp}; held: {found or 'nothing'}): the failed "
                    "ranks took them with them (keep more snapshot replicas: "
                    "--elastic-snapshot-replicas)"
                )
    return transfers


def plan_exchanges(offers: Mapping[int, tuple[Sequence[str], Sequence[Piece]]]) -> dict[int, dict]:
    """Each member's part of the plan for ``offers`` (what each member holds and needs), as it
    travels in JSON: the transfers it sends or receives, in the plan's order, the pairs it
    exchanges in, in wave order, and the bytes the whole job moves; or, for every member, the
    error that no survivor holds a piece."""
    try:
        transfers = plan_transfers({m: held for m, (held, _) in offers.items()},
                                   {m: needs for m, (_, needs) in offers.items()})
    except StateLost as lost:
        return {member: {"error": str(lost)} for member in offers}
    sizes: dict[tuple[int, int], int] = defaultdict(int)
    for transfer in transfers:
        if transfer.source != transfer.target:
            sizes[(transfer.source, transfer.target)] += transfer.end - transfer.start
    pairs = sorted(sizes)
    waves = assign_waves([(source, target, sizes[(source, target)]) for source, target in pairs])
    in_waves = [pair for _, pair in sorted(zip(waves, pairs))]
    moved = sum(sizes.values()) * torch.float32.itemsize
    return {member: {"transfers": [list(astuple(t)) for t in transfers
                                   if member in (t.source, t.target)],
                     "exchanges": [list(pair) for pair in in_waves if member in pair],
                     "bytes": moved}
            for member in offers}


def _exchange_plan(store, prefix: str, rank: int, members: Sequence[int], held: Sequence[str],
                   needs: Sequence[Piece], timeout: timedelta,
                   failure: threading.Event | None) -> dict:
    """This rank's part of the plan (:func:`plan_exchanges`), planned by the lowest member."""
    store.set(f"{prefix}/offer/{rank}",
              json.dumps([sorted(held), [astuple(p) for p in needs]]))
    if rank == members[0]:
        keys = [f"{prefix}/offer/{member}" for member in members]
        offers = {}
        for member, raw in zip(members, read_when_set(store, keys, timeout, failure)):
            member_held, member_needs = json.loads(raw)
            offers[member] = (member_held, [Piece(*fields) for fields in member_needs])
        plans = plan_exchanges(offers)
        store.multi_set([f"{prefix}/plan/{member}" for member in members],
                        [json.dumps(plans[member]) for member in members])
    [raw] = read_when_set(store, [f"{prefix}/plan/{rank}"], timeout, failure)
    plan = json.loads(raw)
    if "error" in plan:
        raise StateLost(plan["error"])
    return plan


def migrate(held: Mapping[str, torch.Tensor], needs: Sequence[Piece], *, rank: int,
            members: Sequence[int], store, prefix: str, group: dist.ProcessGroup | None,
            timeout: timedelta, failure: threading.Event | None = None
            ) -> tuple[list[torch.Tensor], int]:
    """Fill ``needs`` from what the ``members`` hold (module docstring).

    Every member calls this with what it holds (verified snapshot tensors by key) and what it
    needs. ``group`` is the group of ``members`` in that order (ranks are launch ranks, which
    the default group numbers otherwise once it is rebuilt without a missing rank). Returns one
    tensor per need and the bytes the whole job moved between ranks. Raises
    :class:`~megatron_elaswave.launch.store.WaitInterrupted` as soon as ``failure`` is set while it waits
    for a member to publish, or after ``timeout``.
    """
    plan = _exchange_plan(store, prefix, rank, members, list(held), needs, timeout, failure)
    results = [torch.empty(need.numel, dtype=torch.float32) for need in needs]
    outgoing: dict[int, list[Transfer]] = defaultdict(list)
    incoming: dict[int, list[Transfer]] = defaultdict(list)
    for transfer in (Transfer(*fields) for fields in plan["transfers"]):
        if transfer.source == rank == transfer.target:
            _place(results, needs, transfer, _slice(held, transfer))
        elif transfer.source == rank:
            outgoing[transfer.target].append(transfer)
        elif transfer.target == rank:
            incoming[transfer.source].append(transfer)
    in_group = {member: index for index, member in enumerate(members)}
    for source, target in plan["exchanges"]:  # one exchange per wave, in wave order on both sides
        if source == rank:
            _send(held, outgoing[target], in_group[target], group)
        else:
            _place_received(results, needs, incoming[source], source, in_group[source], group)
    return results, plan["bytes"]


def _send(held: Mapping[str, torch.Tensor], items: list[Transfer], group_peer: int,
          group: dist.ProcessGroup | None) -> None:
    buffer = torch.cat([_slice(held, t).float().reshape(-1) for t in items])
    checksum = torch.tensor([zlib.crc32(buffer.numpy())], dtype=torch.int64)
    requests = [dist.isend(buffer, group=group, tag=1, group_dst=group_peer),
                dist.isend(checksum, group=group, tag=2, group_dst=group_peer)]
    for request in requests:
        p2p_wait(request, group)


def _place_received(results: list[torch.Tensor], needs: Sequence[Piece], items: list[Transfer],
                    peer: int, group_peer: int, group: dist.ProcessGroup | None) -> None:
    buffer = torch.empty(sum(t.end - t.start for t in items), dtype=torch.float32)
    checksum = torch.empty(1, dtype=torch.int64)
    requests = [dist.irecv(buffer, group=group, tag=1, group_src=group_peer),
                dist.irecv(checksum, group=group, tag=2, group_src=group_peer)]
    for request in requests:
        p2p_wait(request, group)
    if zlib.crc32(buffer.numpy()) != int(checksum):
        raise TransferCorrupted(f"state received from rank {peer} fails its CRC-32")
    offset = 0
    for transfer in items:
        length = transfer.end - transfer.start
        _place(results, needs, transfer, buffer[offset:offset + length])
        offset += length


def _slice(held: Mapping[str, torch.Tensor], transfer: Transfer) -> torch.Tensor:
    fragment = Piece.parse(transfer.source_key)
    flat = held[transfer.source_key].reshape(-1)
    return flat[transfer.start - fragment.start:transfer.end - fragment.start]


def _place(results: list[torch.Tensor], needs: Sequence[Piece], transfer: Transfer,
           values: torch.Tensor) -> None:
    need = needs[transfer.need]
    results[transfer.need][transfer.start - need.start:transfer.end - need.start] = values


@torch.no_grad()
def load_pieces(objects, values: Sequence[torch.Tensor], step: float) -> None:
    """Set every chunk's parameters, this rank's Adam shard and the trained buffers from
    migrated ``values``, one per need of :func:`needed_pieces`, in its order (the two copies of a tied embedding have
    one name, and may have different shards)."""
    received = iter(values)
    for optimizer, _, param in _chunk_params(objects):
        full = next(received)
        param.data.copy_(full.view_as(param).to(param.dtype))
        span = shard_range(optimizer, param)
        if span is None:
            continue
        tensors = {"param": full[span.start:span.stop]}
        if span:
            tensors.update({kind: next(received) for kind in KINDS[1:]})
        set_shard_state(optimizer, param, tensors)
    for _, buffer, _ in _chunk_buffers(objects):
        buffer.copy_(next(received).view_as(buffer).to(buffer.dtype))
    for optimizer in objects.optimizer.chained_optimizers:
        for state in optimizer.optimizer.state.values():
            if "step" in state:
                state["step"].fill_(step)
