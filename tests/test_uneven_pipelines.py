"""Uneven pipelines as the user sets them: ``--decoder-first/last-pipeline-num-layers``,
``--account-for-embedding/loss-in-pipeline-split`` and ``--pipeline-model-parallel-layout``
give the elastic job's first layout, split as megatron-core splits it; what the elastic layout
cannot start from is refused in one line.

The jobs themselves are in ``tests/test_plain_oracle.py``: ``scripts/pretrain_gpt.py`` against
its plain megatron-core path, and Megatron-LM's loop against itself without ``--elastic``, each
through a SIGKILL and the replacement's rejoin back to the uneven layout.
"""

from __future__ import annotations

import pytest
import torch

from megatron_elaswave.layout import Layout, megatron_chunk_layers
from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.training.arguments import (
    ArgumentError,
    parse_args,
    pipeline_chunk_layers,
    validate_elastic,
)

BASE = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "64"]
ELASTIC = ["--elastic", "--use-distributed-optimizer"]


def megatron_core_split(num_layers: int, pp: int, vpp: int, **fields) -> tuple[int, ...]:
    """Layers per model chunk, in pipeline order, as megatron-core's ``get_num_layers_to_build``
    counts them, and each chunk's first layer as ``get_transformer_layer_offset`` places it:
    they must follow one another."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                               **fields)
    stage = [None] if vpp == 1 else range(vpp)
    counts = [get_num_layers_to_build(config, vp_stage=v, pp_rank=rank)
              for v in stage for rank in range(pp)]
    offsets = [get_transformer_layer_offset(config, vp_stage=v, pp_rank=rank)
               for v in stage for rank in range(pp)]
    assert offsets == [sum(counts[:c]) for c in range(len(counts))]
    return tuple(counts)


@pytest.mark.parametrize("num_layers, pp, vpp, first, last, embedding, loss", [
    (7, 4, 1, 1, None, False, False),
    (7, 4, 1, None, 1, False, False),
    (10, 4, 1, 2, 2, False, False),
    (8, 2, 1, 3, None, False, False),
    (8, 2, 1, 5, 3, False, False),
    (7, 4, 1, None, None, True, False),
    (6, 4, 1, None, None, True, True),
    (5, 2, 1, None, None, False, True),
    (6, 2, 2, 2, None, False, False),
    (12, 3, 2, 2, 6, False, False),
    (16, 3, 4, 4, 4, False, False),
    (10, 3, 2, None, 6, False, False),
    (11, 2, 3, None, None, True, False),
    (10, 3, 2, None, None, True, True),
])
def test_the_split_is_megatron_cores(num_layers, pp, vpp, first, last, embedding, loss):
    ours = megatron_chunk_layers(num_layers, pp, virtual_stages=vpp, first=first, last=last,
                                 embedding_counts=embedding, loss_counts=loss)
    fields = {"num_layers_in_first_pipeline_stage": first,
              "num_layers_in_last_pipeline_stage": last,
              "account_for_embedding_in_pipeline_split": embedding,
              "account_for_loss_in_pipeline_split": loss}
    assert ours == megatron_core_split(num_layers, pp, vpp, **fields)
    assert sum(ours) == num_layers


@pytest.mark.parametrize("layout, pp, expected", [
    ("Et|ttt|tt|ttL", 4, (1, 3, 2, 2)),
    ("Ettt|(tt|)*2,tL", 4, (3, 2, 2, 1)),
    ("Etttttt|tL", 2, (6, 1)),
])
def test_a_layout_string_gives_each_stage_its_transformer_layers(layout, pp, expected):
    args = parse_args([*BASE, "--num-layers", str(sum(expected)), "--pipeline-model-parallel-size",
                       str(pp), "--pipeline-model-parallel-layout", layout], pp)
    assert pipeline_chunk_layers(args) == expected


def test_the_first_layout_and_the_planners_job_start_from_the_users_split():
    layout = Layout.megatron(tp=1, pp=3, dp=2, num_layers=7, num_microbatches=4,
                             chunk_layers=(1, 3, 3))
    for replica in layout.replicas:
        assert [(s.first_layer, s.last_layer) for s in replica.stages] == [(0, 0), (1, 3), (4, 6)]
    job = JobSpec(1, 3, 2, num_layers=7, global_batch_size=4, micro_batch_size=1,
                  stage_layers=(1, 3, 3))
    assert job.initial_layout() == layout
    assert job.initial_ranges() == [(0, 0), (1, 3), (4, 6)]


def test_virtual_stages_of_an_uneven_split_hold_megatron_cores_chunks_and_survive_json():
    """``--decoder-first-pipeline-num-layers 2`` over PP2 with two virtual stages: stage 0
    holds layers 0 and 3, stage 1 layers 1-2 and 4-5, as megatron-core builds them; the plan
    CLI's JSON keeps the chunks; a replica whose stages change runs one chunk per stage."""
    args = parse_args([*BASE, "--num-layers", "6", "--pipeline-model-parallel-size", "2",
                       "--virtual-pipeline-model-parallel-size", "2",
                       "--decoder-first-pipeline-num-layers", "2", *ELASTIC], 4)
    chunks = pipeline_chunk_layers(args)
    assert chunks == (1, 2, 1, 2) == megatron_core_split(
        6, 2, 2, num_layers_in_first_pipeline_stage=2)
    layout = Layout.megatron(tp=1, pp=2, dp=2, num_layers=6, num_microbatches=4,
                             virtual_stages=2, chunk_layers=chunks)
    [replica, _] = layout.replicas
    assert [(s.first_layer, s.last_layer) for s in replica.stages] == [(0, 1), (2, 5)]
    assert replica.held_ranges(0) == [(0, 0), (3, 3)]
    assert replica.held_ranges(1) == [(1, 2), (4, 5)]
    assert layout.layer_groups() == [(0, 0), (1, 2), (3, 3), (4, 5)]
    records = layout.to_json(with_microbatch_ids=True)
    assert records[0]["stages"][1]["chunks"] == [[1, 2], [4, 5]]
    assert Layout.from_json(records) == layout
    restaged = replica.keeping_chunks((replica.stages[0],), replica.microbatch_ids)
    assert restaged.virtual_stages == 1 and restaged.chunk_layers == ()


def test_an_even_chunk_split_is_the_even_layout():
    even = Layout.megatron(tp=1, pp=2, dp=1, num_layers=4, num_microbatches=2,
                           virtual_stages=2)
    assert Layout.megatron(tp=1, pp=2, dp=1, num_layers=4, num_microbatches=2,
                           virtual_stages=2, chunk_layers=(1, 1, 1, 1)) == even


def layout_flags(layout: str, *more: str) -> list[str]:
    """Four layers over two pipeline ranks placed by ``layout``."""
    return ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
            "--pipeline-model-parallel-layout", layout, *more]


@pytest.mark.parametrize("flags, world, message", [
    (["--num-layers", "8", "--pipeline-model-parallel-size", "4",
      "--decoder-first-pipeline-num-layers", "3"], 4,
     "the 5 layers left between the first and last pipeline stages cannot be split evenly "
     "over 3 stages"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "4"], 2,
     "the pipeline split [4, 0] leaves a stage without a transformer layer"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "1", "--account-for-loss-in-pipeline-split"], 2,
     "give the first and last stage's layers or count the embedding and loss as layers, not "
     "both"),
    (layout_flags("Et|t|tL"), 2, "has 3 stages: give one per pipeline stage (2) and virtual stage"),
    (layout_flags("Et|t|t|tL", "--virtual-pipeline-model-parallel-size", "3"), 2,
     "has 4 stages: give one per pipeline stage (2) and virtual stage"),
    (layout_flags("Ett|tt||L"), 2, "leaves a stage without a transformer layer"),
    (layout_flags("Et|tm|t|tL"), 2, "places multi-token prediction layers before the last stage"),
    (layout_flags("Etmt|ttL"), 2, "places multi-token prediction layers before the last stage"),
    (layout_flags("tt|EttL"), 2,
     "must begin with the embedding (E) and end with the loss (L), once each"),
    (layout_flags("tEt|ttL"), 2,
     "must begin with the embedding (E) and end with the loss (L), once each"),
    (layout_flags("Ett|tLt"), 2,
     "must begin with the embedding (E) and end with the loss (L), once each"),
    (layout_flags("Ett|ttL", "--decoder-first-pipeline-num-layers", "2"), 2,
     "--pipeline-model-parallel-layout places every layer itself"),
    (layout_flags("Etttt|L"), 2, "leaves a stage without a transformer layer"),
    (layout_flags("Ett|tL"), 2, "places 3 transformer layers, the model has --num-layers 4"),
    (layout_flags("Ett|tXL"), 2, "Invalid layer character: X"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "3", "--num-virtual-stages-per-pipeline-rank", "2"],
     2, "the 3 layers of pipeline stage 0 cannot be split evenly into 2 virtual stages"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "6",
      "--virtual-pipeline-model-parallel-size", "2"], 2,
     "give the split as --pipeline-model-parallel-layout"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
     2, "an uneven pipeline split takes --num-virtual-stages-per-pipeline-rank"),
    (["--num-layers", "7", "--pipeline-model-parallel-size", "2",
      "--account-for-embedding-in-pipeline-split", "--num-virtual-stages-per-pipeline-rank", "4"],
     2, "leaves a model chunk without a transformer layer"),
])
def test_a_split_the_elastic_layout_cannot_start_from_is_refused_in_one_line(flags, world,
                                                                             message):
    with pytest.raises(ArgumentError) as refused:
        parse_args([*BASE, *flags, *ELASTIC], world)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_megatron_lms_interleaved_uneven_split_starts_the_elastic_layout():
    """Megatron-LM's own validation resolves the virtual stages of an uneven split; the elastic
    layout starts from the chunks megatron-core builds for it."""
    args = parse_args([*BASE, "--num-layers", "8", "--pipeline-model-parallel-size", "2",
                       "--decoder-first-pipeline-num-layers", "2", *ELASTIC], 2)
    args.virtual_pipeline_model_parallel_size = 2  # as Megatron-LM's own validation sets it
    validate_elastic(args, 2)
    assert pipeline_chunk_layers(args) == (1, 3, 1, 3)
