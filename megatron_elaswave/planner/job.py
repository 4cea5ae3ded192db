"""The failure-free job the planner starts from: the parallel grid (with its expert grid, for a
mixture-of-experts model) and the global batch."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_elaswave.layout import ExpertParallelism, Layout, even_layer_split, layer_ranges


@dataclass(frozen=True)
class JobSpec:
    """A TP x PP x DP job in Megatron's rank order, with its global batch."""

    tensor_parallel_size: int
    """Ranks per tensor-parallel group (one stage instance)."""
    pipeline_parallel_size: int
    """Pipeline stages per replica in the failure-free layout."""
    data_parallel_size: int
    """Replicas in the failure-free layout."""
    num_layers: int
    """Transformer layers of the model."""
    global_batch_size: int
    """Samples per optimizer step; never changes after a failure."""
    micro_batch_size: int
    """Samples per micro-batch."""
    zero_chunks_per_replica: int = 1
    """Interleaved ZeRO granularity: each layer's optimizer state is cut into
    ``zero_chunks_per_replica * data_parallel_size`` chunks."""
    ranks_per_node: int | None = None
    """Launch ranks per node, which fail together when a node is lost (``None``: one node)."""
    experts: ExpertParallelism | None = None
    """How an MoE model's experts are sharded over each stage's ranks; ``None`` for a dense
    model. Checked against the grid (:meth:`ExpertParallelism.check`)."""
    stage_layers: tuple[int, ...] | None = None
    """Transformer layers of each pipeline stage in the failure-free layout, as Megatron's
    uneven split gives them (:func:`~megatron_elaswave.layout.stage_totals` of its chunks);
    ``None``: an even split."""

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "num_layers",
            "global_batch_size",
            "micro_batch_size",
            "zero_chunks_per_replica",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be positive, got {self.ranks_per_node!r}")
        if self.stage_layers is not None:
            if (len(self.stage_layers) != self.pipeline_parallel_size
                    or sum(self.stage_layers) != self.num_layers or min(self.stage_layers) < 1):
                raise ValueError(f"stage_layers {list(self.stage_layers)} must give each of the "
                                 f"{self.pipeline_parallel_size} stages at least one of the "
                                 f"{self.num_layers} layers")
        elif self.num_layers % self.pipeline_parallel_size:
            raise ValueError(
                f"num_layers ({self.num_layers}) must be divisible by pipeline_parallel_size "
                f"({self.pipeline_parallel_size})"
            )
        if self.global_batch_size % (self.micro_batch_size * self.data_parallel_size):
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be divisible by "
                f"micro_batch_size * data_parallel_size ({self.micro_batch_size * self.data_parallel_size})"
            )
        if self.experts is not None:
            self.experts.check(self.tensor_parallel_size, self.data_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def num_microbatches(self) -> int:
        """Micro-batches in one global batch (all replicas together)."""
        return self.global_batch_size // self.micro_batch_size

    @property
    def zero_chunks_per_layer(self) -> int:
        return self.zero_chunks_per_replica * self.data_parallel_size

    @property
    def lockstep_size(self) -> int:
        """Replicas that share expert-parallel groups (1 for a dense model)."""
        return 1 if self.experts is None else self.experts.lockstep(self.tensor_parallel_size)

    def initial_layout(self) -> Layout:
        """Megatron's failure-free layout of the job, its expert grid included."""
        return Layout.megatron(
            tp=self.tensor_parallel_size,
            pp=self.pipeline_parallel_size,
            dp=self.data_parallel_size,
            num_layers=self.num_layers,
            num_microbatches=self.num_microbatches,
            experts=self.experts,
            chunk_layers=self.stage_layers,
        )

    def initial_ranges(self) -> list[tuple[int, int]]:
        """The layer range of each stage of a failure-free replica."""
        if self.stage_layers is None:
            return even_layer_split(self.num_layers, self.pipeline_parallel_size)
        return layer_ranges(self.stage_layers)
