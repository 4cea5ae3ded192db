"""Command-line arguments of ``pretrain_gpt.py``: Megatron-LM's names, plus the elastic flags.

Every check that can be made before touching a device or a process group is made here, so a
wrong combination is reported as one line (:class:`ArgumentError`) before any rank starts work.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
from typing import Sequence

from megatron_elaswave.layout import megatron_chunk_layers
from megatron_elaswave.runtime.dvfs import BACKENDS
from megatron_elaswave.runtime.faults import FailureSpecError, InjectedFailure, InjectedSlowdown

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
TOKENIZER_TYPES = ("ByteLevelTokenizer", "NullTokenizer")
RNG_MODES = ("invariant", "megatron")
INIT_MODES = ("invariant", "megatron")


class ArgumentError(ValueError):
    """A flag, or a combination of flags, that cannot work; the message is one line."""


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--num-layers", type=int, required=True)
    group.add_argument("--hidden-size", type=int, required=True)
    group.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    group.add_argument("--num-attention-heads", type=int, required=True)
    group.add_argument("--seq-length", type=int, required=True)
    group.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    group.add_argument("--hidden-dropout", type=float, default=0.1)
    group.add_argument("--attention-dropout", type=float, default=0.1)
    group.add_argument("--init-method-std", type=float, default=0.02)
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                       default="learned_absolute")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    group.add_argument("--disable-bias-linear", action="store_true",
                       help="no bias in the linear layers (MoE layers have none)")
    group.add_argument("--mtp-num-layers", type=int, default=None,
                       help="multi-token prediction layers, on the last pipeline stage, each of "
                            "the kind of the model's last layer")
    group.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                       help="the multi-token prediction losses' weight, shared among them")


def moe_layer_pattern(text: str) -> int | list[int]:
    """``--moe-layer-freq`` as Megatron-LM reads it: every ``N``-th layer is an MoE layer
    (``N``), or a list of 0 and 1, one per layer, written as a Python expression of lists of
    integers joined by ``+`` and repeated by ``*`` (``"[0]*1+[1]*3"``)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError

    try:
        pattern = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor a list of 0 and 1 "
                                         "such as \"[0]*1+[1]*3\"") from None
    if isinstance(pattern, list) and any(flag not in (0, 1) for flag in pattern):
        raise argparse.ArgumentTypeError(f"{text!r}: a layer pattern holds only 0 and 1")
    return pattern


def _add_moe_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mixture of experts")
    group.add_argument("--num-experts", type=int, default=None,
                       help="routed experts per MoE layer (default: a dense model)")
    group.add_argument("--expert-model-parallel-size", type=int, default=1)
    group.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                       help="default: the tensor-parallel size")
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                       help="default: --ffn-hidden-size")
    group.add_argument("--moe-layer-freq", type=moe_layer_pattern, default=1,
                       help="every N-th layer is an MoE layer, or a 0/1 pattern per layer "
                            "(\"[0]*1+[1]*3\": the first layer dense)")
    group.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    group.add_argument("--moe-router-topk", type=int, default=2)
    group.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                       choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "none"))
    group.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    group.add_argument("--moe-z-loss-coeff", type=float, default=None)
    group.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"),
                       default="softmax")
    group.add_argument("--moe-router-pre-softmax", action="store_true")
    group.add_argument("--moe-router-enable-expert-bias", action="store_true",
                       help="aux-loss-free routing: a per-expert bias that follows the load")
    group.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    group.add_argument("--moe-router-num-groups", type=int, default=None)
    group.add_argument("--moe-router-group-topk", type=int, default=None)
    group.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    group.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None)
    group.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"),
                       default="allgather")


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="enables the interleaved 1F1B schedule")
    group.add_argument("--num-virtual-stages-per-pipeline-rank",
                       "--virtual-pipeline-model-parallel-size", type=int, default=None,
                       dest="virtual_pipeline_model_parallel_size",
                       help="model chunks per pipeline rank (interleaved 1F1B schedule)")
    group.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                       help="transformer layers of the first pipeline stage (the rest split "
                            "evenly over the others)")
    group.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                       help="transformer layers of the last pipeline stage")
    group.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                       help="count the embedding as a layer of the first stage in the split")
    group.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                       help="count the output layer and loss as a layer of the last stage")
    group.add_argument("--pipeline-model-parallel-layout", default=None,
                       help="Megatron's layout string, one '|'-separated stage per pipeline "
                            "stage: E the embedding, t a transformer layer, L the loss; "
                            "e.g. 'Et|ttt|tt|ttL'")
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--distributed-backend", choices=("nccl", "gloo", "hccl"), default=None,
                       help="default: the device's own (gloo on CPU, nccl on CUDA, hccl on NPU)")
    group.add_argument("--distributed-timeout-minutes", type=float, default=10.0)


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=int, required=True)
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="default: micro batch size x data-parallel size")
    group.add_argument("--train-iters", type=int, default=None,
                       help="iterations to train (or --train-samples)")
    group.add_argument("--train-samples", type=int, default=None,
                       help="samples to train: --train-samples / global batch size iterations")
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--fp16", action="store_true")
    group = parser.add_argument_group("optimizer")
    group.add_argument("--optimizer", choices=("adam",), default="adam")
    group.add_argument("--lr", type=float, required=True)
    group.add_argument("--min-lr", type=float, default=0.0)
    group.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear")
    group.add_argument("--lr-decay-iters", type=int, default=None, help="default: train iters")
    group.add_argument("--lr-decay-samples", type=int, default=None,
                       help="with --train-samples (default: train samples)")
    group.add_argument("--lr-warmup-iters", type=int, default=0)
    group.add_argument("--lr-warmup-samples", type=int, default=0, help="with --train-samples")
    group.add_argument("--lr-warmup-fraction", type=float, default=None,
                       help="warm-up as a fraction of the decay (instead of --lr-warmup-iters "
                            "or --lr-warmup-samples)")
    group.add_argument("--lr-warmup-init", type=float, default=0.0)
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--mock-data", action="store_true")
    group.add_argument("--data-path", nargs="+", default=None,
                       help="prefix of a Megatron .bin/.idx pair (see scripts/preprocess_data.py)")
    group.add_argument("--split", default="969,30,1")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    group.add_argument("--vocab-size", type=int, default=None)
    group.add_argument("--data-cache-path", default=None)
    group = parser.add_argument_group("logging and checkpoints")
    group.add_argument("--log-interval", type=int, default=100)
    group.add_argument("--log-throughput", action="store_true",
                       help="add the model's TFLOP/s per rank to the log line")
    group.add_argument("--tensorboard-dir", default=None,
                       help="write TensorBoard scalars here from the logging rank: lm loss, "
                            "learning rate, grad norm, batch size, throughput")
    group.add_argument("--tensorboard-queue-size", type=int, default=1000)
    group.add_argument("--wandb-project", default="",
                       help="log the same scalars to this W&B project (WANDB_MODE=offline: "
                            "to disk only)")
    group.add_argument("--wandb-exp-name", default="", help="the W&B run's name")
    group.add_argument("--wandb-save-dir", default="",
                       help="where W&B keeps its files (default: --save's wandb/, else ./wandb)")
    group.add_argument("--wandb-entity", default="")
    group.add_argument("--eval-interval", type=int, default=1000)
    group.add_argument("--eval-iters", type=int, default=100)
    group.add_argument("--save", default=None)
    group.add_argument("--load", default=None)
    group.add_argument("--finetune", action="store_true",
                       help="load the model weights of --load only, and start from iteration 0 "
                            "with a new optimizer and schedule (Megatron's --finetune)")
    group.add_argument("--no-load-optim", action="store_true",
                       help="do not load the optimizer state and schedule of --load (the "
                            "iteration is)")
    group.add_argument("--no-load-rng", action="store_true",
                       help="accepted: the RNG states are never loaded (nor saved: dropout is "
                            "seeded by sample and layer under --elastic)")
    group.add_argument("--no-save-optim", action="store_true",
                       help="save checkpoints without the optimizer state and schedule (loaded "
                            "then as with --no-load-optim)")
    group.add_argument("--no-save-rng", action="store_true",
                       help="accepted: the RNG states are never saved")
    group.add_argument("--save-interval", type=int, default=None)
    group.add_argument("--ckpt-format", choices=("torch_dist",), default="torch_dist",
                       help="Megatron's torch_dist format (the only one)")
    group.add_argument("--async-save", action="store_true",
                       help="write checkpoints in the background (with --elastic they always "
                            "are, from the snapshots)")
    group.add_argument("--exit-duration-in-mins", type=float, default=None,
                       help="save (with --save) and exit with 0 after training this long")
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="on SIGTERM, save (with --save) and exit with 0 after the iteration")


def add_elastic_args(parser: argparse.ArgumentParser) -> None:
    """The ``--elastic*`` flags (also added to Megatron-LM's parser by its adaptor)."""
    group = parser.add_argument_group("elastic")
    group.add_argument("--elastic", action="store_true",
                       help="survive rank failures without restart (ElasWave)")
    group.add_argument("--elastic-device", choices=("auto", "cpu", "cuda", "npu"), default=None,
                       help="default: $ELASWAVE_DEVICE, else auto-detected")
    group.add_argument("--elastic-metrics-file", default=None,
                       help="JSON-lines file of per-iteration (and recovery) records")
    group.add_argument("--elastic-snapshots", action="store_true",
                       help="keep per-step in-memory snapshots (on by default with --elastic)")
    group.add_argument("--elastic-snapshot-replicas", type=int, default=None,
                       help="buddy ranks that hold a copy of each rank's snapshot (default: 2 "
                            "where the snapshots fit in half the host memory available, so that "
                            "any two ranks may fail together, else 1)")
    group.add_argument("--elastic-snapshot-overlap", choices=("on", "off"), default="on",
                       help="finish each step's snapshot in the next step, before its optimizer "
                            "step, so that its device-to-host copies and its exchange with the "
                            "buddies overlap the forward and backward (a failure before then "
                            "rolls back one iteration further if the snapshot of a rank it took "
                            "had not reached its buddy); off: finish it in its own step "
                            "(default: on)")
    group.add_argument("--elastic-snapshot-shared-memory", choices=("on", "off"), default="on",
                       help="on: snapshots live in shared memory, which buddies on the same host "
                            "map instead of receiving a copy; off: every copy is sent through "
                            "the process group, as to buddies on other hosts (default: on)")
    group.add_argument("--elastic-policy", choices=("elaswave", "drop-replica", "reroute"),
                       default="elaswave",
                       help="after a failure: elaswave (reshard layers, micro-batches and state), "
                            "drop-replica (TorchFT-style: the damaged replica and its micro-batches "
                            "go, the global batch shrinks) or reroute (the damaged replica goes, "
                            "its micro-batches move to the others; no layer moves)")
    group.add_argument("--elastic-heartbeat-timeout", type=float, default=5.0,
                       help="seconds without a heartbeat after which a rank counts as hung")
    group.add_argument("--elastic-profile", default=None,
                       help="profile JSON the planner uses after a failure (default: costs "
                            "computed from the model's FLOP counts)")
    group.add_argument("--elastic-inject-failure", action="append", default=[],
                       metavar="rank=R,iteration=I[,phase=P][,kind=kill|hang|raise|poison|nan]",
                       help="fail rank R during iteration I (repeatable); phases: forward, "
                            "backward, allreduce, optimizer, snapshot, recovery, relayout, "
                            "evaluation (the one after iteration I), alltoall, checkpoint, "
                            "commit (docs/elastic.md)")
    group.add_argument("--elastic-max-step-retries", type=int, default=1,
                       help="times an iteration that fails with no rank failing (an error of "
                            "its own, not a peer's death) is re-run from its snapshot before the "
                            "job stops with that error (default 1)")
    group.add_argument("--elastic-save-failures", choices=("stop", "warn"), default="stop",
                       help="when a checkpoint cannot be written (after its retries): stop the "
                            "job in one line naming the error and the last complete checkpoint "
                            "(stop, default), or train on with a warning at every save (warn); "
                            "either way the job exits non-zero if its final or preemption save "
                            "was not written")
    group.add_argument("--elastic-save-retries", type=int, default=2,
                       help="times a checkpoint write that met a transient storage error (EIO, "
                            "EAGAIN, ESTALE...) is tried again, 1 s later and then twice as long "
                            "each time (default 2)")
    group.add_argument("--elastic-inject-slowdown", action="append", default=[],
                       metavar="rank=R,factor=F[,iteration=I]",
                       help="make rank R's compute take F times as long from iteration I on "
                            "(repeatable), a straggler for tests and benchmarks")
    group.add_argument("--elastic-rebalance-window", type=int, default=5,
                       help="iterations of measured pipeline times behind a re-deal of the "
                            "micro-batches to follow a straggler (0: never re-deal)")
    group.add_argument("--elastic-rebalance-min-gain", type=float, default=1.2,
                       help="smallest predicted step speed-up that makes the job re-deal its "
                            "micro-batches or move layers (default 1.2)")
    group.add_argument("--elastic-zero", choices=("contiguous", "interleaved"), default="contiguous",
                       help="how the distributed optimizer shards its state: one contiguous shard "
                            "per rank of each layer group (contiguous, Megatron's, default), or "
                            "each layer's state over that layer's holders (interleaved: less to "
                            "move after a failure)")
    group.add_argument("--elastic-slow-stage-factor", type=float, default=1.5,
                       help="a pipeline stage whose time per transformer layer is this many "
                            "times the median of its replica's other stages, in four iterations "
                            "of five, runs on a slow device: layers move off it (default 1.5)")
    group.add_argument("--elastic-dvfs", choices=BACKENDS, default="sim",
                       help="how the planner's per-stage clocks are applied: sim (logged, energy "
                            "from the power model; default), nvml (locked GPU clocks), npu "
                            "(--elastic-dvfs-command)")
    group.add_argument("--elastic-dvfs-command", default=None,
                       help="with --elastic-dvfs npu: shell command that sets a clock; {device}, "
                            "{clock} (relative to nominal) and {percent} are filled in")
    group.add_argument("--elastic-rng", choices=RNG_MODES, default=None,
                       help="dropout randomness: 'invariant' keys each mask by (seed, iteration, "
                            "micro-batch, layer, TP rank) so it does not depend on the pipeline "
                            "or data-parallel layout (docs/rng.md); 'megatron' is Megatron's "
                            "per-rank streams (default: invariant with --elastic, else megatron)")
    group.add_argument("--elastic-init", choices=INIT_MODES, default=None,
                       help="weight initialisation: 'invariant' draws each parameter whole from "
                            "(seed, its global name) and cuts this rank's shard, so runs launched "
                            "on any layout start from the same weights; 'megatron' is Megatron's "
                            "own, from the per-stage and per-TP-rank streams, so the run starts "
                            "where the same job without --elastic does (default: the "
                            "initialisation of the same script without --elastic: invariant in "
                            "pretrain_gpt.py, megatron in Megatron-LM's loop)")
    group.add_argument("--elastic-profile-out", default=None,
                       help="measure per-layer costs during the run and write the planner's "
                            "profile JSON here (see docs/planner.md)")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors (an unknown flag, a value of the wrong type) are one line
    on stderr, exit status 2, like every other bad input of the script."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="pretrain_gpt.py",
        description="GPT pretraining on Megatron-Core with Megatron-LM's flags, plus --elastic.",
        allow_abbrev=False,
    )
    _add_model_args(parser)
    _add_moe_args(parser)
    _add_parallel_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    add_elastic_args(parser)
    return parser


def _fail_unless(condition: bool, message: str) -> None:
    if not condition:
        raise ArgumentError(message)


def validate(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check ``args`` against the world size and fill in the derived values.

    Adds ``data_parallel_size``, ``virtual_pipeline_model_parallel_size`` (or None) and resolves
    ``elastic_rng`` and ``elastic_init``; ``padded_vocab_size`` is left to the tokenizer; raises :class:`ArgumentError`.
    """
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _fail_unless((args.train_iters is None) != (args.train_samples is None),
                 "give exactly one of --train-iters and --train-samples")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters" if args.train_iters is not None
                 else "train_samples", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size"):
        value = getattr(args, name)
        _fail_unless(value > 0, f"--{name.replace('_', '-')} must be positive, got {value}")
    _fail_unless(world_size % (tp * pp) == 0,
                 f"world size {world_size} is not a multiple of tensor ({tp}) x pipeline ({pp}) "
                 "parallel size")
    args.data_parallel_size = world_size // (tp * pp)
    _fail_unless(args.num_attention_heads % tp == 0,
                 f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                 f"--tensor-model-parallel-size {tp}")
    _fail_unless(args.hidden_size % args.num_attention_heads == 0,
                 f"--hidden-size {args.hidden_size} is not divisible by "
                 f"--num-attention-heads {args.num_attention_heads}")
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    _fail_unless(args.seq_length <= args.max_position_embeddings,
                 f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                 f"{args.max_position_embeddings}")
    _validate_pipeline(args)
    _validate_mtp(args)
    _validate_moe(args)
    _validate_batch(args)
    _validate_data(args)
    _fail_unless(not (args.bf16 and args.fp16), "--bf16 and --fp16 are mutually exclusive")
    _validate_schedule(args)
    _validate_writers(args)
    _fail_unless(args.save_interval is None or args.save_interval > 0,
                 "--save-interval must be positive")
    _fail_unless(args.exit_duration_in_mins is None or args.exit_duration_in_mins > 0,
                 "--exit-duration-in-mins must be positive")
    validate_elastic(args, world_size)
    _fail_unless(args.log_interval > 0 and args.eval_interval > 0,
                 "--log-interval and --eval-interval must be positive")
    return args


def validate_elastic(args: argparse.Namespace, world_size: int, *,
                     init_default: str = "invariant") -> None:
    """Check the ``--elastic*`` flags and what ``--elastic`` needs of the others; resolve
    ``elastic_snapshots``, ``elastic_rng`` and ``elastic_init`` (``init_default`` when not given:
    the initialisation the same script does without ``--elastic``). Raises
    :class:`ArgumentError`."""
    _fail_unless(args.elastic_snapshot_replicas is None or args.elastic_snapshot_replicas >= 0,
                 "--elastic-snapshot-replicas must not be negative")
    args.elastic_snapshots = args.elastic_snapshots or args.elastic
    args.elastic_rng = args.elastic_rng or ("invariant" if args.elastic else "megatron")
    args.elastic_init = args.elastic_init or init_default
    try:
        args.elastic_inject_failure = [InjectedFailure.parse(text)
                                       for text in args.elastic_inject_failure]
    except FailureSpecError as error:
        raise ArgumentError(f"--elastic-inject-failure: {error}") from None
    try:
        args.elastic_inject_slowdown = [InjectedSlowdown.parse(text)
                                        for text in args.elastic_inject_slowdown]
    except FailureSpecError as error:
        raise ArgumentError(f"--elastic-inject-slowdown: {error}") from None
    _fail_unless(args.elastic or not (args.elastic_inject_failure or args.elastic_inject_slowdown),
                 "--elastic-inject-failure and --elastic-inject-slowdown need --elastic")
    _fail_unless(args.elastic_rebalance_window >= 0,
                 "--elastic-rebalance-window must not be negative")
    # A gain of 1 would re-deal for nothing, back and forth.
    _fail_unless(args.elastic_rebalance_min_gain > 1, "--elastic-rebalance-min-gain must be > 1")
    _fail_unless(args.elastic_save_retries >= 0, "--elastic-save-retries must be >= 0")
    _fail_unless(args.elastic_slow_stage_factor > 1, "--elastic-slow-stage-factor must be > 1")
    _fail_unless(args.elastic_heartbeat_timeout > 0, "--elastic-heartbeat-timeout must be positive")
    _fail_unless(args.elastic_max_step_retries >= 0,
                 "--elastic-max-step-retries must be 0 or more")
    _fail_unless(args.elastic or args.elastic_zero == "contiguous",
                 "--elastic-zero interleaved needs --elastic (without it Megatron shards the "
                 "optimizer as usual)")
    if not args.elastic:
        return
    _fail_unless(args.use_distributed_optimizer,
                 "--elastic reshards the distributed optimizer's state: add --use-distributed-optimizer")
    _fail_unless(not args.fp16, "--elastic does not support --fp16 (loss scaling); use --bf16")
    _validate_experts(args)
    _uneven_chunk_layers(args)
    if getattr(args, "save", None):
        _check_writable(args.save)
    for slowdown in args.elastic_inject_slowdown:
        _fail_unless(slowdown.rank < world_size,
                     f"--elastic-inject-slowdown rank {slowdown.rank} is not a rank of this "
                     f"{world_size}-rank job")
    for failure in args.elastic_inject_failure:
        _fail_unless(failure.rank < world_size,
                     f"--elastic-inject-failure rank {failure.rank} is not a rank of this "
                     f"{world_size}-rank job")
        _fail_unless(failure.iteration <= args.train_iters,
                     f"--elastic-inject-failure iteration {failure.iteration} is beyond "
                     f"--train-iters {args.train_iters}")


def _check_writable(save: str) -> None:
    """``--save`` can be created and written here: a save that fails later stops the job, this
    one is refused before the job starts."""
    probe = os.path.join(save, f".elaswave-write-test-{os.getpid()}")
    try:
        os.makedirs(save, exist_ok=True)
        with open(probe, "w", encoding="utf-8"):
            pass
        os.remove(probe)
    except OSError as error:
        raise ArgumentError(f"--save {save} cannot be written: {error.strerror} "
                            f"({error.filename or save})") from None


def _validate_experts(args: argparse.Namespace) -> None:
    """What ``--elastic`` needs of an MoE job's flags: an expert grid whose expert-parallel
    groups hold whole replicas or lie inside a tensor-parallel group, and experts kept as one
    tensor each (a snapshot names them by global index)."""
    if not getattr(args, "num_experts", None):
        return
    from megatron_elaswave.layout import ExpertParallelism

    tp = args.tensor_model_parallel_size
    experts = ExpertParallelism(args.num_experts, getattr(args, "expert_model_parallel_size", 1),
                                getattr(args, "expert_tensor_parallel_size", None) or tp)
    try:
        experts.check(tp, args.data_parallel_size)
    except ValueError as error:
        raise ArgumentError(f"--elastic with --num-experts: {error}") from None
    legacy = getattr(args, "moe_use_legacy_grouped_gemm", False) or (
        getattr(args, "moe_grouped_gemm", False)
        and getattr(args, "transformer_impl", "local") != "transformer_engine")
    _fail_unless(not legacy, "--elastic does not support --moe-grouped-gemm without Transformer "
                             "Engine (the legacy GroupedMLP keeps a rank's experts in one tensor, "
                             "which a snapshot cannot name by expert); drop it, or use "
                             "--transformer-impl transformer_engine")


def _validate_schedule(args: argparse.Namespace) -> None:
    """Megatron-LM's iteration- or sample-based training and LR schedule: sets ``train_iters``
    (from ``--train-samples``), and ``lr_warmup_samples`` and ``lr_decay_samples``, the schedule
    in samples, whichever way it was given."""
    gbs = args.global_batch_size
    _fail_unless(args.lr_warmup_iters >= 0 and args.lr_warmup_samples >= 0,
                 "--lr-warmup-iters and --lr-warmup-samples must not be negative")
    _fail_unless(args.lr_warmup_fraction is None
                 or not (args.lr_warmup_iters or args.lr_warmup_samples),
                 "give one of --lr-warmup-fraction, --lr-warmup-iters and --lr-warmup-samples")
    _fail_unless(args.lr_warmup_fraction is None or 0 <= args.lr_warmup_fraction <= 1,
                 "--lr-warmup-fraction must be between 0 and 1")
    if args.train_samples is not None:
        _fail_unless(args.lr_decay_iters is None and args.lr_warmup_iters == 0,
                     "--train-samples takes the --lr-*-samples schedule, not --lr-*-iters")
        _fail_unless(args.train_samples >= gbs, f"--train-samples {args.train_samples} is less "
                     f"than one global batch ({gbs})")
        args.train_iters = args.train_samples // gbs
        args.lr_decay_samples = args.lr_decay_samples or args.train_samples
    else:
        _fail_unless(args.lr_decay_samples is None and args.lr_warmup_samples == 0,
                     "--lr-decay-samples and --lr-warmup-samples need --train-samples")
        args.lr_decay_iters = args.lr_decay_iters or args.train_iters
        args.lr_decay_samples = args.lr_decay_iters * gbs
        args.lr_warmup_samples = args.lr_warmup_iters * gbs
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_samples = int(args.lr_warmup_fraction * args.lr_decay_samples)


def _validate_writers(args: argparse.Namespace) -> None:
    """TensorBoard and W&B need their packages (the ``logging`` extra) and W&B a run name."""
    for flag, given, package in (("--tensorboard-dir", args.tensorboard_dir, "tensorboard"),
                                 ("--wandb-project", args.wandb_project, "wandb")):
        _fail_unless(not given or importlib.util.find_spec(package) is not None,
                     f"{flag} needs the {package} package: pip install "
                     "'megatron-elaswave[logging]'")
    _fail_unless(not args.wandb_project or args.wandb_exp_name,
                 "--wandb-project needs --wandb-exp-name (the run's name)")


def _validate_pipeline(args: argparse.Namespace) -> None:
    """Resolve ``virtual_pipeline_model_parallel_size`` as Megatron-LM does (from
    ``--num-layers-per-virtual-pipeline-stage`` or a layout string; ``None`` for one chunk per
    stage) and check the split of the layers it gives."""
    pp = args.pipeline_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    _fail_unless(vpp is None or per_chunk is None, "use --num-layers-per-virtual-pipeline-stage "
                 "or --num-virtual-stages-per-pipeline-rank, not both")
    if args.pipeline_model_parallel_layout is not None:
        try:
            stages = _layout_string_stages(str(args.pipeline_model_parallel_layout))
        except ValueError as error:
            raise ArgumentError(str(error)) from None
        _fail_unless(per_chunk is None and len(stages) % pp == 0
                     and vpp in (None, len(stages) // pp),
                     f"--pipeline-model-parallel-layout {args.pipeline_model_parallel_layout} has "
                     f"{len(stages)} stages: give one per pipeline stage ({pp}) and virtual "
                     "stage, without --num-virtual-stages-per-pipeline-rank or "
                     "--num-layers-per-virtual-pipeline-stage")
        vpp = len(stages) // pp
    elif per_chunk is not None:
        _fail_unless(not _uneven_split_flags(args),
                     "an uneven pipeline split takes --num-virtual-stages-per-pipeline-rank, not "
                     "--num-layers-per-virtual-pipeline-stage")
        _fail_unless(args.num_layers % pp == 0 and per_chunk > 0
                     and (args.num_layers // pp) % per_chunk == 0,
                     f"--num-layers-per-virtual-pipeline-stage {per_chunk} does not divide the "
                     f"layers of a pipeline stage (--num-layers {args.num_layers} over {pp})")
        vpp = args.num_layers // pp // per_chunk
    if vpp is not None:
        _fail_unless(pp > 1, "the interleaved schedule needs --pipeline-model-parallel-size > 1")
        _fail_unless(vpp >= 1, "--num-virtual-stages-per-pipeline-rank must be positive")
    args.virtual_pipeline_model_parallel_size = vpp if vpp and vpp > 1 else None
    if _uneven_chunk_layers(args) is not None:
        return
    _fail_unless(args.num_layers % pp == 0,
                 f"--num-layers {args.num_layers} is not divisible by "
                 f"--pipeline-model-parallel-size {pp}")
    vpp = args.virtual_pipeline_model_parallel_size
    _fail_unless(vpp is None or (args.num_layers // pp) % vpp == 0,
                 f"{args.num_layers // pp} layers per pipeline stage cannot be split into "
                 f"{vpp} virtual stages")


def _uneven_split_flags(args: argparse.Namespace) -> bool:
    """Whether the first or last stage's layers are given, or the embedding or loss counts."""
    return (getattr(args, "decoder_first_pipeline_num_layers", None) is not None
            or getattr(args, "decoder_last_pipeline_num_layers", None) is not None
            or bool(getattr(args, "account_for_embedding_in_pipeline_split", False))
            or bool(getattr(args, "account_for_loss_in_pipeline_split", False)))


def pipeline_chunk_layers(args: argparse.Namespace) -> tuple[int, ...] | None:
    """Transformer layers per model chunk, in Megatron's order (every stage's first chunk, then
    every stage's second, ...; one chunk per stage without virtual stages), where the flags
    split the pipeline unevenly (``--pipeline-model-parallel-layout``,
    ``--decoder-first/last-pipeline-num-layers``,
    ``--account-for-embedding/loss-in-pipeline-split``); ``None`` for Megatron's even split.

    Raises ``ValueError`` for a split the elastic layout cannot start from: one Megatron
    refuses, a chunk without a transformer layer, or multi-token prediction layers in a layout
    string before its last chunk."""
    pp = args.pipeline_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size or 1
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if layout is not None:
        if _uneven_split_flags(args):
            raise ValueError("--pipeline-model-parallel-layout places every layer itself: give it "
                             "without --decoder-first/last-pipeline-num-layers and "
                             "--account-for-embedding/loss-in-pipeline-split")
        return _layout_string_chunk_layers(str(layout), pp * vpp, args.num_layers)
    if not _uneven_split_flags(args):
        return None
    return megatron_chunk_layers(
        args.num_layers, pp, virtual_stages=vpp,
        first=getattr(args, "decoder_first_pipeline_num_layers", None),
        last=getattr(args, "decoder_last_pipeline_num_layers", None),
        embedding_counts=bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
        loss_counts=bool(getattr(args, "account_for_loss_in_pipeline_split", False)))


def _layout_string_stages(layout: str) -> list[list]:
    """The layer kinds of each stage of a ``--pipeline-model-parallel-layout``, in layer order.
    Raises ``ValueError`` for one megatron-core cannot parse."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    try:
        return PipelineParallelLayerLayout.parse_str_to_list(layout)
    except (AssertionError, ValueError) as error:
        raise ValueError(f"--pipeline-model-parallel-layout {layout}: {error}") from None


def _layout_string_chunk_layers(layout: str, chunks: int, num_layers: int) -> tuple[int, ...]:
    from megatron.core.transformer.enums import LayerType

    stages = _layout_string_stages(layout)
    if len(stages) != chunks:
        raise ValueError(f"--pipeline-model-parallel-layout {layout} has {len(stages)} stages: "
                         f"give one per pipeline stage and virtual stage ({chunks})")
    flat = [kind for stage in stages for kind in stage]
    if any(LayerType.mtp in stage for stage in stages[:-1]):
        raise ValueError(f"--pipeline-model-parallel-layout {layout} places multi-token "
                         "prediction layers before the last stage: --elastic keeps them on the "
                         "last stage, with the loss; place them there (m before the final L)")
    if (flat.count(LayerType.embedding) != 1 or flat[:1] != [LayerType.embedding]
            or flat.count(LayerType.loss) != 1 or flat[-1:] != [LayerType.loss]):
        raise ValueError(f"--pipeline-model-parallel-layout {layout} must begin with the "
                         "embedding (E) and end with the loss (L), once each")
    counts = tuple(stage.count(LayerType.decoder) for stage in stages)
    if sum(counts) != num_layers:
        raise ValueError(f"--pipeline-model-parallel-layout {layout} places {sum(counts)} "
                         f"transformer layers, the model has --num-layers {num_layers}")
    if min(counts) < 1:
        raise ValueError(f"--pipeline-model-parallel-layout {layout} leaves a stage without a "
                         "transformer layer, which is not supported")
    return counts


def _uneven_chunk_layers(args: argparse.Namespace) -> tuple[int, ...] | None:
    """:func:`pipeline_chunk_layers`, its refusal as an :class:`ArgumentError`."""
    try:
        return pipeline_chunk_layers(args)
    except ValueError as error:
        raise ArgumentError(str(error)) from None


def _validate_mtp(args: argparse.Namespace) -> None:
    """Multi-token prediction layers only where megatron-core keeps the last stage's copies of
    the embedding right (:func:`~megatron_elaswave.patches.multi_token_prediction.unsupported_mtp_model`)."""
    if args.mtp_num_layers is None:
        return
    _fail_unless(args.mtp_num_layers > 0,
                 f"--mtp-num-layers must be positive, got {args.mtp_num_layers}")
    from megatron_elaswave.patches.multi_token_prediction import unsupported_mtp_model

    unsupported = unsupported_mtp_model(args)
    _fail_unless(unsupported is None, str(unsupported))


def _validate_moe(args: argparse.Namespace) -> None:
    """An MoE model's flags: experts that split over the expert grid, a layer pattern as long
    as the model, no bias in the experts, one rank per stage's tensor-parallel group."""
    if args.num_experts is None:
        return
    tp = args.tensor_model_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or tp
    args.expert_tensor_parallel_size = etp
    _fail_unless(args.num_experts > 0 and ep > 0 and etp > 0,
                 "--num-experts and the expert parallel sizes must be positive")
    _fail_unless(args.num_experts % ep == 0, f"--num-experts {args.num_experts} is not "
                 f"divisible by --expert-model-parallel-size {ep}")
    _fail_unless((tp * args.data_parallel_size) % (ep * etp) == 0,
                 f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} does "
                 f"not divide the {tp * args.data_parallel_size} ranks of a pipeline stage")
    _fail_unless(0 < args.moe_router_topk <= args.num_experts,
                 f"--moe-router-topk must be between 1 and --num-experts {args.num_experts}")
    pattern = args.moe_layer_freq
    _fail_unless(not isinstance(pattern, list) or len(pattern) == args.num_layers,
                 f"--moe-layer-freq names {len(pattern) if isinstance(pattern, list) else 0} "
                 f"layers, the model has {args.num_layers}")
    _fail_unless(isinstance(pattern, list) or pattern > 0, "--moe-layer-freq must be positive")
    _fail_unless(args.disable_bias_linear, "MoE layers have no bias: add --disable-bias-linear")
    # megatron-core runs MoE with tensor parallelism only under sequence parallelism.
    _fail_unless(tp == 1, "MoE with --tensor-model-parallel-size > 1 needs sequence "
                          "parallelism, which this script does not run; use "
                          "--expert-model-parallel-size for the experts, or Megatron-LM's "
                          "pretrain_gpt.py with --sequence-parallel")
    args.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size


def _validate_batch(args: argparse.Namespace) -> None:
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    args.global_batch_size = args.global_batch_size or mbs * dp
    gbs = args.global_batch_size
    _fail_unless(gbs % (mbs * dp) == 0,
                 f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x "
                 f"data-parallel size {dp}")
    if args.virtual_pipeline_model_parallel_size:
        pp, microbatches = args.pipeline_model_parallel_size, gbs // (mbs * dp)
        _fail_unless(microbatches >= pp and (microbatches % pp == 0 or microbatches % pp >= pp),
                     f"the interleaved schedule needs at least {pp} micro-batches per replica, "
                     f"a multiple of {pp}; got {microbatches}")


def _validate_data(args: argparse.Namespace) -> None:
    _fail_unless(bool(args.mock_data) != bool(args.data_path),
                 "give exactly one of --mock-data and --data-path")
    if args.data_path:
        prefixes = args.data_path
        if len(args.data_path) > 1:  # a blend: W1 P1 W2 P2 ...
            weights, prefixes = args.data_path[0::2], args.data_path[1::2]
            try:
                valid = len(weights) == len(prefixes) and all(float(w) >= 0 for w in weights)
            except ValueError:
                valid = False
            _fail_unless(valid, f"--data-path {' '.join(args.data_path)}: give one prefix, or "
                         "weights and prefixes in pairs (W1 P1 W2 P2 ...)")
        for prefix in prefixes:
            for suffix in (".bin", ".idx"):
                _fail_unless(os.path.isfile(prefix + suffix),
                             f"--data-path {prefix}: {prefix + suffix} does not exist "
                             "(create it with scripts/preprocess_data.py)")
        args.tokenizer_type = args.tokenizer_type or "ByteLevelTokenizer"
    else:
        args.tokenizer_type = args.tokenizer_type or "NullTokenizer"
    if args.tokenizer_type == "NullTokenizer":
        _fail_unless(args.vocab_size is not None and args.vocab_size > 1,
                     "--tokenizer-type NullTokenizer needs --vocab-size")
    try:
        weights = [float(part) for part in args.split.split(",")]
    except ValueError:
        raise ArgumentError(f"--split {args.split!r} must be comma-separated numbers") from None
    _fail_unless(weights and all(w >= 0 for w in weights) and weights[0] > 0,
                 f"--split {args.split!r} must give the training set a positive share")


def parse_args(argv: Sequence[str] | None, world_size: int) -> argparse.Namespace:
    """Parse and validate; argparse exits on unknown flags, :class:`ArgumentError` otherwise."""
    return validate(build_parser().parse_args(argv), world_size)
