"""``scripts/reproduce.py`` writes the report: its simulated experiments, run for real here (the
measured ones run in CI through ``--smoke``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPRODUCE = Path(__file__).resolve().parents[1] / "scripts" / "reproduce.py"


def test_the_simulated_experiments_make_tables_plots_and_figures(tmp_path):
    result = subprocess.run([sys.executable, str(REPRODUCE), "--only", "bd", "--output", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = (tmp_path / "results.md").read_text()
    assert "## (b) Migration" in report and "## (d) Post-failure throughput" in report
    assert "## (a)" not in report and "Not measured" not in report
    assert "Simulated:" in report and "Machine:" in report
    figures = json.loads((tmp_path / "results" / "results.json").read_text())
    # Interleaved ownership never moves more than Megatron's contiguous shards.
    assert all(0 <= r < 1 for r in figures["b"]["reductions"])
    assert f"Largest reduction {max(figures['b']['reductions']):.0%}" in report
    gain = figures["d"]["summary"]["96 devices"]["recycle"]
    assert gain >= 1 and f"{gain:.2f}x (paper 1.35x)" in report
    assert (tmp_path / "results" / "throughput.png").stat().st_size > 10_000


def test_unknown_experiments_are_refused(tmp_path):
    result = subprocess.run([sys.executable, str(REPRODUCE), "--only", "az", "--output", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "unknown experiments ['z']" in result.stderr
