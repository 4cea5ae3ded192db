"""Entry point of ``scripts/pretrain_gpt.py``: set up one rank and train.

Bad input is reported as one line (``pretrain_gpt.py: error: ...``) with exit code 2, before
any training state exists; nothing here prints a traceback for a user mistake.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_elaswave.device import DeviceUnavailableError, resolve_device_backend
from megatron_elaswave.launch.proctitle import name_worker
from megatron_elaswave.launch.spawn import IMPORT_NOTICES

from . import exit_status
from ..arguments import ArgumentError, parse_args


# Warnings megatron-core and torch print on every rank that a user cannot act on.
_KNOWN_WARNINGS = (
    *IMPORT_NOTICES,
    "full scope is deprecated",
    "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "Warning: tp_group is None",
)
_CUDA_HINTS = ("CUDA_DEVICE_MAX_CONNECTIONS",)


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job, as the launcher (or torchrun) told it."""

    rank: int
    world_size: int
    local_rank: int


def say(line: str) -> None:
    """``line`` on stderr in one write: the workers of a node share their launcher's output, and
    lines that several of them print at once must not run into each other."""
    sys.stderr.write(f"pretrain_gpt.py: {line}\n")
    sys.stderr.flush()


def report_error(message: str, rank: int) -> None:
    """One line on stderr, from rank 0 only (every rank fails the same checks)."""
    if rank == 0:
        say(f"error: {message}")


def pretrain(argv: Sequence[str] | None = None) -> int:
    info = RankInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )
    try:
        args = parse_args(argv, info.world_size)
        backend = resolve_device_backend(args.elastic_device)
    except (ArgumentError, DeviceUnavailableError) as error:
        report_error(str(error), info.rank)
        return exit_status.BAD_INPUT
    half = {"--bf16": torch.bfloat16, "--fp16": torch.float16}
    flag = "--bf16" if args.bf16 else "--fp16" if args.fp16 else None
    if flag and not backend.supports_dtype(half[flag]):
        report_error(f"{flag} needs a CUDA or NPU device; on {backend.name} train in fp32 "
                     f"(drop {flag})", info.rank)
        return exit_status.BAD_INPUT
    for message in _KNOWN_WARNINGS + (() if backend.name == "cuda" else _CUDA_HINTS):
        warnings.filterwarnings("ignore", message=f".*{re.escape(message)}")
    # Imported here so that flag errors come back before megatron-core is loaded.
    from megatron_elaswave.patches import UnsupportedMegatronVersion, UnsupportedTorch

    from megatron_elaswave.launch.etcd_store import StoreLost
    from megatron_elaswave.launch.store import store_address
    from megatron_elaswave.runtime.dvfs import DvfsError

    from ..checkpointing.checkpoint import CheckpointError
    from ..step.data import DataError
    from ..checkpointing.durable import SaveFailed
    from ..recovery.outcomes import CannotContinue, StepFailed, cannot_continue_line
    from .job import CannotRejoin, train_job
    from ..recovery.relayout import JobStopped, JoinInterrupted
    from ..step.migration import StateLost

    try:
        train_job(args, backend, info.rank, info.local_rank, info.world_size)
    except (UnsupportedMegatronVersion, UnsupportedTorch, CheckpointError, DataError,
            DvfsError) as error:
        report_error(str(error), info.rank)
        return exit_status.BAD_INPUT
    except JobStopped:  # the replacement said so; the survivors give the reason
        return exit_status.CANNOT_CONTINUE
    except JoinInterrupted as error:
        say(str(error))
        return exit_status.JOIN_INTERRUPTED
    except CannotRejoin as error:
        say(f"error: {error}")
        return exit_status.BAD_INPUT
    except (CannotContinue, StateLost) as error:
        # Every survivor reaches the same verdict; each says it, since rank 0 may be gone.
        say(cannot_continue_line(error, args.save))
        return exit_status.CANNOT_CONTINUE
    except StoreLost as error:  # met outside a recovery: the training thread used the store
        say(f"cannot continue: lost the job store at {store_address()} ({error})")
        return exit_status.CANNOT_CONTINUE
    except StepFailed as error:
        if error.announce:
            say(f"error: {error}")
        return exit_status.STEP_FAILED
    except SaveFailed as error:  # every rank knows it; each says it, since rank 0 may be gone
        say(f"error: {error}")
        return exit_status.SAVE_FAILED
    return 0


def main() -> None:
    # ``kill -USR1 <pid>`` prints every thread's stack: what a rank is waiting for, live.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    name_worker(os.environ, sys.argv)  # a worker executed afresh: ps shows its rank
    sys.exit(pretrain(sys.argv[1:]))
