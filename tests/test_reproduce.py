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


def test_keep_others_runs_some_experiments_again_and_keeps_the_rest(tmp_path):
    # An earlier report with a measured section (a), as a full run writes it.
    communicator = ["## (a) Communicator recovery: in place against partial and full rebuild", "",
                    "Measured: a table of the earlier run.", ""]
    # The sections written by other scripts follow the experiments, from their own files.
    kept = {"## megatron-core 0.16.1 and 0.19.2": "megatron_core_lines.md",
            "## One GPU: the accelerator path": "gpu_check.md"}
    (tmp_path / "results").mkdir()
    for heading, name in kept.items():
        (tmp_path / "results" / name).write_text(f"Table of {name}, as it stands.\n")
    (tmp_path / "results.md").write_text("\n".join([
        "# Results: the paper's evaluation, reproduced", "",
        "Written by `python scripts/reproduce.py` on 2026-01-02 in 1290 s.", "",
        "## Headline figures", "", *communicator,
        *(line for heading in kept for line in (heading, "", "An older copy.", ""))]))
    (tmp_path / "results" / "results.json").write_text(json.dumps(
        {"a": {"tp2pp2dp2": {"full_over_inplace": 2.2, "partial_over_inplace": 1.1,
                             "inplace_s": 0.15}}}))
    result = subprocess.run([sys.executable, str(REPRODUCE), "--only", "b", "--keep-others",
                             "--output", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = (tmp_path / "results.md").read_text()
    # It opens with its figures; which run wrote which section is said at its end.
    assert report.split("\n## ")[1].startswith("Headline figures")
    section_a, rest = report.split("## (a)")[1].split("## (b)")
    assert "## (a)" + section_a.rstrip("\n") == "\n".join(communicator).rstrip("\n")
    migration, *others, provenance = rest.split("\n## ")
    assert "Largest reduction" in migration
    assert others == [f"{heading[3:]}\n\nTable of {name}, as it stands.\n"
                      for heading, name in kept.items()]
    rows = provenance.split("\n")[4:]
    assert rows[0] == ("| (a), (c), (d), (e), (f), (g), (h) | `python scripts/reproduce.py` "
                       "| 2026-01-02 | 1290 s |")
    assert rows[1].startswith("| (b) | `python scripts/reproduce.py --only b --keep-others` | ")
    headline = report.split("## (a)")[0]
    assert "| (tp2pp2dp2) full rebuild / in place | measured | 2.2 |" in headline
    assert "migration time saved by interleaved ZeRO" in headline
    figures = json.loads((tmp_path / "results" / "results.json").read_text())
    assert figures.keys() == {"a", "b"}


def test_keep_others_needs_a_report_to_keep(tmp_path):
    result = subprocess.run([sys.executable, str(REPRODUCE), "--only", "b", "--keep-others",
                             "--output", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "no report in" in result.stderr
    assert len(result.stderr.strip().splitlines()[-1]) < 200


def test_a_soak_that_fails_its_checks_still_reports_what_it_measured(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPRODUCE.parent))
    import reproduce

    summary = {
        "faults": 2, "faults_per_kind": {"kill": 1, "node": 1}, "recoveries": 2, "grows": 1,
        "clean_stops": 0, "iterations": 40, "samples_lost": 0,
        "largest_relative_loss_difference": 3e-6, "heartbeat_timeout_s": 3.0,
        "node_timeout_s": 3.0,
        "mttr": {"kill": {"count": 1, "median_s": 2.5, "p90_s": 2.5, "max_s": 2.5},
                 "node": {"count": 1, "median_s": 7.0, "p90_s": 7.0, "max_s": 7.0}},
        "fault_log": [{"kind": "node", "victims": [4, 5, 6, 7], "mttr_s": 7.0,
                       "death_recorded_s": 3.2, "recoveries": [{"detect_s": 3.0, "total_s": 6.5}]}],
    }

    def failing_soak(script, *arguments):
        Path(arguments[arguments.index("--json-out") + 1]).write_text(json.dumps(summary))
        raise reproduce.ExperimentFailed("chaos.py exited with status 1: only 2 of 5 faults")

    monkeypatch.setattr(reproduce, "bench_json", failing_soak)
    try:
        reproduce.chaos(reproduce.SMOKE, tmp_path)
    except reproduce.ExperimentFailed as failure:
        assert "only 2 of 5 faults" in str(failure)
        report = "\n".join(failure.lines)
    else:
        raise AssertionError("a failed soak was reported as a success")
    assert "| kill | 1 | 2.50 | 2.50 | 2.50 | < 3 | yes |" in report
    assert "| node | 1 | 7.00 | 7.00 | 7.00 | < 6 | **no** |" in report
    assert "Slowest: node of ranks [4, 5, 6, 7], 7.00 s" in report


def test_a_ratio_that_rounds_to_its_target_shows_which_side_it_is_on():
    sys.path.insert(0, str(REPRODUCE.parent))
    from reproduce import beside

    assert beside(1.0500879509547296, 1.05) == "1.0501"  # over the target by 0.00009
    assert beside(1.0499, 1.05) == "1.0499"
    assert beside(0.9799709, 1.03) == "0.980"  # far from it: the usual digits
    assert beside(2.996, 3.0, 2) == "2.996"
    assert beside(1.05, 1.05) == "1.050"  # on it
