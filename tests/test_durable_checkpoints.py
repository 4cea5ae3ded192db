"""Durable checkpoints under ``--elastic`` (``--save``, ``--save-interval``, ``--load``,
``--exit-signal-handler``), killing real processes from outside.

Every job is TP1 x PP2 x DP2 on four ranks (or another layout of four when resumed). A resumed
run must follow the failure-free run of the same flags: identical ``samples_digest`` every
iteration and ``lm_loss`` within 1e-4 relative. While a job runs, a watcher reads the tracker
(``latest_checkpointed_iteration.txt``) every few milliseconds and records any moment at which it
names a checkpoint that is not complete.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from harness import free_port, launch
from megatron_elaswave.metrics import read_metrics
from megatron_elaswave.training.checkpointing.checkpoint import TRACKER_FILE, latest_complete
from test_megatron_adaptor import (
    LOG_LINE,
    TRAINING_SCRIPT,
    megatron_lm_flags,
    needs_megatron_lm,
)
from test_pretrain_gpt import PRETRAIN, model_flags, text_data  # noqa: F401  (fixture)

pytestmark = pytest.mark.multiprocess

LOSS_TOLERANCE = 1e-4
TRAIN_ITERS = 12
COMPLETE = (".metadata", "common.pt", "metadata.json")
"""What every complete checkpoint directory holds (its index, its common state, its backends)."""


def flags(data_prefix: str, tp: int = 1, pp: int = 2, elastic: bool = True) -> list[str]:
    base = model_flags(data_prefix, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       train_iters=TRAIN_ITERS)
    return [*base, "--use-distributed-optimizer", "--untie-embeddings-and-output-weights",
            *(["--elastic", "--elastic-rebalance-window", "0"] if elastic else [])]


def is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in COMPLETE)


class TrackerWatch(threading.Thread):
    """Reads the tracker under ``root`` every few milliseconds while a job runs, and records
    every iteration it named and every moment it named a checkpoint that was not complete."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.named: list[int] = []
        self.incomplete: list[str] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.005):
            try:
                text = (self.root / TRACKER_FILE).read_text().strip()
            except OSError:
                continue
            if not text.isdigit():
                self.incomplete.append(f"tracker reads {text!r}")
                continue
            if not self.named or self.named[-1] != int(text):
                self.named.append(int(text))
            directory = self.root / f"iter_{int(text):07d}"
            if not is_complete(directory):
                held = sorted(os.listdir(directory)) if directory.is_dir() else "missing"
                self.incomplete.append(f"{directory}: {held}")

    def __enter__(self) -> TrackerWatch:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self.join()


def reached(metrics: Path, iteration: int) -> bool:
    return metrics.exists() and any(
        r["iteration"] >= iteration for r in read_metrics(str(metrics), "iteration"))


def saved_at_least(root: Path, iteration: int) -> bool:
    latest = latest_complete(str(root))
    return latest is not None and latest[0] >= iteration


def train(tmp_path: Path, name: str, command: list[str],
          timeout: float = 240) -> tuple[list[dict], list[dict], str]:
    """Run to the end (exit status 0); the iteration and recovery records and the log."""
    metrics = tmp_path / f"{name}.jsonl"
    with launch([PRETRAIN, *command, "--elastic-metrics-file", str(metrics)], 4,
                master_port=free_port(), log_path=tmp_path / f"{name}.log") as job:
        returncode, output = job.wait(timeout)
    assert returncode == 0, output[-4000:]
    return read_metrics(str(metrics), "iteration"), read_metrics(str(metrics), "recovery"), output


def assert_on_trajectory(reference: list[dict], run: list[dict]) -> None:
    by_iteration = {record["iteration"]: record for record in reference}
    assert run
    for got in run:
        ref = by_iteration[got["iteration"]]
        assert got["samples_digest"] == ref["samples_digest"], got["iteration"]
        relative = abs(got["lm_loss"] - ref["lm_loss"]) / abs(ref["lm_loss"])
        assert relative <= LOSS_TOLERANCE, (got["iteration"], ref["lm_loss"], got["lm_loss"])


@pytest.fixture(scope="module")
def reference(text_data, tmp_path_factory):  # noqa: F811
    """The failure-free run, TP1 x PP2 x DP2, without checkpoints."""
    iterations, recoveries, _ = train(tmp_path_factory.mktemp("reference"), "reference",
                                      flags(text_data))
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1))
    assert not recoveries
    return iterations


@pytest.mark.timeout(400)
def test_checkpoints_saved_after_a_failure_resume_in_another_layout_after_the_whole_job_is_killed(
        text_data, reference, tmp_path):  # noqa: F811
    """Rank 3 is SIGKILLed after iteration 2; the survivors (a replica of two stages and one of
    one) save every 4 iterations; once the checkpoint of iteration 8 is complete the launcher's
    whole process group is SIGKILLed. A new job on TP2 x PP1 x DP2 resumes from the last
    complete checkpoint and finishes on the failure-free trajectory."""
    save = tmp_path / "checkpoints"
    metrics = tmp_path / "killed.jsonl"
    command = [PRETRAIN, *flags(text_data), "--save", str(save), "--save-interval", "4",
               "--elastic-metrics-file", str(metrics)]
    with TrackerWatch(save) as watch, launch(command, 4, master_port=free_port(),
                                             log_path=tmp_path / "killed.log") as job:
        job.wait_for(lambda: reached(metrics, 2), 120, "iteration 2")
        job.kill_worker(3)
        job.wait_for(lambda: saved_at_least(save, 8) and reached(metrics, 8), 180,
                     "the checkpoint of iteration 8")
        job.kill()
        output = job.output()
    assert not watch.incomplete, watch.incomplete
    assert watch.named[:2] == [4, 8], watch.named
    assert "recovered from the failure of ranks [3]" in output, output[-4000:]
    saved, directory = latest_complete(str(save))
    assert is_complete(Path(directory))
    before = [r for r in read_metrics(str(metrics), "iteration") if r["iteration"] <= saved]
    assert [r["iteration"] for r in before] == list(range(1, saved + 1))
    assert before[-1]["world_size"] == 3  # the checkpoint was written by the survivors' layout
    resumed, recoveries, output = train(tmp_path, "resumed",
                                        [*flags(text_data, tp=2, pp=1), "--load", str(save)])
    assert f"loaded checkpoint from {save} at iteration {saved}" in output
    assert [r["iteration"] for r in resumed] == list(range(saved + 1, TRAIN_ITERS + 1))
    assert not recoveries
    assert_on_trajectory(reference, before + resumed)


def kill_rank_1_mid_save(job, save: Path) -> None:
    """SIGKILL rank 1 as soon as the directory of the checkpoint of iteration 4 appears."""
    job.wait_for(lambda: any(entry.startswith("iter_0000004.partial")
                             for entry in (os.listdir(save) if save.is_dir() else ())),
                 120, "the checkpoint of iteration 4 to be written", poll_s=0.002)
    job.kill_worker(1)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kill", [pytest.param("injected", marks=pytest.mark.quick), "external"])
def test_a_worker_killed_while_a_checkpoint_is_written_never_leaves_the_tracker_on_it(
        text_data, reference, tmp_path, kill):  # noqa: F811
    """Checkpoints every 2 iterations; rank 1 dies in the middle of the save of iteration 4:
    injected (it has written its part and dies before reporting it, so the save can never
    complete), or SIGKILLed from outside as soon as that save's directory appears. The tracker
    only ever names complete checkpoints, the survivors recover and go on saving, and the run
    stays on the failure-free trajectory."""
    save = tmp_path / "checkpoints"
    metrics = tmp_path / "saving.jsonl"
    injected = (["--elastic-inject-failure", "rank=1,iteration=4,phase=checkpoint"]
                if kill == "injected" else [])
    command = [PRETRAIN, *flags(text_data), "--save", str(save), "--save-interval", "2",
               *injected, "--elastic-metrics-file", str(metrics)]
    with TrackerWatch(save) as watch, launch(command, 4, master_port=free_port(),
                                             log_path=tmp_path / "saving.log") as job:
        if kill == "external":
            kill_rank_1_mid_save(job, save)
        returncode, output = job.wait(240)
    assert returncode == 0, output[-4000:]
    assert not watch.incomplete, watch.incomplete
    recoveries = read_metrics(str(metrics), "recovery")
    assert [r["failed_ranks"] for r in recoveries] == [[1]], output[-4000:]
    if kill == "injected":
        assert "the checkpoint of iteration 4 is abandoned: a rank that wrote it failed" in output
    # The survivors' saves complete: the last one is the last iteration's.
    assert watch.named[-1] == TRAIN_ITERS and watch.named == sorted(watch.named), watch.named
    assert re.search(rf"saved checkpoint at iteration {TRAIN_ITERS} to ", output)
    assert not [entry for entry in os.listdir(save) if ".partial" in entry and
                int(entry[5:12]) < TRAIN_ITERS], os.listdir(save)
    assert_on_trajectory(reference, read_metrics(str(metrics), "iteration"))


SLOW_SAVE_S = 15
"""How long rank 1 takes to write its part of iteration 3's checkpoint in the preemption test:
longer than the 10 s a launcher gives its workers after a plain SIGTERM."""


@pytest.mark.timeout(400)
def test_sigterm_to_the_launcher_waits_for_a_slow_save_and_resumes_on_the_trajectory(
        text_data, reference, tmp_path):  # noqa: F811
    """The launcher gets SIGTERM once iteration 3 is recorded (as a scheduler preempting the
    job sends it), while rank 1 is still writing its part of iteration 3's checkpoint, which
    takes it 15 s (slow storage). It forwards the signal; the job saves the iteration after
    which it stops, every worker waits for both saves and exits with 0, and the launcher, which
    gives workers run with ``--exit-signal-handler`` their own bound on the save, kills none.
    A new job on TP1 x PP1 x DP4 resumes from the last checkpoint on the trajectory."""
    save = tmp_path / "checkpoints"
    metrics = tmp_path / "preempted.jsonl"
    command = [PRETRAIN, *flags(text_data), "--save", str(save), "--save-interval", "3",
               "--exit-signal-handler", "--elastic-metrics-file", str(metrics),
               "--elastic-inject-failure",
               f"rank=1,iteration=3,phase=checkpoint,kind=delay,seconds={SLOW_SAVE_S}"]
    with TrackerWatch(save) as watch, launch(command, 4, master_port=free_port(),
                                             log_path=tmp_path / "preempted.log") as job:
        job.wait_for(lambda: reached(metrics, 3), 120, "iteration 3")
        sent = time.monotonic()
        job.send_signal(signal.SIGTERM)
        returncode, output = job.wait(120)
        took = time.monotonic() - sent
    assert returncode == 128 + signal.SIGTERM, output[-4000:]
    assert "4 of 4 workers finished, 0 failed" in output, output[-4000:]
    assert "killing the workers still running" not in output
    assert 10 < took < SLOW_SAVE_S + 60, took
    stopped = re.search(r"stopping after iteration (\d+): received SIGTERM "
                        r"\(--exit-signal-handler\)", output)
    assert stopped, output[-4000:]
    stopped_at = int(stopped.group(1))
    assert 3 < stopped_at < TRAIN_ITERS
    assert watch.named == [3, stopped_at] and not watch.incomplete, watch.named
    before = read_metrics(str(metrics), "iteration")
    assert [r["iteration"] for r in before] == list(range(1, stopped_at + 1))
    resumed, _, _ = train(tmp_path, "resumed", [*flags(text_data, pp=1), "--load", str(save)])
    assert [r["iteration"] for r in resumed] == list(range(stopped_at + 1, TRAIN_ITERS + 1))
    assert_on_trajectory(reference, before + resumed)


@pytest.mark.timeout(400)
def test_finetuning_from_a_checkpoint_of_the_plain_path_logs_what_the_plain_path_logs(
        text_data, tmp_path):  # noqa: F811
    """The plain path (no ``--elastic``) saves iteration 4; ``--load`` it with ``--finetune``
    (the weights only, from iteration 0) and with ``--no-load-optim`` (the weights and the
    iteration), with and without ``--elastic``: the same losses, iteration by iteration. A
    checkpoint saved under ``--elastic`` with ``--no-save-optim`` holds no optimizer state and
    loads as with ``--no-load-optim``, as Megatron-LM loads one."""
    save = tmp_path / "pretrained"
    base = flags(text_data, elastic=False)
    at = base.index("--train-iters")
    _, _, output = train(tmp_path, "pretraining",
                         base[:at + 1] + ["4"] + base[at + 2:] + ["--save", str(save)])
    assert latest_complete(str(save))[0] == 4, output[-3000:]
    for flag, first in (("--finetune", 1), ("--no-load-optim", 5)):
        losses = {}
        for arm, command in (("plain", base), ("elastic", flags(text_data))):
            _, _, output = train(tmp_path, f"{arm}{flag}",
                                 [*command, "--load", str(save), flag, "--no-load-rng"])
            losses[arm] = [(int(i), float(loss)) for i, _, loss in LOG_LINE.findall(output)]
        assert [i for i, _ in losses["plain"]] == list(range(first, TRAIN_ITERS + 1)), flag
        assert_same_log_losses(losses["plain"], losses["elastic"])
    without_optimizer = tmp_path / "without-optimizer"
    elastic = flags(text_data)
    train(tmp_path, "saving-no-optim", elastic[:at + 1] + ["4"] + elastic[at + 2:] + [
        "--save", str(without_optimizer), "--no-save-optim"])
    index = (Path(latest_complete(str(without_optimizer))[1]) / ".metadata").read_bytes()
    assert b"decoder" in index and b"optimizer.state" not in index
    _, _, output = train(tmp_path, "loading-no-optim", [*elastic, "--load", str(without_optimizer)])
    assert_same_log_losses(losses["plain"],  # the last flag's: --no-load-optim
                           [(int(i), float(loss)) for i, _, loss in LOG_LINE.findall(output)])


@pytest.mark.timeout(300)
def test_cannot_continue_names_the_last_complete_checkpoint_and_how_to_resume_it(
        text_data, tmp_path):  # noqa: F811
    """Without snapshot replicas a rank's death loses state for good: every survivor stops in one
    line that names the last periodic checkpoint and the ``--load`` that resumes it."""
    save = tmp_path / "checkpoints"
    command = [PRETRAIN, *flags(text_data), "--save", str(save), "--save-interval", "2",
               "--elastic-snapshot-replicas", "0",
               "--elastic-inject-failure", "rank=1,iteration=6,phase=optimizer"]
    with launch(command, 4, master_port=free_port(), log_path=tmp_path / "lost.log") as job:
        returncode, output = job.wait(200)
    assert returncode != 0
    lines = [line for line in output.splitlines() if "cannot continue" in line]
    assert len(lines) == 3 and "Traceback" not in output, output[-4000:]
    saved, directory = latest_complete(str(save))
    assert saved in (2, 4) and is_complete(Path(directory))  # 4's save may be lost with rank 1
    expected = (f"; the last complete checkpoint is iteration {saved} in {directory}: resume "
                f"with --load {save}")
    assert all(line.startswith("pretrain_gpt.py: cannot continue: no survivor holds a snapshot "
                               "of ranks [1]") and line.endswith(expected) for line in lines), lines


# -- Megatron-LM's own loop (the training package of the 0.19 wheels, or a checkout) --------------

MEGATRON_LM_ITERS = 8


def megatron_lm(tmp_path: Path, name: str, extra: list[str], *,
                kill_once_saved: Path | None = None) -> tuple[int, str, list[tuple[int, float]]]:
    """Megatron-LM's loop on TP1 x PP2 x DP2 (four ranks); with ``kill_once_saved``, the whole
    job is SIGKILLed once the checkpoint of iteration 4 is complete there. Its exit status, log,
    and the ``(iteration, lm loss)`` of its log lines."""
    command = ["-m", "megatron_elaswave.run_megatron_lm", str(TRAINING_SCRIPT),
               *megatron_lm_flags(1, 2, MEGATRON_LM_ITERS), "--untie-embeddings-and-output-weights",
               "--hidden-dropout", "0", "--attention-dropout", "0", *extra]
    with launch(command, 4, master_port=free_port(), log_path=tmp_path / f"{name}.log") as job:
        if kill_once_saved is not None:
            job.wait_for(lambda: saved_at_least(kill_once_saved, 4), 240,
                         "the checkpoint of iteration 4")
            job.kill()
            returncode, output = -signal.SIGKILL, job.output()
        else:
            returncode, output = job.wait(300)
    losses = [(int(i), float(loss)) for i, _, loss in LOG_LINE.findall(output)]
    return returncode, output, losses


def assert_same_log_losses(reference: list[tuple[int, float]],
                           run: list[tuple[int, float]]) -> None:
    assert [i for i, _ in run] == [i for i, _ in reference]
    for (i, expected), (_, got) in zip(reference, run):
        assert abs(got - expected) <= 1e-5 * abs(expected), (i, expected, got)


@pytest.fixture(scope="module")
def megatron_lm_resumes(tmp_path_factory):
    """Megatron-LM's loop uninterrupted under ``--elastic`` (the reference); saving every 4
    iterations with and without ``--elastic`` (Megatron-LM's default ``dp_reshardable``
    optimizer state, keyed by its gradient buckets), each SIGKILLed once iteration 4 is saved;
    then each checkpoint resumed by Megatron-LM's loop without ``--elastic`` and with it. The
    reference's records, and the log losses of every resumed run by (loader, saver)."""
    tmp_path = tmp_path_factory.mktemp("megatron_lm_resumes")
    returncode, output, _ = megatron_lm(
        tmp_path, "reference", ["--elastic", "--elastic-metrics-file", str(tmp_path / "ref.jsonl")])
    assert returncode == 0, output[-4000:]
    saved = {}
    for saver, extra in (("elastic", ["--elastic"]), ("plain", [])):
        save = tmp_path / f"saved-by-{saver}"
        _, output, _ = megatron_lm(tmp_path, f"saving-{saver}",
                                   [*extra, "--save", str(save), "--save-interval", "4"],
                                   kill_once_saved=save)
        assert latest_complete(str(save))[0] == 4, output[-4000:]
        saved[saver] = save
    resumed = {}
    for loader, extra in (("elastic", ["--elastic"]), ("plain", [])):
        for saver, save in saved.items():
            name = f"{loader}-loads-{saver}"
            metrics = ["--elastic-metrics-file", str(tmp_path / f"{name}.jsonl")] if extra else []
            returncode, output, losses = megatron_lm(
                tmp_path, name, ["--load", str(save), *extra, *metrics])
            assert returncode == 0 and "Traceback" not in output, output[-4000:]
            assert [i for i, _ in losses] == list(range(5, MEGATRON_LM_ITERS + 1)), output[-4000:]
            resumed[loader, saver] = losses
    return read_metrics(str(tmp_path / "ref.jsonl"), "iteration"), resumed, tmp_path


@pytest.mark.timeout(1800)
@needs_megatron_lm
def test_megatron_lm_loads_a_checkpoint_saved_under_elastic_as_its_own(megatron_lm_resumes):
    """Megatron-LM's loop without ``--elastic`` (its ``load_checkpoint``) resumes the checkpoint
    saved under ``--elastic`` as it resumes its own: the same log losses. (Its resumed runs are
    compared with each other: the second line after a resume averages its first two iterations,
    as Megatron-LM 0.19 resets its sums only after the first.)"""
    _, resumed, _ = megatron_lm_resumes
    assert_same_log_losses(resumed["plain", "plain"], resumed["plain", "elastic"])


@pytest.mark.timeout(1800)
@needs_megatron_lm
def test_elastic_resumes_either_checkpoint_on_the_uninterrupted_trajectory(megatron_lm_resumes):
    """Under ``--elastic``, the checkpoint saved under ``--elastic`` and Megatron-LM's own both
    resume on the uninterrupted run (the same samples and losses, iteration by iteration), and
    its log lines are those of Megatron-LM's loop resuming the same checkpoint."""
    reference, resumed, tmp_path = megatron_lm_resumes
    for saver in ("elastic", "plain"):
        assert_same_log_losses(resumed["plain", saver], resumed["elastic", saver])
        assert_on_trajectory(reference, read_metrics(
            str(tmp_path / f"elastic-loads-{saver}.jsonl"), "iteration"))


@pytest.mark.timeout(1800)
@needs_megatron_lm
@pytest.mark.parametrize("flag", ["--finetune", "--no-load-optim"])
def test_a_checkpoint_of_megatron_lms_own_loop_starts_a_run_as_in_megatron_lm(
        megatron_lm_resumes, flag):
    """Megatron-LM's checkpoint (its own loop, without ``--elastic``) with ``--finetune`` (the
    weights only, from iteration 0) or ``--no-load-optim`` (the weights and the iteration, a new
    optimizer and schedule), and ``--no-load-rng``: under ``--elastic`` the first iterations
    log the losses Megatron-LM's loop logs given the same flags."""
    _, _, tmp_path = megatron_lm_resumes
    saved = str(tmp_path / "saved-by-plain")
    name = flag.strip("-")
    runs = {}
    for arm, extra in (("plain", []), ("elastic", ["--elastic"])):
        returncode, output, losses = megatron_lm(
            tmp_path, f"{arm}-{name}", ["--load", saved, flag, "--no-load-rng", *extra])
        assert returncode == 0 and "Traceback" not in output, output[-4000:]
        runs[arm] = losses
    first = 1 if flag == "--finetune" else latest_complete(saved)[0] + 1
    assert [i for i, _ in runs["plain"]] == list(range(first, MEGATRON_LM_ITERS + 1))
    assert_same_log_losses(runs["plain"], runs["elastic"])

