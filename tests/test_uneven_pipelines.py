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

from megatron_elaswave.layout import Layout, megatron_stage_layers
from megatron_elaswave.planner.job import JobSpec
from megatron_elaswave.training.arguments import (
    ArgumentError,
    parse_args,
    pipeline_stage_layers,
    validate_elastic,
)

BASE = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "64"]
ELASTIC = ["--elastic", "--use-distributed-optimizer"]


def megatron_core_split(num_layers: int, pp: int, **fields) -> tuple[int, ...]:
    """Layers per pipeline rank as megatron-core's ``get_num_layers_to_build`` counts them."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    config = TransformerConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               **fields)
    return tuple(get_num_layers_to_build(config, pp_rank=rank) for rank in range(pp))


@pytest.mark.parametrize("num_layers, pp, first, last, embedding, loss", [
    (7, 4, 1, None, False, False),
    (7, 4, None, 1, False, False),
    (10, 4, 2, 2, False, False),
    (8, 2, 3, None, False, False),
    (8, 2, 5, 3, False, False),
    (7, 4, None, None, True, False),
    (6, 4, None, None, True, True),
    (5, 2, None, None, False, True),
])
def test_the_split_is_megatron_cores(num_layers, pp, first, last, embedding, loss):
    ours = megatron_stage_layers(num_layers, pp, first=first, last=last,
                                 embedding_counts=embedding, loss_counts=loss)
    fields = {"num_layers_in_first_pipeline_stage": first,
              "num_layers_in_last_pipeline_stage": last,
              "account_for_embedding_in_pipeline_split": embedding,
              "account_for_loss_in_pipeline_split": loss}
    assert ours == megatron_core_split(num_layers, pp, **fields)
    assert sum(ours) == num_layers


@pytest.mark.parametrize("layout, pp, expected", [
    ("Et|ttt|tt|ttL", 4, (1, 3, 2, 2)),
    ("Ettt|(tt|)*2,tL", 4, (3, 2, 2, 1)),
    ("Etttttt|tL", 2, (6, 1)),
])
def test_a_layout_string_gives_each_stage_its_transformer_layers(layout, pp, expected):
    args = parse_args([*BASE, "--num-layers", str(sum(expected)), "--pipeline-model-parallel-size",
                       str(pp), "--pipeline-model-parallel-layout", layout], pp)
    assert pipeline_stage_layers(args) == expected


def test_the_first_layout_and_the_planners_job_start_from_the_users_split():
    layout = Layout.megatron(tp=1, pp=3, dp=2, num_layers=7, num_microbatches=4,
                             stage_layers=(1, 3, 3))
    for replica in layout.replicas:
        assert [(s.first_layer, s.last_layer) for s in replica.stages] == [(0, 0), (1, 3), (4, 6)]
    job = JobSpec(1, 3, 2, num_layers=7, global_batch_size=4, micro_batch_size=1,
                  stage_layers=(1, 3, 3))
    assert job.initial_layout() == layout
    assert job.initial_ranges() == [(0, 0), (1, 3), (4, 6)]


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
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Et|t|t|tL"], 2,
     "has 4 stages: one per pipeline stage (2) is supported, without virtual pipeline "
     "stages"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Etmt|ttL"], 2,
     "places multi-token prediction layers before the last stage"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "tt|EttL"], 2,
     "must begin with the embedding (E) and end with the loss (L), once each"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "tEt|ttL"], 2,
     "must begin with the embedding (E) and end with the loss (L), once each"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Ett|tLt"], 2,
     "must begin with the embedding (E) and end with the loss (L), once each"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Ett|ttL", "--decoder-first-pipeline-num-layers", "2"], 2,
     "--pipeline-model-parallel-layout places every layer itself"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Etttt|L"], 2,
     "leaves a stage without a transformer layer"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Ett|tL"], 2,
     "places 3 transformer layers, the model has --num-layers 4"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Ett|tXL"], 2, "Invalid layer character: X"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "2", "--virtual-pipeline-model-parallel-size", "2"],
     2, "an uneven pipeline split runs without virtual pipeline stages"),
])
def test_a_split_the_elastic_layout_cannot_start_from_is_refused_in_one_line(flags, world,
                                                                             message):
    with pytest.raises(ArgumentError) as refused:
        parse_args([*BASE, *flags, *ELASTIC], world)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_megatron_lms_interleaved_uneven_split_is_refused_under_elastic():
    """Megatron-LM's loop runs an uneven split with virtual stages; ``--elastic`` starts each
    stage as one chunk, and says so."""
    args = parse_args([*BASE, "--num-layers", "8", "--pipeline-model-parallel-size", "2",
                       "--decoder-first-pipeline-num-layers", "2", *ELASTIC], 2)
    args.virtual_pipeline_model_parallel_size = 2  # as Megatron-LM's own validation sets it
    with pytest.raises(ArgumentError, match="uneven pipeline split without virtual pipeline"):
        validate_elastic(args, 2)
