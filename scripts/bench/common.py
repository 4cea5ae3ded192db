"""Shared pieces of the benchmarks: launching training runs and alternating arms."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import statistics
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

SCRIPTS = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def demo_corpus(workdir: Path) -> str:
    """The demo's text corpus (built under ``workdir`` on first use); its data prefix."""
    sys.path.insert(0, str(SCRIPTS))
    from demo import prepare_data

    return prepare_data(workdir)


def mock_gpt_flags(*, pipeline: int, num_layers: int, hidden_size: int, micro_batch_size: int,
                   global_batch_size: int, train_iters: int, seq_length: int = 128) -> list[str]:
    """The benchmarks' model: a small GPT on mock data with the distributed optimizer, logging
    only in the metrics file."""
    return [
        "--pipeline-model-parallel-size", str(pipeline), "--num-layers", str(num_layers),
        "--hidden-size", str(hidden_size), "--num-attention-heads", "4",
        "--seq-length", str(seq_length), "--micro-batch-size", str(micro_batch_size),
        "--global-batch-size", str(global_batch_size), "--train-iters", str(train_iters),
        "--lr", "1e-3", "--mock-data", "--vocab-size", "511", "--use-distributed-optimizer",
        "--log-interval", "1000", "--eval-interval", "100000",
    ]


def _launch_command(script: Path, script_args: Sequence[str], nproc: int,
                    launcher_args: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "megatron_elaswave.launch.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", *launcher_args, str(script), *script_args]


def _run_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def launch(script: Path, script_args: Sequence[str], nproc: int,
           launcher_args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` ranks through elaswave-run; exit with its stderr on failure."""
    command = _launch_command(script, script_args, nproc, launcher_args)
    result = subprocess.run(command, capture_output=True, text=True, env=_run_env())
    if result.returncode != 0:
        sys.exit(f"{script.name} failed:\n{result.stderr[-3000:]}")
    return result


def pretrain_metrics(flags: Sequence[str], nproc: int) -> list[dict]:
    """Every record of one ``pretrain_gpt.py`` run's metrics file."""
    with tempfile.TemporaryDirectory() as workdir:
        metrics = Path(workdir) / "metrics.jsonl"
        launch(SCRIPTS / "pretrain_gpt.py", [*flags, "--elastic-metrics-file", str(metrics)],
               nproc)
        return [json.loads(line) for line in metrics.read_text().splitlines()]


def pretrain_records(flags: Sequence[str], nproc: int) -> list[dict]:
    """The iteration records of one ``pretrain_gpt.py`` run."""
    return [r for r in pretrain_metrics(flags, nproc) if r["event"] == "iteration"]


STEP_TIME = "step_time_s"


@dataclass
class Alternated:
    """The per-iteration records (after warm-up) of every run of every arm, by round; each
    record maps a measure (``"step_time_s"``, ...) to its value in that iteration."""

    runs: dict[str, list[list[dict[str, float]]]]
    rounds_per_set: int = 1
    """How many consecutive rounds the same runs measured (one set of runs). Rounds of one set
    share those runs' speed, which differs from set to set by as much as a tenth; only the sets
    are independent draws."""

    def pooled(self, arm: str, measure: str = STEP_TIME) -> list[float]:
        """Every iteration's ``measure`` of ``arm``, all rounds together."""
        return [record[measure] for run in self.runs[arm] for record in run]

    def median(self, arm: str, measure: str = STEP_TIME) -> float:
        return statistics.median(self.pooled(arm, measure))

    def round_ratios(self, arm: str, base: str, measure: str = STEP_TIME) -> list[float]:
        """Per round, the median ``measure`` of ``arm``'s run over that of ``base``'s."""
        return [statistics.median(r[measure] for r in run)
                / statistics.median(r[measure] for r in base_run)
                for run, base_run in zip(self.runs[arm], self.runs[base], strict=True)]

    def set_ratios(self, arm: str, base: str, measure: str = STEP_TIME) -> list[float]:
        """Per set of runs, the median of its :meth:`round_ratios`: a window slowed by other
        work moves one round's ratio, not its set's."""
        ratios = self.round_ratios(arm, base, measure)
        size = self.rounds_per_set
        return [statistics.median(ratios[start:start + size])
                for start in range(0, len(ratios), size)]

    def paired_ratio(self, arm: str, base: str, measure: str = STEP_TIME) -> float:
        """The median of :meth:`set_ratios` (of the rounds' ratios where every round ran new
        runs)."""
        return statistics.median(self.set_ratios(arm, base, measure))

    def ratio_interval(self, arm: str, base: str, measure: str = STEP_TIME,
                       confidence: float = 0.95) -> tuple[float, float]:
        """:func:`median_interval` of :meth:`set_ratios`: where :meth:`paired_ratio` would lie
        if new sets were measured, the sets taken as independent."""
        return median_interval(self.set_ratios(arm, base, measure), confidence)


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of the population ``values`` were drawn
    from: the order statistics ``k`` from either end, ``k`` the largest whose interval covers
    the median with at least ``confidence`` (the binomial sign-test bound). Too few values for
    that (fewer than 6 at 95%): their whole range."""
    ordered = sorted(values)
    n = len(ordered)
    tail = (1 - confidence) / 2
    depth, below = 0, 0.0  # below: P(at most depth - 1 of the n values lie below the median)
    while depth < n // 2:
        below += math.comb(n, depth) / 2 ** n
        if below > tail:
            break
        depth += 1
    depth = max(depth, 1)
    return ordered[depth - 1], ordered[n - depth]


def alternate(arms: dict[str, Callable[[], list[dict[str, float]]]], rounds: int, warmup: int,
              report: Callable[[str], None] = print) -> Alternated:
    """Run every arm ``rounds`` times in rotating order, dropping the records of the first
    ``warmup`` iterations of each run. A first run of the first arm is not counted: a
    benchmark's first run has been seen half again as slow as the rest on a machine that did
    other work just before."""
    names = list(arms)
    runs: dict[str, list[list[dict[str, float]]]] = {name: [] for name in names}
    arms[names[0]]()
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            run = arms[name]()[warmup:]
            runs[name].append(run)
            median_ms = statistics.median(r[STEP_TIME] for r in run) * 1e3
            report(f"  {name:12s} run: median {median_ms:.1f} ms over {len(run)} iterations")
    return Alternated(runs)


class SlicedJob:
    """A training run on ``nproc`` ranks through elaswave-run, in a process group of its own so
    that it can be paused (SIGSTOP) and resumed as a whole. Its iteration records are read, as
    they are written, from JSON lines: the script's stdout, or the file the script is told to
    write with the flag ``records_flag`` (``pretrain_gpt.py``'s ``--elastic-metrics-file``).
    ``launcher_args`` go to elaswave-run."""

    def __init__(self, script: Path, script_args: Sequence[str], nproc: int,
                 records_flag: str | None = None, launcher_args: Sequence[str] = ()) -> None:
        self._workdir = tempfile.TemporaryDirectory()
        workdir = Path(self._workdir.name)
        self._stdout = open(workdir / "stdout", "w+b")
        self._stderr = open(workdir / "stderr", "w+b")
        self._records_path = workdir / ("stdout" if records_flag is None else "records.jsonl")
        if records_flag is not None:
            script_args = [*script_args, records_flag, str(self._records_path)]
        self._offset = 0
        self._partial = b""
        self.records: list[dict] = []
        """Every iteration record read so far."""
        self.process = subprocess.Popen(_launch_command(script, script_args, nproc, launcher_args),
                                        stdout=self._stdout, stderr=self._stderr, env=_run_env(),
                                        start_new_session=True)

    @classmethod
    def pretrain(cls, flags: Sequence[str], nproc: int) -> "SlicedJob":
        """A ``pretrain_gpt.py`` run; its records are the metrics file's iteration events."""
        return cls(SCRIPTS / "pretrain_gpt.py", flags, nproc, "--elastic-metrics-file")

    def _read(self) -> None:
        try:
            with open(self._records_path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            if line.startswith(b"{"):
                record = json.loads(line)
                if record.get("event", "iteration") == "iteration":
                    self.records.append(record)

    def wait_for(self, count: int, timeout_s: float = 600.0) -> None:
        """Return once ``count`` records are in; exit with the run's stderr if it ended first,
        or after ``timeout_s`` (the run is killed by whoever started it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._read()
            if len(self.records) >= count:
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                self._stderr.seek(0)
                ended = (f"exited with {self.process.returncode}" if self.process.poll() is not None
                         else f"wrote {len(self.records)} of {count} records in {timeout_s:.0f} s")
                sys.exit(f"a benchmark run {ended}:\n"
                         f"{self._stderr.read()[-3000:].decode(errors='replace')}")
            time.sleep(0.02)

    def pause(self) -> None:
        """Stop every process of the run, then read the records written before it stopped."""
        os.killpg(self.process.pid, signal.SIGSTOP)
        self._read()

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """Kill every process of the run, paused or not, and remove its files."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._stdout.close()
        self._stderr.close()
        self._workdir.cleanup()


RESUME_DROPPED = 2
"""Records dropped after each resume of a time-sliced run: that of the iteration the pause cut
in two and, as ``pretrain_gpt.py --elastic`` writes each iteration's record once the next step
has settled it, that of the iteration before."""


def time_sliced(jobs: dict[str, Callable[[int], SlicedJob]], rounds: int, window: int,
                warmup: int, sets: int = 1, report: Callable[[str], None] = print) -> Alternated:
    """Run the arms side by side, one at a time, in ``sets`` of runs one after the other.

    In a set every arm's job starts, trains ``warmup`` iterations and is paused; then, round
    after round, each arm in turn is resumed for ``window`` measured iterations and paused
    again, the others waiting. Arms measured seconds apart see the same machine, where runs
    minutes apart were seen to differ by a quarter in speed and CPU time alike. Each set starts
    new jobs: a run of 8 ranks on 2 cores keeps a speed of its own within a few percent (how its
    processes came to share the cores), which only more runs average out. The first
    :data:`RESUME_DROPPED` records after each resume are dropped. ``jobs`` start a run given its
    number of iterations; every job is killed at the end of its set. Rounds of all sets are
    returned in order."""
    names = list(jobs)
    train_iters = warmup + rounds * (window + RESUME_DROPPED + 1) + 2
    runs: dict[str, list[list[dict[str, float]]]] = {name: [] for name in names}
    for set_index in range(sets):
        started: dict[str, SlicedJob] = {}
        try:
            for name in names:
                started[name] = jobs[name](train_iters)
                started[name].wait_for(warmup)
                started[name].pause()
            for round_index in range(rounds):
                shift = (set_index + round_index) % len(names)
                for name in names[shift:] + names[:shift]:
                    job = started[name]
                    first = len(job.records) + RESUME_DROPPED
                    job.resume()
                    job.wait_for(first + window)
                    job.pause()
                    run = job.records[first:]
                    runs[name].append(run)
                    median_ms = statistics.median(r[STEP_TIME] for r in run) * 1e3
                    report(f"  set {set_index + 1} {name:12s} window: median {median_ms:.1f} ms "
                           f"over {len(run)} iterations")
        finally:
            for job in started.values():
                job.kill()
    return Alternated(runs, rounds_per_set=rounds)


MEGATRON_LM_LINE = re.compile(r"iteration +(\d+)/ +\d+ \|(.*)")
"""Megatron-LM's iteration log line: the iteration, then its ``name: value | ...`` fields."""
MEGATRON_LM_ELAPSED = "elapsed time per iteration (ms)"


def megatron_lm_record(line: str) -> dict[str, float] | None:
    """Megatron-LM's iteration log line as a record: ``iteration``, each field with a number by
    its name, and :data:`STEP_TIME`, the line's elapsed time per iteration in seconds (at
    ``--log-interval 1`` the wall time of that iteration, on the logging rank); ``None`` for any
    other line."""
    match = MEGATRON_LM_LINE.search(line)
    if match is None:
        return None
    record: dict[str, float] = {"iteration": int(match.group(1))}
    for field in match.group(2).split("|"):
        name, _, value = field.partition(":")
        try:
            record[name.strip()] = float(value)
        except ValueError:
            continue
    if MEGATRON_LM_ELAPSED not in record:
        return None
    record[STEP_TIME] = record[MEGATRON_LM_ELAPSED] / 1e3
    return record


class MegatronLMJob(SlicedJob):
    """A :class:`SlicedJob` of Megatron-LM's own loop as users run it under elaswave-run:
    ``elaswave-run -m megatron_elaswave.run_megatron_lm TRAINING_SCRIPT ARGS``; its records are
    Megatron-LM's iteration log lines in the job's output (:func:`megatron_lm_record`; run it
    with ``--log-interval 1``), the same with ``--elastic`` and without."""

    RUNNER = "megatron_elaswave.run_megatron_lm"

    def __init__(self, training_script: Path | str, script_args: Sequence[str], nproc: int,
                 launcher_args: Sequence[str] = ()) -> None:
        super().__init__(Path(self.RUNNER), [str(training_script), *script_args], nproc,
                         launcher_args=["-m", *launcher_args])

    def _read(self) -> None:
        try:
            with open(self._records_path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            record = megatron_lm_record(line.decode(errors="replace"))
            if record is not None:
                self.records.append(record)


def bootstrap_median_ratio(samples: Sequence[float], base: Sequence[float],
                           confidence: float = 0.95, draws: int = 4000,
                           seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval for ``median(samples) / median(base)``, two independent
    samples (each redrawn with replacement)."""
    draw = random.Random(seed)
    ratios = sorted(statistics.median(draw.choices(samples, k=len(samples)))
                    / statistics.median(draw.choices(base, k=len(base))) for _ in range(draws))
    tail = (1 - confidence) / 2
    return ratios[int(tail * (draws - 1))], ratios[int(round((1 - tail) * (draws - 1)))]


def bootstrap_ratio_interval(times: Alternated, arm: str, base: str, measure: str = STEP_TIME,
                             confidence: float = 0.95, draws: int = 4000,
                             seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval for :meth:`Alternated.paired_ratio`, resampling on both
    levels the runs have: sets with replacement, then the rounds of each drawn set with
    replacement (the median of a set's drawn rounds' ratios, the median over the drawn sets).
    Narrower than :func:`median_interval` with few sets, where that is their whole range; it
    takes the sets as a sample of the machine's states, which a handful of sets is not always."""
    ratios = times.round_ratios(arm, base, measure)
    size = times.rounds_per_set
    sets = [ratios[start:start + size] for start in range(0, len(ratios), size)]
    draw = random.Random(seed)
    medians = sorted(
        statistics.median(statistics.median(draw.choices(rounds, k=len(rounds)))
                          for rounds in draw.choices(sets, k=len(sets)))
        for _ in range(draws))
    tail = (1 - confidence) / 2
    return medians[int(tail * (draws - 1))], medians[int(round((1 - tail) * (draws - 1)))]
