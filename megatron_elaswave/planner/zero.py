"""Interleaved ZeRO: who owns which optimizer state, and how state moves when the layout changes.

Ownership. The model is cut into *parts*: the embedding (part 0), the transformer layers (parts
``1..L``) and the output layer with the loss (part ``L+1``). The optimizer state of each part on one
tensor-parallel rank is cut into ``K = zero_chunks_per_replica * D0`` equal chunks (``D0``: replicas
of the failure-free job). Chunk ``c`` of part ``p`` has the *home* replica ``(p + c) mod D0``; when
the home replica is gone, the orphaned chunks of the part are dealt round-robin over the live
replicas, starting at live replica ``p mod n``. Within the owning replica, the stage instance that
holds the part keeps the chunk, on the same tensor-parallel rank. Guarantees:

* ownership is a pure function of the set of live replica indices;
* each live replica owns at most ``ceil(K / n)`` chunks of any part (exactly ``K / D0`` without
  failures), and the owner always holds the part's parameters;
* a stage failure inside a replica changes no replica's chunk set, so only that replica's chunks
  move; a dissolved replica's chunks move and nothing else does.

Recovery sources. Every rank keeps a snapshot of its optimizer chunks (with their fp32 master
weights) on its *buddy* (:func:`buddy_rank`), in another failure domain. A chunk whose owner
failed is copied from the buddy; parameters come from a live holder of the same layer, or, when
every holder failed, are rebuilt from the buddies' master weights. When a rank and its buddy both
failed the state is lost and planning stops with :class:`StateLostError`.

Experts. The routed experts of an MoE layer stay at their expert coordinates
(:meth:`~megatron_elaswave.layout.Layout.expert_coordinates`): a layer's experts move with it to
the rank of its new stage instance at the same TP rank, from a live holder of the same experts
(or, when all failed, from the snapshots of their shards). Their optimizer state is not owned by
replicas but sharded contiguously over the ranks that hold the same experts (Megatron's expert
data parallelism); when those ranks change (a layer moves, a lockstep set leaves), every element
whose holder changes is copied. Only the other, dense, state follows interleaved ownership.

Transfers. A change becomes a list of rank-to-rank copies grouped into waves: within one wave no
rank takes part in two copies, so every wave runs as disjoint concurrent copies.
:func:`contiguous_migration` gives the same figures for Megatron's contiguous layout (each layer
group's flat buffer sharded in equal contiguous slices over its holders), for comparison.
"""

from __future__ import annotations

import bisect
import functools
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_elaswave.layout import Layout, Replica, StageInstance
from megatron_elaswave.planner.cost import CostModel


class StateLostError(RuntimeError):
    """Optimizer state whose owner and buddy both failed: only a checkpoint can restore it."""


@dataclass(frozen=True)
class Transfer:
    """One rank-to-rank copy."""

    wave: int
    """Wave the copy runs in; copies of one wave share no rank."""
    src: int
    dst: int
    bytes: int
    what: str
    """What is copied, e.g. ``"params layer 5 tp 0"`` or ``"optimizer layer 5 chunk 2 tp 0"``."""

    def to_json(self) -> dict:
        return {"wave": self.wave, "src": self.src, "dst": self.dst, "bytes": self.bytes, "what": self.what}


@dataclass(frozen=True)
class MigrationPlan:
    """Transfers of one layout change, with summary figures."""

    transfers: tuple[Transfer, ...]
    num_waves: int
    total_bytes: int
    estimated_s: float
    """Sum over waves of the latency plus the largest copy over the migration bandwidth."""

    def summary(self) -> dict:
        return {
            "transfers": len(self.transfers),
            "waves": self.num_waves,
            "bytes": self.total_bytes,
            "estimated_s": self.estimated_s,
        }


def chunk_counts(param_count: int, num_chunks: int) -> np.ndarray:
    """Elements in each of the ``num_chunks`` near-equal chunks of ``param_count`` elements."""
    base, extra = divmod(param_count, num_chunks)
    return base + (np.arange(num_chunks) < extra).astype(np.int64)


def chunk_owners(
    part: int, live_replicas: tuple[int, ...], data_parallel_size: int, num_chunks: int
) -> np.ndarray:
    """Owning replica of every chunk of ``part`` (see the module docstring)."""
    homes = (part + np.arange(num_chunks)) % data_parallel_size
    live = np.asarray(live_replicas, dtype=np.int64)
    orphan = ~np.isin(homes, live)
    owners = homes.copy()
    if orphan.any():
        start = part % len(live)
        owners[orphan] = live[(start + np.arange(int(orphan.sum()))) % len(live)]
    return owners


def _part_holders(replica: Replica, num_layers: int) -> list[StageInstance]:
    """Stage instance holding each part (embedding, layers, loss) of one replica."""
    holders = [replica.stages[0]]
    for stage in replica.stages:
        holders.extend([stage] * (stage.last_layer - stage.first_layer + 1))
    holders.append(replica.stages[-1])
    assert len(holders) == num_layers + 2
    return holders


def _part_name(part: int, num_layers: int) -> str:
    if part == 0:
        return "embedding"
    if part == num_layers + 1:
        return "loss"
    return f"layer {part - 1}"


def buddy_ranks(layout: Layout, rank: int, count: int = 1,
                ranks_per_node: int | None = None) -> list[int]:
    """The ``count`` ranks that keep ``rank``'s optimizer snapshot: ranks at the same
    tensor-parallel rank of other stage instances (fewer when fewer exist), placed so that a
    correlated loss takes a snapshot with its owner only when nothing else was possible.

    Guarantees: the buddies are on other nodes whenever other nodes hold stage instances; among
    those, in other replicas whenever possible; among those, at other stage indices whenever
    possible. So losing every rank of one node loses no snapshot while another node is left, and
    on one node neither does losing every rank of one replica, nor one stage in every replica,
    while another replica is left. Among equally good choices, one cyclic shift of the instances
    (in launch-rank order) serves every rank where one exists, so that each rank then holds
    exactly ``count`` copies. ``ranks_per_node``: launch ranks per node (``None``: the whole job
    on one node). A pure function of its arguments; raises ``ValueError`` for a rank that holds
    no stage.
    """
    position = layout.position(rank)
    if position is None:
        raise ValueError(f"rank {rank} holds no stage")
    return _Placement.of(layout, position[2], count, ranks_per_node).buddies(rank)


def buddy_rank(layout: Layout, rank: int, ranks_per_node: int | None = None) -> int | None:
    """The first of :func:`buddy_ranks`, or ``None`` when no other stage instance exists."""
    buddies = buddy_ranks(layout, rank, 1, ranks_per_node)
    return buddies[0] if buddies else None


@dataclass(frozen=True)
class Survival:
    """Which losses a layout's snapshot placement survives (:func:`survival`), once every rank's
    snapshot is replicated: a loss takes state with it when it takes a rank's snapshot and every
    copy of it."""

    any_rank: bool
    """The loss of any one rank."""
    any_node: bool | None
    """The loss of any one node's ranks; ``None`` when the job has one node."""
    fatal_pairs: tuple[tuple[int, int], ...]
    """The pairs of ranks whose loss together takes some rank's snapshot with every copy,
    sorted; empty when any two ranks may fail, and when one rank's loss does already
    (``any_rank`` false: every pair with that rank would be listed)."""

    def describe(self) -> str:
        """One line: what the placement survives and which pairs of ranks it does not."""
        if not self.any_rank:
            return "survives no loss of a rank that holds a stage"
        survived = ["of any one rank"]
        if self.any_node:
            survived.append("of any one node")
        if not self.fatal_pairs:
            survived.append("of any two ranks")
        text = "survives the loss " + ", ".join(survived[:-1]) + (
            " and " if len(survived) > 1 else "") + survived[-1]
        if self.fatal_pairs:
            shown = ", ".join(f"{a}+{b}" for a, b in self.fatal_pairs[:4])
            more = ", ..." if len(self.fatal_pairs) > 4 else ""
            text += (f"; not of {len(self.fatal_pairs)} pairs of ranks that each hold every "
                     f"copy of a snapshot ({shown}{more})")
        if self.any_node is False:
            text += "; not of every node (one holds every copy of a snapshot)"
        return text


def survival(layout: Layout, copies: int, ranks_per_node: int | None = None) -> Survival:
    """What the snapshots of ``layout``, each kept by its owner and ``copies`` buddies
    (:func:`buddy_ranks`), survive. Linear in the number of ranks times ``copies``."""
    holders = [frozenset({rank, *buddy_ranks(layout, rank, copies, ranks_per_node)})
               for rank in sorted(layout.active_ranks())]
    known = sorted(layout.known_ranks())
    any_rank = all(len(held) > 1 for held in holders)
    pairs = {tuple(sorted(held)) for held in holders if len(held) == 2} if any_rank else set()
    any_node = None
    if ranks_per_node is not None and len({r // ranks_per_node for r in known}) > 1:
        any_node = all(len({r // ranks_per_node for r in held}) > 1 for held in holders)
    return Survival(any_rank=any_rank, any_node=any_node, fatal_pairs=tuple(sorted(pairs)))


_UNIFORM_OFFSETS_TRIED = 64
"""Offsets :class:`_Placement` tries for one shift that suits every rank, before it picks per
rank (which may leave some ranks holding more than ``count`` copies)."""


class _Placement:
    """The snapshot buddies of one tensor-parallel rank's stage instances (:func:`buddy_ranks`)."""

    def __init__(self, layout: Layout, tp_rank: int, count: int, ranks_per_node: int | None):
        instances = sorted(
            (rank, (0 if ranks_per_node is None else rank // ranks_per_node, replica.index, index))
            for replica in layout.replicas for index, stage in enumerate(replica.stages)
            for rank in (stage.ranks[tp_rank],))
        self.ranks = [rank for rank, _ in instances]
        self.index = {rank: i for i, rank in enumerate(self.ranks)}
        self.domains = [domain for _, domain in instances]
        self.wanted = min(count, len(instances) - 1)
        self.lowest = _lowest_risks(self.domains)
        self.offsets = self._uniform_offsets()

    @classmethod
    @functools.lru_cache(maxsize=256)
    def of(cls, layout: Layout, tp_rank: int, count: int, ranks_per_node: int | None) -> _Placement:
        return cls(layout, tp_rank, count, ranks_per_node)

    def _risk(self, i: int, j: int) -> int:
        return _risk(self.domains[i], self.domains[j % len(self.domains)])

    def _uniform_offsets(self) -> list[int]:
        """Up to ``wanted`` shifts that give every instance a buddy of its lowest risk."""
        size, found = len(self.ranks), []
        for offset in range(1, min(size, _UNIFORM_OFFSETS_TRIED + 1)):
            if len(found) == self.wanted:
                break
            if all(self._risk(i, i + offset) == self.lowest[i] for i in range(size)):
                found.append(offset)
        return found

    def buddies(self, rank: int) -> list[int]:
        i, size = self.index[rank], len(self.ranks)
        chosen = [(i + offset) % size for offset in self.offsets]
        if len(chosen) < self.wanted:
            # The nearest instances of the lowest risk; the rest by risk, then distance.
            nearest = [j % size for j in range(i + 1, i + size) if j % size not in chosen]
            for j in nearest:
                if self._risk(i, j) == self.lowest[i]:
                    chosen.append(j)
                    if len(chosen) == self.wanted:
                        break
            else:
                rest = sorted((j for j in nearest if j not in chosen),
                              key=lambda j: self._risk(i, j))  # stable: distance breaks ties
                chosen += rest[:self.wanted - len(chosen)]
        return [self.ranks[j] for j in chosen]


def _risk(a: tuple[int, int, int], b: tuple[int, int, int]) -> int:
    """How much two (node, replica, stage index) domains share, shared node weighing most."""
    return 4 * (a[0] == b[0]) + 2 * (a[1] == b[1]) + (a[2] == b[2])


def _lowest_risks(domains: list[tuple[int, int, int]]) -> list[int]:
    """For each domain, the lowest :func:`_risk` that any other instance offers, in linear time:
    the number of instances sharing exactly the attributes in ``same`` follows by inclusion and
    exclusion from the counts of those that share each subset of attributes."""
    subsets = [tuple(k for k in range(3) if mask >> k & 1) for mask in range(8)]
    agreeing = [Counter(tuple(d[k] for k in subset) for d in domains) for subset in subsets]
    lowest = []
    for domain in domains:
        shared = [agreeing[mask][tuple(domain[k] for k in subsets[mask])] for mask in range(8)]
        shared[7] -= 1  # not itself
        exact = {same: sum((-1) ** bin(mask ^ same).count("1") * shared[mask]
                           for mask in range(8) if mask & same == same)
                 for same in range(8)}
        # Bit k of ``same`` is attribute k (node, replica, stage); _risk weighs them 4, 2, 1.
        risks = [4 * (same & 1) + 2 * (same >> 1 & 1) + (same >> 2 & 1)
                 for same, number in exact.items() if number > 0]
        lowest.append(min(risks, default=7))
    return lowest


class _Sources:
    """Where the pre-change state of a rank can be read after the failure."""

    def __init__(self, old: Layout, failed: frozenset[int]):
        self.old = old
        self.failed = failed
        self._buddies: dict[int, int | None] = {}

    def optimizer_source(self, rank: int, what: str) -> int:
        if rank not in self.failed:
            return rank
        if rank not in self._buddies:
            self._buddies[rank] = buddy_rank(self.old, rank)
        buddy = self._buddies[rank]
        if buddy is None or buddy in self.failed:
            raise StateLostError(
                f"{what}: rank {rank} and its snapshot buddy {buddy} both failed; restart from a checkpoint"
            )
        return buddy


def _dense_parts(cost: CostModel) -> tuple[list[int], list[int]]:
    """Per part (embedding, layers, loss): bytes and elements of its parameters on one rank that
    are not routed experts, the state interleaved ownership shards."""
    dense_bytes = [cost.embedding.param_bytes, *(cost.param_bytes - cost.expert_param_bytes).tolist(),
                   cost.loss.param_bytes]
    dense_counts = [cost.embedding.param_count, *(cost.param_count - cost.expert_param_count).tolist(),
                    cost.loss.param_count]
    return dense_bytes, dense_counts


def _parameter_copies(old: Layout, new: Layout, failed: frozenset[int], cost: CostModel) -> list[tuple]:
    """Parameters of every part that lands on a stage instance that did not hold it: from the
    part's old holder in the same replica or, when it failed, from the next replica with a live
    holder; when every holder failed, rebuilt chunk by chunk from the snapshots' master weights.
    An MoE layer's routed experts come the same way from the holders of the same experts
    (:func:`_expert_parameter_copies`)."""
    num_layers, job = new.num_layers, cost.job
    dtype_bytes = cost.profile.config.params_dtype_bytes
    part_bytes, part_counts = _dense_parts(cost)
    old_replicas = old.replica_by_index()
    old_order = tuple(sorted(old_replicas))
    holders: dict[int, list[StageInstance]] = {}

    def old_holder(replica: int, part: int) -> StageInstance:
        if replica not in holders:
            holders[replica] = _part_holders(old_replicas[replica], num_layers)
        return holders[replica][part]

    sources = _Sources(old, failed)
    copies = []
    for replica in new.replicas:
        if old_replicas[replica.index].stages == replica.stages:
            continue
        now = _part_holders(replica, num_layers)
        start = old_order.index(replica.index)
        peers = old_order[start:] + old_order[:start]  # own replica first, then the next ones
        for part in range(num_layers + 2):
            if now[part].ranks == old_holder(replica.index, part).ranks:
                continue
            name = _part_name(part, num_layers)
            for tp_rank, dst in enumerate(now[part].ranks):
                if 0 < part <= num_layers and cost.expert_param_count[part - 1]:
                    copies += _expert_parameter_copies(old, old_holder, sources, cost, peers,
                                                       part, tp_rank, dst)
                live = (old_holder(p, part).ranks[tp_rank] for p in peers)
                src = next((rank for rank in live if rank not in failed), None)
                if src is not None:
                    if src != dst:
                        copies.append((src, dst, part_bytes[part], f"params {name} tp {tp_rank}"))
                    continue
                owners = chunk_owners(part, old_order, job.data_parallel_size, job.zero_chunks_per_layer)
                sizes = chunk_counts(part_counts[part], job.zero_chunks_per_layer) * dtype_bytes
                for c, owner in enumerate(owners.tolist()):
                    what = f"params {name} chunk {c} tp {tp_rank} from snapshot"
                    src = sources.optimizer_source(old_holder(owner, part).ranks[tp_rank], what)
                    if src != dst:
                        copies.append((src, dst, int(sizes[c]), what))
    return copies


def _same_experts(layout: Layout, replica: int, tp_rank: int) -> list[tuple[int, int]]:
    """``(replica index, TP rank)`` of every position of ``layout`` that holds the experts that
    ``tp_rank`` of ``replica`` holds (the same expert TP and expert-parallel rank), in expert
    data-parallel order."""
    tp, coordinates = layout.tensor_parallel_size, layout.experts.coordinates
    wanted = coordinates(replica, tp_rank, tp)[:2]
    return [(r, t) for r in sorted(layout.replica_by_index()) for t in range(tp)
            if coordinates(r, t, tp)[:2] == wanted]


def _expert_parameter_copies(old: Layout, old_holder, sources: _Sources, cost: CostModel,
                             peers: tuple[int, ...], part: int, tp_rank: int, dst: int) -> list[tuple]:
    """The routed experts of MoE layer ``part`` that rank ``dst``, at ``tp_rank`` of the first of
    ``peers``, now needs: from the first live old holder of the same experts, taking replicas in
    the order of ``peers`` (its own first); when every one failed, rebuilt from the snapshots of
    their expert data-parallel shards (Megatron's contiguous sharding of the experts' state)."""
    layer, name = part - 1, _part_name(part, old.num_layers)
    positions = _same_experts(old, peers[0], tp_rank)
    order = {replica: i for i, replica in enumerate(peers)}
    live = (old_holder(r, part).ranks[t] for r, t in sorted(positions, key=lambda p: (order[p[0]], p[1])))
    src = next((rank for rank in live if rank not in sources.failed), None)
    if src is not None:
        return [] if src == dst else [(src, dst, int(cost.expert_param_bytes[layer]),
                                       f"params {name} experts tp {tp_rank}")]
    dtype_bytes = cost.profile.config.params_dtype_bytes
    sizes = chunk_counts(int(cost.expert_param_count[layer]), len(positions)) * dtype_bytes
    copies = []
    for shard, (r, t) in enumerate(positions):
        what = f"params {name} experts shard {shard} tp {tp_rank} from snapshot"
        src = sources.optimizer_source(old_holder(r, part).ranks[t], what)
        if src != dst:
            copies.append((src, dst, int(sizes[shard]), what))
    return copies


def _expert_holders(layout: Layout, layer: int) -> dict[tuple[int, int], list[int]]:
    """The ranks holding MoE layer ``layer``, by ``(expert TP rank, expert-parallel rank)``, in
    expert data-parallel order: each list shares one copy of those experts' optimizer state."""
    tp, coordinates = layout.tensor_parallel_size, layout.experts.coordinates
    holders: dict[tuple[int, int], list[int]] = defaultdict(list)
    for index, replica in sorted(layout.replica_by_index().items()):
        stage = _part_holders(replica, layout.num_layers)[layer + 1]
        for t, rank in enumerate(stage.ranks):
            holders[coordinates(index, t, tp)[:2]].append(rank)
    return holders


def _moved_elements(count: int, before: list[int], after: list[int]) -> list[tuple[int, int, int, int]]:
    """``(first, end, old holder, new holder)`` of every element range of a ``count``-element
    tensor, sharded contiguously over ``before`` and then over ``after``, whose holder changes."""
    def bounds(holders: list[int]) -> list[int]:
        return np.concatenate(([0], np.cumsum(chunk_counts(count, len(holders))))).tolist()

    old_bounds, new_bounds = bounds(before), bounds(after)
    cuts = sorted(set(old_bounds) | set(new_bounds))
    moved = []
    for first, end in zip(cuts, cuts[1:]):
        was = before[bisect.bisect_right(old_bounds, first) - 1]
        now = after[bisect.bisect_right(new_bounds, first) - 1]
        if was != now:
            moved.append((first, end, was, now))
    return moved


def _expert_optimizer_copies(old: Layout, new: Layout, failed: frozenset[int],
                             cost: CostModel) -> list[tuple]:
    """The routed experts' optimizer state of every MoE layer whose holders change: each set of
    ranks holding the same experts shards it contiguously in expert data-parallel order, as
    Megatron's distributed optimizer does over the expert data-parallel group, and every element
    whose holder changes is copied, from the old holder's snapshot buddy where it failed."""
    if new.experts is None:
        return []
    sources = _Sources(old, failed)
    per_param = cost.memory.optimizer_bytes_per_param
    copies = []
    for layer in np.nonzero(cost.expert_param_count)[0].tolist():
        before, after = _expert_holders(old, layer), _expert_holders(new, layer)
        count = int(cost.expert_param_count[layer])
        for (etp, ep), holders in sorted(before.items()):
            what = f"optimizer layer {layer} experts etp {etp} ep {ep}"
            for first, end, was, dst in _moved_elements(count, holders, after[etp, ep]):
                src = sources.optimizer_source(was, what)
                if src != dst:
                    copies.append((src, dst, (end - first) * per_param, what))
    return copies


def _optimizer_copies(old: Layout, new: Layout, failed: frozenset[int], cost: CostModel) -> list[tuple]:
    """The dense optimizer chunks whose owning stage instance changes (interleaved ownership)."""
    num_layers, job = new.num_layers, cost.job
    num_chunks = job.zero_chunks_per_layer
    _, part_counts = _dense_parts(cost)
    old_replicas, new_replicas = old.replica_by_index(), new.replica_by_index()
    old_live, new_live = tuple(sorted(old_replicas)), tuple(sorted(new_replicas))
    changed = np.array(
        [r.index for r in new.replicas if old_replicas[r.index].stages != r.stages], dtype=np.int64
    )
    holders: dict[tuple[str, int], list[StageInstance]] = {}

    def holder(which: str, replica: int, part: int) -> StageInstance:
        if (which, replica) not in holders:
            source = old_replicas if which == "old" else new_replicas
            holders[which, replica] = _part_holders(source[replica], num_layers)
        return holders[which, replica][part]

    sources = _Sources(old, failed)
    copies = []
    for part in range(num_layers + 2):
        old_owner = chunk_owners(part, old_live, job.data_parallel_size, num_chunks)
        new_owner = chunk_owners(part, new_live, job.data_parallel_size, num_chunks)
        moving = np.nonzero((old_owner != new_owner) | np.isin(new_owner, changed))[0]
        if not len(moving):
            continue
        sizes = chunk_counts(part_counts[part], num_chunks) * cost.memory.optimizer_bytes_per_param
        for c in moving.tolist():
            before = holder("old", int(old_owner[c]), part).ranks
            after = holder("new", int(new_owner[c]), part).ranks
            for tp_rank, (was, dst) in enumerate(zip(before, after)):
                if was == dst:
                    continue
                what = f"optimizer {_part_name(part, num_layers)} chunk {c} tp {tp_rank}"
                src = sources.optimizer_source(was, what)
                if src != dst:  # a buddy that becomes the owner already has the snapshot
                    copies.append((src, dst, int(sizes[c]), what))
    return copies


def _contiguous_owners(layout: Layout, part_counts: list[int]) -> dict[int, list[tuple[int, int, int]]]:
    """Per part: ``(start, end, replica)`` element intervals each replica owns when every layer
    group's flat buffer (embedding first, loss last) is sharded contiguously over its holders."""
    num_layers = layout.num_layers
    live = sorted(r.index for r in layout.replicas)
    owners: dict[int, list[tuple[int, int, int]]] = {}
    for first, last in layout.layer_groups():
        parts = list(range(first + 1, last + 2))
        if first == 0:
            parts.insert(0, 0)
        if last == num_layers - 1:
            parts.append(num_layers + 1)
        size = sum(part_counts[p] for p in parts)
        shard = max(1, -(-size // len(live)))
        offset = 0
        for p in parts:
            intervals = []
            start, end = offset, offset + part_counts[p]
            for i in range(start // shard, (end - 1) // shard + 1 if end > start else start // shard):
                lo, hi = max(start, i * shard), min(end, (i + 1) * shard)
                intervals.append((lo - offset, hi - offset, live[i]))
            owners[p] = intervals
            offset = end
    return owners


def contiguous_migration(old: Layout, new: Layout, failed: frozenset[int], cost: CostModel) -> MigrationPlan:
    """The copies the same change needs with Megatron's contiguous distributed-optimizer layout:
    parameters as in the interleaved plan, and every optimizer element whose owning rank changes,
    merged into one copy per (source, destination) pair."""
    num_layers = new.num_layers
    _, part_counts = _dense_parts(cost)
    before, after = _contiguous_owners(old, part_counts), _contiguous_owners(new, part_counts)
    old_holders = {r.index: _part_holders(r, num_layers) for r in old.replicas}
    new_holders = {r.index: _part_holders(r, num_layers) for r in new.replicas}
    sources = _Sources(old, failed)
    merged: dict[tuple[int, int], int] = defaultdict(int)
    for part in range(num_layers + 2):
        cuts = sorted({a for a, _, _ in before[part]} | {a for a, _, _ in after[part]} | {part_counts[part]})
        for lo, hi in zip(cuts, cuts[1:]):
            was = next(r for a, b, r in before[part] if a <= lo < b)
            now = next(r for a, b, r in after[part] if a <= lo < b)
            for tp_rank, (src, dst) in enumerate(
                zip(old_holders[was][part].ranks, new_holders[now][part].ranks)
            ):
                if src != dst:
                    what = f"optimizer {_part_name(part, num_layers)} tp {tp_rank}"
                    src = sources.optimizer_source(src, what)
                    if src != dst:
                        merged[src, dst] += (hi - lo) * cost.memory.optimizer_bytes_per_param
    copies = _parameter_copies(old, new, failed, cost) + _expert_optimizer_copies(old, new, failed, cost)
    copies += [
        (src, dst, size, "optimizer (contiguous shards)") for (src, dst), size in sorted(merged.items())
    ]
    return schedule_waves(copies, cost)


def interleaved_migration(old: Layout, new: Layout, failed: frozenset[int], cost: CostModel) -> MigrationPlan:
    """The copies that take ``old`` (before ``failed`` died) to ``new`` with interleaved ownership."""
    copies = (_parameter_copies(old, new, failed, cost) + _optimizer_copies(old, new, failed, cost)
              + _expert_optimizer_copies(old, new, failed, cost))
    return schedule_waves(copies, cost)


def assign_waves(copies: Sequence[tuple[int, int, int]]) -> list[int]:
    """The wave of each ``(source, destination, bytes)`` copy, largest copies first: each goes to
    the first wave in which neither its source nor its destination is busy, so that every rank
    takes part in at most one copy per wave (the waves are disjoint rank-to-rank transfers)."""
    busy: dict[int, set[int]] = defaultdict(set)
    waves = [0] * len(copies)
    for index in sorted(range(len(copies)), key=lambda i: (-copies[i][2], copies[i][:2], i)):
        src, dst, _ = copies[index]
        wave = 0
        while wave in busy[src] or wave in busy[dst]:
            wave += 1
        busy[src].add(wave)
        busy[dst].add(wave)
        waves[index] = wave
    return waves


def schedule_waves(copies: list[tuple[int, int, int, str]], cost: CostModel) -> MigrationPlan:
    """The copies in disjoint waves (:func:`assign_waves`), with the time they are predicted to
    take: each wave as long as its largest copy."""
    copies = sorted(copies, key=lambda c: (c[0], c[1], c[3]))
    waves = assign_waves([(src, dst, size) for src, dst, size, _ in copies])
    largest = [0] * (max(waves) + 1 if waves else 0)
    for (_, _, size, _), wave in zip(copies, waves):
        largest[wave] = max(largest[wave], size)
    transfers = sorted((Transfer(wave, src, dst, size, what)
                        for (src, dst, size, what), wave in zip(copies, waves)),
                       key=lambda t: (t.wave, t.src, t.dst, t.what))
    latency = cost.p2p_latency_ns / 1e9
    return MigrationPlan(
        transfers=tuple(transfers),
        num_waves=len(largest),
        total_bytes=sum(t.bytes for t in transfers),
        estimated_s=sum(latency + size / cost.dp_bandwidth for size in largest),
    )
