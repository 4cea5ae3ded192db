"""Shared pieces of the benchmarks: launching training runs and alternating arms."""

from __future__ import annotations

import json
import os
import statistics
import socket
import subprocess
import sys
import tempfile
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


def launch(script: Path, script_args: Sequence[str], nproc: int,
           launcher_args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` ranks through elaswave-run; exit with its stderr on failure."""
    command = [sys.executable, "-m", "megatron_elaswave.run", f"--nproc-per-node={nproc}",
               f"--master-port={free_port()}", *launcher_args, str(script), *script_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
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

    def paired_ratio(self, arm: str, base: str, measure: str = STEP_TIME) -> float:
        """The median of :meth:`round_ratios`: runs of one round are minutes apart, so a
        machine slowed for a while moves one round's ratio, not this figure."""
        return statistics.median(self.round_ratios(arm, base, measure))


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
