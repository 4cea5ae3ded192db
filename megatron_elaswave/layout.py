"""The layout of a hybrid-parallel job: which ranks hold which layers, and which micro-batches
each data-parallel replica runs.

A job starts as a TP x PP x DP grid in Megatron's rank order ``tp-cp-ep-dp-pp`` (tensor-parallel
rank fastest, then data-parallel, then pipeline; context parallelism is 1). A *stage
instance* is the tensor-parallel group that holds one pipeline stage of one replica: it is the
failure domain. After failures, replicas may have different numbers of stages; every replica
still holds every layer exactly once, as contiguous ranges, or as Megatron's virtual pipeline
stages where the replica runs the interleaved schedule (:attr:`Replica.virtual_stages`).

A mixture-of-experts job folds Megatron's expert grid (``etp-ep-edp``) over each stage's TP x DP
ranks (:class:`ExpertParallelism`). A rank's expert coordinates follow from its replica's index
and its TP rank alone, so they never change: a layer that moves takes the experts its old holder
had to a new holder at the same coordinates. Where an expert-parallel group spans replicas,
those replicas form a *lockstep* set (:meth:`ExpertParallelism.lockstep`): their all-to-alls pair
the same micro-batches of the same layers only if they run the same pipeline, so they keep equal
stage boundaries and micro-batch counts, and leave the job together.

Layers are numbered from 0 and ranges are inclusive, as in the metrics file and the plan CLI.
This module is pure Python: it is shared by the planner, the runtime and the training script.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def megatron_rank(tp_rank: int, dp_rank: int, pp_rank: int, *, tp: int, dp: int) -> int:
    """Global rank of a grid position in Megatron's ``tp-cp-ep-dp-pp`` order."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def megatron_position(rank: int, *, tp: int, dp: int) -> tuple[int, int, int]:
    """Inverse of :func:`megatron_rank`: ``(tp_rank, dp_rank, pp_rank)`` of a global rank."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def even_layer_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Megatron's default split: ``num_layers / num_stages`` layers per stage, in order."""
    if num_stages <= 0 or num_layers % num_stages:
        raise ValueError(
            f"{num_layers} layers cannot be split evenly over {num_stages} pipeline stages"
        )
    return layer_ranges((num_layers // num_stages,) * num_stages)


def layer_ranges(stage_layers: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    """The inclusive layer range of each stage that holds ``stage_layers[s]`` layers, in order."""
    ranges, first = [], 0
    for count in stage_layers:
        ranges.append((first, first + count - 1))
        first += count
    return ranges


def megatron_chunk_layers(num_layers: int, num_stages: int, *, virtual_stages: int = 1,
                          first: int | None = None, last: int | None = None,
                          embedding_counts: bool = False, loss_counts: bool = False
                          ) -> tuple[int, ...]:
    """Transformer layers per model chunk as Megatron splits them, in its order (every stage's
    first chunk, then every stage's second, ...; with one virtual stage, a chunk is a stage):
    ``first`` and ``last`` on the first and last stage where given
    (``--decoder-first/last-pipeline-num-layers``) and the rest evenly over the stages between,
    each stage's layers evenly over its ``virtual_stages`` chunks; or, where the embedding or the
    loss counts as a layer (``--account-for-embedding/loss-in-pipeline-split``), an even split
    of the layers and those over all chunks, that takes them from the first or last chunk; an
    even split otherwise.

    Raises ``ValueError`` where the layers do not split so, or a chunk would hold none."""
    if num_stages < 1 or virtual_stages < 1:
        raise ValueError("the pipeline needs at least one stage and one virtual stage")
    chunks = num_stages * virtual_stages
    if first is not None or last is not None:
        if embedding_counts or loss_counts:
            raise ValueError("give the first and last stage's layers or count the embedding "
                             "and loss as layers, not both")
        if num_stages < (first is not None) + (last is not None):
            raise ValueError(f"{num_stages} pipeline stages have no room for a first and a "
                             "last stage of their own")
        middle_stages = num_stages - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        if middle_stages == 0 and virtual_stages > 1:
            # megatron-core's layer offset divides by the middle stages' count.
            raise ValueError("megatron-core cannot place virtual pipeline stages between a first "
                             "and a last stage with no stage between them: give the split as "
                             "--pipeline-model-parallel-layout")
        if middle_stages == 0 and middle_layers != 0 or middle_stages and (
                middle_layers < 0 or middle_layers % middle_stages):
            raise ValueError(f"the {middle_layers} layers left between the first and last "
                             f"pipeline stages cannot be split evenly over {middle_stages} stages")
        stages = [middle_layers // middle_stages if middle_stages else 0] * num_stages
        if first is not None:
            stages[0] = first
        if last is not None:
            stages[-1] = last
        for s, count in enumerate(stages):
            if count % virtual_stages:
                raise ValueError(f"the {count} layers of pipeline stage {s} cannot be split "
                                 f"evenly into {virtual_stages} virtual stages")
        counts = [stages[s] // virtual_stages for _ in range(virtual_stages)
                  for s in range(num_stages)]
    else:
        counted = num_layers + embedding_counts + loss_counts
        if counted % chunks:
            raise ValueError(f"{counted} layers (the embedding and loss counted as layers where "
                             f"asked) cannot be split evenly over {num_stages} pipeline stages"
                             + (f" of {virtual_stages} virtual stages" if virtual_stages > 1
                                else ""))
        counts = [counted // chunks] * chunks
        counts[0] -= embedding_counts
        counts[-1] -= loss_counts
    if min(counts) < 1:
        what = "stage" if virtual_stages == 1 else "model chunk"
        raise ValueError(f"the pipeline split {counts} leaves a {what} without a transformer layer")
    return tuple(counts)


def stage_totals(chunk_layers: tuple[int, ...], num_stages: int) -> tuple[int, ...]:
    """Transformer layers of each stage whose model chunks hold ``chunk_layers``, in Megatron's
    order (:func:`megatron_chunk_layers`)."""
    return tuple(sum(chunk_layers[s::num_stages]) for s in range(num_stages))


@dataclass(frozen=True)
class ExpertParallelism:
    """How a mixture-of-experts job shards its experts: Megatron's expert grid, expert tensor
    parallelism fastest, then expert parallelism, then expert data parallelism, folded over each
    pipeline stage's ranks in ``tp-dp`` order."""

    num_experts: int
    """Routed experts of every MoE layer (``--num-experts``)."""
    expert_parallel_size: int = 1
    """Ranks that split each MoE layer's experts between them (``--expert-model-parallel-size``)."""
    expert_tensor_parallel_size: int = 1
    """Ranks that split each expert's weights (``--expert-tensor-parallel-size``)."""

    @property
    def span(self) -> int:
        """Ranks of one expert-tensor-and-expert-parallel group: one copy of every expert."""
        return self.expert_parallel_size * self.expert_tensor_parallel_size

    def check(self, tp: int, dp: int) -> None:
        """Raise ``ValueError`` unless this sharding folds over a ``tp x dp`` stage the way the
        elastic layout can keep it: whole replicas per expert-parallel group, or whole groups per
        tensor-parallel group."""
        if self.num_experts < 1 or self.expert_parallel_size < 1 or self.expert_tensor_parallel_size < 1:
            raise ValueError("the number of experts and the expert parallel sizes must be positive")
        if self.num_experts % self.expert_parallel_size:
            raise ValueError(f"{self.num_experts} experts cannot be split evenly over "
                             f"{self.expert_parallel_size} expert-parallel ranks")
        if (tp * dp) % self.span:
            raise ValueError(f"expert tensor x expert parallel size {self.span} must divide the "
                             f"{tp * dp} ranks of a pipeline stage")
        if self.span % tp and tp % self.span:
            raise ValueError(f"expert tensor x expert parallel size {self.span} and tensor-parallel "
                             f"size {tp} must divide one another: an expert-parallel group holds "
                             "whole replicas or lies inside one tensor-parallel group")

    def lockstep(self, tp: int) -> int:
        """Replicas whose ranks share expert-parallel groups (1: the groups lie inside a
        tensor-parallel group)."""
        return max(1, self.span // tp)

    def coordinates(self, replica: int, tp_rank: int, tp: int) -> tuple[int, int, int]:
        """``(expert TP rank, expert-parallel rank, expert data-parallel rank)`` of the rank at
        ``tp_rank`` of replica ``replica`` (its data-parallel rank in Megatron's grid)."""
        local = tp_rank + tp * replica
        etp = self.expert_tensor_parallel_size
        return local % etp, (local // etp) % self.expert_parallel_size, local // self.span

    def local_experts(self, ep_rank: int) -> range:
        """Global indices of the experts an expert-parallel rank holds, as Megatron numbers them."""
        count = self.num_experts // self.expert_parallel_size
        return range(ep_rank * count, (ep_rank + 1) * count)

    def to_json(self) -> dict:
        return {"num_experts": self.num_experts, "expert_parallel_size": self.expert_parallel_size,
                "expert_tensor_parallel_size": self.expert_tensor_parallel_size}


@dataclass(frozen=True)
class StageInstance:
    """One pipeline stage of one replica: a tensor-parallel group and its layer range."""

    ranks: tuple[int, ...]
    """Global ranks of the tensor-parallel group, in TP-rank order."""
    first_layer: int
    """First layer held (0-based)."""
    last_layer: int
    """Last layer held (inclusive); ``last_layer < first_layer`` means no transformer layer."""

    def to_json(self) -> dict:
        return {"ranks": list(self.ranks), "layers": [self.first_layer, self.last_layer]}


@dataclass(frozen=True)
class Replica:
    """A data-parallel replica: a pipeline of stage instances and the micro-batches it runs."""

    index: int
    stages: tuple[StageInstance, ...]
    microbatch_ids: tuple[int, ...]
    """Global micro-batch ids this replica runs each step, in order."""
    virtual_stages: int = 1
    """Model chunks per stage (Megatron's virtual pipeline stages, run by the interleaved
    schedule). With more than one, the layers are split into ``len(stages) * virtual_stages``
    chunks (:attr:`chunk_layers`) and stage ``s`` holds chunks ``s``, ``s + len(stages)``, ...
    (:meth:`held_ranges`); its ``first_layer`` and ``last_layer`` are then the range a stage of
    the plain split would hold, as many layers, which is what the planner costs. A replica whose
    stages change is built with one."""
    chunk_layers: tuple[int, ...] = ()
    """Transformer layers of each model chunk in Megatron's order (every stage's first chunk,
    then every stage's second, ...) where the user split them unevenly
    (:func:`megatron_chunk_layers`); empty: as many in each. Only with virtual stages."""

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatch_ids)

    def held_ranges(self, stage_index: int) -> list[tuple[int, int]]:
        """The layer ranges stage ``stage_index`` holds, in layer order: its own range, or its
        virtual stages' ranges."""
        if self.virtual_stages == 1:
            stage = self.stages[stage_index]
            return [(stage.first_layer, stage.last_layer)]
        depth = len(self.stages)
        if self.chunk_layers:
            return layer_ranges(self.chunk_layers)[stage_index::depth]
        chunks = even_layer_split(self.stages[-1].last_layer + 1, depth * self.virtual_stages)
        return chunks[stage_index::depth]

    def stage_index_of_layer(self, layer: int) -> int:
        """Index of the stage that holds ``layer``."""
        for s in range(len(self.stages)):
            if any(first <= layer <= last for first, last in self.held_ranges(s)):
                return s
        raise ValueError(f"replica {self.index} holds no layer {layer}")

    def keeping_chunks(self, stages: tuple[StageInstance, ...],
                       microbatch_ids: tuple[int, ...]) -> "Replica":
        """This replica with ``stages`` and ``microbatch_ids``: its virtual stages (and their
        split) kept where the stages are the same and the interleaved schedule can run the
        micro-batches (at least one per stage), one chunk per stage otherwise."""
        if stages == self.stages and len(microbatch_ids) >= len(stages):
            return Replica(self.index, stages, microbatch_ids, self.virtual_stages,
                           self.chunk_layers)
        return Replica(self.index, stages, microbatch_ids)

    def to_json(self, with_microbatch_ids: bool = False) -> dict:
        record = {
            "replica": self.index,
            "stages": [stage.to_json() for stage in self.stages],
            "num_microbatches": self.num_microbatches,
        }
        if self.virtual_stages > 1:
            record["virtual_stages"] = self.virtual_stages
            for s, stage_record in enumerate(record["stages"]):
                stage_record["chunks"] = [list(chunk) for chunk in self.held_ranges(s)]
        if with_microbatch_ids:
            record["microbatch_ids"] = list(self.microbatch_ids)
        return record


@dataclass(frozen=True)
class Layout:
    """Every replica of a job, plus the ranks that are alive but hold no stage (spares)."""

    num_layers: int
    replicas: tuple[Replica, ...]
    spares: tuple[int, ...] = field(default=())
    experts: ExpertParallelism | None = None
    """How the MoE layers' experts are sharded; ``None`` for a dense model."""

    @classmethod
    def megatron(
        cls, *, tp: int, pp: int, dp: int, num_layers: int, num_microbatches: int,
        virtual_stages: int = 1, experts: ExpertParallelism | None = None,
        chunk_layers: tuple[int, ...] | None = None,
    ) -> "Layout":
        """The failure-free layout Megatron builds: the layers split into ``pp *
        virtual_stages`` model chunks as ``chunk_layers`` says (:func:`megatron_chunk_layers`;
        evenly by default), and the micro-batches dealt round-robin over replicas as
        Megatron-LM's pretraining sampler does (micro-batch ``j`` of the global batch goes to
        replica ``j % dp``). Raises ``ValueError`` where the split does not fit."""
        if experts is not None:
            experts.check(tp, dp)
        if num_microbatches % dp:
            raise ValueError(f"{num_microbatches} micro-batches cannot be dealt evenly to {dp} replicas")
        if chunk_layers is None:
            splits = even_layer_split(num_layers, pp)
            chunk_layers = ()
        elif (len(chunk_layers) != pp * virtual_stages or sum(chunk_layers) != num_layers
              or min(chunk_layers) < 1):
            raise ValueError(f"the pipeline split {list(chunk_layers)} does not hold "
                             f"{num_layers} layers in {pp * virtual_stages} non-empty chunks")
        else:
            splits = layer_ranges(stage_totals(chunk_layers, pp))
            chunk_layers = _uneven_chunks(chunk_layers, virtual_stages)
        replicas = []
        for d in range(dp):
            stages = tuple(
                StageInstance(
                    ranks=tuple(megatron_rank(t, d, s, tp=tp, dp=dp) for t in range(tp)),
                    first_layer=first,
                    last_layer=last,
                )
                for s, (first, last) in enumerate(splits)
            )
            replicas.append(Replica(d, stages, tuple(range(d, num_microbatches, dp)),
                                    virtual_stages, chunk_layers))
        layout = cls(num_layers=num_layers, replicas=tuple(replicas), experts=experts)
        layout.validate()
        return layout

    def with_replicas(self, replicas: tuple[Replica, ...], spares: tuple[int, ...] | None = None
                      ) -> "Layout":
        """This job's layout with other replicas (and spares: the same by default)."""
        return Layout(self.num_layers, tuple(replicas),
                      self.spares if spares is None else tuple(spares), self.experts)

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.replicas[0].stages[0].ranks) if self.replicas else 1

    @property
    def lockstep_size(self) -> int:
        """Replicas that run in lockstep (1 for a dense model, or experts inside TP groups)."""
        return 1 if self.experts is None else self.experts.lockstep(self.tensor_parallel_size)

    def lockstep_set(self, replica_index: int) -> int:
        """The lockstep set a replica belongs to (replicas ``k*C .. k*C + C - 1`` form set ``k``)."""
        return replica_index // self.lockstep_size

    def expert_coordinates(self, rank: int) -> tuple[int, int, int] | None:
        """``(expert TP rank, expert-parallel rank, expert data-parallel rank)`` of a rank that
        holds a stage of an MoE job; ``None`` for a dense job or a spare."""
        position = self.position(rank)
        if self.experts is None or position is None:
            return None
        return self.experts.coordinates(position[0], position[2], self.tensor_parallel_size)

    @property
    def global_num_microbatches(self) -> int:
        return sum(r.num_microbatches for r in self.replicas)

    def position(self, rank: int) -> tuple[int, int, int] | None:
        """``(replica, stage, tp_rank)`` of a rank, or ``None`` for a spare or unknown rank."""
        for replica in self.replicas:
            for s, stage in enumerate(replica.stages):
                if rank in stage.ranks:
                    return replica.index, s, stage.ranks.index(rank)
        return None

    def to_json(self, with_microbatch_ids: bool = False) -> list[dict]:
        """The ``layout`` value of the metrics file and of the plan CLI's ``replicas``."""
        return [r.to_json(with_microbatch_ids) for r in self.replicas]

    # ---- queries used by the planner -----------------------------------------------------------

    def replica_by_index(self) -> dict[int, Replica]:
        return {replica.index: replica for replica in self.replicas}

    def active_ranks(self) -> frozenset[int]:
        """Ranks that hold a stage."""
        return frozenset(rank for r in self.replicas for stage in r.stages for rank in stage.ranks)

    def known_ranks(self) -> frozenset[int]:
        """Ranks that hold a stage or are spares."""
        return self.active_ranks() | frozenset(self.spares)

    def layer_groups(self) -> list[tuple[int, int]]:
        """The coarsest common refinement of all replicas' stage boundaries: the layer ranges
        whose holders form one data-parallel group."""
        starts = sorted({first for r in self.replicas for s in range(len(r.stages))
                         for first, _ in r.held_ranges(s)} | {0})
        return [(first, end - 1) for first, end in zip(starts, starts[1:] + [self.num_layers])]

    def validate(self) -> None:
        """Raise ``ValueError`` unless every replica holds every layer exactly once in contiguous
        non-empty stages, no rank appears twice, and the micro-batch ids of all replicas are a
        permutation of ``0..M-1``."""
        seen: set[int] = set()
        for replica in self.replicas:
            expected_first = 0
            for stage in replica.stages:
                if stage.first_layer != expected_first or stage.last_layer < stage.first_layer:
                    raise ValueError(f"replica {replica.index}: stages do not cover the layers in order")
                expected_first = stage.last_layer + 1
                if seen & set(stage.ranks) or len(set(stage.ranks)) != len(stage.ranks):
                    raise ValueError(f"replica {replica.index}: a rank appears twice")
                seen.update(stage.ranks)
            if expected_first != self.num_layers:
                raise ValueError(f"replica {replica.index}: stages do not cover all {self.num_layers} layers")
            if replica.virtual_stages > 1:
                self._validate_chunks(replica)
            elif replica.chunk_layers:
                raise ValueError(f"replica {replica.index}: a chunk split without virtual stages")
        if seen & set(self.spares) or len(set(self.spares)) != len(self.spares):
            raise ValueError("a spare also holds a stage, or appears twice")
        ids = sorted(i for r in self.replicas for i in r.microbatch_ids)
        if ids != list(range(len(ids))):
            raise ValueError("micro-batch ids are not a permutation of 0..M-1")
        if len({r.index for r in self.replicas}) != len(self.replicas):
            raise ValueError("two replicas share an index")
        if self.lockstep_size > 1:
            self._validate_lockstep()

    def _validate_chunks(self, replica: Replica) -> None:
        """Raise ``ValueError`` unless ``replica``'s virtual stages split its stages' layers
        into non-empty chunks and it runs at least one micro-batch per stage."""
        depth, chunks = len(replica.stages), len(replica.stages) * replica.virtual_stages
        if replica.chunk_layers:
            stages = tuple(s.last_layer - s.first_layer + 1 for s in replica.stages)
            fits = (len(replica.chunk_layers) == chunks and min(replica.chunk_layers) >= 1
                    and stage_totals(replica.chunk_layers, depth) == stages)
        else:
            fits = self.num_layers % chunks == 0
        if not fits or replica.num_microbatches < depth:
            raise ValueError(
                f"replica {replica.index}: {replica.virtual_stages} virtual stages need the "
                f"stages' layers to split into {chunks} non-empty chunks and at least "
                f"{depth} micro-batches")

    def _validate_lockstep(self) -> None:
        """Raise ``ValueError`` unless every lockstep set is whole and its replicas run the same
        pipeline on as many micro-batches."""
        size = self.lockstep_size
        sets: dict[int, list[Replica]] = {}
        for replica in self.replicas:
            sets.setdefault(self.lockstep_set(replica.index), []).append(replica)
        for index, members in sorted(sets.items()):
            if sorted(r.index for r in members) != list(range(index * size, (index + 1) * size)):
                raise ValueError(f"replicas {sorted(r.index for r in members)} share expert-"
                                 f"parallel groups with replicas they run without")
            shapes = {(tuple((s.first_layer, s.last_layer) for s in r.stages), r.num_microbatches,
                       r.virtual_stages, r.chunk_layers) for r in members}
            if len(shapes) != 1:
                raise ValueError(f"replicas {[r.index for r in members]} share expert-parallel "
                                 "groups but differ in stages or micro-batches")

    @classmethod
    def from_json(cls, replicas: list[dict], spares: list[int] = (),
                  experts: dict | None = None) -> "Layout":
        """Inverse of :meth:`to_json` with micro-batch ids (the plan CLI's ``replicas`` list);
        ``experts`` as :meth:`ExpertParallelism.to_json` gives it."""
        built = []
        for record in replicas:
            stages = tuple(
                StageInstance(tuple(s["ranks"]), s["layers"][0], s["layers"][1]) for s in record["stages"]
            )
            virtual_stages = record.get("virtual_stages", 1)
            built.append(Replica(record["replica"], stages, tuple(record["microbatch_ids"]),
                                 virtual_stages, _chunk_layers_of(record, virtual_stages)))
        num_layers = built[0].stages[-1].last_layer + 1 if built else 0
        layout = cls(num_layers=num_layers, replicas=tuple(built), spares=tuple(spares),
                     experts=ExpertParallelism(**experts) if experts else None)
        layout.validate()
        return layout


def _uneven_chunks(chunk_layers: tuple[int, ...], virtual_stages: int) -> tuple[int, ...]:
    """:attr:`Replica.chunk_layers` for chunks of ``chunk_layers`` layers: themselves where
    virtual stages split the layers unevenly, empty otherwise."""
    if virtual_stages == 1 or len(set(chunk_layers)) <= 1:
        return ()
    return tuple(chunk_layers)


def _chunk_layers_of(record: dict, virtual_stages: int) -> tuple[int, ...]:
    """:attr:`Replica.chunk_layers` of a replica's JSON record: its stages' ``chunks`` in
    Megatron's order, empty where they split evenly."""
    if virtual_stages == 1 or any("chunks" not in stage for stage in record["stages"]):
        return ()
    return _uneven_chunks(tuple(last - first + 1 for v in range(virtual_stages)
                                for stage in record["stages"]
                                for first, last in [stage["chunks"][v]]), virtual_stages)
