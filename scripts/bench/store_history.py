"""The etcd cluster's history under a job's heartbeats, with and without the job's compaction.

etcd keeps every revision until the cluster is compacted and counts them against its quota; a
full quota answers every write with "database space exceeded", and the job stops. This runs the
writes of a quiet job, sped up: ``--ranks`` members beating their heartbeat keys
(:class:`~megatron_elaswave.launch.silence.Heartbeat`, one client thread each, as fast as the
cluster answers) on a one-member cluster whose quota is ``--quota-mib``, for ``--seconds``. One
arm never compacts; the other ticks :class:`~megatron_elaswave.launch.etcd_store.HistoryCompaction`
every ``--interval`` seconds, as the lowest running node's launcher does. Each arm reports the
beats written, when (and whether) the quota stopped the writes, and the database size at the end.

    python scripts/bench/store_history.py --ranks 4 --quota-mib 4 --seconds 120 --interval 5
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from datetime import timedelta

from common import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from etcd_cluster import EtcdCluster, etcd_missing  # noqa: E402

import torch.distributed as dist  # noqa: E402

from megatron_elaswave.launch.etcd_store import (  # noqa: E402
    EtcdAddress,
    EtcdStore,
    HistoryCompaction,
)
from megatron_elaswave.launch.keys import heartbeat_key  # noqa: E402
from megatron_elaswave.launch.silence import Heartbeat  # noqa: E402

UNAVAILABLE_S = 2.0
"""How long a refused write is retried before the store counts as lost (the job's is 10 s)."""


def run_arm(ranks: int, quota_bytes: int, seconds: float, interval_s: float | None) -> dict:
    """Beat for ``seconds`` on a fresh cluster; compact every ``interval_s`` (``None``: never)."""
    with EtcdCluster(1, quota_bytes=quota_bytes) as cluster:
        address = EtcdAddress.parse(cluster.url, "history")
        stores = [EtcdStore(address, timedelta(seconds=10), unavailable_s=UNAVAILABLE_S)
                  for _ in range(ranks + 1)]
        beats, stopped, errors = [0] * ranks, threading.Event(), []
        started = time.monotonic()

        def beat(rank: int) -> None:
            heartbeat = Heartbeat(heartbeat_key(rank))
            try:
                while not stopped.is_set():
                    heartbeat.beat(stores[rank])
                    beats[rank] += 1
            except dist.DistStoreError as error:
                errors.append((time.monotonic() - started, str(error).splitlines()[0]))
                stopped.set()

        threads = [threading.Thread(target=beat, args=(rank,)) for rank in range(ranks)]
        for thread in threads:
            thread.start()
        said: list[str] = []
        compaction = None if interval_s is None else HistoryCompaction(interval_s, said.append)
        while time.monotonic() - started < seconds and not stopped.is_set():
            if compaction is not None:
                compaction.tick(stores[ranks], time.monotonic())
            time.sleep(0.1)
        stopped.set()
        for thread in threads:
            thread.join()
        status = cluster.call("maintenance/status", {})
        return {"compaction_interval_s": interval_s, "beats": sum(beats),
                "ran_s": round(time.monotonic() - started, 1),
                "stopped_at_s": round(errors[0][0], 1) if errors else None,
                "error": errors[0][1] if errors else None,
                "db_size_mib": round(int(status["dbSize"]) / 2**20, 2),
                "compaction_said": said}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--quota-mib", type=float, default=4.0)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    missing = etcd_missing()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    quota = int(args.quota_mib * 2**20)
    arms = [run_arm(args.ranks, quota, args.seconds, interval)
            for interval in (None, args.interval)]
    if args.json:
        print(json.dumps(arms, indent=1))
        return 0
    print(f"{args.ranks} ranks beating as fast as a one-member cluster answers, quota "
          f"{args.quota_mib:g} MiB, at most {args.seconds:g} s")
    print("| compaction | beats | stopped by the quota after | database at the end |")
    print("|---|---|---|---|")
    for arm in arms:
        every = ("never" if arm["compaction_interval_s"] is None
                 else f"every {arm['compaction_interval_s']:g} s")
        stop = (f"{arm['stopped_at_s']:g} s ({arm['error']})" if arm["stopped_at_s"] is not None
                else f"not stopped in {arm['ran_s']:g} s")
        print(f"| {every} | {arm['beats']} | {stop} | {arm['db_size_mib']:g} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
