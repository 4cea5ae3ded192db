"""The metrics file, followed while it grows."""

from __future__ import annotations

import json

from megatron_elaswave.metrics import MetricsFollower, MetricsWriter, read_metrics


def test_a_follower_reads_each_complete_line_once_as_the_file_grows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    follower = MetricsFollower(path)
    assert follower.poll() == []  # not written yet
    writer = MetricsWriter(str(path))
    writer.write("iteration", iteration=1)
    writer.write("recovery", failed_ranks=[3])
    first = follower.poll()
    assert [r["event"] for r in first] == ["iteration", "recovery"]
    kept = first[0]
    with open(path, "a") as handle:  # a record half written by the job
        handle.write(json.dumps({"event": "iteration", "iteration": 2})[:10])
    assert len(follower.poll()) == 2
    with open(path, "a") as handle:
        handle.write(json.dumps({"event": "iteration", "iteration": 2})[10:] + "\n")
    writer.write("grow", ranks=[3])
    records = follower.poll()
    assert records == read_metrics(str(path))
    assert records[0] is kept  # parsed once
