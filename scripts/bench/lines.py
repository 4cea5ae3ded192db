"""MTTR and the failure-free step-time ratios on each megatron-core line, measured in one run.

Each line is a virtual environment as ``scripts/setup.sh`` makes it (by default ``.venv``, with
megatron-core 0.16.1 on Python 3.11, and ``.venv-mcore0.19.2``, set up by
``MEGATRON_CORE=0.19.2 bash scripts/setup.sh``). With each environment's Python, in turn:

* ``scripts/bench/mttr.py --skip-restart --skip-torchft``: the ElasWave arm, rank 5 of
  TP2 x PP2 x DP2 SIGKILLed from outside the job; the median MTTR;
* ``scripts/bench/overhead.py``: the iteration time of ``pretrain_gpt.py`` without and with
  ``--elastic``, each as a ratio to megatron-core's own loop (``plain_gpt.py``) on that line, the
  three time-sliced in sets of new runs.

The lines alternate (all MTTR runs, then all overhead runs), so that machine noise hits both.
Writes a Markdown table to ``--output`` (``docs/results/megatron_core_lines.md``, which
``scripts/reproduce.py`` keeps in ``docs/results.md``) and prints it.

    python scripts/bench/lines.py --repetitions 3 --sets 8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parents[1]

_VERSIONS = ("import platform, torch; from importlib.metadata import version; "
             "print(platform.python_version(), torch.__version__, version('megatron-core'))")


def run_json(python: Path, script: str, args: list[str]) -> dict:
    """``python script args --json``'s object; exits with its stderr if it fails."""
    result = subprocess.run([str(python), str(BENCH / script), *args, "--json"], cwd=REPO,
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"lines: {script} on {python} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", action="append", dest="venvs",
                        help="a line's virtual environment (repeat; default: .venv and "
                             ".venv-mcore0.19.2)")
    parser.add_argument("--repetitions", type=int, default=3, help="MTTR runs per line")
    parser.add_argument("--sets", type=int, default=8, help="overhead sets of new runs per line")
    parser.add_argument("--rounds", type=int, default=3,
                        help="overhead windows per arm, set of runs and line")
    parser.add_argument("--output", default=str(REPO / "docs" / "results" /
                                                "megatron_core_lines.md"))
    args = parser.parse_args()
    pythons = [REPO / venv / "bin" / "python" for venv in args.venvs or
               [".venv", ".venv-mcore0.19.2"]]
    missing = [str(p) for p in pythons if not p.exists()]
    if missing:
        sys.exit(f"lines: no virtual environment at {', '.join(missing)} (scripts/setup.sh makes "
                 f"them; MEGATRON_CORE=0.19.2 for the 0.19 line)")
    versions = [subprocess.run([str(p), "-c", _VERSIONS], capture_output=True, text=True,
                               check=True).stdout.split() for p in pythons]
    mttr = [run_json(p, "mttr.py", ["--skip-restart", "--skip-torchft",
                                     "--repetitions", str(args.repetitions)]) for p in pythons]
    overhead = [run_json(p, "overhead.py",
                         ["--arms", "plugin,elastic", "--sets", str(args.sets),
                          "--rounds", str(args.rounds)])
                for p in pythons]
    rows = ["| Python | torch | megatron-core | ElasWave MTTR, median (s) | plugin / plain "
            "megatron-core | --elastic / plain megatron-core |", "|---|---|---|---|---|---|"]
    for (python, torch, megatron_core), recovery, cost in zip(versions, mttr, overhead):
        ratios = cost["ratio_to_plain"]
        rows.append(f"| {python} | {torch} | {megatron_core} | {recovery['elaswave_mttr_s']:.2f} | "
                    f"{ratios['plugin']:.4f} | {ratios['elastic']:.4f} |")
    text = "\n".join([
        f"Measured: `python scripts/bench/lines.py --repetitions {args.repetitions} --sets "
        f"{args.sets} --rounds {args.rounds}`, both lines in one run on this machine. MTTR: rank 5 "
        f"of TP2 x PP2 x DP2 SIGKILLed in iteration 8 ({args.repetitions} runs per line); ratios: "
        f"iteration time of {overhead[0]['layout']} over megatron-core's own loop on the same "
        f"line, the arms time-sliced ({args.sets} sets of new runs of {args.rounds} rounds, "
        f"{overhead[0]['iterations_per_arm']} iterations per arm), the median over rounds of the "
        "ratio within a round.", "", *rows, ""])
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
