"""``scripts/bench/moe.py --quick`` end to end: Megatron-LM's Mixtral recipe on 8 CPU ranks
without and with ``--elastic`` time-sliced, then one SIGKILL of a worker in the MoE job and one
in its dense twin, each recovered; its figures are written to ``--output`` and printed in a
table. Skipped where no Megatron-LM training package is at hand, as ``test_moe.py`` is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_megatron_adaptor import TRAINING_SCRIPT

MOE_BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "moe.py"

pytestmark = pytest.mark.multiprocess


@pytest.mark.skipif(TRAINING_SCRIPT is None, reason="no Megatron-LM training package: set "
                    "MEGATRON_LM_PATH, or install megatron-core 0.19 or later")
@pytest.mark.timeout(900)
def test_moe_benchmark_quick_runs_both_measurements_end_to_end(tmp_path):
    output = tmp_path / "moe.json"
    result = subprocess.run(
        [sys.executable, str(MOE_BENCH), "--quick", "--output", str(output),
         "--training-script", str(TRAINING_SCRIPT)],
        capture_output=True, text=True, timeout=840,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(output.read_text())
    assert figures["quick"] and figures["model"]["layout"] == "TP1xPP2xDP4xEP4"

    step = figures["step_time"]
    assert all(median > 0 for median in step["median_s"].values())
    assert step["iterations_per_arm"] >= 2 and step["ratio"] > 0
    low, high = step["interval"]
    assert low <= step["ratio"] <= high

    mttr = figures["mttr"]
    for job in ("moe", "dense"):
        [kill] = mttr[job]["samples"]
        assert kill["failed_ranks"] == [5]
        assert 0 < kill["total_s"] < 120
        assert set(kill["phases_s"]) >= {"detect_s", "migrate_s", "first_step_s"}
    # The MoE job moves its experts' state too.
    assert mttr["moe"]["median_bytes_moved"] > mttr["dense"]["median_bytes_moved"]
    assert mttr["ratio"] == pytest.approx(
        mttr["moe"]["median_total_s"] / mttr["dense"]["median_total_s"])

    table = result.stdout
    assert "ratio --elastic / megatron-lm" in table and "ratio MoE / dense" in table
