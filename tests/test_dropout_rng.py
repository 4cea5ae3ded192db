"""Layout-invariant dropout RNG: the keys, the patches that reseed Megatron's streams, and the
property that matters: with dropout on, a TP2 x PP2 run and a TP2 x PP1 run of
``scripts/pretrain_gpt.py`` follow the same trajectory with ``--elastic-rng invariant`` and
drift apart with Megatron's stock RNG.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness import free_port, launch
from megatron_elaswave.device import DeviceBackend
from megatron_elaswave.metrics import read_metrics
from megatron_elaswave.planner import rng
from megatron_elaswave.runtime import dropout_rng
from megatron_elaswave.training.arguments import parse_args

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = str(REPO / "scripts" / "pretrain_gpt.py")
CPU = DeviceBackend("cpu")


@pytest.fixture(autouse=True)
def _fresh_position():
    dropout_rng.reset()
    yield
    dropout_rng.reset()


def positioned(seed=7, iteration=3, microbatch=5):
    dropout_rng.set_seed(seed)
    dropout_rng.set_iteration(iteration)
    dropout_rng.set_microbatch(microbatch)


# -- the key --------------------------------------------------------------------------------------


def test_seeds_are_the_planner_key_of_the_logical_coordinates():
    positioned(seed=7, iteration=3, microbatch=5)
    seeds = dropout_rng.stream_seeds(layer=2, tp_rank=1)
    assert seeds.default == rng.op_seed(7, 3, 5, 2, rng.HIDDEN_DROPOUT_ATTN, rng.REPLICATED)
    assert seeds.model_parallel == rng.op_seed(7, 3, 5, 2, rng.ATTENTION_DROPOUT, 1)
    embedding = dropout_rng.stream_seeds(dropout_rng.EMBEDDING_LAYER, tp_rank=1)
    assert embedding.default == rng.op_seed(7, 3, 5, -1, rng.EMBEDDING_DROPOUT, rng.REPLICATED)
    assert embedding.model_parallel == rng.op_seed(7, 3, 5, -1, rng.EMBEDDING_DROPOUT, 1)


def test_every_coordinate_changes_the_seeds_except_tp_rank_for_the_default_stream():
    base = dict(seed=7, iteration=3, microbatch=5)

    def seeds(layer=2, tp_rank=0, **override):
        positioned(**{**base, **override})
        return dropout_rng.stream_seeds(layer, tp_rank)

    reference = seeds()
    assert reference.default != reference.model_parallel
    variants = [seeds(seed=8), seeds(iteration=4), seeds(microbatch=6), seeds(layer=3),
                seeds(layer=dropout_rng.EMBEDDING_LAYER, tp_rank=1)]
    for variant in variants:
        assert variant.default != reference.default and variant.model_parallel != reference.model_parallel
    all_seeds = {s for v in [reference, *variants] for s in (v.default, v.model_parallel)}
    assert len(all_seeds) == 2 * (1 + len(variants))
    # TP ranks share the default stream (replicated activations), not the model-parallel one.
    other_rank = seeds(tp_rank=1)
    assert other_rank.default == reference.default
    assert other_rank.model_parallel != reference.model_parallel
    # No collisions over a realistic grid of micro-batches, layers and TP ranks.
    grid = set()
    for microbatch in range(32):
        for layer in range(-1, 16):
            for tp_rank in range(4):
                s = seeds(microbatch=microbatch, layer=layer, tp_rank=tp_rank)
                grid.add(("mp", s.model_parallel))
                if tp_rank == 0:
                    grid.add(("default", s.default))
    assert len({value for _, value in grid}) == 32 * 17 * 5 - 32  # embedding: 2 streams meet on TP 0


def test_seeds_are_the_same_in_another_process():
    positioned(seed=1234, iteration=9, microbatch=17)
    here = dropout_rng.stream_seeds(5, 3)
    code = ("from megatron_elaswave.runtime import dropout_rng as d; d.set_seed(1234); d.set_iteration(9); "
            "d.set_microbatch(17); s = d.stream_seeds(5, 3); print(s.default, s.model_parallel)")
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": str(salt)}).stdout
        for salt in (0, 1)
    }
    assert outputs == {f"{here.default} {here.model_parallel}\n"}


def test_runtime_module_does_not_import_megatron_or_torch():
    code = ("import sys, megatron_elaswave.runtime.dropout_rng; "
            "print(any(m.split('.')[0] in ('megatron', 'torch') for m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout == "False\n"


def test_an_unpositioned_op_and_bad_values_are_refused():
    with pytest.raises(dropout_rng.NotPositioned, match="iteration, microbatch"):
        dropout_rng.set_seed(1)
        dropout_rng.stream_seeds(0, 0)
    for setter in (dropout_rng.set_seed, dropout_rng.set_iteration, dropout_rng.set_microbatch):
        for bad in (-1, 1.5, True, None):
            with pytest.raises(ValueError):
                setter(bad)


def test_position_block_restores_the_previous_position():
    positioned(iteration=1, microbatch=2)
    with dropout_rng.position(iteration=4, microbatch=9) as where:
        assert (where.iteration, where.microbatch) == (4, 9)
    current = dropout_rng.current()
    assert (current.seed, current.iteration, current.microbatch) == (7, 1, 2)


def test_elastic_rng_flag_defaults():
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data", "--vocab-size", "64"]
    elastic = ["--elastic", "--use-distributed-optimizer", "--untie-embeddings-and-output-weights"]
    assert parse_args(base, 1).elastic_rng == "megatron"
    assert parse_args(base + elastic, 1).elastic_rng == "invariant"
    assert parse_args(base + elastic + ["--elastic-rng", "megatron"], 1).elastic_rng == "megatron"
    assert parse_args(base + ["--elastic-rng", "invariant"], 1).elastic_rng == "invariant"


# -- the patches, on Megatron's real RNG tracker ---------------------------------------------------


@pytest.fixture
def keyed_cpu():
    """CPU compatibility plus the layout-invariant RNG patches, and a seeded tracker (TP rank 0)."""
    from megatron_elaswave.patches import compatibility_registry

    registry = compatibility_registry(CPU, dropout_seeds=dropout_rng)
    registry.apply()
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.model_parallel_cuda_manual_seed(
        99, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    yield megatron_random.get_cuda_rng_tracker()
    registry.remove()


def test_patches_are_installed_only_when_asked():
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_elaswave.patches import compatibility_registry, language_model_embedding, transformer_layer

    targets = {transformer_layer.FORWARD, language_model_embedding.FORWARD}
    assert not targets & set(compatibility_registry(CPU).targets)
    original = TransformerLayer.forward, LanguageModelEmbedding.forward
    registry = compatibility_registry(CPU, dropout_seeds=dropout_rng)
    assert targets <= set(registry.targets)
    registry.apply()
    try:
        assert TransformerLayer.forward.__wrapped__ is original[0]
        assert LanguageModelEmbedding.forward.__wrapped__ is original[1]
    finally:
        registry.remove()
    assert (TransformerLayer.forward, LanguageModelEmbedding.forward) == original


class _Group:
    def __init__(self, rank: int) -> None:
        self._rank = rank

    def rank(self) -> int:
        return self._rank


def fake_layer(layer_number: int, tp_rank: int, training: bool = True, **config):
    """What the wrapper reads of a TransformerLayer (1-based ``layer_number``, as Megatron's)."""
    config = SimpleNamespace(**{"hidden_dropout": 0.1, "attention_dropout": 0.1,
                                "recompute_granularity": None, **config})
    return SimpleNamespace(layer_number=layer_number, tp_group=_Group(tp_rank), config=config,
                           training=training)


def draws(tracker):
    """What a layer draws: the default stream (hidden dropout) around the model-parallel one
    (attention dropout, under ``tracker.fork()``), as Megatron's layer does."""
    before = torch.rand(3)
    with tracker.fork():
        attention = torch.rand(3)
    return torch.cat([before, attention, torch.rand(3)])


def test_a_layer_draws_its_keyed_masks_whatever_ran_before(keyed_cpu):
    from megatron_elaswave.patches.transformer_layer import _keyed_forward

    # The wrapper the patch installs.
    run = _keyed_forward(lambda self: draws(keyed_cpu), CPU, dropout_rng)
    positioned(seed=7, iteration=3, microbatch=5)
    first = run(fake_layer(3, tp_rank=0))
    # Another stage: other layers drew before, and the tracker moved on.
    torch.rand(100)
    with keyed_cpu.fork():
        torch.rand(50)
    again = run(fake_layer(3, tp_rank=0))
    assert torch.equal(first, again)
    # Exactly the seeds' streams: default for hidden dropout, model-parallel for attention.
    seeds = dropout_rng.stream_seeds(2, 0)
    default = torch.Generator().manual_seed(seeds.default)
    model_parallel = torch.Generator().manual_seed(seeds.model_parallel)
    expected = torch.cat([torch.rand(3, generator=default), torch.rand(3, generator=model_parallel),
                          torch.rand(3, generator=default)])
    assert torch.equal(first, expected)
    # TP rank 1: the same hidden-dropout draws, its own attention-dropout draws.
    other = run(fake_layer(3, tp_rank=1))
    assert torch.equal(other[:3], first[:3]) and torch.equal(other[6:], first[6:])
    assert not torch.equal(other[3:6], first[3:6])
    # Another micro-batch or layer draws differently.
    dropout_rng.set_microbatch(6)
    assert not torch.equal(run(fake_layer(3, tp_rank=0)), first)
    dropout_rng.set_microbatch(5)
    assert not torch.equal(run(fake_layer(4, tp_rank=0)), first)


def test_the_streams_outside_a_layer_are_left_as_they_were(keyed_cpu):
    from megatron_elaswave.patches.transformer_layer import _keyed_forward

    positioned()
    run = _keyed_forward(lambda self: draws(keyed_cpu), CPU, dropout_rng)
    cpu_state = torch.get_rng_state()
    tracker_state = keyed_cpu.get_states()["model-parallel-rng"].clone()
    run(fake_layer(1, tp_rank=0))
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert torch.equal(keyed_cpu.get_states()["model-parallel-rng"], tracker_state)


def test_inside_a_model_parallel_fork_the_layer_draws_its_tp_keyed_stream(keyed_cpu):
    """Sequence parallelism: Megatron runs the whole block inside ``tracker.fork()``, so every
    draw of the layer comes from the model-parallel stream, keyed by TP rank."""
    from megatron_elaswave.patches.transformer_layer import _keyed_forward

    positioned()
    run = _keyed_forward(lambda self: draws(keyed_cpu), CPU, dropout_rng)
    with keyed_cpu.fork():
        got = run(fake_layer(2, tp_rank=0))
    stream = torch.Generator().manual_seed(dropout_rng.stream_seeds(1, 0).model_parallel)
    assert torch.equal(got, torch.rand(9, generator=stream))


def test_eval_and_dropout_free_layers_run_unchanged_and_full_recompute_is_refused(keyed_cpu):
    from megatron_elaswave.patches.transformer_layer import _keyed_forward

    run = _keyed_forward(lambda self: torch.rand(2), CPU, dropout_rng)
    # Not positioned, yet fine: nothing is keyed in eval or without dropout.
    state = torch.get_rng_state()
    run(fake_layer(1, 0, training=False))
    run(fake_layer(1, 0, hidden_dropout=0.0, attention_dropout=0.0))
    assert not torch.equal(torch.get_rng_state(), state)  # Megatron's own streams moved on
    with pytest.raises(dropout_rng.NotPositioned):
        run(fake_layer(1, 0))
    positioned()
    with pytest.raises(NotImplementedError, match="recompute"):
        run(fake_layer(1, 0, recompute_granularity="full"))


def test_an_moe_layers_router_draws_its_keyed_streams_without_dropout(keyed_cpu):
    """Without dropout an MoE layer still draws: the router's input jitter from the default
    stream, forced load balancing's random logits from the expert-parallel stream; both are
    keyed by layer and micro-batch, and the expert stream by TP rank."""
    from megatron_elaswave.patches.transformer_layer import _keyed_forward

    def router_draws(self):
        jitter = torch.rand(3)
        with keyed_cpu.fork("expert-parallel-rng"):
            logits = torch.rand(3)
        return torch.cat([jitter, logits])

    run = _keyed_forward(router_draws, CPU, dropout_rng)
    moe = dict(hidden_dropout=0.0, attention_dropout=0.0, moe_input_jitter_eps=0.01,
               moe_router_force_load_balancing=True)
    positioned(seed=7, iteration=3, microbatch=5)
    expert_state = keyed_cpu.get_states()["expert-parallel-rng"].clone()
    first = run(fake_layer(2, tp_rank=1, **moe))
    torch.rand(10)
    with keyed_cpu.fork("expert-parallel-rng"):
        torch.rand(10)
    assert torch.equal(run(fake_layer(2, tp_rank=1, **moe)), first)
    seeds = dropout_rng.stream_seeds(1, 1)
    expected = torch.cat([torch.rand(3, generator=torch.Generator().manual_seed(seeds.default)),
                          torch.rand(3, generator=torch.Generator().manual_seed(seeds.expert))])
    assert torch.equal(first, expected)
    assert seeds.expert == rng.op_seed(7, 3, 5, 1, rng.EXPERT_ROUTING, 1)
    assert not torch.equal(run(fake_layer(2, tp_rank=0, **moe))[3:], first[3:])
    # The expert stream outside the layer is as the layer found it.
    with keyed_cpu.fork("expert-parallel-rng"):
        torch.rand(10)
    before = keyed_cpu.get_states()["expert-parallel-rng"].clone()
    run(fake_layer(2, tp_rank=1, **moe))
    assert torch.equal(keyed_cpu.get_states()["expert-parallel-rng"], before)
    assert not torch.equal(before, expert_state)


def test_the_embedding_draws_its_keyed_mask(keyed_cpu):
    from megatron_elaswave.patches.language_model_embedding import _keyed_forward

    run = _keyed_forward(lambda self: torch.rand(4), CPU, dropout_rng)
    embedding = SimpleNamespace(training=True, embedding_dropout=torch.nn.Dropout(0.1),
                                tp_group=_Group(1))
    positioned()
    torch.rand(10)
    got = run(embedding)
    seed = dropout_rng.stream_seeds(dropout_rng.EMBEDDING_LAYER, 1).default
    assert torch.equal(got, torch.rand(4, generator=torch.Generator().manual_seed(seed)))


def test_a_multi_token_prediction_layer_draws_after_the_decoders_layers(keyed_cpu):
    """Its transformer layer is keyed by its place after the decoder's ``num_layers`` (0.19.2
    numbers it from 1 and marks it, 0.16.1 numbers it so), and its embedding lookup of the
    shifted tokens by the same place with the embedding's site: neither mask is another's."""
    from megatron_elaswave.patches import language_model_embedding, transformer_layer

    layer = transformer_layer._keyed_forward(lambda self: torch.rand(4), CPU, dropout_rng)
    positioned()
    marked = fake_layer(1, tp_rank=1, num_layers=4)
    marked.is_mtp_layer = True
    numbered_after = fake_layer(5, tp_rank=1, num_layers=4)
    assert torch.equal(layer(marked), layer(numbered_after))
    assert not torch.equal(layer(marked), layer(fake_layer(1, tp_rank=1, num_layers=4)))
    seeds = dropout_rng.stream_seeds(4, 1)
    assert torch.equal(layer(marked), torch.rand(4, generator=torch.Generator().manual_seed(
        seeds.default)))

    lookup = language_model_embedding._keyed_forward(lambda self: torch.rand(4), CPU, dropout_rng)
    embedding = SimpleNamespace(training=True, embedding_dropout=torch.nn.Dropout(0.1),
                                tp_group=_Group(1))
    model_lookup = lookup(embedding)
    with language_model_embedding.looked_up_by(4):
        mtp_lookup = lookup(embedding)
    assert torch.equal(lookup(embedding), model_lookup)
    keyed = dropout_rng.stream_seeds(4, 1, embedding=True).default
    assert torch.equal(mtp_lookup, torch.rand(4, generator=torch.Generator().manual_seed(keyed)))
    assert len({keyed, seeds.default,
                dropout_rng.stream_seeds(dropout_rng.EMBEDDING_LAYER, 1).default}) == 3


# -- the property, end to end -------------------------------------------------------------------

TRAIN_ITERS = 4
INVARIANT_TOLERANCE = 1e-5
"""fp32 reduction order may differ between layouts; dropout masks may not."""
STOCK_MIN_DIFFERENCE = 1e-4
"""Megatron's per-stage streams give the PP2 layout other masks: far above the tolerance."""


def run_flags(**overrides) -> list[str]:
    flags = {
        "num-layers": 4, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 32,
        "micro-batch-size": 2, "global-batch-size": 8, "train-iters": TRAIN_ITERS, "lr": 3e-3,
        "lr-warmup-iters": 1, "hidden-dropout": 0.1, "attention-dropout": 0.1, "seed": 7,
        "mock-data": None, "vocab-size": 256, "make-vocab-size-divisible-by": 128,
        "log-interval": 1, "eval-interval": 1000, "tensor-model-parallel-size": 2,
        # A multi-token prediction layer: its transformer layer and its lookup of the shifted
        # tokens draw masks too (in the last stage's copy of the embedding).
        "mtp-num-layers": 1, "untie-embeddings-and-output-weights": None,
        "position-embedding-type": "rope",
    }
    flags.update({key.replace("_", "-"): value for key, value in overrides.items()})
    return [item for key, value in flags.items()
            for item in ((f"--{key}",) if value is None else (f"--{key}", str(value)))]


def losses(tmp_path: Path, name: str, pp: int, **overrides) -> list[float]:
    metrics = tmp_path / f"{name}.jsonl"
    flags = run_flags(pipeline_model_parallel_size=pp, **overrides)
    with launch([PRETRAIN, *flags, "--elastic-metrics-file", str(metrics)], 2 * pp,
                master_port=free_port(), log_path=tmp_path / f"{name}.log") as job:
        returncode, output = job.wait(240)
    assert returncode == 0, output[-4000:]
    records = read_metrics(str(metrics), "iteration")
    assert [r["iteration"] for r in records] == list(range(1, TRAIN_ITERS + 1))
    return [r["lm_loss"] for r in records]


def relative(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(x) for x, y in zip(a, b)]


@pytest.fixture(scope="module")
def invariant_tp2_pp1(tmp_path_factory) -> list[float]:
    return losses(tmp_path_factory.mktemp("tp2pp1"), "invariant_tp2pp1", pp=1, elastic_rng="invariant")


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_invariant_rng_gives_pipeline_layouts_the_same_trajectory(invariant_tp2_pp1, tmp_path):
    tp2_pp2 = losses(tmp_path, "invariant_tp2pp2", pp=2, elastic_rng="invariant")
    differences = relative(invariant_tp2_pp1, tp2_pp2)
    print(f"invariant RNG, TP2xPP2 vs TP2xPP1, relative lm-loss difference: {differences}")
    assert max(differences) <= INVARIANT_TOLERANCE, (invariant_tp2_pp1, tp2_pp2)
    # Dropout is on: without it the trajectory is another one.
    no_dropout = losses(tmp_path, "no_dropout_tp2pp1", pp=1, elastic_rng="invariant",
                        hidden_dropout=0.0, attention_dropout=0.0)
    assert min(relative(invariant_tp2_pp1, no_dropout)[:1]) > STOCK_MIN_DIFFERENCE


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_megatron_rng_gives_pipeline_layouts_different_masks(invariant_tp2_pp1, tmp_path):
    tp2_pp1 = losses(tmp_path, "megatron_tp2pp1", pp=1, elastic_rng="megatron")
    tp2_pp2 = losses(tmp_path, "megatron_tp2pp2", pp=2, elastic_rng="megatron")
    differences = relative(tp2_pp1, tp2_pp2)
    print(f"Megatron RNG, TP2xPP2 vs TP2xPP1, relative lm-loss difference: {differences}")
    assert max(differences) > STOCK_MIN_DIFFERENCE, (tp2_pp1, tp2_pp2)
    # The keyed masks are not Megatron's.
    assert relative(invariant_tp2_pp1, tp2_pp1)[0] > STOCK_MIN_DIFFERENCE
