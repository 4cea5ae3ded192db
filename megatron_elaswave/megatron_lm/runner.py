"""``python -m megatron_elaswave.run_megatron_lm SCRIPT [ARGS...]``: adapt Megatron-LM
(:mod:`.adaptor`), then run an unmodified Megatron-LM training script as ``__main__`` with its
arguments, as ``python SCRIPT ARGS...`` would."""

from __future__ import annotations

import importlib
import os
import runpy
import sys

from megatron_elaswave.launch.proctitle import MEGATRON_LM_RUNNER, name_worker


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m megatron_elaswave.run_megatron_lm SCRIPT [ARGS...] "
                 "(a Megatron-LM training script, e.g. pretrain_gpt.py, and its flags)")
    script = os.path.abspath(sys.argv[1])
    if not os.path.isfile(script):
        sys.exit(f"megatron_elaswave.run_megatron_lm: no such script: {sys.argv[1]}")
    # As `python SCRIPT` would: the script's directory first (a checkout's root holds `megatron`).
    sys.path.insert(0, os.path.dirname(script))
    name_worker(os.environ, ["-m", MEGATRON_LM_RUNNER, *sys.argv[1:]])  # ps shows its rank
    importlib.import_module("megatron_elaswave.megatron_lm.adaptor")  # adapts on import, once

    sys.argv = [script, *sys.argv[2:]]
    runpy.run_path(script, run_name="__main__")
