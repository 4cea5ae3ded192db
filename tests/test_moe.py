"""Mixtures of experts under ``--elastic``, in Megatron-LM's own loop.

Megatron-LM's Mixtral recipe (``examples/mixtral/train_mixtral_8x7b_distributed.sh``: 8 experts,
top-2, aux loss, the alltoall dispatcher, GQA, RoPE, SwiGLU, RMSNorm, bf16, the distributed
optimizer with ``--overlap-grad-reduce --overlap-param-gather``) and a DeepSeek-V3-style
configuration (a dense first layer, a shared expert, a sigmoid router with an expert bias and
group-limited top-k, the sequence-level aux loss) scaled down to eight CPU ranks. Without a
failure, ``--elastic`` follows Megatron-LM's loop without it (its log lines: lm loss, the
load-balancing loss, grad norm); through failures every iteration completes on the failure-free
run's samples with its loss. Layouts: expert parallelism over the replicas (one lockstep set of
four, or two sets of two with expert data parallelism 2), and inside each tensor-parallel group
(TP2 with sequence parallelism). Faults: a SIGKILL from outside after a log line, a kill between
the all-to-alls of an MoE layer, and a SIGKILL of a rank right after layers and experts moved
onto it.

Megatron-LM's loop comes from the training package of the installed megatron-core (0.19 on) or
a checkout named by ``MEGATRON_LM_PATH``, as in ``test_megatron_adaptor.py``; skipped where
neither is at hand.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from harness import LaunchedJob, free_port, launch
from megatron_elaswave.metrics import read_metrics
from megatron_elaswave.training.checkpointing.checkpoint import write_tracker
from test_megatron_adaptor import TRAINING_SCRIPT
from test_growth import HELD, hold_while_joining
from test_megatron_lm_recipes import CPU, assert_on_trajectory

pytestmark = pytest.mark.multiprocess
needs_megatron_lm = pytest.mark.skipif(
    TRAINING_SCRIPT is None, reason="no Megatron-LM training package: set MEGATRON_LM_PATH, or "
    "install megatron-core 0.19 or later")

PARITY_TOLERANCE = 1e-5
"""Relative: ``--elastic`` without a failure against Megatron-LM's loop without it."""
LOSS_TOLERANCE = 1e-4
"""Relative: a run through failures against the failure-free run."""
ITERATIONS = 10
LOG_LINE = re.compile(r"iteration +(\d+)/ +\d+ \|(.*)")


def mixtral_recipe(*, tp: int = 1, pp: int = 2, ep: int = 4) -> list[str]:
    """``train_mixtral_8x7b_distributed.sh`` at 4 layers, hidden 64, 8 experts of FFN 128; the
    recipe's ``--moe-grouped-gemm`` needs Transformer Engine, which a CPU does not run, and its
    checkpoint flags are left to the checkpoint tests."""
    return [
        "--use-mcore-models", "--disable-bias-linear", "--seq-length", "32",
        "--max-position-embeddings", "64", "--num-layers", "4", "--hidden-size", "64",
        "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--init-method-std", "0.01",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--no-rope-fusion", "--swiglu",
        "--untie-embeddings-and-output-weights", "--group-query-attention",
        "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
        "--rotary-base", "1000000",
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
        "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
        "--overlap-param-gather", "--overlap-grad-reduce",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
        "--split", "99990,8,2", "--micro-batch-size", "1", "--global-batch-size", "16",
        "--lr", "1e-4", "--train-iters", str(ITERATIONS), "--lr-decay-iters", "320",
        "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
        "--lr-warmup-iters", "5", "--clip-grad", "1.0", "--bf16",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--expert-model-parallel-size", str(ep), "--use-distributed-optimizer",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", *CPU,
    ]


def deepseek_v3_style() -> list[str]:
    """The Mixtral model with DeepSeek-V3's routing: a dense first layer (``--moe-layer-freq``),
    a shared expert, a sigmoid router with an expert bias (aux-loss-free balancing), top-2 of 8
    experts in 4 groups limited to 2, the sequence-level aux loss, an fp32 router, and its
    multi-token prediction layer (an MoE layer with its own copy of the embedding, on the last
    stage); expert parallelism 2 over eight ranks at TP1 x PP2: two lockstep sets of two
    replicas, expert data parallelism 2."""
    flags = mixtral_recipe(ep=2)
    at = flags.index("--moe-router-load-balancing-type")
    flags[at + 1] = "seq_aux_loss"
    flags[flags.index("--moe-aux-loss-coeff") + 1] = "1e-4"
    return flags + [
        "--moe-layer-freq", "[0]*1+[1]*3", "--moe-ffn-hidden-size", "32",
        "--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-3",
        "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32",
        "--mtp-num-layers", "1",
    ]


def log_lines(output: str) -> dict[int, dict[str, float]]:
    """Megatron-LM's iteration lines by iteration: every ``name: number`` field."""
    lines = {}
    for iteration, fields in LOG_LINE.findall(output):
        values = {}
        for field in fields.split("|"):
            name, _, value = field.partition(":")
            try:
                values[name.strip()] = float(value)
            except ValueError:
                continue
        assert int(iteration) not in lines, f"iteration {iteration} was logged twice"
        lines[int(iteration)] = values
    return lines


def run(tmp_path: Path, name: str, flags: list[str], *, elastic: bool = True,
        kill: tuple[int, int] | None = None, kill_on_death: tuple[int, int] | None = None,
        nproc: int = 8) -> dict:
    """Megatron-LM's ``pretrain_gpt.py`` with ``flags`` (and ``--elastic``) on ``nproc`` ranks;
    ``kill=(rank, iteration)`` SIGKILLs ``rank`` from outside once the log line of
    ``iteration`` is out; ``kill_on_death=(dead, rank)`` SIGKILLs ``rank`` as soon as the
    launcher reports the death of ``dead``, in the middle of the recovery from it. The run's
    output, log lines and records."""
    metrics = tmp_path / f"{name}.jsonl"
    extra = ["--elastic", "--elastic-rebalance-window", "0", "--elastic-metrics-file",
             str(metrics)] if elastic else []
    with launch(["-m", "megatron_elaswave.run_megatron_lm", str(TRAINING_SCRIPT), *flags, *extra],
                nproc, master_port=free_port(), log_path=tmp_path / f"{name}.log") as job:
        if kill is not None:
            rank, iteration = kill
            job.wait_for(lambda: max(log_lines(job.output()), default=0) >= iteration, 300,
                         f"iteration {iteration}")
            job.kill_worker(rank)
        if kill_on_death is not None:
            dead, rank = kill_on_death
            job.wait_for(lambda: f"worker rank {dead} (pid" in job.output(), 300,
                         f"the death of rank {dead}")
            job.kill_worker(rank)
        returncode, output = job.wait(600)
    assert returncode == 0, output[-6000:]
    return {"output": output, "lines": log_lines(output),
            "iterations": read_metrics(str(metrics), "iteration") if elastic else [],
            "recoveries": read_metrics(str(metrics), "recovery") if elastic else []}


def assert_lines_agree(got: dict, reference: dict, tolerance: float) -> None:
    """Every iteration logged once, each field of the reference's line within ``tolerance``."""
    assert sorted(got["lines"]) == list(range(1, ITERATIONS + 1)), got["output"][-4000:]
    for iteration, fields in reference["lines"].items():
        for name in ("lm loss", "load_balancing_loss", "seq_load_balancing_loss", "mtp_1 loss",
                     "grad norm"):
            if name in fields:
                value = got["lines"][iteration][name]
                assert value == pytest.approx(fields[name], rel=tolerance, abs=1e-6), \
                    (iteration, name, fields[name], value)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> dict[str, dict]:
    """The Mixtral recipe without a failure, in Megatron-LM's loop without and with
    ``--elastic``."""
    root = tmp_path_factory.mktemp("mixtral")
    return {"megatron-lm": run(root, "megatron-lm", mixtral_recipe(), elastic=False),
            "elastic": run(root, "elastic", mixtral_recipe())}


@needs_megatron_lm
@pytest.mark.timeout(900)
def test_mixtral_recipe_with_elastic_follows_megatron_lms_own_loop(mixtral):
    assert "load_balancing_loss" in mixtral["megatron-lm"]["lines"][1]
    assert_lines_agree(mixtral["elastic"], mixtral["megatron-lm"], PARITY_TOLERANCE)
    # The job's own account of the load-balancing loss (its metrics file) is Megatron-LM's. Its
    # second line is left out: Megatron-LM 0.19 does not reset its accumulators after the first
    # line (`should_reset = not is_first_iteration`), so that line averages iterations 1 and 2.
    for record in mixtral["elastic"]["iterations"]:
        if record["iteration"] == 2:
            continue
        logged = mixtral["megatron-lm"]["lines"][record["iteration"]]["load_balancing_loss"]
        assert record["moe_losses"]["load_balancing_loss"] == pytest.approx(
            logged, rel=PARITY_TOLERANCE)


@needs_megatron_lm
@pytest.mark.timeout(900)
def test_a_sigkilled_rank_of_an_expert_parallel_group_over_the_replicas(tmp_path, mixtral):
    """TP1 x PP2 x DP4 with expert parallelism 4: every replica shares each MoE layer's
    all-to-all, so the four run in lockstep. Rank 5 (replica 1's second stage) is SIGKILLed
    after iteration 3: all four replicas run the model on one stage each, every expert staying
    at its expert-parallel rank; Megatron-LM's log line goes on, on its trajectory."""
    killed = run(tmp_path, "killed", mixtral_recipe(), kill=(5, 3))
    assert_on_trajectory(killed, mixtral["elastic"])
    assert_lines_agree(killed, mixtral["megatron-lm"], LOSS_TOLERANCE)
    [recovery] = killed["recoveries"]
    assert recovery["failed_ranks"] == [5]
    layout = killed["iterations"][-1]["layout"]
    assert [[stage["ranks"] for stage in replica["stages"]] for replica in layout] == \
        [[[0]], [[1]], [[2]], [[3]]]
    assert [replica["num_microbatches"] for replica in layout] == [4, 4, 4, 4]


@needs_megatron_lm
@pytest.mark.timeout(900)
def test_expert_parallelism_inside_tensor_parallel_groups_through_a_sigkill(tmp_path):
    """TP2 x PP2 x DP2 with sequence parallelism and expert parallelism 2 at expert TP 1: each
    stage's tensor-parallel pair splits the experts, so the replicas run apart. Rank 5 is
    SIGKILLed after iteration 3: its replica runs on one stage, its partner rank 4 waits as a
    spare, the other replica keeps two stages and the micro-batches are dealt by speed."""
    flags = mixtral_recipe(tp=2, pp=2, ep=2) + ["--sequence-parallel",
                                                "--expert-tensor-parallel-size", "1"]
    reference = run(tmp_path, "megatron-lm", flags, elastic=False)
    killed = run(tmp_path, "killed", flags, kill=(5, 3))
    assert_lines_agree(killed, reference, LOSS_TOLERANCE)
    [recovery] = killed["recoveries"]
    assert recovery["failed_ranks"] == [5]
    stages = [len(replica["stages"]) for replica in killed["iterations"][-1]["layout"]]
    assert stages == [1, 2]


@needs_megatron_lm
@pytest.mark.timeout(1200)
def test_deepseek_v3_style_survives_a_kill_between_all_to_alls_and_one_in_the_recovery(
        tmp_path):
    """Two lockstep sets (replicas 0-1 and 2-3). Rank 4 is killed between the dispatch and the
    combine all-to-all of an MoE layer in iteration 3, its expert-parallel peer waiting in the
    combine: the recovery would run replicas 0 and 1 on one stage each, moving layers 2-3 and
    their experts to ranks 0 and 1. As soon as the launcher reports rank 4's death, rank 0 is
    SIGKILLed from outside, in the middle of that recovery: the set of replicas 0 and 1 leaves
    the job whole (its all-to-alls cannot run without replica 0), and replicas 2 and 3 run the
    global batch, with the experts' state of their own expert data parallelism and the expert
    biases from the snapshots. Megatron-LM's loop without ``--elastic`` is the reference of the
    lines (load-balancing losses included)."""
    flags = deepseek_v3_style()
    reference = run(tmp_path, "megatron-lm", flags, elastic=False)
    failure_free = run(tmp_path, "elastic", flags)
    assert_lines_agree(failure_free, reference, PARITY_TOLERANCE)
    killed = run(tmp_path, "killed", flags + [
        "--elastic-inject-failure", "rank=4,iteration=3,phase=alltoall"],
        kill_on_death=(4, 0))
    assert "injected failure: rank 4 kill in the alltoall of iteration 3" in killed["output"]
    assert_on_trajectory(killed, failure_free)
    assert_lines_agree(killed, reference, LOSS_TOLERANCE)
    failed = {rank for recovery in killed["recoveries"] for rank in recovery["failed_ranks"]}
    assert failed == {0, 4}
    last = killed["iterations"][-1]["layout"]
    assert [(r["replica"], len(r["stages"]), r["num_microbatches"]) for r in last] == \
        [(2, 2, 8), (3, 2, 8)]


@needs_megatron_lm
@pytest.mark.timeout(900)
def test_multi_token_prediction_follows_megatron_lms_own_loop_and_moves_with_the_last_stage(
        tmp_path):
    """The DeepSeek-V3-style model with its multi-token prediction layer (``--mtp-num-layers 1``:
    an MoE layer of its own, with its own embedding copy, on the last stage) on four ranks: one
    lockstep set of two replicas of two stages. Without a failure, ``--elastic`` logs Megatron-LM's
    lines (lm loss, the MTP loss, the load-balancing losses, grad norm). Rank 3 (replica 1's last
    stage) is SIGKILLed after iteration 3: both replicas run on one stage each, the MTP layer, its
    experts and the embedding copy moved onto ranks 0 and 1 from the snapshots, on the
    trajectory."""
    flags = deepseek_v3_style()
    reference = run(tmp_path, "megatron-lm", flags, elastic=False, nproc=4)
    failure_free = run(tmp_path, "elastic", flags, nproc=4)
    assert "mtp_1 loss" in reference["lines"][1]
    assert_lines_agree(failure_free, reference, PARITY_TOLERANCE)
    killed = run(tmp_path, "killed", flags, kill=(3, 3), nproc=4)
    assert_on_trajectory(killed, failure_free)
    assert_lines_agree(killed, reference, LOSS_TOLERANCE)
    [recovery] = killed["recoveries"]
    assert recovery["failed_ranks"] == [3]
    assert [[stage["ranks"] for stage in replica["stages"]]
            for replica in killed["iterations"][-1]["layout"]] == [[[0]], [[1]]]


# -- the project's pretrain_gpt.py ---------------------------------------------------------------

PRETRAIN = str(Path(__file__).resolve().parents[1] / "scripts" / "pretrain_gpt.py")


def pretrain_gpt_flags(*, ep: int, etp: int = 1, iterations: int = ITERATIONS,
                       dispatcher: str = "alltoall") -> list[str]:
    """``pretrain_gpt.py`` with the DeepSeek-V3-style MoE layers and multi-token prediction
    layer of :func:`deepseek_v3_style` (untied embeddings, RoPE), TP1 x PP2 on eight ranks, no
    dropout."""
    return [
        "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", "4", "--seq-length", "32", "--disable-bias-linear",
        "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", str(iterations),
        "--lr", "1e-4", "--lr-decay-style", "constant", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--mock-data", "--vocab-size", "300", "--log-interval", "1",
        "--eval-interval", "1000", "--use-distributed-optimizer",
        "--pipeline-model-parallel-size", "2", "--num-experts", "8", "--moe-router-topk", "2",
        "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(etp),
        "--moe-token-dispatcher-type", dispatcher, "--moe-layer-freq", "[0]*1+[1]*3",
        "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
        "--moe-router-num-groups", "4", "--moe-router-group-topk", "2", "--mtp-num-layers", "1",
        "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
    ]


def pretrain_gpt(tmp_path: Path, name: str, flags: list[str], *,
                 launcher_args: tuple[str, ...] = (),
                 during: Callable[[LaunchedJob, Path], None] | None = None) -> dict:
    """The project's ``pretrain_gpt.py`` on eight ranks; ``during(job, metrics_file)`` is called
    once it has started. Its records."""
    metrics = tmp_path / f"{name}.jsonl"
    with launch([PRETRAIN, *flags, "--elastic-rebalance-window", "0", "--elastic-metrics-file",
                 str(metrics)], 8, master_port=free_port(), launcher_args=launcher_args,
                log_path=tmp_path / f"{name}.log") as job:
        if during is not None:
            during(job, metrics)
        returncode, output = job.wait(600)
    assert returncode == 0, output[-6000:]
    return {"output": output, "iterations": read_metrics(str(metrics), "iteration"),
            "recoveries": read_metrics(str(metrics), "recovery"),
            "grows": read_metrics(str(metrics), "grow")}


def assert_moe_losses_agree(got: dict, reference: dict, tolerance: float) -> None:
    """The MoE losses and the multi-token prediction losses of every iteration."""
    for ref, record in zip(reference["iterations"], got["iterations"], strict=True):
        for kind in ("moe_losses", "mtp_losses"):
            for name, value in ref[kind].items():
                assert record[kind][name] == pytest.approx(value, rel=tolerance), \
                    (record["iteration"], name)


@pytest.mark.timeout(900)
def test_pretrain_gpt_with_elastic_follows_its_plain_path_with_expert_tensor_parallelism(
        tmp_path):
    """Expert parallelism 2 x expert tensor parallelism 2 over four replicas (one lockstep
    set), the allgather dispatcher: ``--elastic`` trains as the same script without it, on
    Megatron's own groups."""
    flags = pretrain_gpt_flags(ep=2, etp=2, iterations=6, dispatcher="allgather")
    plain = pretrain_gpt(tmp_path, "plain", flags)
    elastic = pretrain_gpt(tmp_path, "elastic", flags + ["--elastic"])
    assert_on_trajectory(elastic, plain)
    assert_moe_losses_agree(elastic, plain, PARITY_TOLERANCE)
    assert "seq_load_balancing_loss: " in elastic["output"] and "mtp_1 loss: " in elastic["output"]


@pytest.fixture(scope="module")
def two_lockstep_sets(tmp_path_factory) -> dict:
    """The failure-free run with expert parallelism 2 over four replicas: two lockstep sets."""
    return pretrain_gpt(tmp_path_factory.mktemp("moe"), "failure-free",
                        pretrain_gpt_flags(ep=2) + ["--elastic"])


@pytest.mark.timeout(900)
def test_pretrain_gpt_survives_a_kill_and_one_right_after_layers_and_experts_moved(
        tmp_path, two_lockstep_sets):
    """Rank 4 (replica 0's second stage) is SIGKILLed in iteration 3: replicas 0 and 1 are to
    run on one stage each, layers 2-3 and their experts moved onto ranks 0 and 1. Rank 0 is
    SIGKILLed as soon as it has restored that state, before it snapshots it: the set of
    replicas 0 and 1 leaves the job, replicas 2 and 3 run the global batch, the routers' expert
    biases and the experts' state coming from the snapshots. Each step's snapshot completes in the step (``--elastic-snapshot-overlap off``),
    so the first recovery rolls back to iteration 2 and the second failure lands in the change
    before iteration 3."""
    killed = pretrain_gpt(tmp_path, "killed", pretrain_gpt_flags(ep=2) + [
        "--elastic", "--elastic-snapshot-overlap", "off",
        "--elastic-inject-failure", "rank=4,iteration=3",
        "--elastic-inject-failure", "rank=0,iteration=3,phase=relayout"])
    # Rank 0 held a stage of the layout rank 4's failure led to, and had restored its state.
    assert "injected failure: rank 0 kill in the relayout of iteration 3" in killed["output"]
    assert_on_trajectory(killed, two_lockstep_sets)
    assert_moe_losses_agree(killed, two_lockstep_sets, LOSS_TOLERANCE)
    [recovery] = killed["recoveries"]  # the second failure came before the re-run completed
    assert recovery["failed_ranks"] == [0, 4] and recovery["rolled_back_to"] == 2
    assert [(r["replica"], len(r["stages"]), r["num_microbatches"])
            for r in recovery["layout"]] == [(2, 2, 8), (3, 2, 8)]


@pytest.mark.timeout(900)
def test_a_replacement_rejoins_an_moe_job_and_its_layout_returns(tmp_path, two_lockstep_sets):
    """Under ``elaswave-run --rejoin``, rank 5 is SIGKILLed in iteration 3 and started again:
    its lockstep set runs on one stage per replica until the replacement joins, then the job
    runs its first layout again, on the failure-free trajectory. Rank 0 is held once the job
    has recovered, until the replacement asks to join: its imports take longer than the job."""
    def hold_until_rank_5_asks(job: LaunchedJob, metrics: Path) -> None:
        job.wait_for(lambda: metrics.exists() and bool(read_metrics(str(metrics), "recovery")),
                     300, "the recovery")
        hold_while_joining(job, [5])

    rejoined = pretrain_gpt(tmp_path, "rejoined", pretrain_gpt_flags(ep=2) + [
        "--elastic", *HELD, "--elastic-inject-failure", "rank=5,iteration=3"],
        launcher_args=("--rejoin", "--rejoin-delay", "1"), during=hold_until_rank_5_asks)
    assert "ranks [5] joined after iteration" in rejoined["output"]
    assert_on_trajectory(rejoined, two_lockstep_sets)
    [recovery] = rejoined["recoveries"]
    [grow] = rejoined["grows"]
    assert recovery["failed_ranks"] == [5] and grow["joined_ranks"] == [5]
    assert [len(r["stages"]) for r in recovery["layout"]] == [1, 1, 2, 2]
    assert grow["layout"] == two_lockstep_sets["iterations"][0]["layout"]
    assert rejoined["iterations"][-1]["world_size"] == 8


# -- checkpoints ---------------------------------------------------------------------------------


@needs_megatron_lm
@pytest.mark.timeout(1800)
def test_a_checkpoint_saved_after_a_failure_loads_in_megatron_lms_own_loop(tmp_path):
    """The DeepSeek-V3-style job saves iteration 4 after rank 4 failed in iteration 3: its two
    lockstep sets then run one and two stages. Megatron-LM's loop without ``--elastic`` resumes
    that checkpoint (the experts by global index, the expert optimizer's state, the routers'
    expert biases) as it resumes one it saved itself. (``--elastic`` resumes such a checkpoint
    on the run that saved it: ``test_pretrain_gpt_resumes_an_moe_checkpoint_in_another_expert_layout``,
    through the same loader.)"""
    flags = deepseek_v3_style()
    saved = {"elastic": tmp_path / "saved-by-elastic", "megatron-lm": tmp_path / "saved-by-megatron-lm"}
    run(tmp_path, "saving-elastic", flags + [
        "--save", str(saved["elastic"]), "--save-interval", "4",
        "--elastic-inject-failure", "rank=4,iteration=3"])
    run(tmp_path, "saving-megatron-lm", flags + ["--save", str(saved["megatron-lm"]),
                                                 "--save-interval", "4"], elastic=False)
    for directory in saved.values():  # resume the checkpoint of iteration 4
        write_tracker(str(directory), 4)
    resumed = {saver: run(tmp_path, f"megatron-lm-loads-{saver}", flags + ["--load", str(path)],
                          elastic=False)["lines"] for saver, path in saved.items()}
    assert sorted(resumed["elastic"]) == list(range(5, ITERATIONS + 1))
    for iteration, fields in resumed["megatron-lm"].items():
        for name in ("lm loss", "seq_load_balancing_loss", "grad norm"):
            assert resumed["elastic"][iteration][name] == pytest.approx(
                fields[name], rel=PARITY_TOLERANCE, abs=1e-6), (iteration, name)


@pytest.mark.timeout(900)
def test_pretrain_gpt_resumes_an_moe_checkpoint_in_another_expert_layout(tmp_path,
                                                                         two_lockstep_sets):
    """``pretrain_gpt.py`` saves iteration 4 after a failure with expert parallelism 2 (two
    lockstep sets, one of them on one stage per replica), and resumes it with expert
    parallelism 4: every expert is found by its global index, on the uninterrupted run."""
    flags = pretrain_gpt_flags(ep=2) + ["--elastic"]
    uninterrupted = two_lockstep_sets
    at = flags.index("--train-iters")
    pretrain_gpt(tmp_path, "saving", flags[:at + 1] + ["4"] + flags[at + 2:] + [
        "--save", str(tmp_path / "saved"), "--save-interval", "4",
        "--elastic-inject-failure", "rank=4,iteration=3"])
    at = flags.index("--expert-model-parallel-size")
    resumed = pretrain_gpt(tmp_path, "resumed", flags[:at + 1] + ["4"] + flags[at + 2:] + [
        "--load", str(tmp_path / "saved")])
    assert_on_trajectory(resumed, {"iterations": [r for r in uninterrupted["iterations"]
                                                  if r["iteration"] > 4]})


@pytest.mark.timeout(900)
def test_an_moe_job_whose_lockstep_set_cannot_go_on_saves_and_stops_in_one_line(
        tmp_path, two_lockstep_sets):
    """Expert parallelism 4 over the four replicas: one lockstep set. Both stages of replica 1
    fail in iteration 3: no replica of the set may leave it, so the survivors gather the state
    into one lockstep set of replicas of one stage each, save it and stop with one line (exit
    status 3); ``--load`` finishes the run on the trajectory, with expert parallelism 2."""
    checkpoint = tmp_path / "checkpoint"
    flags = pretrain_gpt_flags(ep=4) + ["--elastic"]
    metrics = tmp_path / "stopped.jsonl"
    with launch([PRETRAIN, *flags, "--save", str(checkpoint), "--elastic-metrics-file",
                 str(metrics), "--elastic-inject-failure", "rank=1,iteration=3",
                 "--elastic-inject-failure", "rank=5,iteration=3"], 8, master_port=free_port(),
                log_path=tmp_path / "stopped.log") as job:
        returncode, output = job.wait(600)
    assert returncode != 0 and "Traceback" not in output, output[-4000:]
    for survivor in (0, 2, 3, 4, 6, 7):
        assert re.search(rf"worker rank {survivor} \(pid \d+\) exited with code 3", output), \
            output[-4000:]
    at = re.escape(str(checkpoint))
    saved = re.search(r"cannot continue: .*\. The state of iteration (\d+) is saved in "
                      rf"{at}/iter_\d+: resume with --load {at}", output)
    assert saved, output[-4000:]
    stopped = read_metrics(str(metrics), "iteration")
    assert [r["iteration"] for r in stopped] == list(range(1, int(saved.group(1)) + 1))
    at = flags.index("--expert-model-parallel-size")
    resumed = pretrain_gpt(tmp_path, "resumed", flags[:at + 1] + ["2"] + flags[at + 2:] + [
        "--load", str(checkpoint)])
    assert_on_trajectory({"iterations": stopped + resumed["iterations"]}, two_lockstep_sets)
