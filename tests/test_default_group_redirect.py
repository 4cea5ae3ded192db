"""Megatron-LM's calls on the default process group go to the ranks that still run.

A real process is SIGKILLed after the groups are formed; the survivors' calls without a group
(barrier, all-reduce, broadcast, all-gather, rank queries) complete among themselves through
``DefaultGroupRedirect``, as Megatron-LM's timers and logging need in an elastic run.
"""

from __future__ import annotations

import json

import pytest

from harness import free_port, launch, worker_script


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_default_group_calls_complete_among_the_survivors_of_a_sigkill(tmp_path):
    with launch([worker_script("default_group_redirect.py"), str(tmp_path)], 4,
                master_port=free_port()) as job:
        [death] = job.wait_for_deaths(1, timeout=30)
        job.wait(90)
    assert death.rank == 2
    reports = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1, 3)}
    assert not (tmp_path / "rank2.json").exists()
    for position, (rank, report) in enumerate(sorted(reports.items())):
        assert report["rank"] == position
        assert report["world_size"] == report["explicit_group_size"] == 3
        assert report["sum"] == 0 + 1 + 3
        assert report["broadcast"] == 30  # from the group's rank 2: launch rank 3
        assert report["gathered"] == [0.0, 1.0, 3.0]
        assert report["untouched"]
