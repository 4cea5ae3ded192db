"""The pieces that make ``--elastic`` follow Megatron-LM's own loop, one by one: which
initialisation each script gets by default, and each micro-batch's loss normalised as
megatron-core's schedules normalise it (``tests/test_plain_oracle.py`` checks the whole runs).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_elaswave.megatron_lm.job import microbatch_mean
from megatron_elaswave.training.arguments import parse_args, validate_elastic

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "64"]
ELASTIC = ["--elastic", "--use-distributed-optimizer"]


def test_pretrain_gpt_initialises_layout_invariantly_unless_told_otherwise():
    assert parse_args(BASE, 1).elastic_init == "invariant"
    assert parse_args(BASE + ELASTIC, 1).elastic_init == "invariant"
    assert parse_args(BASE + ELASTIC + ["--elastic-init", "megatron"], 1).elastic_init == "megatron"
    assert parse_args(BASE + ["--elastic-init", "megatron"], 1).elastic_init == "megatron"


def test_megatron_lms_loop_initialises_as_megatron_unless_told_otherwise():
    """The default is what the same script does without ``--elastic``."""
    args = parse_args(BASE + ELASTIC, 1)
    for given, resolved in ((None, "megatron"), ("invariant", "invariant")):
        args.elastic_init = given
        validate_elastic(args, 1, init_default="megatron")
        assert args.elastic_init == resolved


def test_an_unknown_initialisation_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--elastic-init", "xavier"], 1)
    assert "--elastic-init: invalid choice: 'xavier'" in capsys.readouterr().err


@pytest.mark.parametrize("tokens, expected", [(4, 2.0), (0, 8.0)])
def test_a_microbatch_loss_is_its_mean_and_counts_as_one(tokens, expected):
    """As megatron-core's schedules without ``calculate_per_token_loss``: the sum over the
    micro-batch's tokens divided by their count (at least 1); the job divides by the count of
    micro-batches instead of tokens."""
    report = {"lm loss": torch.tensor([8.0, float(tokens)])}
    loss, count, reported = microbatch_mean(
        lambda output: (output.sum(), torch.tensor(tokens, dtype=torch.int), report))(
        torch.tensor([3.0, 5.0]))
    assert loss.item() == expected
    assert count.dtype == torch.int and count.item() == 1
    assert reported is report


def test_a_microbatch_mean_already_taken_is_left_as_it_is():
    """A loss function of two results returns a mean (megatron-core divides it by the
    micro-batch count only)."""
    report = {"lm loss": torch.tensor(2.5)}
    loss, count, reported = microbatch_mean(lambda output: (output.mean(), report))(
        torch.tensor([2.0, 3.0]))
    assert loss.item() == 2.5 and count.item() == 1 and reported is report


def test_the_flag_is_known_to_megatron_lms_parser():
    """The adaptor adds the ``--elastic*`` flags to Megatron-LM's parser with this function."""
    from megatron_elaswave.training.arguments import add_elastic_args

    parser = argparse.ArgumentParser()
    add_elastic_args(parser)
    assert parser.parse_args(["--elastic-init", "megatron"]).elastic_init == "megatron"
    assert parser.parse_args([]).elastic_init is None
