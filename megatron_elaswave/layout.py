"""The layout of a hybrid-parallel job: which ranks hold which layers, and which micro-batches
each data-parallel replica runs.

A job starts as a TP x PP x DP grid in Megatron's rank order ``tp-cp-ep-dp-pp`` (tensor-parallel
rank fastest, then data-parallel, then pipeline; context and expert parallelism are 1). A *stage
instance* is the tensor-parallel group that holds one pipeline stage of one replica: it is the
failure domain. After failures, replicas may have different numbers of stages; every replica
still holds every layer exactly once, as contiguous ranges, or as Megatron's virtual pipeline
stages where the replica runs the interleaved schedule (:attr:`Replica.virtual_stages`).

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
    per_stage = num_layers // num_stages
    return [(s * per_stage, (s + 1) * per_stage - 1) for s in range(num_stages)]


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
    schedule). With more than one, the layers are split evenly into ``len(stages) *
    virtual_stages`` chunks and stage ``s`` holds chunks ``s``, ``s + len(stages)``, ...
    (:meth:`held_ranges`); its ``first_layer`` and ``last_layer`` are then the range a stage of
    the plain split would hold, as many layers, which is what the planner costs. A replica whose
    stages change is built with one."""

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
        """This replica with ``stages`` and ``microbatch_ids``: its virtual stages kept where the
        stages are the same and the interleaved schedule can run the micro-batches (at least one
        per stage), one chunk per stage otherwise."""
        keep = stages == self.stages and len(microbatch_ids) >= len(stages)
        return Replica(self.index, stages, microbatch_ids, self.virtual_stages if keep else 1)

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

    @classmethod
    def megatron(
        cls, *, tp: int, pp: int, dp: int, num_layers: int, num_microbatches: int,
        virtual_stages: int = 1,
    ) -> "Layout":
        """The failure-free layout Megatron builds: even layer split (into ``virtual_stages``
        chunks per stage), and the micro-batches dealt round-robin over replicas as
        Megatron-LM's pretraining sampler does (micro-batch ``j`` of the global batch goes to
        replica ``j % dp``)."""
        if num_microbatches % dp:
            raise ValueError(f"{num_microbatches} micro-batches cannot be dealt evenly to {dp} replicas")
        splits = even_layer_split(num_layers, pp)
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
                                    virtual_stages))
        layout = cls(num_layers=num_layers, replicas=tuple(replicas))
        layout.validate()
        return layout

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
                chunks = len(replica.stages) * replica.virtual_stages
                if self.num_layers % chunks or replica.num_microbatches < len(replica.stages):
                    raise ValueError(
                        f"replica {replica.index}: {replica.virtual_stages} virtual stages need "
                        f"the layers to split evenly into {chunks} chunks and at least "
                        f"{len(replica.stages)} micro-batches")
        if seen & set(self.spares) or len(set(self.spares)) != len(self.spares):
            raise ValueError("a spare also holds a stage, or appears twice")
        ids = sorted(i for r in self.replicas for i in r.microbatch_ids)
        if ids != list(range(len(ids))):
            raise ValueError("micro-batch ids are not a permutation of 0..M-1")
        if len({r.index for r in self.replicas}) != len(self.replicas):
            raise ValueError("two replicas share an index")

    @classmethod
    def from_json(cls, replicas: list[dict], spares: list[int] = ()) -> "Layout":
        """Inverse of :meth:`to_json` with micro-batch ids (the plan CLI's ``replicas`` list)."""
        built = []
        for record in replicas:
            stages = tuple(
                StageInstance(tuple(s["ranks"]), s["layers"][0], s["layers"][1]) for s in record["stages"]
            )
            built.append(Replica(record["replica"], stages, tuple(record["microbatch_ids"]),
                                 record.get("virtual_stages", 1)))
        num_layers = built[0].stages[-1].last_layer + 1 if built else 0
        layout = cls(num_layers=num_layers, replicas=tuple(built), spares=tuple(spares))
        layout.validate()
        return layout
