"""The job store's load from failure detection and from a recovery, and how soon a stopped rank
is found, against the number of ranks: the design of this tree (each rank watches two
neighbours, an alert is one counter that each node's launcher reads and relays to its workers)
beside the one it replaced (each rank read every peer's heartbeat, an alert set two keys per
rank), side by side.

Four parts, against real stores on this machine (part 1 also counts the store traffic of one
recovery, :func:`count_recovery`):

1. **Counted.** Real ``FailureMonitor`` objects (``--ranks-counted`` of them, threads of this
   process) watch a quiet job for a few heartbeat periods through a wrapper that counts every
   store request and every key it touches; one alert is raised and counted the same way. The
   old design is counted by the same code run on an older checkout of the package
   (``--old-tree``, a directory holding ``megatron_elaswave/``, e.g. the main branch before the
   change), in a subprocess. These counts check the model below.
2. **Model.** Per heartbeat period (0.5 s) each role makes a fixed list of calls (written out in
   :func:`per_rank_period`); the model multiplies them by the number of ranks, from 1k to 16k,
   with 8 ranks per node.
3. **Measured cost.** Lightweight clients (``--clients`` threads, real ``TCPStore`` calls) play
   the heartbeat period of sampled ranks of an N-rank job against a store, in a process of its
   own, that holds N heartbeat counters; the store process's CPU time is read before and after.
   The store serves one request at a time, so N times its CPU time for one rank's period is the
   store time that one heartbeat period of the whole job needs; where that exceeds the period,
   heartbeats fall behind, and detection of a stopped rank is estimated as the heartbeat timeout
   stretched by that factor, plus one period of the store.
4. **A recovery, measured.** Lightweight clients play, one simulated survivor after another,
   the calls that one real survivor of part 1's counted recovery made (its agreement, its
   meeting, its monitor's beats meanwhile, in order: :func:`time_recovery`), against a job
   store that holds an N-rank job's keys: a ``TCPStore`` process, or a three-member etcd
   cluster with the meeting in a generation's ``TCPStore``, as a job on etcd has it
   (``--recovery-stores``). The stores' CPU time per survivor times the survivors is the store
   time one recovery needs; requests per recovery are the model, the survivors times what one
   made as counted. Torch's own rendezvous of the new groups comes after, on the generation's
   store (gloo: one set and one get per peer and rank).

    python scripts/bench/store_load.py --old-tree /tmp/elaswave-main

Prints one table per part and ``--json`` one object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import timedelta

import torch.distributed as dist

INTERVAL_S = 0.5
"""Heartbeat period of the workers' monitors (``MonitorConfig``'s default)."""
RELAY_S = 0.05
"""How often a launcher of this tree reads the alert count for its workers."""
BACKSTOP_BEATS = 10
"""A monitor of this tree reads the shared state at one beat in this many without an alert."""
TIMEOUT_S = 5.0
"""Heartbeat timeout of the workers (``MonitorConfig``'s default)."""
RANKS_PER_NODE = 8
NODE_TIMEOUT_S = 10.0
NEIGHBOURS = 2
SCALES = (1024, 2048, 4096, 8192, 16384)


class CountingStore:
    """A store that counts, per method, the requests made and the keys they touch. Its clones
    count into the same tallies. With ``calls``, every call is also appended there as
    ``(thread name, role, method, args)``: ``role`` tells the job store's traffic from that of
    a generation's store (:meth:`as_role`)."""

    def __init__(self, store, requests: Counter | None = None, keys: Counter | None = None,
                 calls: list | None = None, role: str = "job"):
        self._store = store
        self.requests = Counter() if requests is None else requests
        self.keys = Counter() if keys is None else keys
        self.calls = calls
        self.role = role
        self._lock = threading.Lock()

    def clone(self) -> CountingStore:
        return CountingStore(self._store.clone(), self.requests, self.keys, self.calls, self.role)

    def as_role(self, role: str) -> CountingStore:
        """The same store and tallies, its calls recorded under ``role``."""
        return CountingStore(self._store, self.requests, self.keys, self.calls, role)

    def __getattr__(self, name: str):
        method = getattr(self._store, name)

        def call(*args):
            touched = len(args[0]) if name in ("multi_get", "multi_set", "check", "wait") else 1
            with self._lock:
                self.requests[name] += 1
                self.keys[name] += touched
                if self.calls is not None:
                    self.calls.append((threading.current_thread().name, self.role, name, args))
            return method(*args)
        return call


def quiet_job(ranks: int) -> tuple[dist.TCPStore, CountingStore, str, list]:
    """``ranks`` real monitors (threads of this process) of a quiet job, started, past their
    first beats and reads, with their store's counts cleared: the store, the counting view they
    call it through, the file through which a launcher relays the alert count to them, and the
    monitors. Runs whichever ``megatron_elaswave`` is imported."""
    from megatron_elaswave.launch.decisions import Decision
    from megatron_elaswave.runtime.monitor import FailureMonitor, MonitorConfig

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    # As under a launcher, which relays the alert count (counted in the model, per node).
    relayed = os.path.join(tempfile.mkdtemp(prefix="store-load-"), "alerts")
    with open(relayed, "w") as out:
        out.write("0")
    os.environ["ELASWAVE_NODE_ALERTS"] = relayed
    counting = CountingStore(server)
    config = MonitorConfig(heartbeat_interval_s=INTERVAL_S, heartbeat_timeout_s=TIMEOUT_S)
    monitors = [FailureMonitor(counting, rank, Decision.initial(ranks), config,
                               on_failure=lambda: None) for rank in range(ranks)]
    for monitor in monitors:
        monitor.start()
    time.sleep(2 * INTERVAL_S)  # first beats and first reads of every key
    counting.requests.clear()
    counting.keys.clear()
    return server, counting, relayed, monitors


def count_design(ranks: int, periods: int) -> dict:
    """Store calls of ``ranks`` real monitors over ``periods`` quiet heartbeat periods, per rank
    and period; and of one alert. Runs whichever ``megatron_elaswave`` is imported."""
    import inspect

    import megatron_elaswave
    from megatron_elaswave.launch.store import raise_alert

    server, counting, _, monitors = quiet_job(ranks)
    time.sleep(periods * INTERVAL_S)  # a whole number of backstop rounds, by default
    requests, keys = sum(counting.requests.values()), sum(counting.keys.values())
    by_call = dict(counting.requests)
    counting.requests.clear()
    counting.keys.clear()
    alerting = CountingStore(server)
    takes_size = len(inspect.signature(raise_alert).parameters) > 1
    for _ in range(2):  # the second alert: the first of the old design sets fewer keys
        alerting.keys.clear()
        raise_alert(alerting, ranks) if takes_size else raise_alert(alerting)
    keys_of_alert = sum(alerting.keys.values())
    for monitor in monitors:
        monitor.stop()
    scale = ranks * periods
    return {"package": os.path.dirname(megatron_elaswave.__file__), "ranks": ranks,
            "requests_per_rank_period": requests / scale, "keys_per_rank_period": keys / scale,
            "calls_per_rank_period": {name: count / scale for name, count in by_call.items()},
            "alert_keys": keys_of_alert}


def count_recovery(ranks: int) -> dict:
    """Store calls of the part of a recovery that goes through the store alone, made by
    ``ranks`` real monitors (threads of this process): rank 1's death is recorded as its
    launcher records it, then every survivor, on a thread of its own, agrees on who failed
    (:func:`~megatron_elaswave.runtime.agreement.agree`) and meets the others before forming the
    new default group, as :func:`~megatron_elaswave.runtime.world.init_generation` does before
    torch's rendezvous. Counted from the death record to the last survivor's meeting."""
    from megatron_elaswave.launch.store import WorkerDeath, record_death
    from megatron_elaswave.runtime.agreement import agree
    from megatron_elaswave.runtime.world import _meet_survivors

    _, counting, relayed, monitors = quiet_job(ranks)
    # On etcd the survivors meet (and their groups form) in a generation's store, not the job
    # store (runtime/generation_store.py): those calls are recorded apart.
    generation = counting.as_role("generation")
    met: dict[int, float] = {}

    def survive(monitor) -> None:
        if not monitor.failure_detected.wait(30):
            return
        decision = agree(counting, monitor)
        _meet_survivors(decision, generation, timedelta(seconds=60), None)
        met[monitor.rank] = time.perf_counter()

    threads = [threading.Thread(target=survive, args=(monitor,), name=f"survivor-{monitor.rank}")
               for monitor in monitors if monitor.rank != 1]
    counting.requests.clear()
    counting.keys.clear()
    calls: list = []
    counting.calls = generation.calls = calls
    started = time.perf_counter()
    record_death(counting, WorkerDeath(rank=1, local_rank=1, node_rank=0, pid=None,
                                       exit_code=None, signal="SIGKILL", cause="signal",
                                       time=time.time()))
    with open(relayed, "w") as out:  # the launcher relays the alert to its workers
        out.write("1")
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    counting.calls = generation.calls = None
    requests, keys = sum(counting.requests.values()), sum(counting.keys.values())
    by_call = dict(counting.requests)
    for monitor in monitors:
        monitor.stop()
    survivors = ranks - 1
    # One survivor's own calls in order (its agreement and meeting, and its monitor's), for
    # the simulated ranks of measure_recoveries to play.
    template = ranks // 2
    own = {f"survivor-{template}", f"elaswave-monitor-{template}"}
    return {"ranks": ranks, "survivors_met": len(met),
            "seconds": max(met.values(), default=started) - started,
            "requests_per_survivor": requests / survivors, "keys_per_survivor": keys / survivors,
            "calls_per_survivor": {name: count / survivors for name, count in by_call.items()},
            "sequence": [(role, name, args) for thread, role, name, args in calls
                         if thread in own]}


def per_rank_period(design: str, ranks: int) -> tuple[float, float]:
    """(requests, keys) of one worker's monitor per quiet heartbeat period."""
    if design == "old":
        # heartbeat add, multi_get of every peer, death count, announcement, decision
        return 5, 4 + (ranks - 1)
    # heartbeat set, multi_get of two neighbours; one beat in BACKSTOP_BEATS: the death and
    # silence counts, the announcement, the decision
    return 2 + 4 / BACKSTOP_BEATS, 1 + NEIGHBOURS + 4 / BACKSTOP_BEATS


def per_launcher_period(design: str, nodes: int) -> float:
    """Requests of the launchers of the whole job per worker heartbeat period (launchers beat
    every ``min(1, node_timeout / 4)`` s)."""
    beats = INTERVAL_S / min(1.0, NODE_TIMEOUT_S / 4)
    if design == "old":  # node 0 reads every node's done and heartbeat; the others beat
        return beats * (2 * (nodes - 1) + 2 * (nodes - 1) + nodes)
    # each: beat, own lost key, node changes, two watched heartbeats, decision; and the alert
    # count every RELAY_S for its workers
    return nodes * (beats * (3 + NEIGHBOURS + 1) + INTERVAL_S / RELAY_S)


def alert_keys(design: str, ranks: int) -> int:
    return 1 + 2 * ranks if design == "old" else 1


def model(ranks: int) -> dict:
    nodes = max(1, ranks // RANKS_PER_NODE)
    row = {"ranks": ranks}
    for design in ("old", "new"):
        requests, keys = per_rank_period(design, ranks)
        launchers = per_launcher_period(design, nodes)
        row[design] = {"requests_per_s": (ranks * requests + launchers) / INTERVAL_S,
                       "keys_per_s": (ranks * keys + launchers) / INTERVAL_S,
                       "alert_keys": alert_keys(design, ranks)}
    return row


STORE_SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
print(store.port, flush=True)
sys.stdin.read()
"""


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_rank_periods(design: str, ranks: int, samples: int, clients: int
                      ) -> tuple[float, float]:
    """(store CPU seconds, wall seconds) that one rank's heartbeat period costs in an N-rank
    job, measured by ``clients`` threads playing ``samples`` periods against a real store run by
    a process of its own."""
    process = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        return _time_rank_periods(design, ranks, samples, clients, process)
    finally:
        process.kill()
        process.wait()


def _time_rank_periods(design: str, ranks: int, samples: int, clients: int,
                       process: subprocess.Popen) -> tuple[float, float]:
    port = int(process.stdout.readline())
    server = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    keys = [f"rt/heartbeat/{rank}" for rank in range(ranks)]
    server.multi_set(keys, ["1"] * ranks)
    for key in ("elaswave/deaths/count", "rt/gen0/silent/count", "rt/join/requests", "rt/alerts"):
        server.add(key, 0)

    def play(store, rank: int) -> None:
        if design == "old":
            store.add(keys[rank], 1)
            store.multi_get(keys[:rank] + keys[rank + 1:])
        else:
            store.set(keys[rank], "2")
            store.multi_get([keys[(rank + 1) % ranks], keys[(rank + 2) % ranks]])
            if rank % RANKS_PER_NODE == 0:  # the node's launcher relays the alert count
                for _ in range(int(INTERVAL_S / RELAY_S)):
                    store.add("rt/alerts", 0)
            if rank % BACKSTOP_BEATS:
                return  # the shared state is read at one beat in BACKSTOP_BEATS
            store.add("rt/gen0/silent/count", 0)
        store.add("elaswave/deaths/count", 0)
        store.check(["rt/gen0/round"])
        store.check(["rt/gen0/decision"])

    stores = [server.clone() for _ in range(clients)]

    def client(index: int) -> None:
        for sample in range(index, samples, clients):
            play(stores[index], sample % ranks)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    cpu, started = cpu_seconds(process.pid), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return (cpu_seconds(process.pid) - cpu) / samples, wall / samples


def measure(scales: tuple[int, ...], clients: int, budget_s: float) -> list[dict]:
    rows = []
    for ranks in scales:
        row = {"ranks": ranks}
        for design in ("old", "new"):
            _, probe = time_rank_periods(design, ranks, 8, clients)  # size the sample
            samples = max(50, min(5000, int(budget_s / max(probe, 1e-6))))
            per_rank, wall = time_rank_periods(design, ranks, samples, clients)
            store_s = per_rank * ranks
            row[design] = {"samples": samples, "rank_period_ms": per_rank * 1000,
                           "client_wall_ms": wall * 1000, "store_s_per_period": store_s,
                           "detection_s": TIMEOUT_S * max(1.0, store_s / INTERVAL_S)
                           + max(INTERVAL_S, store_s)}
        rows.append(row)
    return rows


READS = ("get", "multi_get", "wait")
"""Calls that block on a key that is not set: the simulated store holds every key they read."""


def _read_keys(sequence: list) -> dict[str, set[str]]:
    keys: dict[str, set[str]] = {"job": set(), "generation": set()}
    for role, name, args in sequence:
        if name in READS:
            keys[role].update([args[0]] if name == "get" else args[0])
    return keys


def time_recovery(store: str, ranks: int, sequence: list, samples: int, clients: int) -> dict:
    """Store CPU seconds that one survivor's part of a recovery costs in an N-rank job:
    ``clients`` threads play, ``samples`` times in all, the calls one real survivor made in a
    counted recovery (:func:`count_recovery`: its agreement, its meeting, its monitor's beats
    meanwhile), in order, against stores that hold an N-rank job's heartbeat keys and every key
    the calls read. ``store`` ``tcp``: the job store is a ``TCPStore`` process, and serves the
    meeting too; ``etcd``: the job store is a three-member etcd cluster and the meeting goes to
    a ``TCPStore`` process, as a generation's store."""
    import contextlib

    from megatron_elaswave.launch.etcd_address import EtcdAddress
    from megatron_elaswave.launch.etcd_store import EtcdStore

    with contextlib.ExitStack() as stack:
        process = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        stack.callback(lambda: (process.kill(), process.wait()))
        tcp = dist.TCPStore("127.0.0.1", int(process.stdout.readline()), is_master=False,
                            timeout=timedelta(seconds=60))
        pids = {"generation" if store == "etcd" else "job": [process.pid]}
        job = tcp
        if store == "etcd":
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            from etcd_cluster import EtcdCluster

            cluster = stack.enter_context(EtcdCluster(3))
            job = EtcdStore(EtcdAddress.parse(cluster.url, f"store-load-{ranks}"),
                            timedelta(seconds=60))
            pids["job"] = [member.pid for member in cluster.processes if member is not None]
        stores = {"job": job, "generation": tcp}
        heartbeats = [f"rt/heartbeat/{rank}" for rank in range(ranks)]
        for at in range(0, ranks, 1024):
            job.multi_set(heartbeats[at:at + 1024], ["1"] * len(heartbeats[at:at + 1024]))
        for role, keys in _read_keys(sequence).items():
            if keys:
                stores[role].multi_set(sorted(keys), ["0"] * len(keys))
        clones = [{role: store_.clone() for role, store_ in stores.items()}
                  for _ in range(clients)]

        def client(index: int) -> None:
            for _ in range(index, samples, clients):
                for role, name, args in sequence:
                    getattr(clones[index][role], name)(*args)

        def cpu() -> dict[str, float]:
            return {role: sum(cpu_seconds(pid) for pid in role_pids)
                    for role, role_pids in pids.items()}

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        before, started = cpu(), time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        after = cpu()
    return {role: (after[role] - before[role]) / samples for role in pids} | {
        "client_wall_s": wall / samples}


def measure_recoveries(scales: tuple[int, ...], sequence: list, stores: tuple[str, ...],
                       clients: int, budget_s: float) -> list[dict]:
    """:func:`time_recovery` at each scale and store; a recovery's store time is that of one
    survivor times the survivors, as the store serves one request at a time."""
    rows = []
    for ranks in scales:
        row = {"ranks": ranks}
        for store in stores:
            probe = time_recovery(store, ranks, sequence, 2, 1)["client_wall_s"]
            samples = max(20, min(2000, int(budget_s / max(probe, 1e-6))))
            per_survivor = time_recovery(store, ranks, sequence, samples, clients)
            row[store] = {"samples": samples, **{
                f"{role}_s_per_recovery": per_survivor[role] * (ranks - 1)
                for role in ("job", "generation") if role in per_survivor}}
        rows.append(row)
    return rows


def count_old(old_tree: str, ranks: int, periods: int) -> dict:
    """:func:`count_design` run on the package at ``old_tree``, in a subprocess."""
    code = (f"import sys, json; sys.path.insert(0, {old_tree!r}); "
            f"sys.path.insert(1, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import store_load; print(json.dumps(store_load.count_design({ranks}, {periods})))")
    env = {**os.environ, "PYTHONPATH": old_tree, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=600, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-tree", help="a checkout of the package before the change, to "
                        "count the old design's calls with its own code")
    parser.add_argument("--ranks-counted", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--periods", type=int, default=6)
    parser.add_argument("--scales", type=int, nargs="+", default=list(SCALES))
    parser.add_argument("--clients", type=int, default=2, help="client threads (the machine's "
                        "cores: the store server is one more thread)")
    parser.add_argument("--budget-s", type=float, default=3.0,
                        help="seconds of measurement per design and scale")
    parser.add_argument("--ranks-recovering", type=int, nargs="+", default=[16, 64],
                        help="job sizes whose store traffic of one recovery is counted")
    parser.add_argument("--recovery-stores", nargs="+", choices=("tcp", "etcd"),
                        default=None, help="job stores whose time per recovery part 4 measures "
                        "(default: both, etcd where it is installed)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    stores = tuple(args.recovery_stores or (("tcp", "etcd") if shutil.which("etcd") else ("tcp",)))

    counted = []
    for ranks in args.ranks_counted:
        entry = {"ranks": ranks, "new": count_design(ranks, args.periods)}
        if args.old_tree:
            entry["old"] = count_old(args.old_tree, ranks, args.periods)
        counted.append(entry)
    recoveries = [count_recovery(ranks) for ranks in args.ranks_recovering]
    modelled = [model(ranks) for ranks in args.scales]
    measured = measure(tuple(args.scales), args.clients, args.budget_s)
    template = recoveries[-1]
    recovering = measure_recoveries(tuple(args.scales), template.pop("sequence"), stores,
                                    args.clients, args.budget_s)
    for row in recoveries[:-1]:
        del row["sequence"]
    if args.json:
        print(json.dumps({"counted": counted, "recoveries": recoveries, "model": modelled,
                          "measured": measured, "recovering": recovering}))
        return 0

    print("1. Counted: store calls of real monitors per rank and heartbeat period "
          f"({args.periods} quiet periods of {INTERVAL_S:g} s), and keys one alert writes")
    print(f"{'ranks':>6} {'design':>6} {'requests':>9} {'model':>7} {'keys':>8} {'model':>7} "
          f"{'alert keys':>10} {'model':>6}")
    for entry in counted:
        for design in ("old", "new"):
            if design not in entry:
                continue
            got, (requests, keys) = entry[design], per_rank_period(design, entry["ranks"])
            print(f"{entry['ranks']:>6} {design:>6} {got['requests_per_rank_period']:>9.2f} "
                  f"{requests:>7.2f} {got['keys_per_rank_period']:>8.2f} {keys:>7.2f} "
                  f"{got['alert_keys']:>10} {alert_keys(design, entry['ranks']):>6}")
    print()
    print("1b. Counted: store calls of one recovery (rank 1 SIGKILLed) per survivor, from the "
          "death record to the survivors' meeting before the new group (agreement and meeting; "
          "torch's own rendezvous of the group comes after, one set and one get per peer on gloo)")
    print(f"{'ranks':>6} {'met':>5} {'seconds':>8} {'requests':>9} {'keys':>8}  calls")
    for row in recoveries:
        calls = ", ".join(f"{name} {count:.1f}" for name, count in
                          sorted(row["calls_per_survivor"].items(), key=lambda kv: -kv[1]))
        print(f"{row['ranks']:>6} {row['survivors_met']:>5} {row['seconds']:>8.3f} "
              f"{row['requests_per_survivor']:>9.1f} {row['keys_per_survivor']:>8.1f}  {calls}")
    print()
    print(f"2. Model: store load of failure detection, {RANKS_PER_NODE} ranks per node")
    print(f"{'ranks':>6} {'old req/s':>11} {'new req/s':>10} {'old keys/s':>12} "
          f"{'new keys/s':>11} {'keys old/new':>12} {'alert keys old':>14} {'new':>4}")
    for row in modelled:
        old, new = row["old"], row["new"]
        print(f"{row['ranks']:>6} {old['requests_per_s']:>11.3g} {new['requests_per_s']:>10.3g} "
              f"{old['keys_per_s']:>12.3g} {new['keys_per_s']:>11.3g} "
              f"{old['keys_per_s'] / new['keys_per_s']:>12.1f} {old['alert_keys']:>14} "
              f"{new['alert_keys']:>4}")
    print()
    print(f"3. Measured: store time of one heartbeat period of the whole job ({args.clients} "
          f"client threads, real TCPStore); detection of a stopped rank ({TIMEOUT_S:g} s "
          "timeout) where the store falls behind")
    print(f"{'ranks':>6} {'old ms/rank':>11} {'new ms/rank':>11} {'old s/period':>12} "
          f"{'new s/period':>12} {'old/new':>8} {'old detect s':>12} {'new detect s':>12}")
    for row in measured:
        old, new = row["old"], row["new"]
        print(f"{row['ranks']:>6} {old['rank_period_ms']:>11.3f} {new['rank_period_ms']:>11.3f} "
              f"{old['store_s_per_period']:>12.3f} {new['store_s_per_period']:>12.3f} "
              f"{old['store_s_per_period'] / new['store_s_per_period']:>8.1f} "
              f"{old['detection_s']:>12.1f} {new['detection_s']:>12.1f}")
    print()
    per_survivor = template["requests_per_survivor"]
    print(f"4. Measured: store time of one recovery (simulated survivors, {args.clients} client "
          f"threads, each playing the calls of survivor {template['ranks'] // 2} of the "
          f"{template['ranks']}-rank recovery counted in 1b); on etcd the survivors meet in a "
          "generation's TCPStore. Requests per recovery: the model, "
          f"{per_survivor:.1f} per survivor as counted")
    header = f"{'ranks':>6} {'requests':>9}"
    for store in stores:
        header += f" {store + ' job s':>11}" + (f" {'gen s':>7}" if store == "etcd" else "")
    print(header)
    for row in recovering:
        line = f"{row['ranks']:>6} {per_survivor * (row['ranks'] - 1):>9.0f}"
        for store in stores:
            line += f" {row[store]['job_s_per_recovery']:>11.3f}"
            if store == "etcd":
                line += f" {row[store]['generation_s_per_recovery']:>7.3f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
