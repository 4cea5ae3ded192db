"""Megatron-LM's TensorBoard and W&B scalars, written by the rank that logs.

``--tensorboard-dir`` and ``--wandb-project`` (with ``--wandb-exp-name``, ``--wandb-save-dir``,
``--wandb-entity``) mean what they mean to Megatron-LM: every iteration the logging rank writes
``lm loss``, ``learning-rate``, ``grad-norm``, ``batch-size`` and, with ``--log-throughput``,
``throughput`` (TFLOP/s per rank), and ``lm loss validation`` after each evaluation, under
Megatron-LM's tags, by iteration. With ``--elastic`` the logging rank may change after a
failure: the new one opens its own writers on the same directory and the same W&B run (whose
id the first logger shares through the job store), so the scalars go on where they stopped.
"""

from __future__ import annotations

import argparse
import os

from megatron_elaswave.launch.keys import shared_key
from megatron_elaswave.launch.store import read_if_set

WANDB_RUN = "wandb_run_id"
"""The name under which the first logging rank shares its W&B run's id."""


def gpt_training_flops(args: argparse.Namespace, samples: int) -> float:
    """Floating-point operations of training a GPT on ``samples`` sequences, forward and
    backward: Megatron-LM's count, ``6 x tokens x (layers x (4 h^2 + 2 h ffn + 2 s h) + V h)``
    (72 B s L h^2 (1 + s/6h + V/12hL) for an MLP of 4 h)."""
    h, s = args.hidden_size, args.seq_length
    per_layer = 4 * h * h + 2 * h * args.ffn_hidden_size + 2 * s * h
    return 6.0 * samples * s * (args.num_layers * per_layer + args.padded_vocab_size * h)


class ScalarWriters:
    """The TensorBoard ``SummaryWriter`` and W&B run the flags ask for, on one rank.

    Raises ``ImportError`` where a package is missing (the flags' validation checks first)."""

    def __init__(self, args: argparse.Namespace, *, wandb_run_id: str | None = None) -> None:
        self.tensorboard = None
        self.wandb = None
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir,
                                             max_queue=args.tensorboard_queue_size)
        if args.wandb_project:
            import wandb

            save_dir = args.wandb_save_dir or os.path.join(args.save or ".", "wandb")
            os.makedirs(save_dir, exist_ok=True)
            self.wandb = wandb.init(dir=save_dir, project=args.wandb_project,
                                    name=args.wandb_exp_name, id=wandb_run_id, resume="allow",
                                    config=vars(args),
                                    **({"entity": args.wandb_entity} if args.wandb_entity else {}))

    @classmethod
    def wanted(cls, args: argparse.Namespace) -> bool:
        return bool(args.tensorboard_dir or args.wandb_project)

    @classmethod
    def for_logging_rank(cls, args: argparse.Namespace, store) -> "ScalarWriters | None":
        """The writers of a rank that starts logging (``None`` where no flag asks for any):
        the job's W&B run goes on where the store names one, and this rank names its own
        otherwise."""
        if not cls.wanted(args):
            return None
        key = shared_key(WANDB_RUN)
        raw = None if store is None else read_if_set(store, key)
        run_id = None if raw is None else raw.decode()
        writers = cls(args, wandb_run_id=run_id)
        if writers.wandb is not None and store is not None and run_id is None:
            store.compare_set(key, "", writers.wandb.id)
        return writers

    def write(self, iteration: int, scalars: dict[str, float]) -> None:
        """``scalars`` (Megatron-LM's tags) of ``iteration``."""
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, iteration)
        if self.wandb is not None:
            self.wandb.log(scalars, step=iteration)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
