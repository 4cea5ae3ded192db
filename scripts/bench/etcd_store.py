"""The job store on etcd against the TCPStore in node 0's launcher: store latency, and time to
recover from a failure on the same job.

* **Latency.** The calls the runtime makes (``set``, ``get``, ``add``, a read of a counter,
  ``compare_set``, ``check``, ``multi_get`` of 8 keys), each timed ``--calls`` times in a row
  from one client: against a ``TCPStore`` hosted in another process, and against the
  ``EtcdStore`` on a three-member etcd cluster on loopback ports (each write committed by a
  quorum to its disk). Medians in microseconds and their ratio.
* **MTTR.** The job of ``mttr.py`` (a GPT on 8 CPU ranks, TP2 x PP2 x DP2, two nodes of four
  workers, ``--elastic``) loses a rank of node 1 to a SIGKILL once iteration ``--fail-at - 1``
  is recorded; MTTR is the time from the kill to the ``recovery`` record (the broken iteration
  done again), with the store in node 0's launcher and on etcd, arms alternating, and the
  phases of the recovery record beside it. On etcd a third arm loses node 0 as a whole (its
  launcher and workers SIGKILLed), which the TCPStore job cannot survive; its detection is
  bound by ``--node-timeout``.

    python scripts/bench/etcd_store.py --repetitions 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from common import SCRIPTS, demo_corpus, free_port
from mttr import model_flags

sys.path.insert(0, str(SCRIPTS))
from etcd_cluster import EtcdCluster, etcd_missing  # noqa: E402

import torch.distributed as dist  # noqa: E402

from megatron_elaswave.launch.etcd_store import EtcdStore  # noqa: E402
from megatron_elaswave.launch.etcd_address import EtcdAddress  # noqa: E402
from megatron_elaswave.launch.store import read_worker  # noqa: E402

NODES, WORKERS_PER_NODE = 2, 4
NODE_TIMEOUT_S = 2.0
STORE_SERVER = """
import sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
print(store.port, flush=True)
sys.stdin.read()
"""


def time_calls(store, calls: int) -> dict[str, float]:
    """Median microseconds of each kind of call."""
    store.set("counter", "0")
    keys = [f"many/{i}" for i in range(8)]
    store.multi_set(keys, ["x"] * len(keys))
    operations = {
        "set": lambda i: store.set(f"key/{i % 16}", "value"),
        "get": lambda i: store.get("counter"),
        "add": lambda i: store.add("counter", 1),
        "read counter": lambda i: store.add("counter", 0),
        "compare_set": lambda i: store.compare_set(f"once/{i}", "", "mine"),
        "check": lambda i: store.check(["counter"]),
        "multi_get 8": lambda i: store.multi_get(keys),
    }
    medians = {}
    for name, operation in operations.items():
        times = []
        for i in range(calls):
            started = time.perf_counter()
            operation(i)
            times.append(time.perf_counter() - started)
        medians[name] = statistics.median(times) * 1e6
    return medians


def latency(cluster: EtcdCluster, calls: int) -> dict:
    server = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        tcp = time_calls(dist.TCPStore("127.0.0.1", port, is_master=False,
                                       timeout=timedelta(seconds=60)), calls)
    finally:
        server.kill()
        server.wait()
    etcd = time_calls(EtcdStore(EtcdAddress.parse(cluster.url, "latency")), calls)
    return {"tcpstore_us": tcp, "etcd_us": etcd}


class TwoNodeJob:
    """The benchmark's job: two launchers of four workers on this machine."""

    def __init__(self, data: str, workdir: Path, fail_at: int, store: str | None) -> None:
        self.metrics = workdir / "metrics.jsonl"
        self.port, self.run_id = free_port(), f"bench-{os.getpid()}-{time.monotonic_ns()}"
        self.store_url = store
        flags = [*model_flags(data, fail_at + 3), "--elastic",
                 "--elastic-metrics-file", str(self.metrics)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        self.logs = [open(workdir / f"node{node}.log", "w") for node in range(NODES)]
        self.launchers = [
            subprocess.Popen(
                [sys.executable, "-m", "megatron_elaswave.launch.run", f"--nnodes={NODES}",
                 f"--node-rank={node}", f"--nproc-per-node={WORKERS_PER_NODE}",
                 f"--master-port={self.port}", f"--run-id={self.run_id}",
                 f"--node-timeout={NODE_TIMEOUT_S:g}", *([f"--store={store}"] if store else []),
                 str(SCRIPTS / "pretrain_gpt.py"), *flags],
                stdout=self.logs[node], stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
            for node in range(NODES)]

    def store(self):
        if self.store_url:
            return EtcdStore(EtcdAddress.parse(self.store_url, self.run_id))
        return dist.TCPStore("127.0.0.1", self.port, is_master=False,
                             timeout=timedelta(seconds=300))

    def record(self, event: str, matches=lambda record: True, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.metrics.exists():
                for line in self.metrics.read_text().splitlines():
                    record = json.loads(line) if line else {}
                    if record.get("event") == event and matches(record):
                        return record
            if all(launcher.poll() is not None for launcher in self.launchers):
                sys.exit(f"the job ended before its {event} record; see {self.logs[0].name}")
            time.sleep(0.02)
        sys.exit(f"no {event} record within {timeout:g} s; see {self.logs[0].name}")

    def close(self) -> None:
        for launcher in self.launchers:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        for log in self.logs:
            log.close()


def mttr(data: str, fail_at: int, store: str | None, victim: str) -> dict:
    """Seconds from the kill of ``victim`` (``rank`` 6, on node 1, or ``node0``) to the
    recovery record, and the record's phases."""
    with tempfile.TemporaryDirectory(prefix="elaswave-etcd-bench-") as scratch:
        job = TwoNodeJob(data, Path(scratch), fail_at, store)
        try:
            store_client = job.store()
            deadline = time.monotonic() + 600
            while (worker := read_worker(store_client, 6)) is None:
                if time.monotonic() > deadline:
                    sys.exit("rank 6 was never spawned")
                time.sleep(0.05)
            job.record("iteration", lambda record: record["iteration"] == fail_at - 1)
            killed_at = time.time()
            if victim == "node0":
                os.killpg(job.launchers[0].pid, signal.SIGKILL)
            else:
                os.kill(worker.pid, signal.SIGKILL)
            recovery = job.record("recovery")
        finally:
            job.close()
    return {"mttr_s": recovery["time"] - killed_at,
            "phases": {k: v for k, v in recovery.items() if k.endswith("_s")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--fail-at", type=int, default=4)
    parser.add_argument("--skip-mttr", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if (missing := etcd_missing()) is not None:
        print(f"etcd_store.py: error: {missing}", file=sys.stderr)
        return 2
    report: dict = {}
    with EtcdCluster(3) as cluster:
        report["latency"] = latency(cluster, args.calls)
        if not args.skip_mttr:
            data = demo_corpus(Path(tempfile.gettempdir()) / "elaswave-bench-data")
            arms = {"tcpstore": (None, "rank6"), "etcd": (cluster.url, "rank6"),
                    "etcd_node0": (cluster.url, "node0")}
            runs: dict[str, list[dict]] = {arm: [] for arm in arms}
            for _ in range(args.repetitions):
                for arm, (store, victim) in arms.items():
                    runs[arm].append(mttr(data, args.fail_at, store, victim))
            report["mttr"] = runs
    if args.json:
        print(json.dumps(report))
        return 0
    tcp, etcd = report["latency"]["tcpstore_us"], report["latency"]["etcd_us"]
    print(f"Store latency, median of {args.calls} calls (microseconds)")
    print(f"{'call':>14} {'TCPStore':>10} {'etcd':>10} {'etcd/TCPStore':>14}")
    for name in tcp:
        print(f"{name:>14} {tcp[name]:>10.0f} {etcd[name]:>10.0f} {etcd[name] / tcp[name]:>14.1f}")
    if "mttr" in report:
        print()
        print(f"MTTR, {NODES} nodes x {WORKERS_PER_NODE} workers, TP2 x PP2 x DP2 "
              f"(median of {args.repetitions}; seconds)")
        phases = ("detect_s", "agree_s", "comm_s", "migrate_s", "rebuild_s", "first_step_s")
        print(f"{'arm':>11} {'victim':>7} {'MTTR':>6} " + " ".join(f"{p[:-2]:>10}" for p in phases))
        for arm, results in report["mttr"].items():
            victim = arms[arm][1]
            median = statistics.median(r["mttr_s"] for r in results)
            cells = " ".join(f"{statistics.median(r['phases'].get(p, 0.0) for r in results):>10.2f}"
                             for p in phases)
            print(f"{arm:>11} {victim:>7} {median:>6.2f} {cells}")
        tcp_mttr = statistics.median(r["mttr_s"] for r in report["mttr"]["tcpstore"])
        etcd_mttr = statistics.median(r["mttr_s"] for r in report["mttr"]["etcd"])
        print(f"etcd / TCPStore MTTR (rank 6): {etcd_mttr / tcp_mttr:.2f}; with the TCPStore, "
              "losing node 0 ends the job")
    return 0


if __name__ == "__main__":
    sys.exit(main())
