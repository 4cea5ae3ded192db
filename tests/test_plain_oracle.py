"""``--elastic`` against Megatron-LM's own training loop without it, and against the plain
megatron-core path of ``scripts/pretrain_gpt.py``.

The reference of the first tests is Megatron-LM's ``pretrain_gpt.py`` without ``--elastic``, on
the same ranks and flags (a Megatron-LM checkout named by ``MEGATRON_LM_PATH``, or the training
package of the installed megatron-core from 0.19 on, through ``megatron_lm_pretrain_gpt.py``;
skipped where neither is at hand). It shares nothing with the elastic job but megatron-core and
the script: Megatron-LM builds its own model, DDP, optimizer, data loaders and samplers, and
normalises the loss in megatron-core's schedules. The elastic arm is the same command with
``--elastic``: lm loss and grad norm within 1e-5 relative for every iteration without a failure,
1e-4 with one, with ``--clip-grad`` binding (the grad norm is above it) and ``--eod-mask-loss``
(micro-batches count different numbers of tokens), so a wrong initialisation, sample, loss
normalisation, gradient scale or optimizer setting changes the losses and the norms.

The later tests compare ``scripts/pretrain_gpt.py --elastic`` with the same script without it
(megatron-core's own ``GPTModel``, ``DistributedDataParallel``, distributed optimizer and
``finalize_model_grads``), for what Megatron-LM's loop cannot run elastically: virtual pipeline
stages, replacement workers and the survivors' checkpoint. That path shares the project's loop,
data dealing and initialisation with the elastic arm, so it checks the elastic job's model
chunks, gradient reduction and optimizers, not those.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from harness import free_port, launch, worker_script
from megatron_elaswave.metrics import read_metrics
from test_growth import HELD, hold_while_joining, stage_ranks
from test_megatron_adaptor import LOG_LINE, TRAINING_SCRIPT, megatron_lm_flags, needs_megatron_lm
from test_pretrain_gpt import PRETRAIN, model_flags, text_data  # noqa: F401  (fixture)

TRAIN_ITERS = 10
CLIP_GRAD = 0.3
EXACT = 1e-5
"""Without a failure both paths reduce the same numbers, in a different order at most."""
AFTER_FAILURE = 1e-4
ELASTIC = ["--elastic", "--elastic-rebalance-window", "0"]

pytestmark = pytest.mark.multiprocess


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def stage_layers(layout: list[dict]) -> list[list[list[int]]]:
    """The layer range of each stage of each replica of a layout record."""
    return [[stage["layers"] for stage in replica["stages"]] for replica in layout]


def stage_chunks(layout: list[dict]) -> list[list[list[list[int]]]]:
    """The layer range of each virtual stage of each stage of each replica of a layout record."""
    return [[stage["chunks"] for stage in replica["stages"]] for replica in layout]


# -- against Megatron-LM's own loop -------------------------------------------------------------

def megatron_lm_oracle_flags(tp: int, pp: int, *extra: str) -> list[str]:
    """Megatron-LM's flags for a tiny GPT on CPU ranks (mock data), without dropout, with
    loss masks that differ between micro-batches and a clip that binds."""
    return [*megatron_lm_flags(tp, pp, TRAIN_ITERS), "--hidden-dropout", "0",
            "--attention-dropout", "0", "--eod-mask-loss", "--clip-grad", str(CLIP_GRAD), *extra]


def run_megatron_lm(tmp_path: Path, name: str, nproc: int, arguments: list[str],
                    kill: tuple[int, int] | None = None, rejoin: bool = False) -> str:
    """``arguments`` (Megatron-LM's training script, after a recorder or runner, and its flags)
    on ``nproc`` ranks under ``elaswave-run``; the output. With ``kill = (rank, after_iteration)``
    that worker is SIGKILLed from outside once Megatron-LM's log has that iteration's line; with
    ``rejoin`` the launcher starts it again and the job is held until it asks to join (the
    flags must then tolerate a held rank: :data:`test_growth.HELD`)."""
    with launch(arguments, nproc, master_port=free_port(), log_path=tmp_path / f"{name}.log",
                launcher_args=["--rejoin", "--rejoin-delay=0.5"] if rejoin else ()) as job:
        if kill is not None:
            rank, after = kill
            pid = job.worker_pids()[rank]
            job.wait_for(lambda: any(int(i) >= after for i, _, _ in LOG_LINE.findall(job.output())),
                         120, f"iteration {after}")
            os.kill(pid, signal.SIGKILL)
            if rejoin:
                job.wait_for(lambda: "recovered from the failure of ranks" in job.output(), 120,
                             "the recovery")
                hold_while_joining(job, [rank])
        returncode, output = job.wait(240)
    assert returncode == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def megatron_lm_reference(tmp_path_factory):
    """``reference(nproc, flags)``: what Megatron-LM's ``train()`` got from each ``train_step``
    without ``--elastic`` (``megatron_lm_record.py``), one run per ``(nproc, flags)``."""
    runs = {}

    def reference(nproc: int, flags: list[str], iterations: int = TRAIN_ITERS) -> list[dict]:
        key = (nproc, tuple(flags))
        if key not in runs:
            directory = tmp_path_factory.mktemp("megatron-lm")
            record = directory / "record.jsonl"
            run_megatron_lm(directory, "reference", nproc, [
                worker_script("megatron_lm_record.py"), str(record), str(TRAINING_SCRIPT), *flags])
            runs[key] = [json.loads(line) for line in record.read_text().splitlines()]
            assert [r["iteration"] for r in runs[key]] == list(range(1, iterations + 1))
        return runs[key]

    return reference


def train_elastic_in_megatron_lm(tmp_path: Path, nproc: int, flags: list[str],
                                 kill: tuple[int, int] | None = None, rejoin: bool = False,
                                 iterations: int = TRAIN_ITERS) -> dict[str, list[dict]]:
    """The records of Megatron-LM's loop with ``--elastic`` by event (see
    :func:`run_megatron_lm` for ``kill`` and ``rejoin``): every iteration once, one recovery
    per kill and one grow per rejoin."""
    metrics = tmp_path / "elastic.jsonl"
    output = run_megatron_lm(tmp_path, "elastic", nproc, [
        "-m", "megatron_elaswave.run_megatron_lm", str(TRAINING_SCRIPT), *flags, *ELASTIC,
        "--elastic-metrics-file", str(metrics)], kill, rejoin)
    records = {event: read_metrics(str(metrics), event)
               for event in ("iteration", "recovery", "grow")}
    assert [r["iteration"] for r in records["iteration"]] == list(range(1, iterations + 1)), \
        output[-4000:]
    assert len(records["recovery"]) == (kill is not None), output[-4000:]
    assert len(records["grow"]) == rejoin, output[-4000:]
    return records


def assert_follows_megatron_lm(reference: list[dict], elastic: list[dict], tolerance: float,
                               clip: float = CLIP_GRAD) -> None:
    """lm loss and grad norm within ``tolerance`` relative, every iteration; the clip
    (``clip``) binds in half of them or more."""
    assert sum(r["grad_norm"] > clip for r in reference) >= len(reference) // 2, \
        [r["grad_norm"] for r in reference]  # the clip binds: the scale reaches the update
    worst = {"lm_loss": 0.0, "grad_norm": 0.0}
    for ref, got in zip(reference, elastic, strict=True):
        for field in worst:
            deviation = relative(got[field], ref[field])
            assert deviation <= tolerance, (got["iteration"], field, ref[field], got[field])
            worst[field] = max(worst[field], deviation)
    print(f"largest relative difference from Megatron-LM's own loop: {worst}")


VIRTUAL_STAGES = ("--num-layers-per-virtual-pipeline-stage", "1")
"""Two virtual stages of one layer per pipeline stage: Megatron's interleaved schedule."""


@pytest.mark.timeout(600)
@needs_megatron_lm
@pytest.mark.parametrize("tp, pp, nproc, extra, elastic_extra", [
    (1, 2, 4, (), ()),
    (2, 1, 4, (), ()),
    (2, 2, 8, (), ()),
    (1, 2, 4, ("--untie-embeddings-and-output-weights", "--calculate-per-token-loss"), ()),
    (1, 2, 4, (), ("--elastic-zero", "interleaved")),
    (1, 2, 4, ("--bf16", "--no-masked-softmax-fusion"), ()),
    (1, 2, 4, VIRTUAL_STAGES, ()),
    (1, 2, 4, ("--untie-embeddings-and-output-weights", "--overlap-grad-reduce",
               "--overlap-param-gather"), ()),
], ids=["pp2-dp2", "tp2-dp2", "tp2-pp2-dp2", "pp2-dp2-untied-per-token-loss",
       "pp2-dp2-interleaved-zero", "pp2-dp2-bf16", "pp2-dp2-interleaved-schedule",
       "pp2-dp2-overlap"])
def test_elastic_without_failures_follows_megatron_lms_own_loop(megatron_lm_reference, tmp_path,
                                                                tp, pp, nproc, extra,
                                                                elastic_extra):
    """The same command with and without ``--elastic``: Megatron's initialisation (the default
    of ``--elastic-init`` in Megatron-LM's loop), samples, loss normalisation (each
    micro-batch's mean, or with ``--calculate-per-token-loss`` the global batch's per-token
    mean), optimizer and LR schedule; also with the interleaved schedule and with the gradient
    reduction and parameter gather overlapped. In bf16 the optimizer's main copies of the tied
    embedding's output-layer copy must be taken after Megatron sums the two."""
    flags = megatron_lm_oracle_flags(tp, pp, *extra)
    reference = megatron_lm_reference(nproc, flags)
    elastic = train_elastic_in_megatron_lm(tmp_path, nproc, [*flags, *elastic_extra])
    assert_follows_megatron_lm(reference, elastic["iteration"], EXACT)


@pytest.mark.timeout(600)
@needs_megatron_lm
@pytest.mark.parametrize("tp, pp, extra, killed, survivors", [
    (1, 2, (), 1, 3),
    (2, 1, (), 2, 2),
    (1, 2, VIRTUAL_STAGES, 3, 3),
], ids=["pp2-dp2", "tp2-dp2", "pp2-dp2-interleaved-schedule"])
def test_elastic_with_a_failure_stays_on_megatron_lms_own_loop(megatron_lm_reference, tmp_path,
                                                              tp, pp, extra, killed, survivors):
    """Four ranks; a worker is SIGKILLed from outside after iteration 4. TP1 x PP2 x DP2: rank 1,
    the first stage of replica 1, whose layers move to its last stage; TP2 x PP1 x DP2: rank 2,
    whose tensor-parallel partner is left without a stage while the other replica carries the
    whole global batch; interleaved: rank 3, whose replica runs 1F1B on rank 1 while the other
    keeps its virtual stages. Every iteration stays on Megatron-LM's own trajectory."""
    flags = megatron_lm_oracle_flags(tp, pp, *extra)
    reference = megatron_lm_reference(4, flags)
    elastic = train_elastic_in_megatron_lm(tmp_path, 4, flags, kill=(killed, 4))
    assert elastic["iteration"][-1]["world_size"] == survivors
    assert_follows_megatron_lm(reference, elastic["iteration"], AFTER_FAILURE)


@pytest.mark.timeout(600)
@needs_megatron_lm
def test_a_replacement_that_rejoins_stays_on_megatron_lms_own_loop(megatron_lm_reference,
                                                                  tmp_path):
    """TP1 x PP2 x DP2 under ``elaswave-run --rejoin``: rank 3 is SIGKILLed after iteration 3,
    its replica re-partitions onto rank 1, the replacement joins Megatron-LM's running loop and
    the job ends on its first layout, every iteration on Megatron-LM's own trajectory."""
    flags = megatron_lm_oracle_flags(1, 2)
    reference = megatron_lm_reference(4, flags)
    elastic = train_elastic_in_megatron_lm(tmp_path, 4, flags + HELD, kill=(3, 3), rejoin=True)
    [recovery], [grow] = elastic["recovery"], elastic["grow"]
    assert stage_ranks(recovery["layout"]) == [[[0], [2]], [[1]]], recovery["layout"]
    assert stage_ranks(grow["layout"]) == [[[0], [2]], [[1], [3]]], grow["layout"]
    assert elastic["iteration"][-1]["world_size"] == 4
    assert_follows_megatron_lm(reference, elastic["iteration"], AFTER_FAILURE)


@pytest.mark.timeout(600)
@needs_megatron_lm
@pytest.mark.parametrize("layout, num_layers, users_split, users_chunks", [
    ("Ettt|tL", 4, [[0, 2], [3, 3]], None),
    ("Et|tt|t|ttL", 6, [[0, 1], [2, 5]], [[[0, 0], [3, 3]], [[1, 2], [4, 5]]]),
], ids=["pp2", "pp2-interleaved"])
def test_an_uneven_pipeline_layout_stays_on_megatron_lms_own_loop_through_a_failure_and_back(
        megatron_lm_reference, tmp_path, layout, num_layers, users_split, users_chunks):
    """TP1 x PP2 x DP2 with an uneven ``--pipeline-model-parallel-layout``: more layers on one
    stage than the other, as Megatron-LM builds them without ``--elastic``; with two stages
    per pipeline rank in the string, the chunks of its interleaved schedule. Rank 3 (the last
    stage of replica 1) is SIGKILLed after iteration 3 and started again; the job goes on
    without it and ends on the user's layout. Within 1e-5 of Megatron-LM's own loop before the
    kill, 1e-4 after."""
    flags = megatron_lm_oracle_flags(1, 2, "--pipeline-model-parallel-layout", layout,
                                     "--num-layers", str(num_layers))
    reference = megatron_lm_reference(4, flags)
    elastic = train_elastic_in_megatron_lm(tmp_path, 4, flags + HELD, kill=(3, 3), rejoin=True)
    [recovery], [grow] = elastic["recovery"], elastic["grow"]
    users_layout = [users_split] * 2
    assert stage_layers(elastic["iteration"][0]["layout"]) == users_layout
    assert stage_ranks(recovery["layout"]) == [[[0], [2]], [[1]]], recovery["layout"]
    assert stage_layers(grow["layout"]) == users_layout, grow["layout"]
    if users_chunks is not None:
        for record in (elastic["iteration"][0]["layout"], grow["layout"]):
            assert stage_chunks(record) == [users_chunks] * 2, record
    assert elastic["iteration"][-1]["world_size"] == 4
    assert_follows_megatron_lm(reference[:3], elastic["iteration"][:3], EXACT)
    assert_follows_megatron_lm(reference, elastic["iteration"], AFTER_FAILURE)


@pytest.mark.timeout(600)
@needs_megatron_lm
def test_elastic_on_a_llama3_recipe_follows_megatron_lms_own_loop(megatron_lm_reference,
                                                                 tmp_path, text_data):  # noqa: F811
    """Megatron-LM's Llama 3 recipe scaled down (``test_megatron_lm_recipes.llama3_recipe``,
    TP1 x PP2 x DP2): a blend over an indexed dataset of real text, RoPE, SwiGLU, RMSNorm,
    grouped-query attention, ``--calculate-per-token-loss``, the overlapped reduction and
    gather, the sample-based LR schedule; 8 iterations within 1e-5."""
    from test_megatron_lm_recipes import llama3_recipe  # skips without TensorBoard

    blend = ["0.3", text_data, "0.7", text_data]
    flags = llama3_recipe(blend, tmp_path / "tensorboard", tmp_path / "cache", tp=1)
    reference = megatron_lm_reference(4, flags, iterations=8)
    elastic = train_elastic_in_megatron_lm(tmp_path, 4, flags, iterations=8)
    assert_follows_megatron_lm(reference, elastic["iteration"], EXACT, clip=1.0)


# -- against the plain megatron-core path of scripts/pretrain_gpt.py --------------------------

def oracle_flags(data_prefix: str, tied: bool = False, **overrides) -> list[str]:
    settings = {"num_layers": 4, "train_iters": TRAIN_ITERS, "global_batch_size": 8,
                "clip_grad": CLIP_GRAD, **overrides}
    untie = [] if tied else ["--untie-embeddings-and-output-weights"]
    return [*model_flags(data_prefix, **settings), "--use-distributed-optimizer", *untie]



def train(tmp_path: Path, name: str, nproc: int, flags: list[str],
          kill: tuple[int, int] | None = None, rejoin: bool = False,
          resumed_at: int = 0) -> list[dict]:
    """The iteration records of one run; ``kill`` is ``(rank, after_iteration)``: SIGKILL that
    worker from outside once the metrics file holds that iteration. With ``rejoin`` the worker
    is started again and the job held until it asks to join (the run's flags must then tolerate
    a held rank: :data:`test_growth.HELD`); the records then include the ``recovery`` and
    ``grow`` events. ``resumed_at`` is the iteration a ``--load`` starts from."""
    metrics = tmp_path / f"{name}.jsonl"

    def reached(event: str, iteration: int) -> bool:
        return metrics.exists() and any(
            r["iteration"] >= iteration for r in read_metrics(str(metrics), event))

    with launch([PRETRAIN, *flags, "--elastic-metrics-file", str(metrics)], nproc,
                master_port=free_port(), log_path=tmp_path / f"{name}.log",
                launcher_args=["--rejoin", "--rejoin-delay=0.5"] if rejoin else ()) as job:
        if kill is not None:
            rank, after = kill
            job.wait_for(lambda: reached("iteration", after), 120, f"iteration {after}")
            job.kill_worker(rank)
            if rejoin:
                job.wait_for(lambda: reached("recovery", after), 120, "the recovery")
                hold_while_joining(job, [rank])
        returncode, output = job.wait(240)
    assert returncode == 0, output[-4000:]
    records = read_metrics(str(metrics), "iteration")
    assert [r["iteration"] for r in records] == list(range(resumed_at + 1, TRAIN_ITERS + 1)), \
        output[-4000:]
    if rejoin:
        return [r for r in read_metrics(str(metrics)) if r["event"] in ("iteration", "recovery",
                                                                        "grow")]
    return records


def assert_matches_plain(plain: list[dict], elastic: list[dict], tolerance: float) -> None:
    """Same samples, lm loss, grad norm and multi-token prediction losses within ``tolerance``
    relative, every iteration."""
    worst = {"lm_loss": 0.0, "grad_norm": 0.0}
    for ref, got in zip(plain, elastic, strict=True):
        assert got["samples_digest"] == ref["samples_digest"], got["iteration"]
        values = [(field, ref[field], got[field]) for field in ("lm_loss", "grad_norm")]
        values += [(name, value, got["mtp_losses"][name])
                   for name, value in ref.get("mtp_losses", {}).items()]
        for field, expected, value in values:
            deviation = relative(value, expected)
            assert deviation <= tolerance, (got["iteration"], field, expected, value)
            worst[field] = max(worst.get(field, 0.0), deviation)
    print(f"largest relative difference from the plain path: {worst}")


@pytest.fixture(scope="module")
def plain_path(tmp_path_factory):
    """``plain(nproc, flags)``: the iteration records of ``scripts/pretrain_gpt.py`` without
    ``--elastic`` on ``nproc`` ranks, one run per ``(nproc, flags)`` for the module's tests."""
    runs = {}

    def plain(nproc: int, flags: list[str]) -> list[dict]:
        key = (nproc, tuple(flags))
        if key not in runs:
            runs[key] = train(tmp_path_factory.mktemp("plain"), "plain", nproc, flags)
        return runs[key]

    return plain


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp, pp, nproc, dropout, zero", [
    pytest.param(2, 1, 2, 0.0, "contiguous", marks=pytest.mark.sweep),
    pytest.param(1, 2, 2, 0.0, "contiguous", marks=pytest.mark.sweep),
    pytest.param(2, 2, 4, 0.0, "contiguous", marks=pytest.mark.sweep),
    (2, 2, 8, 0.0, "contiguous"),
    (2, 2, 4, 0.1, "contiguous"),
    (2, 2, 8, 0.0, "interleaved"),
], ids=["tp2", "pp2", "tp2-pp2", "tp2-pp2-dp2", "tp2-pp2-dropout",
       "tp2-pp2-dp2-interleaved-zero"])
def test_elastic_without_failures_is_the_plain_megatron_core_path(
        plain_path, text_data, tmp_path, tp, pp, nproc, dropout, zero):  # noqa: F811
    """With interleaved ZeRO each rank's two layers are two chunks over one data-parallel group,
    which share one reduce-scatter and one all-gather."""
    # With dropout both paths draw the layout-invariant masks (the plain default is Megatron's).
    flags = oracle_flags(text_data, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         hidden_dropout=dropout, attention_dropout=dropout, elastic_rng="invariant")
    plain = plain_path(nproc, flags)
    elastic = train(tmp_path, "elastic", nproc, [*flags, *ELASTIC, "--elastic-zero", zero])
    assert sum(r["grad_norm"] > CLIP_GRAD for r in plain) >= TRAIN_ITERS // 2, \
        [r["grad_norm"] for r in plain]  # the clip binds: the scale reaches the update
    assert_matches_plain(plain, elastic, EXACT)


@pytest.mark.timeout(400)
def test_elastic_with_a_failure_stays_on_the_plain_megatron_core_path(
        plain_path, text_data, tmp_path):  # noqa: F811
    """TP2 x PP1 x DP2: rank 3 is SIGKILLed after iteration 4; its TP partner becomes a spare,
    one replica carries the whole global batch, and the losses stay on the plain path's."""
    flags = oracle_flags(text_data, tensor_model_parallel_size=2)
    plain = plain_path(4, flags)
    elastic = train(tmp_path, "elastic", 4, flags + ELASTIC, kill=(3, 4))
    assert elastic[-1]["world_size"] == 2
    assert_matches_plain(plain, elastic, AFTER_FAILURE)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp, pp, nproc", [pytest.param(2, 1, 2, marks=pytest.mark.sweep),
                                           pytest.param(1, 2, 2, marks=pytest.mark.sweep),
                                           (2, 2, 8)],
                         ids=["tp2", "pp2", "tp2-pp2-dp2"])
def test_tied_embeddings_under_elastic_are_the_plain_megatron_core_path(
        plain_path, text_data, tmp_path, tp, pp, nproc):  # noqa: F811
    """Megatron's default, one weight for the embedding and the output layer: one parameter on
    a one-stage model, a copy on each end of a pipeline whose gradients are summed."""
    flags = oracle_flags(text_data, tied=True, tensor_model_parallel_size=tp,
                         pipeline_model_parallel_size=pp)
    plain = plain_path(nproc, flags)
    elastic = train(tmp_path, "elastic", nproc, flags + ELASTIC)
    assert_matches_plain(plain, elastic, EXACT)


@pytest.mark.timeout(400)
def test_megatrons_initialisation_under_elastic_is_the_plain_megatron_core_path(
        plain_path, text_data, tmp_path):  # noqa: F811
    """``--elastic-init megatron`` in ``pretrain_gpt.py``, TP1 x PP2 x DP2 with tied embeddings:
    both paths start from Megatron's own weights (the output layer's copy of the embedding
    summed in from the first stage), not the layout-invariant ones."""
    flags = oracle_flags(text_data, tied=True, pipeline_model_parallel_size=2)
    plain = plain_path(4, flags + ["--elastic-init", "megatron"])
    elastic = train(tmp_path, "elastic", 4, flags + ["--elastic-init", "megatron"] + ELASTIC)
    invariant = plain_path(4, flags)
    assert relative(plain[0]["lm_loss"], invariant[0]["lm_loss"]) > 1e-3
    assert_matches_plain(plain, elastic, EXACT)


@pytest.mark.timeout(400)
def test_tied_embeddings_through_a_one_stage_replica_and_back_stay_on_the_plain_path(
        plain_path, text_data, tmp_path):  # noqa: F811
    """TP1 x PP2 x DP2, tied embeddings: rank 3 (the last stage of replica 1) is SIGKILLed after
    iteration 3, so rank 1 holds both copies of the embedding, in two chunks, while the other
    replica keeps one on each stage; the replacement rejoins and the replica has two stages
    again. Every iteration stays on the plain path's."""
    flags = oracle_flags(text_data, tied=True, pipeline_model_parallel_size=2)
    plain = plain_path(4, flags)
    records = train(tmp_path, "elastic", 4, flags + ELASTIC + HELD, kill=(3, 3), rejoin=True)
    [recovery] = [r for r in records if r["event"] == "recovery"]
    [grow] = [r for r in records if r["event"] == "grow"]
    assert stage_ranks(recovery["layout"]) == [[[0], [2]], [[1]]], recovery["layout"]
    assert stage_ranks(grow["layout"]) == [[[0], [2]], [[1], [3]]], grow["layout"]
    elastic = [r for r in records if r["event"] == "iteration"]
    assert any(r["world_size"] == 3 for r in elastic) and elastic[-1]["world_size"] == 4
    assert_matches_plain(plain, elastic, AFTER_FAILURE)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("split, users_split, users_chunks", [
    pytest.param({"decoder_first_pipeline_num_layers": 1}, [[0, 0], [1, 3]], None,
                 marks=pytest.mark.sweep, id="pp2"),
    pytest.param({"decoder_first_pipeline_num_layers": 2, "num_layers": 6,
                  "num_virtual_stages_per_pipeline_rank": 2, "mtp_num_layers": 1,
                  "position_embedding_type": "rope"}, [[0, 1], [2, 5]],
                 [[[0, 0], [3, 3]], [[1, 2], [4, 5]]], id="pp2-interleaved-mtp"),
])
def test_an_uneven_pipeline_stays_on_the_plain_path_through_a_failure_and_back(
        plain_path, text_data, tmp_path, split, users_split, users_chunks):  # noqa: F811
    """TP1 x PP2 x DP2 with ``--decoder-first-pipeline-num-layers``: the first stage holds the
    embedding and fewer layers than the last, as megatron-core splits them on the plain path;
    with two virtual stages, split again into the chunks the interleaved schedule runs, and a
    multi-token prediction layer in the last chunk. Rank 3
    (the last stage of replica 1) is SIGKILLed after iteration 3 and started again: rank 1
    carries its replica's layers, then the replacement rejoins and the job is back on the
    user's split (the plain split's stage ranges in ``layers``, the chunks in ``chunks``).
    Every iteration stays on the plain path's, within 1e-5 before the kill."""
    flags = oracle_flags(text_data, pipeline_model_parallel_size=2, **split)
    plain = plain_path(4, flags)
    records = train(tmp_path, "elastic", 4, flags + ELASTIC + HELD, kill=(3, 3), rejoin=True)
    elastic = [r for r in records if r["event"] == "iteration"]
    [recovery] = [r for r in records if r["event"] == "recovery"]
    [grow] = [r for r in records if r["event"] == "grow"]
    users_split = [users_split] * 2
    assert stage_layers(elastic[0]["layout"]) == users_split, elastic[0]["layout"]
    assert stage_ranks(recovery["layout"]) == [[[0], [2]], [[1]]], recovery["layout"]
    assert stage_layers(grow["layout"]) == users_split, grow["layout"]
    assert stage_ranks(grow["layout"]) == [[[0], [2]], [[1], [3]]], grow["layout"]
    if users_chunks is not None:
        for layout in (elastic[0]["layout"], grow["layout"]):
            assert stage_chunks(layout) == [users_chunks] * 2, layout
    assert elastic[-1]["world_size"] == 4 and elastic[-1]["layout"] == grow["layout"]
    assert_matches_plain(plain[:3], elastic[:3], EXACT)
    assert_matches_plain(plain, elastic, AFTER_FAILURE)


@pytest.mark.timeout(400)
def test_tied_embeddings_saved_by_survivors_that_cannot_continue_resume_on_the_plain_path(
        plain_path, text_data, tmp_path):  # noqa: F811
    """TP1 x PP2 x DP2, tied embeddings, ``--elastic-policy reroute``: a failure in each replica
    leaves none whole, so the survivors save the state of the last complete iteration (the
    embedding's copy on each end of their pipeline) and stop; ``--load`` on two ranks finishes
    the run. Every iteration, before and after, is the plain path's."""
    flags = oracle_flags(text_data, tied=True, pipeline_model_parallel_size=2)
    plain = plain_path(4, flags)
    checkpoint, metrics = tmp_path / "checkpoint", tmp_path / "stopped.jsonl"
    with launch([PRETRAIN, *flags, *ELASTIC, "--elastic-policy", "reroute",
                 "--save", str(checkpoint), "--elastic-metrics-file", str(metrics),
                 "--elastic-inject-failure", "rank=1,iteration=3",
                 "--elastic-inject-failure", "rank=0,iteration=6"], 4,
                master_port=free_port(), log_path=tmp_path / "stopped.log") as job:
        returncode, output = job.wait(200)
    assert returncode != 0 and f"resume with --load {checkpoint}" in output, output[-4000:]
    assert "Traceback" not in output
    # Iteration 5's snapshot is settled in 6: the state saved is 5's, or 4's if rank 0's copy
    # of 5 had not reached its buddy when it was killed.
    saved = re.search(r"The state of iteration ([45]) is saved in ", output)
    assert saved, output[-4000:]
    saved = int(saved.group(1))
    stopped = read_metrics(str(metrics), "iteration")
    assert [r["iteration"] for r in stopped] == list(range(1, saved + 1))
    resumed = train(tmp_path, "resumed", 2, flags + ELASTIC + ["--load", str(checkpoint)],
                    resumed_at=saved)
    assert_matches_plain(plain, stopped + resumed, AFTER_FAILURE)


def virtual_stages(layout: list[dict]) -> list[int]:
    """Each replica's virtual stages per stage in a metrics record's layout."""
    return [replica.get("virtual_stages", 1) for replica in layout]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp, pp, nproc, num_layers", [
    pytest.param(1, 2, 4, 4, marks=pytest.mark.sweep), (2, 2, 8, 4),
    pytest.param(1, 4, 4, 8, marks=pytest.mark.sweep)], ids=["pp2-dp2", "tp2-pp2-dp2", "pp4"])
def test_interleaved_schedule_under_elastic_is_the_plain_megatron_core_path(
        plain_path, text_data, tmp_path, tp, pp, nproc, num_layers):  # noqa: F811
    """Two virtual stages of one layer per stage: both paths run Megatron's interleaved
    schedule, the elastic one over one chunk per layer group."""
    flags = oracle_flags(text_data, tensor_model_parallel_size=tp,
                         pipeline_model_parallel_size=pp, num_layers=num_layers,
                         num_layers_per_virtual_pipeline_stage=1)
    plain = plain_path(nproc, flags)
    elastic = train(tmp_path, "elastic", nproc, flags + ELASTIC)
    dp = nproc // (tp * pp)
    assert virtual_stages(elastic[-1]["layout"]) == [2] * dp, elastic[-1]["layout"]
    assert_matches_plain(plain, elastic, EXACT)


@pytest.mark.timeout(400)
def test_interleaved_replicas_keep_their_schedule_through_a_failure_and_back(
        plain_path, text_data, tmp_path):  # noqa: F811
    """TP1 x PP2 x DP2 interleaved: rank 3 (stage 1 of replica 1) is SIGKILLed after iteration
    3; replica 1 re-partitions onto rank 1 and runs 1F1B while replica 0 keeps the interleaved
    schedule with more of the 8 micro-batches; the replacement rejoins and both replicas are
    interleaved again. Every iteration stays on the plain interleaved run's."""
    flags = oracle_flags(text_data, pipeline_model_parallel_size=2, global_batch_size=16,
                         num_layers_per_virtual_pipeline_stage=1)
    plain = plain_path(4, flags)
    records = train(tmp_path, "elastic", 4, flags + ELASTIC + HELD, kill=(3, 3), rejoin=True)
    assert "; replicas [1] run 1F1B, their stages changed" in (tmp_path / "elastic.log").read_text()
    [recovery] = [r for r in records if r["event"] == "recovery"]
    [grow] = [r for r in records if r["event"] == "grow"]
    assert stage_ranks(recovery["layout"]) == [[[0], [2]], [[1]]], recovery["layout"]
    assert virtual_stages(recovery["layout"]) == [2, 1], recovery["layout"]
    assert recovery["layout"][0]["num_microbatches"] > 4, recovery["layout"]
    assert virtual_stages(grow["layout"]) == [2, 2], grow["layout"]
    elastic = [r for r in records if r["event"] == "iteration"]
    assert any(r["world_size"] == 3 for r in elastic) and elastic[-1]["world_size"] == 4
    assert_matches_plain(plain, elastic, AFTER_FAILURE)
