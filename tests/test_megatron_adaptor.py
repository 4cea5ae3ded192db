"""Megatron-LM's own ``pretrain_gpt.py`` through the adaptor.

Without Megatron-LM the adaptor stops in one line. With a Megatron-LM checkout named by
``MEGATRON_LM_PATH`` (its requirements installed; skipped when unset), its unmodified
``pretrain_gpt.py`` trains TP2 x PP2 with the distributed optimizer on four CPU ranks under
``elaswave-run``. Megatron-LM's code is read from that checkout, never copied here.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import free_port, launch

MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")


def python(*args: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=Path(__file__).parent)


def test_without_megatron_lm_the_adaptor_stops_in_one_line():
    if python("-c", "import megatron.training").returncode == 0:
        pytest.skip("Megatron-LM is installed in this environment")
    result = python("-c", "import megatron_elaswave.megatron_adaptor")
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("megatron_elaswave.megatron_adaptor: Megatron-LM's training package "
                           "is not importable")
    assert "PYTHONPATH" in line


def test_a_megatron_lm_of_another_version_is_refused_in_one_line(tmp_path):
    """A stand-in checkout whose megatron-core says 0.15.0."""
    for package in ("megatron/training", "megatron/core"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").touch()
    (tmp_path / "megatron/core/package_info.py").write_text("__version__ = '0.15.0'\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", "import megatron_elaswave.megatron_adaptor"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line == ("megatron_elaswave.megatron_adaptor: this Megatron-LM has megatron-core 0.15.0; "
                    "megatron-elaswave supports <0.17,>=0.16.1: use a checkout of core_v0.16.1")


@pytest.mark.parametrize("args, message", [
    ((), "usage: python -m megatron_elaswave.run_megatron_lm SCRIPT"),
    (("no_such_script.py",), "no such script: no_such_script.py"),
])
def test_the_runner_refuses_what_it_cannot_run_in_one_line(args, message):
    result = python("-m", "megatron_elaswave.run_megatron_lm", *args)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert message in line


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.skipif(MEGATRON_LM is None, reason="MEGATRON_LM_PATH names no Megatron-LM checkout")
def test_megatron_lms_pretrain_gpt_trains_on_four_cpu_ranks(tmp_path):
    iterations = 5
    flags = [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", str(iterations), "--lr", "1e-3",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--distributed-backend", "gloo", "--transformer-impl", "local",
        "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
        "--use-distributed-optimizer", "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "1",
    ]
    script = str(Path(MEGATRON_LM, "pretrain_gpt.py"))
    with launch(["-m", "megatron_elaswave.run_megatron_lm", script, *flags], 4,
                master_port=free_port(), log_path=tmp_path / "megatron-lm.log") as job:
        returncode, output = job.wait(240)
    assert returncode == 0, output[-4000:]
    losses = [float(loss) for loss in re.findall(r"iteration +\d+/ +\d+ \|.*?lm loss: ([0-9.E+-]+)",
                                                   output)]
    assert len(losses) == iterations, output[-4000:]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
