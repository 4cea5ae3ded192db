"""Megatron objects for any layout, heterogeneous replicas included: one model chunk per layer group.

A replica that lost a stage re-partitions its layers over fewer stages, so replicas end up with
different stage boundaries. The *layer groups* are the coarsest common refinement of every
replica's boundaries (:meth:`Layout.layer_groups`). A rank builds one ``GPTModel`` chunk per layer
group of its stage, each in its own ``DistributedDataParallel`` over that layer group's
data-parallel group (its holders at this TP rank, one per replica) with its own
``DistributedOptimizer``; the optimizers are chained. A stage's chunks are consecutive layer
groups and run back to back as one pipeline stage (:class:`ChunkSequence`), so the stock 1F1B and
no-pipelining schedules drive every replica, whatever its depth. A replica with virtual pipeline
stages (:attr:`~megatron_elaswave.layout.Replica.virtual_stages`) runs the stock interleaved
schedule instead, one :class:`ChunkSequence` per virtual stage; its virtual boundaries are among
the layer groups' like any stage boundary.

With interleaved ZeRO (``--elastic-zero interleaved``) a rank builds one chunk per *layer* instead,
each over the data-parallel group of the layer group it belongs to: every layer's optimizer state
is then sharded over that layer's holders alone, so a layer whose holders did not change keeps its
shards where they are after a re-partition, and moving a layer or recovering a lost shard is a set
of rank-to-rank copies of that layer's state only. The chunks of one layer group share one
bucket group (:func:`~megatron_elaswave.patches.distributed_data_parallel.share_bucket_groups`),
so their gradient reduce-scatter and parameter all-gather stay one coalesced collective each, as
with one chunk per layer group.

Gradients are normalised by the token count of the whole global batch (one all-reduce over
every active rank), and the gradient norm is reduced over the same group, so any split of the
global batch over replicas and micro-batches gives the same update. With tied embeddings the
first chunk's word embedding and the last chunk's output weight are two copies, as on Megatron's
first and last pipeline stages: each replica sums their gradients before the data-parallel
reduction (over its embedding group, or on the rank that holds both), so both copies take the
same update. With the failure-free grid
the layer groups are the stages and every object is the one Megatron builds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer import ChainedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import get_attr_wrapped_model

from megatron_elaswave.layout import Layout
from megatron_elaswave.patches.distributed_data_parallel import (
    distributed_data_parallel,
    share_bucket_groups,
)
from megatron_elaswave.patches.gpt_model import compute_mtp_loss_as_built
from megatron_elaswave.patches.optimizer import agree_grad_norm_groups, param_groups_aligned_on
from megatron_elaswave.patches.parallel_state import install_process_groups, pipeline_position
from megatron_elaswave.patches.process_groups_config import process_group_collection
from megatron_elaswave.runtime.communicator import GroupRegistry, Role

from .model import (
    TrainingObjects,
    allocate_optimizer_state,
    build_scheduler,
    layer_spec,
    layout_invariant_init,
    mtp_block_spec,
    optimizer_config,
    place_chunk,
    seed_random_generators,
    transformer_config,
)


class LayerGroupStage:
    """What a chunk's model code sees as its pipeline group: the chunk's place among the model's
    chunks. Megatron's model code asks it only for ``rank()`` and ``size()`` (layer offset and
    count, first/last stage); it never issues a collective on it."""

    def __init__(self, index: int, count: int) -> None:
        self.index, self.count = index, count

    def rank(self) -> int:
        return self.index

    def size(self) -> int:
        return self.count


class ChunkSequence(torch.nn.Module):
    """A stage made of several consecutive layer-group chunks, run as one stage by the schedules.

    The schedule's input tensor goes to the first chunk; each chunk's output is the next one's
    input. Autograd spans the chunks, so one backward covers them all.
    """

    def __init__(self, chunks: list[DistributedDataParallel], config,
                 vp_stage: int | None = None) -> None:
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)
        self.config = config
        """What the schedule reads (:func:`interleaved_schedule_config` for virtual stages)."""
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = chunks[0].module.pre_process
        self.post_process = chunks[-1].module.post_process
        self.mtp_process = getattr(chunks[-1].module, "mtp_process", False)
        self.vp_stage = vp_stage
        """This stage's index among the rank's virtual stages; ``None`` in a plain pipeline."""

    def set_input_tensor(self, tensor) -> None:
        get_attr_wrapped_model(self.chunks[0], "set_input_tensor")(tensor)

    def forward(self, *args, **kwargs):
        hidden = None
        for index, chunk in enumerate(self.chunks):
            if index > 0:
                get_attr_wrapped_model(chunk, "set_input_tensor")(hidden)
            hidden = chunk(*args, **kwargs)
        return hidden


def interleaved_schedule_config(config: TransformerConfig,
                                virtual_stages: int) -> TransformerConfig:
    """What the interleaved schedule and its P2P communicator read for ``virtual_stages``
    model chunks per stage: a copy of the chunks' config, which describes each chunk as a stage
    of its own and must stay so for the model code.

    Its messages are not batched: with two stages the schedule batches an activation and a
    gradient to the same peer, which gloo pairs by posting order (swapped on the two sides)."""
    schedule_config = copy.copy(config)
    schedule_config.virtual_pipeline_model_parallel_size = virtual_stages
    schedule_config.batch_p2p_comm = False
    return schedule_config


def pipeline_layout_string(groups: list[tuple[int, int]], mtp_num_layers: int = 0) -> str:
    """Megatron's ``pipeline_model_parallel_layout`` with one pipeline stage per model chunk, the
    multi-token prediction layers on the last, with the loss."""
    stages = []
    for index, (first, last) in enumerate(groups):
        stage = "t" * (last - first + 1)
        if index == 0:
            stage = "E" + stage
        if index == len(groups) - 1:
            stage += "m" * mtp_num_layers + "L"
        stages.append(stage)
    return "|".join(stages)


@dataclass
class StageObjects(TrainingObjects):
    """:class:`TrainingObjects` of one rank of a layout, with what its schedule needs.

    ``optimizer.chained_optimizers`` holds the ``DistributedOptimizer`` of each chunk, in the
    order of ``model``: two for a chunk with experts (its dense parameters', then its experts').
    """

    virtual_stages: list[torch.nn.Module] = None
    """The modules the schedule runs, one per virtual stage: the only chunk, or a
    :class:`ChunkSequence` each."""
    schedule_groups: ProcessGroupCollection = None
    """The groups the schedule and its P2P communication use (the replica's pipeline)."""

    @property
    def stages(self) -> list[torch.nn.Module]:
        return self.virtual_stages


@dataclass(frozen=True)
class ChunkRange:
    """The layers of one model chunk and the layer group whose data-parallel group it uses."""

    first_layer: int
    last_layer: int
    layer_group: int


def chunk_ranges(layout: Layout, zero: str) -> list[ChunkRange]:
    """The model chunks of ``layout``, in layer order: one per layer group (``contiguous``) or
    one per layer (``interleaved``)."""
    ranges = []
    for g, (first, last) in enumerate(layout.layer_groups()):
        if zero == "interleaved":
            ranges += [ChunkRange(layer, layer, g) for layer in range(first, last + 1)]
        elif zero == "contiguous":
            ranges.append(ChunkRange(first, last, g))
        else:
            raise ValueError(f"unknown ZeRO sharding {zero!r}: interleaved or contiguous")
    return ranges


@dataclass(frozen=True)
class ModelFactory:
    """How a rank builds its model chunks (the job's config, one ``GPTModel`` per chunk) and
    its LR schedule.

    The default builds what ``pretrain_gpt.py``'s flags describe; Megatron-LM runs pass their
    own ``core_transformer_config_from_args``, model provider, optimizer config, scheduler and
    the random state Megatron-LM's initialisation left.
    """

    config: Callable[[], TransformerConfig]
    """The job's transformer config; the per-chunk pipeline fields are set on a fresh one."""
    build_chunk: Callable[[TransformerConfig, bool, bool, ProcessGroupCollection], GPTModel]
    """``(config, pre_process, post_process, pg_collection) -> GPTModel`` for one chunk."""
    scheduler: Callable[[ChainedOptimizer], OptimizerParamScheduler]
    """The LR and weight-decay schedule of the stage's optimizer."""
    optimizer_config: Callable[[], tuple[OptimizerConfig, dict | None]]
    """The optimizer's config and its parameter-group overrides (``None``: megatron-core's
    standard ones, no weight decay on biases and 1-D parameters)."""
    seed_generators: Callable[[ProcessGroupCollection], None]
    """Sets this rank's random generators, given its first layer group's groups, before the
    chunks of the job's first layout are built: where Megatron's initialisation
    (``--elastic-init megatron``) and its dropout streams (``--elastic-rng megatron``) start."""

    @classmethod
    def from_flags(cls, args: argparse.Namespace, vocab_size: int) -> "ModelFactory":
        def build_chunk(config, pre_process, post_process, pg_collection):
            return GPTModel(
                config=config,
                transformer_layer_spec=layer_spec(config, pg_collection.pp.rank()),
                mtp_block_spec=mtp_block_spec(config, pg_collection.pp.rank()),
                vocab_size=vocab_size,
                max_sequence_length=args.max_position_embeddings,
                pre_process=pre_process,
                post_process=post_process,
                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                position_embedding_type=args.position_embedding_type,
                pg_collection=pg_collection,
            )

        return cls(config=lambda: transformer_config(args, batch_p2p_comm=True),
                   build_chunk=build_chunk,
                   scheduler=lambda optimizer: build_scheduler(args, optimizer),
                   optimizer_config=lambda: (optimizer_config(args), None),
                   seed_generators=lambda groups: seed_random_generators(args.seed, groups))


def _chunk_config(factory: ModelFactory, ranges: list[ChunkRange]) -> TransformerConfig:
    groups = [(r.first_layer, r.last_layer) for r in ranges]
    config = factory.config()
    config.batch_p2p_comm = True  # 1F1B sends one message per peer at a time
    config.pipeline_model_parallel_size = len(groups)
    config.virtual_pipeline_model_parallel_size = None
    # The chunks' layout says where each layer is; the user's uneven split gave the first layout.
    config.num_layers_in_first_pipeline_stage = None
    config.num_layers_in_last_pipeline_stage = None
    config.account_for_embedding_in_pipeline_split = False
    config.account_for_loss_in_pipeline_split = False
    if len(groups) > 1:
        # Set after construction: the config checks a layout against the job's pipeline size.
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,
        )

        config.pipeline_model_parallel_layout = PipelineParallelLayerLayout.from_str(
            pipeline_layout_string(groups, config.mtp_num_layers or 0), len(groups))
    else:
        config.pipeline_model_parallel_layout = None
    return config


def chunk_ddp_config(args: argparse.Namespace, *,
                     holds_tied_copy: bool) -> DistributedDataParallelConfig:
    """The DDP config of one chunk: Megatron's distributed optimizer with fp32 gradient
    reduction, overlapped with the backward pass and the next forward where the flags ask for it
    (``--overlap-grad-reduce``, ``--overlap-param-gather``, ``--ddp-bucket-size``; Megatron-LM's
    names).

    A chunk that holds a copy of a tied embedding reduces its gradients at the step, never
    overlapped: each replica sums the two copies' gradients before the data-parallel reduction
    (:func:`sum_tied_embedding_grads`), which an overlapped reduction would already have begun.
    Every holder of a layer group decides alike, so a group's reduction is one collective."""
    overlap = bool(getattr(args, "overlap_grad_reduce", False)) and not holds_tied_copy
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
        overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
        use_distributed_optimizer=True,
        bucket_size=getattr(args, "ddp_bucket_size", None) if overlap else None)


def schedule_no_sync(stages: list[torch.nn.Module]) -> Callable | list[Callable] | None:
    """What the schedule takes as ``config.no_sync_func`` for ``stages`` (one per virtual stage):
    a context that holds back the overlapped gradient reduction of every chunk of a stage until
    its last micro-batch; ``None`` where no chunk overlaps it."""
    chunks_of = [list(stage.chunks) if isinstance(stage, ChunkSequence) else [stage]
                 for stage in stages]
    if not any(chunk.ddp_config.overlap_grad_reduce for chunks in chunks_of for chunk in chunks):
        return None

    def no_sync_of(chunks):
        def no_sync():
            stack = contextlib.ExitStack()
            for chunk in chunks:
                stack.enter_context(chunk.no_sync())
            return stack

        return no_sync

    funcs = [no_sync_of(chunks) for chunks in chunks_of]
    return funcs[0] if len(funcs) == 1 else funcs


@contextlib.contextmanager
def forward_pre_hooks_on(chunks: list[DistributedDataParallel]):
    """Within: the forward pre-hooks that gather the parameters of chunks with
    ``--overlap-param-gather`` are on (Megatron-LM's ``train()`` turns them off for its first
    iteration and its evaluations); after, those that were off are off again, without a sync."""
    turned_on = [chunk for chunk in chunks if chunk.ddp_config.overlap_param_gather
                 and not chunk.remove_forward_pre_hook_handles]
    for chunk in turned_on:
        chunk.enable_forward_pre_hook()
    try:
        yield
    finally:
        for chunk in turned_on:
            chunk.disable_forward_pre_hook(param_sync=False)


def tied_embedding_copies(chunks: list[DistributedDataParallel]) -> list[torch.nn.Parameter]:
    """The copies of the word embedding that this rank's chunks hold as parameters of their own
    (:func:`holds_tied_copy`)."""
    return [ddp.module.shared_embedding_or_output_weight() for ddp in chunks
            if holds_tied_copy(ddp.module)]


def holds_tied_copy(chunk: GPTModel) -> bool:
    """Whether ``chunk`` holds one of the two copies of the word embedding that Megatron keeps
    equal: the first chunk's embedding and, when the model ties it to the output layer, the last
    chunk's output weight, or, with multi-token prediction, the embedding of the chunk with those
    layers (in one chunk they are one parameter)."""
    if chunk.share_embeddings_and_output_weights:
        return chunk.pre_process != chunk.post_process
    if chunk.config.mtp_num_layers:
        return chunk.pre_process != getattr(chunk, "mtp_process", False)
    return False


@torch.no_grad()
def sum_tied_copies(tensors: list[torch.Tensor], embedding_group: dist.ProcessGroup | None) -> None:
    """Give each of this replica's tensors of the two tied-embedding copies (their gradients, or
    their values) the sum of both: the first and last stage of the replica at this TP rank add
    theirs over ``embedding_group``; a rank that holds both copies (a one-stage replica of a
    deeper layout) adds them itself."""
    if len(tensors) == 2:
        total = tensors[0] + tensors[1]
        for tensor in tensors:
            tensor.copy_(total)
    elif tensors:
        dist.all_reduce(tensors[0], group=embedding_group)


def sum_tied_embedding_grads(copies: list[torch.nn.Parameter],
                             embedding_group: dist.ProcessGroup | None) -> None:
    """Give each copy of the tied embedding the sum of both uses' gradients in this replica,
    before the data-parallel reduction (:func:`sum_tied_copies`). Every replica then reduces
    the same sum over each copy's layer group, whatever the layouts, so the copies stay equal."""
    sum_tied_copies([copy.main_grad for copy in copies], embedding_group)


def build_stage_objects(args: argparse.Namespace, layout: Layout, registry: GroupRegistry,
                        factory: ModelFactory, device: torch.device, *,
                        initialize: bool = True) -> StageObjects:
    """Model chunks, DDPs, optimizers and LR schedule of this rank's stage in ``layout``.

    Collective over the holders of each of this rank's layer groups. With ``initialize`` the
    parameters are initialised as ``--elastic-init`` says; without it they are left for a
    restore to fill.
    """
    ranges = chunk_ranges(layout, args.elastic_zero)
    config = _chunk_config(factory, ranges)
    rank = registry.rank
    replica_index, stage_index, tp_rank = layout.position(rank)
    replica = layout.replica_by_index()[replica_index]
    held_ranges = replica.held_ranges(stage_index)
    virtual = [[c for c, chunk_range in enumerate(ranges) if first <= chunk_range.first_layer <= last]
               for first, last in held_ranges]
    held = [c for chunks_of_range in virtual for c in chunks_of_range]
    tp, pp, world = registry.group(Role.TP), registry.group(Role.PP), registry.group(Role.WORLD)
    cp = registry.group(Role.CP)
    install_process_groups(registry.process_group_collection(ranges[held[0]].layer_group))
    opt_config, param_overrides = factory.optimizer_config()
    # Megatron's routers scale their aux losses by the config's per-token flag as built, the
    # schedules and DDP by its value when they run: the job's flag for the first (and for the
    # multi-token prediction loss), the global token count (every split of the batch alike) for
    # the others.
    routers_per_token = config.calculate_per_token_loss
    chunks, chunk_groups, optimizers = [], [], []
    for c in held:
        g = ranges[c].layer_group
        dp = registry.group(Role.DP, (g, tp_rank))
        expert_groups = registry.expert_groups(g)
        tp_dp = registry.group(Role.TP_DP, (g,))
        model_groups = process_group_collection(tp=tp, cp=cp, pp=LayerGroupStage(c, len(ranges)),
                                              embd=None, pos_embd=None, tp_cp=tp,
                                              tp_dp_cp=tp_dp, **expert_groups)
        config.calculate_per_token_loss = routers_per_token
        with pipeline_position(c, len(ranges)):
            chunk = factory.build_chunk(config, c == 0, c == len(ranges) - 1, model_groups)
        compute_mtp_loss_as_built(chunk)
        config.calculate_per_token_loss = True
        ddp_config = chunk_ddp_config(args, holds_tied_copy=holds_tied_copy(chunk))
        place_chunk(chunk, config, device)
        if initialize and args.elastic_init == "invariant":
            expert_tp = expert_groups["expt_tp"]
            layout_invariant_init(chunk, config, args.seed, tp_rank, tp.size(),
                                  (expert_tp.rank(), expert_tp.size()))
        # The tied embedding's two uses are summed by ``finalize`` below, so Megatron's own
        # embedding groups are this rank alone (``None`` would make it read the global ones).
        groups_of_chunk = process_group_collection(
            tp=tp, cp=cp, pp=pp, embd=cp, pos_embd=cp, dp=dp, dp_cp=dp, intra_dp_cp=dp,
            intra_dist_opt=world, mp=LayerGroupStage(c, len(ranges)), tp_ep_pp=None, tp_cp=tp,
            tp_dp_cp=tp_dp, **expert_groups,
        )
        ddp = distributed_data_parallel(config, ddp_config, chunk, groups_of_chunk)
        with param_groups_aligned_on(dp):
            optimizers += get_megatron_optimizer(
                opt_config, [ddp], config_overrides=param_overrides, use_gloo_process_groups=False,
                pg_collection=groups_of_chunk).chained_optimizers
        chunks.append(ddp)
        chunk_groups.append(groups_of_chunk)
    # ``finalize`` syncs the chunks' gradients, and the chained optimizer steps them, in order.
    if not any(chunk.ddp_config.overlap_grad_reduce for chunk in chunks):
        share_bucket_groups(chunks)
    optimizer = ChainedOptimizer(optimizers)
    # A host tensor: the world's gloo twin where the device backend is not gloo.
    agree_grad_norm_groups(optimizer, registry.host_group(Role.WORLD))
    allocate_optimizer_state(optimizers)
    tied = tied_embedding_copies(chunks)
    embedding_group = registry.group(Role.EMBEDDING) if len(tied) == 1 else None
    if initialize and args.elastic_init == "megatron" and tied:
        # Megatron zeroes the output layer's copy and sums the two over its embedding group;
        # the optimizers' main copies of half-precision parameters were taken before.
        sum_tied_copies([copy.data for copy in tied], embedding_group)
        optimizer.reload_model_params()

    def finalize(model, num_tokens, pg_collection=None, force_all_reduce=False):
        """The tied embedding's two uses summed in each replica, each chunk's reduce-scatter
        over its layer group, then the global token scale."""
        sum_tied_embedding_grads(tied, embedding_group)
        for ddp, chunk_pgc in zip(chunks, chunk_groups):
            finalize_model_grads([ddp], None, pg_collection=chunk_pgc,
                                 force_all_reduce=force_all_reduce)
        # Every tensor-parallel rank of a loss stage counts the same tokens: one of them adds.
        tokens = num_tokens.clone() if tp.rank() == 0 else torch.zeros_like(num_tokens)
        dist.all_reduce(tokens, group=world)
        for ddp in chunks:
            ddp.scale_gradients(1.0 / max(tokens.item(), 1))

    config.finalize_model_grads_func = finalize
    if len(virtual) == 1:
        stage_modules = [chunks[0] if len(chunks) == 1 else ChunkSequence(chunks, config)]
    else:
        config = interleaved_schedule_config(config, len(virtual))
        position = {c: index for index, c in enumerate(held)}
        stage_modules = [ChunkSequence([chunks[position[c]] for c in chunks_of_range], config,
                                       vp_stage=v)
                         for v, chunks_of_range in enumerate(virtual)]
    schedule_groups = process_group_collection(tp=tp, cp=cp, pp=pp, embd=None, pos_embd=None,
                                             dp_cp=chunk_groups[0].dp)
    return StageObjects(
        config=config,
        model=chunks,
        optimizer=optimizer,
        scheduler=factory.scheduler(optimizer),
        virtual_stages=stage_modules,
        schedule_groups=schedule_groups,
    )
