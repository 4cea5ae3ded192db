"""Megatron-LM's own ``pretrain_gpt.py`` through the adaptor.

Without Megatron-LM the adaptor stops in one line. With a Megatron-LM checkout named by
``MEGATRON_LM_PATH`` (its requirements installed), its unmodified ``pretrain_gpt.py`` trains
TP2 x PP2 with the distributed optimizer on four CPU ranks under ``elaswave-run``, and with
``--elastic`` a rank SIGKILLed from outside leaves the run on the failure-free trajectory, in
Megatron-LM's log as in the metrics file. Megatron-LM's code is read from that checkout, never
copied here. Without a checkout, where the installed megatron-core ships Megatron-LM's training
package (0.19 on), the same tests run Megatron-LM's loop from it through
``megatron_lm_pretrain_gpt.py``; they are skipped where neither is at hand.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from harness import free_port, launch
from megatron_elaswave.metrics import read_metrics
from megatron_elaswave.patches.version import installed_megatron_core_version
from test_pretrain_gpt import LOSS_TOLERANCE

MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")
"""A Megatron-LM checkout, whose ``pretrain_gpt.py`` the tests run."""


def python(*args: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=Path(__file__).parent)


def training_script() -> Path | None:
    """Megatron-LM's ``pretrain_gpt.py`` in the checkout; without one, the script that runs
    Megatron-LM's loop from the training package of the installed megatron-core, if it ships one
    that imports here and has the API of 0.19 that the script calls."""
    if MEGATRON_LM is not None:
        return Path(MEGATRON_LM, "pretrain_gpt.py")
    version = installed_megatron_core_version()
    if (version is None or version < Version("0.19")
            or python("-c", "import megatron.training.training").returncode != 0):
        return None
    return Path(__file__).with_name("megatron_lm_pretrain_gpt.py")


TRAINING_SCRIPT = training_script()

TORCH_LOG_LINE = re.compile(r"[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")
"""A line of torch's own logging, as a CUDA build prints on import on a machine without CUDA."""


def error_lines(stderr: str) -> list[str]:
    """What a process wrote to stderr, less torch's own log lines."""
    return [line for line in stderr.strip().splitlines() if not TORCH_LOG_LINE.match(line)]


def test_without_megatron_lm_the_adaptor_stops_in_one_line():
    if python("-c", "import megatron.training").returncode == 0:
        pytest.skip("Megatron-LM is installed in this environment")
    result = python("-c", "import megatron_elaswave.megatron_adaptor")
    assert result.returncode == 1, result.stderr
    [line] = error_lines(result.stderr)
    assert line.startswith("megatron_elaswave.megatron_adaptor: Megatron-LM's training package "
                           "is not importable")
    assert "PYTHONPATH" in line


def adapt_stand_in_checkout(tmp_path: Path, version: str) -> subprocess.CompletedProcess:
    """Import the adaptor with a stand-in checkout first on the path: empty packages, whose
    megatron-core says ``version``."""
    for package in ("megatron/training", "megatron/core"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").touch()
    (tmp_path / "megatron/core/package_info.py").write_text(f"__version__ = {version!r}\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run([sys.executable, "-c", "import megatron_elaswave.megatron_adaptor"],
                          capture_output=True, text=True, env=env, timeout=120)


def test_a_megatron_lm_of_another_version_is_refused_in_one_line(tmp_path):
    result = adapt_stand_in_checkout(tmp_path, "0.15.0")
    assert result.returncode == 1, result.stderr
    [line] = error_lines(result.stderr)
    assert line == ("megatron_elaswave.megatron_adaptor: this Megatron-LM has megatron-core 0.15.0; "
                    "megatron-elaswave supports <0.20,>=0.16.1: use a checkout of core_v0.16.1 to "
                    "core_v0.19.0")


def test_a_megatron_lm_without_what_the_adaptor_patches_is_refused_in_one_line(tmp_path):
    """A supported version whose modules lack what the adaptor patches (a branch that moved
    them): the process ends with one line naming the first missing target."""
    result = adapt_stand_in_checkout(tmp_path, "0.16.1")
    assert result.returncode == 1, result.stderr
    [line] = error_lines(result.stderr)
    assert line.startswith("megatron_elaswave.megatron_adaptor: cannot patch megatron.")
    assert line.endswith("this Megatron-LM differs from core_v0.16.1 to core_v0.19.0, which the "
                         "adaptor was checked against")


def test_a_torch_without_an_api_used_is_refused_in_one_line():
    """Before Megatron-LM is looked for: a torch older than the project's needs may not import it."""
    result = python("-c", "import torch; from torch.distributed import distributed_c10d; "
                    "del distributed_c10d.GroupName; print(torch.__version__, flush=True); "
                    "import megatron_elaswave.megatron_adaptor")
    assert result.returncode == 1, result.stderr
    [line] = error_lines(result.stderr)
    version = result.stdout.strip()
    assert line == (f"megatron_elaswave.megatron_adaptor: megatron-elaswave needs torch>=2.12: "
                    f"torch {version} has no torch.distributed.distributed_c10d.GroupName "
                    f"(new in torch 2.10)")


def test_elastic_refuses_a_model_other_than_gpt():
    """A script whose model provider builds another model than ``GPTModel`` with flags that do
    not name it hybrid (a ``MambaModel``) is refused when its first chunk is built; the hooks end
    the process with this message in one line."""
    from megatron_elaswave.megatron_lm.job import UnsupportedModel, gpt_chunks

    build_chunk = gpt_chunks(lambda **kwargs: torch.nn.Linear(1, 1))
    with pytest.raises(UnsupportedModel, match=r"^--elastic trains GPTModel \(Megatron-LM's "
                       r"pretrain_gpt.py\); this script builds Linear$"):
        build_chunk(None, True, True, None)


@pytest.mark.parametrize("args, message", [
    ((), "usage: python -m megatron_elaswave.run_megatron_lm SCRIPT"),
    (("no_such_script.py",), "no such script: no_such_script.py"),
])
def test_the_runner_refuses_what_it_cannot_run_in_one_line(args, message):
    result = python("-m", "megatron_elaswave.run_megatron_lm", *args)
    assert result.returncode == 1
    [line] = error_lines(result.stderr)
    assert message in line


needs_megatron_lm = pytest.mark.skipif(
    TRAINING_SCRIPT is None, reason="MEGATRON_LM_PATH names no Megatron-LM checkout and the "
    "installed megatron-core ships no Megatron-LM training package of 0.19 or later")

LOG_LINE = re.compile(r"iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \|.*?"
                      r"lm loss: ([0-9.E+-]+)")
"""Megatron-LM's iteration log line: iteration, consumed samples, lm loss."""


def megatron_lm_flags(tp: int, pp: int, iterations: int) -> list[str]:
    """Megatron-LM's own flags for a tiny GPT on CPU ranks (docs/megatron-lm.md)."""
    return [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", str(iterations), "--lr", "1e-3",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--distributed-backend", "gloo", "--transformer-impl", "local",
        "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
        "--use-distributed-optimizer", "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "1",
    ]


def run_megatron_lm(tmp_path: Path, name: str, flags: list[str], *, kill_after: int | None = None,
                    kill_rank: int = 3, through_runner: bool = True) -> tuple[int, str]:
    """Megatron-LM's ``pretrain_gpt.py`` on four ranks under ``elaswave-run``, named to it through
    the adaptor's runner or (``through_runner=False``, for a script in a checkout, which the
    launcher recognises) as it is; with ``kill_after``, SIGKILL ``kill_rank`` once Megatron-LM's
    log has that iteration's line.

    The line is printed after the iteration's train_step, so the kill lands in a later one, where
    the job detects failures (a rank that dies in Megatron-LM's own collectives between steps, or
    in an evaluation, is not survived). The metrics file would say so later: an iteration's record
    waits for the next iteration's snapshots."""
    named = through_runner or MEGATRON_LM is None
    runner = ["-m", "megatron_elaswave.run_megatron_lm"] if named else []
    with launch([*runner, str(TRAINING_SCRIPT), *flags], 4,
                master_port=free_port(), log_path=tmp_path / f"{name}.log") as job:
        if kill_after is not None:
            job.wait_for(lambda: any(int(i) >= kill_after for i, _, _ in
                                     LOG_LINE.findall(job.output())), 120, f"iteration {kill_after}")
            job.kill_worker(kill_rank)
        return job.wait(240)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@needs_megatron_lm
def test_megatron_lms_pretrain_gpt_trains_on_four_cpu_ranks(tmp_path):
    iterations = 5
    returncode, output = run_megatron_lm(tmp_path, "plain", megatron_lm_flags(2, 2, iterations))
    assert returncode == 0, output[-4000:]
    losses = [float(loss) for _, _, loss in LOG_LINE.findall(output)]
    assert len(losses) == iterations, output[-4000:]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@needs_megatron_lm
@pytest.mark.parametrize("tp, pp, survivors", [(1, 2, 3), (2, 1, 2)])
def test_megatron_lm_with_elastic_survives_a_sigkilled_rank_on_the_trajectory(tmp_path, tp, pp,
                                                                              survivors):
    """TP x PP x DP2 on four ranks: the last rank (the one that prints Megatron-LM's log line)
    is SIGKILLed after iteration 3; the survivors continue in Megatron-LM's loop with the same
    samples, losses and consumed-samples count as the failure-free run. With TP2 its
    tensor-parallel partner is left without a stage and leaves Megatron-LM's loop once the
    others are done."""
    iterations = 8  # `elaswave-run .../pretrain_gpt.py --elastic ...`, no runner named
    flags = megatron_lm_flags(tp, pp, iterations) + [
        "--elastic", "--untie-embeddings-and-output-weights", "--eval-interval", "5"]
    runs = {}
    for name, kill_after in (("reference", None), ("killed", 3)):
        returncode, output = run_megatron_lm(
            tmp_path, name, flags + ["--elastic-metrics-file", str(tmp_path / f"{name}.jsonl")],
            kill_after=kill_after, through_runner=False)
        assert returncode == 0, output[-4000:]
        runs[name] = (read_metrics(str(tmp_path / f"{name}.jsonl"), "iteration"),
                      read_metrics(str(tmp_path / f"{name}.jsonl"), "recovery"),
                      LOG_LINE.findall(output), output)
    reference, killed = runs["reference"], runs["killed"]
    assert not reference[1]
    [recovery] = killed[1]
    assert recovery["failed_ranks"] == [3]
    assert [r["iteration"] for r in killed[0]] == list(range(1, iterations + 1))
    for ref, got in zip(reference[0], killed[0], strict=True):
        assert got["samples_digest"] == ref["samples_digest"], got["iteration"]
        relative = abs(got["lm_loss"] - ref["lm_loss"]) / abs(ref["lm_loss"])
        assert relative <= LOSS_TOLERANCE, (got["iteration"], ref["lm_loss"], got["lm_loss"])
    assert killed[0][-1]["world_size"] == survivors
    # Megatron-LM's own log: each iteration once, with the exact consumed samples and the
    # reference's loss. The killed rank printed the lines until it died: the one of the
    # iteration it died in (3, or 4 if it died after that step and before its line) may die
    # with it; the new last rank prints every line from the iteration the recovery re-ran on.
    reference_lines = {int(i): float(loss) for i, _, loss in reference[2]}
    printed = [int(i) for i, _, _ in killed[2]]
    assert printed == sorted(set(printed)), killed[3][-4000:]
    assert recovery["iteration"] in (4, 5)
    assert set(range(1, 3)) | set(range(recovery["iteration"], iterations + 1)) <= set(printed), \
        killed[3][-4000:]
    assert "global batch size:     8" in killed[3] and "global batch size:     4" not in killed[3]
    for i, consumed, loss in killed[2]:
        assert int(consumed) == 8 * int(i)
        assert abs(float(loss) - reference_lines[int(i)]) <= LOSS_TOLERANCE * reference_lines[int(i)]
    assert "validation loss at iteration 8 on test set" in killed[3]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@needs_megatron_lm
@pytest.mark.parametrize("tp, extra, message", [
    (1, ["--mtp-num-layers", "1", "--position-embedding-type", "rope", "--no-rope-fusion"],
     "does not support --mtp-num-layers with tied embeddings"),
    (1, ["--hybrid-override-pattern", "*-*-"], "does not support --hybrid-override-pattern"),
    pytest.param(
        1, ["--num-experts", "2", "--moe-grouped-gemm"], "does not support --moe-grouped-gemm "
        "without Transformer Engine (the legacy GroupedMLP keeps a rank's experts in one tensor",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="Megatron-LM's own argument check reads the GPU's compute capability for "
                   "--moe-grouped-gemm, before --elastic sees the flags")),
    (1, ["--mtp-num-layers", "1", "--position-embedding-type", "rope", "--no-rope-fusion",
         "--untie-embeddings-and-output-weights", "--pipeline-model-parallel-layout", "Ett|ttmL"],
     "does not support --mtp-num-layers with --pipeline-model-parallel-layout"),
    (1, ["--context-parallel-size", "2"], "does not support --context-parallel-size > 1: a "
     "failed rank's sequence shards are not resharded"),
])
def test_megatron_lm_with_elastic_refuses_what_it_cannot_do_in_one_line(tmp_path, tp, extra,
                                                                        message):
    flags = megatron_lm_flags(tp, 2 if tp == 1 else 1, 4) + ["--elastic", *extra]
    returncode, output = run_megatron_lm(tmp_path, "refused", flags)
    assert returncode != 0
    errors = [line for line in output.splitlines() if "pretrain_gpt.py: error:" in line]
    assert len(errors) == 1 and message in errors[0], output[-4000:]
    assert "Traceback" not in output


def test_megatron_lms_collectives_survive_a_failed_peer_and_do_nothing_outside_the_job():
    """The ``torch.distributed`` Megatron-LM's loop sees with ``--elastic``: a collective that
    fails where the job says a peer failed returns without its result (the next step
    recovers), any other failure raises; on a rank outside the ranks that hold a stage (a spare,
    a replacement before its first iteration) collectives do nothing and the rank queries
    answer as in a group of that rank alone."""
    from megatron_elaswave.patches.megatron_lm_elastic import DefaultGroupRedirect

    tensor = torch.ones(2)
    failed_peer = DefaultGroupRedirect(lambda: None, survives=lambda error: True)
    assert failed_peer.all_reduce(tensor) is None and failed_peer.barrier() is None
    assert tensor.tolist() == [1.0, 1.0]
    own_error = DefaultGroupRedirect(lambda: None, survives=lambda error: False)
    with pytest.raises((ValueError, RuntimeError)):  # no default group in this process
        own_error.barrier()
    outside = DefaultGroupRedirect(lambda: DefaultGroupRedirect.OUTSIDE)
    assert outside.all_reduce(tensor) is None and outside.barrier() is None
    assert outside.broadcast(tensor, src=0) is None
    assert (outside.get_rank(), outside.get_world_size()) == (0, 1)


def test_megatron_lms_lr_schedule_is_built_from_samples_with_train_samples():
    """Megatron-LM tells a sample-based schedule by ``args.train_iters`` being unset; the elastic
    job has set it from ``--train-samples``, and hides it whenever it builds a scheduler."""
    import argparse

    from megatron_elaswave.patches.megatron_lm_elastic import lr_schedule_from_flags

    args = argparse.Namespace(train_iters=8, train_samples=64)
    seen = lr_schedule_from_flags(lambda optimizer: args.train_iters, args)(None)
    assert seen is None and args.train_iters == 8
    args.train_samples = None
    assert lr_schedule_from_flags(lambda optimizer: args.train_iters, args)(None) == 8
