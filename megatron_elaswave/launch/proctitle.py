"""The process title of a worker, so that ``ps``, ``top`` and ``py-spy`` tell workers apart.

A worker forked from the launcher's preloaded server (:mod:`megatron_elaswave.launch.spawn`) would show
the server's command line, ``python -u -m megatron_elaswave.launch.spawn <pid> ...``, and its
``/proc/PID/environ`` holds the server's environment, without ``RANK``. Each worker therefore
names itself, e.g. ``elaswave rank 5/8 pretrain_gpt.py``: the fork server does so for every
worker it starts, and the project's entry points (``scripts/pretrain_gpt.py``, the Megatron-LM
runner) do so when executed afresh.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from setproctitle import getproctitle, setproctitle

MEGATRON_LM_RUNNER = "megatron_elaswave.run_megatron_lm"
"""Runs a Megatron-LM training script with the adaptor (and ``--elastic``) in place."""


def script_name(argv: Sequence[str]) -> str:
    """What a worker runs, as an operator knows it: the script's file name, the module after
    ``-m``, and for the Megatron-LM runner the Megatron-LM script it runs."""
    if not argv:
        return "python"
    if argv[0] != "-m":
        return os.path.basename(argv[0])
    module = argv[1] if len(argv) > 1 else ""
    if module == MEGATRON_LM_RUNNER and len(argv) > 2:
        return os.path.basename(argv[2])
    return f"-m {module}"


def worker_title(env: Mapping[str, str], argv: Sequence[str]) -> str | None:
    """``elaswave rank R/N SCRIPT`` for a worker with ``RANK`` and ``WORLD_SIZE`` in ``env``
    running ``python -u *argv``; ``None`` outside a launched job."""
    rank, world_size = env.get("RANK"), env.get("WORLD_SIZE")
    if rank is None or world_size is None:
        return None
    return f"elaswave rank {rank}/{world_size} {script_name(argv)}"


def prepare_titles() -> None:
    """Let this process, and the workers it forks, set their titles later: setproctitle finds
    the memory of the command line on its first call, which must come before the environment
    changes (a forked worker replaces it)."""
    getproctitle()


def name_worker(env: Mapping[str, str], argv: Sequence[str]) -> None:
    """Give this process :func:`worker_title` (left as it is outside a launched job)."""
    title = worker_title(env, argv)
    if title is not None:
        setproctitle(title)
