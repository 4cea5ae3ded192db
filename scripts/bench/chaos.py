"""Chaos soak: one long ``--elastic`` run under ``elaswave-run --rejoin``, hit by random faults.

Two launchers of four workers each (TP2 x PP2 x DP2, a small GPT on mock data; ``--sizes``
gives more workers per node, the data-parallel width growing with them) train while the
soak sends, at random moments (seeded), faults drawn from:

* ``kill``: SIGKILL of one worker;
* ``stop``: SIGSTOP of one worker, never resumed: the job excludes it after the heartbeat
  timeout and its launcher ends it;
* ``recovery-kill``: SIGKILL of one worker, then of another of its node 0 to 0.5 s after the
  launcher recorded the first death, while the survivors recover;
* ``burst``: 2 to 4 workers of one node SIGKILLed within one second;
* ``node``: node 1's launcher SIGKILLed with its workers; a new launcher takes its place;
* ``join-kill``: SIGKILL of one worker, then of another of the job as soon as the first one's
  replacement asks to join (its request is in the store): a failure while a rank joins;
* ``grow-kill``: SIGKILL of one worker, then of another as soon as the job records the grow that
  took its replacement back in (the damaged replica's layers move back at that step boundary):
  a failure right after a layer move;
* ``consecutive``: SIGKILL of one worker, then of another as soon as the job records the
  recovery from the first: failures in consecutive iterations;
* ``save-kill``: SIGKILL of one worker as soon as a periodic checkpoint starts to be written
  (its ``.partial`` directory appears; the job saves every ``SAVE_INTERVAL`` iterations): a
  failure during a save, which must never leave the tracker naming a partial checkpoint;
* ``node0`` (with ``--store etcd`` only): node 0's launcher SIGKILLed with its workers; a new
  launcher takes its place. With the job store in node 0's launcher (the default) this ends the
  job; with ``--store etcd`` the soak starts a three-member etcd cluster on loopback ports
  (``scripts/etcd_cluster.py``) and keeps the job store there, and node 0 is lost like node 1.

The first faults are every kind once, in a seeded order; the rest are drawn at random. Every
dead worker is started again (``--rejoin``) and joins at a step boundary. Before the next
fault the soak waits until the job runs on all its ranks again, then a random number of
iterations. After the last fault the job trains a few iterations on every rank and the soak
stops it; the failure-free run of the same flags, up to the same iteration, is the reference:
every iteration must be recorded exactly once, with the same samples and a loss on the
failure-free trajectory: within 1e-4 of the reference, or, where the reference itself drifts
further, within twice what a second failure-free run on another parallel layout (TP2 x PP1 x DP4,
the same samples) differs from it in the same window of iterations. Summing gradients in another
order (micro-batches dealt differently, another data-parallel width) changes the loss in its
last digits, and over a thousand Adam steps that grows past 1e-4 with no failure at all.

Prints the faults injected, recoveries, grows, clean stops, samples lost, the largest relative
loss difference, and the MTTR (from the fault's first signal to the recovery record of its last
victim: the first step after the recovery done) median, p90 and max per fault kind;
``--json-out`` writes them as JSON, ``--json`` prints them as the last line. Exit status 1, with
the reasons on stderr, when a sample was lost, the trajectory left the reference, a fault was
never recovered from, the job ended before every fault was sent, or the checkpoint its tracker
names at the end is not complete.

    python scripts/bench/chaos.py --faults 50 --seed 1 --json-out chaos.json
    python scripts/bench/chaos.py --faults 18 --seed 1 --store etcd    # node0 faults too
    python scripts/bench/chaos.py --faults 10 --seed 1206 --compare-stores

``--compare-stores`` runs the same seeded soak on both stores, one after the other (each with its
references, logs under ``tcp/`` and ``etcd/``), and ends with one table of the MTTR per fault
kind on each and their ratio; ``--json-out`` then holds both summaries. ``--sizes 8,16`` does the
same at two job sizes on one store (logs under ``ranks8/`` and ``ranks16/``):

    python scripts/bench/chaos.py --kinds kill --faults 6 --seed 1 --sizes 8,16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from common import SCRIPTS, free_port

from megatron_elaswave.launch.keys import join_key, node_lost_key
from megatron_elaswave.launch.store import WorkerDeath, read_deaths, read_worker
from megatron_elaswave.metrics import MetricsFollower, read_metrics
from megatron_elaswave.training.checkpointing.checkpoint import latest_complete

NODES = 2
PER_NODE = 4
"""Workers per node unless ``--sizes`` says otherwise."""
KINDS = ("kill", "stop", "recovery-kill", "burst", "node", "join-kill", "grow-kill", "consecutive",
         "save-kill")
ETCD_KINDS = (*KINDS, "node0")
"""The kinds a soak with the job store on etcd draws from: node 0 can be lost too."""
SECOND_KILL = {"join-kill", "grow-kill", "consecutive"}
"""The kinds that SIGKILL a second worker at a moment the first one's handling reports."""
LOSS_TOLERANCE = 1e-4
OTHER_LAYOUT = {"--pipeline-model-parallel-size": "1"}
"""The failure-free run that measures how far summation order alone moves the loss: TP2 x PP1 x
DP4, on the same samples in the same order."""
DRIFT_WINDOW = 100
"""Iterations per window in which the two failure-free runs' largest difference is taken."""
DRIFT_MARGIN = 2.0
"""How much further than the other layout the soak may drift in a window (where that exceeds
``LOSS_TOLERANCE``)."""
HEARTBEAT_TIMEOUT_S = 3.0
NODE_TIMEOUT_S = 10.0
"""``--node-timeout``, its default: a node whose launcher is SIGKILLed is declared lost by its
watcher's connection to it at once, without waiting for its heartbeat's silence."""
ITERATIONS_PER_FAULT = 150
"""Training iterations budgeted per fault: the replacement's start (imports) dominates. The
soak stops the job once every fault is recovered from, so the budget only sets the schedule."""
REFERENCE_START_S, REFERENCE_ITERATION_S = 300.0, 5.0
"""Bound on the failure-free run: start-up, then per iteration (about 0.3 s here)."""
REJOIN_DELAY_S = 0.2
"""Seconds between a worker's death and the start of its replacement (``elaswave-run
--rejoin-delay``). On this machine the replacement starts on the cores the survivors recover on."""
TRAILING_ITERATIONS = 5
"""Iterations trained on every rank after the last fault, before the soak stops the job."""
SAVE_INTERVAL = 10
"""The soak's job saves a durable checkpoint every this many iterations (``--save-interval``)."""


def model_flags(train_iters: int, layout: dict[str, str] | None = None) -> list[str]:
    flags = [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
        "--train-iters", str(train_iters), "--lr", "1e-3", "--seed", "1234",
        "--mock-data", "--vocab-size", "511", "--use-distributed-optimizer",
        "--untie-embeddings-and-output-weights", "--log-interval", "1000",
        "--eval-interval", "100000", "--elastic", "--elastic-rebalance-window", "0",
        "--elastic-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
    ]
    for flag, value in (layout or {}).items():
        flags[flags.index(flag) + 1] = value
    return flags


@dataclass
class Fault:
    kind: str
    victims: list[int]
    started: float
    """Wall-clock time of the fault's first signal."""
    mttr_s: float | None = None
    death_recorded_s: float | None = None
    """From the first signal to the first death record of a victim (its launcher's)."""
    breakdowns: list[dict] = field(default_factory=list)
    """The phase times (``*_s``) of the recoveries attributed to it."""


class Node:
    """One node's launcher, started in a session of its own."""

    def __init__(self, node_rank: int, port: int, flags: list[str], workdir: Path,
                 rejoin_delay_s: float, rejoin_node: bool = False,
                 store: tuple[str, str] | None = None, per_node: int = PER_NODE) -> None:
        """``store``: the etcd URL and run id of a job whose store is on etcd."""
        name = f"node{node_rank}{'-replacement' if rejoin_node else ''}"
        self.log = open(workdir / f"{name}.log", "a")
        etcd = [f"--store={store[0]}", f"--run-id={store[1]}"] if store else []
        command = [sys.executable, "-m", "megatron_elaswave.launch.run", f"--nproc-per-node={per_node}",
                   f"--nnodes={NODES}", f"--node-rank={node_rank}", f"--master-port={port}",
                   f"--node-timeout={NODE_TIMEOUT_S:g}", "--rejoin", *etcd,
                   f"--rejoin-delay={rejoin_delay_s:g}", "--max-rejoins=1000",
                   str(SCRIPTS / "pretrain_gpt.py"), *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        """SIGTERM to the launcher and its workers; SIGKILL if they outlive its grace period."""
        stop(self.process)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@dataclass
class Soak:
    workdir: Path
    metrics: Path
    port: int
    flags: list[str]
    rng: random.Random
    rejoin_delay_s: float
    etcd: tuple[str, str] | None = None
    """The etcd URL and run id, when the job store is on etcd."""
    per_node: int = PER_NODE
    nodes: list[Node] = field(default_factory=list)
    _store: object = None
    _follower: MetricsFollower = field(init=False)

    def __post_init__(self) -> None:
        # The soak polls the records every 50 ms: parsing the whole file each time took enough
        # of the two cores to starve the replacements starting beside the job.
        self._follower = MetricsFollower(self.metrics)

    def records(self) -> list[dict]:
        """The job's records so far, read as the file grows."""
        return self._follower.poll()

    def store(self):
        from torch.distributed import TCPStore

        if self._store is None and self.etcd is not None:
            from megatron_elaswave.launch.etcd_address import EtcdAddress
            from megatron_elaswave.launch.etcd_store import EtcdStore

            self._store = EtcdStore(EtcdAddress.parse(*self.etcd), timedelta(seconds=30))
        if self._store is None:
            self._store = TCPStore("127.0.0.1", self.port, is_master=False,
                                   timeout=timedelta(seconds=30))
        return self._store

    def node(self, node_rank: int, rejoin_node: bool = False) -> Node:
        return Node(node_rank, self.port, self.flags, self.workdir, self.rejoin_delay_s,
                    rejoin_node, self.etcd, self.per_node)

    @property
    def ranks(self) -> int:
        return NODES * self.per_node

    def iterations(self) -> list[dict]:
        return [r for r in self.records() if r["event"] == "iteration"]

    def running(self) -> bool:
        return any(node.process.poll() is None for node in self.nodes)

    def wait(self, condition, timeout: float) -> bool:
        """Whether ``condition`` came true within ``timeout`` while the job runs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.running():
            if condition():
                return True
            time.sleep(0.05)
        return False

    def recoveries(self) -> int:
        return sum(r["event"] == "recovery" for r in self.records())

    def whole(self) -> bool:
        """Whether the job runs on every rank again: its last iteration came after every
        recovery and grow, on all ranks."""
        records = self.records()
        changes = [r["time"] for r in records if r["event"] in ("recovery", "grow")]
        last = next((r for r in reversed(records) if r["event"] == "iteration"), None)
        return (last is not None and last["world_size"] == self.ranks
                and last["time"] > max(changes, default=0.0))

    def deaths(self, known: list[WorkerDeath]) -> list[WorkerDeath]:
        """Every death recorded so far; ``known`` once the job, and its store, are gone."""
        try:
            return read_deaths(self.store()) if self.running() else known
        except RuntimeError:  # the store went away meanwhile
            return known

    def pid(self, rank: int) -> int:
        return read_worker(self.store(), rank).pid

    def saves_started(self) -> set[str]:
        """The directories of the checkpoints whose writing has started (``.partial``) so far."""
        return {path.name for path in (self.workdir / "checkpoints").glob("iter_*.partial*")}

    def inject(self, kind: str) -> Fault:
        """Inject one fault of ``kind``. The victims' pids are read from the store first: the
        fault's clock starts at its first signal, not at the soak's own look-ups (the first one
        imports torch, seconds on this machine)."""
        node = self.rng.randrange(NODES)
        ranks = list(range(node * self.per_node, (node + 1) * self.per_node))
        if kind in ("kill", "stop"):
            victims = [self.rng.choice(ranks)]
        elif kind == "recovery-kill":
            victims = self.rng.sample(ranks, 2)
        elif kind in SECOND_KILL:
            victims = self.rng.sample(range(self.ranks), 2)
        elif kind == "save-kill":
            victims = [self.rng.randrange(self.ranks)]
        elif kind == "burst":
            victims = self.rng.sample(ranks, self.rng.randint(2, 4))
        else:
            lost = 0 if kind == "node0" else 1
            victims = list(range(lost * self.per_node, (lost + 1) * self.per_node))
        pids = [self.pid(rank) for rank in victims] if kind not in ("node", "node0") else []
        deaths = len(read_deaths(self.store())) if kind == "recovery-kill" else 0
        records = len(self.records())
        if kind == "save-kill":
            saves = self.saves_started()
            self.wait(lambda: self.saves_started() - saves, 120)
        started = time.time()
        if kind in ("kill", "stop", "save-kill"):
            send(pids[0], signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
        elif kind == "recovery-kill":
            send(pids[0], signal.SIGKILL)
            self.wait(lambda: len(read_deaths(self.store())) > deaths, 10)
            time.sleep(self.rng.uniform(0.0, 0.5))
            send(pids[1], signal.SIGKILL)
        elif kind in SECOND_KILL:
            send(pids[0], signal.SIGKILL)
            if kind == "join-kill":
                self.wait(lambda: self.store().check([join_key(victims[0])]), 60)
            else:
                event = "grow" if kind == "grow-kill" else "recovery"
                self.wait(lambda: any(r["event"] == event for r in self.records()[records:]), 120)
            send(pids[1], signal.SIGKILL)
        elif kind == "burst":
            gaps = sorted(self.rng.uniform(0.0, 1.0) for _ in victims)
            for pid, at in zip(pids, gaps):
                time.sleep(max(0.0, started + at - time.time()))
                send(pid, signal.SIGKILL)
        else:
            lost = 0 if kind == "node0" else 1
            self.nodes[lost].kill()
            self.wait(lambda: self.store().check([node_lost_key(lost)]), NODE_TIMEOUT_S + 30)
            self.nodes[lost] = self.node(lost, rejoin_node=True)
        return Fault(kind, sorted(victims), started)


def send(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it died of another fault meanwhile
        pass


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def run_soak(faults: int, seed: int, kinds: tuple[str, ...], workdir: Path,
             rejoin_delay_s: float = REJOIN_DELAY_S, etcd: str | None = None,
             per_node: int = PER_NODE) -> tuple[list[Fault], list[dict], list[WorkerDeath], str]:
    train_iters = ITERATIONS_PER_FAULT * faults + 50
    metrics = workdir / "soak.jsonl"
    port = free_port()
    flags = [*model_flags(train_iters), "--elastic-metrics-file", str(metrics),
             "--save", str(workdir / "checkpoints"), "--save-interval", str(SAVE_INTERVAL)]
    soak = Soak(workdir, metrics, port, flags, random.Random(seed), rejoin_delay_s,
                None if etcd is None else (etcd, f"chaos-seed{seed}-{os.getpid()}"), per_node)
    soak.nodes = [soak.node(rank) for rank in range(NODES)]
    order = soak.rng.sample(kinds, len(kinds))  # every kind once first, in a seeded order
    injected: list[Fault] = []
    deaths: list[WorkerDeath] = []
    try:
        soak.wait(lambda: len(soak.iterations()) >= 5, 300)
        for _ in range(faults):
            if not soak.wait(soak.whole, 300):
                break
            start = soak.iterations()[-1]["iteration"]
            gap = soak.rng.randint(2, 10)
            if not soak.wait(lambda: soak.iterations()[-1]["iteration"] >= start + gap, 120):
                break
            recovered = soak.recoveries()
            injected.append(soak.inject(order[len(injected)] if len(injected) < len(order)
                                        else soak.rng.choice(kinds)))
            # The fault's recovery first: until then the job still looks whole.
            soak.wait(lambda: soak.recoveries() > recovered, 60)
            print(f"  fault {len(injected)}: {injected[-1].kind} of ranks {injected[-1].victims}",
                  flush=True)
            deaths = soak.deaths(deaths)
        # The soak ends once the last fault is recovered from and the job is whole again.
        soak.wait(soak.whole, 300)
        if soak.iterations():
            end = soak.iterations()[-1]["iteration"] + TRAILING_ITERATIONS
            soak.wait(lambda: soak.iterations()[-1]["iteration"] >= end, 120)
        deaths = soak.deaths(deaths)
    finally:
        stopping = time.time()
        for node in reversed(soak.nodes):  # node 0, which hosts the store, last
            node.stop()
    # Stopping node 1 first is no fault: the recovery the others may begin is not one from the
    # last fault.
    records = [r for r in read_metrics(str(metrics))
               if r["event"] not in ("recovery", "grow") or r["time"] < stopping]
    return injected, records, deaths, "".join(
        path.read_text() for path in sorted(workdir.glob("node*.log")))


def reference_run(train_iters: int, until: int, workdir: Path, name: str = "reference",
                  layout: dict[str, str] | None = None, ranks: int = NODES * PER_NODE
                  ) -> list[dict]:
    """Iterations 1 to ``until`` of the failure-free run of a ``train_iters`` job on ``ranks``
    (on the soak's layout unless ``layout`` changes some of its flags)."""
    metrics = workdir / f"{name}.jsonl"
    command = [sys.executable, "-m", "megatron_elaswave.launch.run", f"--nproc-per-node={ranks}",
               f"--master-port={free_port()}", str(SCRIPTS / "pretrain_gpt.py"),
               *model_flags(train_iters, layout), "--elastic-metrics-file", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(workdir / f"{name}.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        deadline = time.monotonic() + REFERENCE_START_S + REFERENCE_ITERATION_S * until
        try:
            while process.poll() is None and time.monotonic() < deadline:
                done = read_metrics(str(metrics), "iteration") if metrics.exists() else []
                if done and done[-1]["iteration"] >= until:
                    break
                time.sleep(0.5)
        finally:
            stop(process)
    iterations = read_metrics(str(metrics), "iteration") if metrics.exists() else []
    if not iterations or iterations[-1]["iteration"] < until:
        sys.exit(f"the failure-free run ended before iteration {until}:\n"
                 f"{(workdir / f'{name}.log').read_text()[-3000:]}")
    return [r for r in iterations if r["iteration"] <= until]


def attribute(faults: list[Fault], recoveries: list[dict], deaths: list[WorkerDeath]) -> None:
    """Each fault's MTTR: to the recovery record of its last victim after it started; and when
    a launcher first recorded a victim's death."""
    for index, fault in enumerate(faults):
        until = faults[index + 1].started if index + 1 < len(faults) else float("inf")
        recorded = [d.time for d in deaths
                    if d.rank in fault.victims and fault.started <= d.time < until]
        if recorded:
            fault.death_recorded_s = min(recorded) - fault.started
        mine = [r for r in recoveries if fault.started <= r["time"] < until
                and set(r["failed_ranks"]) & set(fault.victims)]
        covered = {rank for r in mine for rank in r["failed_ranks"]}
        if mine and set(fault.victims) <= covered:
            fault.mttr_s = max(r["time"] for r in mine) - fault.started
        fault.breakdowns = [{key: value for key, value in r.items() if key.endswith("_s")}
                            for r in mine]


def tracked_checkpoint(checkpoints: Path) -> str | None:
    """What is wrong with the checkpoint the tracker in ``checkpoints`` names, if anything: it
    must be a complete one (renamed from its ``.partial`` directory, with its metadata)."""
    latest = latest_complete(str(checkpoints))
    if latest is None:
        return f"the tracker in {checkpoints} names no checkpoint"
    directory = Path(latest[1])
    if not all((directory / name).is_file() for name in ("metadata.json", "common.pt")):
        return f"the tracker names {directory.name}, which is not a complete checkpoint"
    return None


def relative_differences(run: list[dict], reference: list[dict]) -> dict[int, float]:
    """Per iteration of both: the relative difference of ``run``'s loss from ``reference``'s."""
    losses = {r["iteration"]: r["lm_loss"] for r in run}
    return {r["iteration"]: abs(losses[r["iteration"]] - r["lm_loss"]) / abs(r["lm_loss"])
            for r in reference if r["iteration"] in losses}


def off_trajectory(differences: dict[int, float], floor: dict[int, float]) -> list[int]:
    """The iterations whose difference exceeds both ``LOSS_TOLERANCE`` and ``DRIFT_MARGIN``
    times the largest difference of the other layout's run (``floor``) in their window."""
    window_floor: dict[int, float] = {}
    for iteration, difference in floor.items():
        window = iteration // DRIFT_WINDOW
        window_floor[window] = max(window_floor.get(window, 0.0), difference)
    return [iteration for iteration, difference in sorted(differences.items())
            if difference > max(LOSS_TOLERANCE,
                                DRIFT_MARGIN * window_floor.get(iteration // DRIFT_WINDOW, 0.0))]


def summarise(faults: list[Fault], records: list[dict], deaths: list[WorkerDeath],
              reference: list[dict], other_layout: list[dict], output: str,
              checkpoints: Path) -> dict:
    iterations = [r for r in records if r["event"] == "iteration"]
    recoveries = [r for r in records if r["event"] == "recovery"]
    attribute(faults, recoveries, deaths)
    seen = [r["iteration"] for r in iterations]
    by_iteration = {r["iteration"]: r for r in iterations}
    gbs = reference[0]["global_batch_size"]
    missing = sorted({r["iteration"] for r in reference} - set(seen))
    repeated = sorted({i for i in seen if seen.count(i) > 1})
    other_samples = [ref["iteration"] for ref in reference if ref["iteration"] in by_iteration
                     and by_iteration[ref["iteration"]]["samples_digest"] != ref["samples_digest"]]
    differences = relative_differences(iterations, reference)
    floor = relative_differences(other_layout, reference)
    off = off_trajectory(differences, floor)
    lost = gbs * (len(missing) + len(seen) - len(set(seen)) + len(other_samples))
    mttr = {}
    kinds = ETCD_KINDS if any(f.kind == "node0" for f in faults) else KINDS
    for kind in kinds:
        values = [f.mttr_s for f in faults if f.kind == kind and f.mttr_s is not None]
        if values:
            mttr[kind] = {"count": len(values), "median_s": statistics.median(values),
                          "p90_s": percentile(values, 0.9), "max_s": max(values)}
    return {
        "faults": len(faults),
        "faults_per_kind": {kind: sum(f.kind == kind for f in faults) for kind in kinds},
        "faults_without_recovery": [(f.kind, f.victims) for f in faults if f.mttr_s is None],
        "recoveries": len(recoveries),
        "grows": sum(r["event"] == "grow" for r in records),
        "clean_stops": output.count("cannot continue"),
        "iterations": len(reference),
        "samples_lost": lost,
        "iterations_missing": missing,
        "iterations_recorded_twice": repeated,
        "iterations_on_other_samples": other_samples,
        "largest_relative_loss_difference": max(differences.values(), default=0.0),
        "other_layout_largest_relative_loss_difference": max(floor.values(), default=0.0),
        "iterations_off_trajectory": off,
        "on_trajectory": lost == 0 and not off,
        "tracked_checkpoint_problem": tracked_checkpoint(checkpoints),
        "mttr": mttr,
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        "node_timeout_s": NODE_TIMEOUT_S,
        "fault_log": [{"kind": f.kind, "victims": f.victims, "mttr_s": f.mttr_s,
                       "death_recorded_s": f.death_recorded_s, "recoveries": f.breakdowns}
                      for f in faults],
    }


def soak(args: argparse.Namespace, kinds: tuple[str, ...], store: str, workdir: Path,
         ranks: int = NODES * PER_NODE) -> tuple[dict, list[str]]:
    """One soak on ``ranks`` (over two nodes) with the job store ``store`` (``tcp`` or
    ``etcd``) and its two failure-free references; prints its summary and returns it with what
    went wrong."""
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"soak: {args.faults} faults, seed {args.seed}, {ranks} ranks, store {store}, logs in "
          f"{workdir}", flush=True)
    with contextlib.ExitStack() as stack:
        etcd = None
        if store == "etcd":
            sys.path.insert(0, str(SCRIPTS))
            from etcd_cluster import EtcdCluster

            etcd = stack.enter_context(EtcdCluster(3)).url
        faults, records, deaths, output = run_soak(args.faults, args.seed, kinds, workdir,
                                                   args.rejoin_delay, etcd, ranks // NODES)
    print("failure-free reference run", flush=True)
    trained = max((r["iteration"] for r in records if r["event"] == "iteration"), default=0)
    reference = reference_run(ITERATIONS_PER_FAULT * args.faults + 50, trained, workdir,
                              ranks=ranks)
    print("failure-free run on another layout (summation order)", flush=True)
    other_layout = reference_run(ITERATIONS_PER_FAULT * args.faults + 50, trained, workdir,
                                 "other-layout", OTHER_LAYOUT, ranks)
    summary = summarise(faults, records, deaths, reference, other_layout, output,
                        workdir / "checkpoints")
    print(f"faults injected: {summary['faults']} {summary['faults_per_kind']}")
    print(f"recoveries: {summary['recoveries']}, grows: {summary['grows']}, "
          f"clean stops: {summary['clean_stops']}")
    print(f"samples lost: {summary['samples_lost']}; largest relative loss difference from the "
          f"failure-free run: {summary['largest_relative_loss_difference']:.2e} over "
          f"{summary['iterations']} iterations (a failure-free run on TP2 x PP1 x "
          f"DP{ranks // 2}: "
          f"{summary['other_layout_largest_relative_loss_difference']:.2e})")
    for kind, figures in summary["mttr"].items():
        print(f"  MTTR {kind:14s} n={figures['count']:3d}  median {figures['median_s']:.2f} s  "
              f"p90 {figures['p90_s']:.2f} s  max {figures['max_s']:.2f} s")
    problems = [f"{store}: {name.replace('_', ' ')}: {summary[name]}" for name in (
        "iterations_missing", "iterations_recorded_twice", "iterations_on_other_samples",
        "iterations_off_trajectory", "tracked_checkpoint_problem") if summary[name]]
    if summary["faults_without_recovery"]:
        problems.append(f"{store}: faults with no recovery record: "
                        f"{summary['faults_without_recovery']}")
    if summary["faults"] < args.faults:
        problems.append(f"{store}: only {summary['faults']} of {args.faults} faults injected: the "
                        "job did not run on every rank again, or ended, before the next one")
    return summary, problems


def comparison(first: tuple[str, dict], second: tuple[str, dict]) -> list[str]:
    """The rows of a table of MTTR per fault kind in two soaks, each ``(name, mttr figures)``:
    median (n) and p90 of each, and the ratio of the second's median to the first's; a kind
    measured in one soak only has a row without the ratio."""
    (name_a, a), (name_b, b) = first, second
    rows = [f"| fault kind | {name_a} median (n; p90) | {name_b} median (n; p90) | "
            f"{name_b} / {name_a} |", "|---|---|---|---|"]
    for kind in [kind for kind in ETCD_KINDS if kind in a or kind in b]:
        cells = [f"{runs[kind]['median_s']:.2f} s ({runs[kind]['count']}; "
                 f"{runs[kind]['p90_s']:.2f} s)" if kind in runs else "" for runs in (a, b)]
        ratio = (f"{b[kind]['median_s'] / a[kind]['median_s']:.2f}"
                 if kind in a and kind in b else "")
        rows.append(f"| {kind} | {cells[0]} | {cells[1]} | {ratio} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json-out", default=None, help="write the summary here as JSON")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON, last")
    parser.add_argument("--kinds", default=None,
                        help=f"comma-separated fault kinds to draw from (default: {','.join(KINDS)}"
                        ", and node0 with --store etcd)")
    parser.add_argument("--store", choices=("tcp", "etcd"), default="tcp",
                        help="where the job store lives: in node 0's launcher (default), or on a "
                        "three-member etcd cluster this soak starts on loopback ports")
    parser.add_argument("--compare-stores", action="store_true",
                        help="run the soak on both stores with the same seed and faults (node0 "
                        "left out), then print one table of MTTR per kind with their ratio")
    parser.add_argument("--sizes", default=None, metavar="RANKS,RANKS",
                        help="run the soak at two job sizes (ranks over two nodes, multiples of "
                        "eight) with the same seed, then print one table of MTTR per kind at "
                        "both sizes; default: one soak on eight ranks")
    parser.add_argument("--workdir", default=None,
                        help="keep logs and metrics here (default: runs/chaos-seed<SEED>, emptied "
                             "first)")
    parser.add_argument("--rejoin-delay", type=float, default=REJOIN_DELAY_S,
                        help="seconds before a dead worker's replacement starts (default: "
                             f"{REJOIN_DELAY_S:g})")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")] if args.sizes else [NODES * PER_NODE]
    if args.sizes and (len(sizes) != 2 or any(size < 8 or size % 8 for size in sizes)
                       or args.compare_stores):
        parser.error("--sizes takes two job sizes, multiples of 8 ranks, without "
                     "--compare-stores")
    stores = ("tcp", "etcd") if args.compare_stores else (args.store,)
    allowed = ETCD_KINDS if stores == ("etcd",) else KINDS
    kinds = tuple(args.kinds.split(",")) if args.kinds else allowed
    if not set(kinds) <= set(allowed) or args.faults < 1:
        parser.error(f"--kinds takes some of {', '.join(allowed)} (node0 needs --store etcd "
                     "without --compare-stores); --faults must be positive")
    if "etcd" in stores:
        sys.path.insert(0, str(SCRIPTS))
        from etcd_cluster import etcd_missing

        if (missing := etcd_missing()) is not None:
            parser.error(f"--store etcd: {missing}")
    workdir = Path(args.workdir) if args.workdir else SCRIPTS.parent / "runs" / f"chaos-seed{args.seed}"
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)  # the launchers' logs are appended to
    runs = [(store, size) for store in stores for size in sizes]
    summaries, problems = {}, []
    for store, size in runs:
        name, place = (f"{size} ranks", f"ranks{size}") if args.sizes else (store, store)
        summaries[name], found = soak(args, kinds, store,
                                      workdir / place if len(runs) > 1 else workdir, size)
        problems += found
    if len(summaries) == 2:
        labels = {"tcp": "TCPStore", "etcd": "etcd"}
        print("\n".join(comparison(*((labels.get(name, name), summary["mttr"])
                                      for name, summary in summaries.items()))))
    for problem in problems:
        print(problem, file=sys.stderr)
    summary = summaries if len(summaries) == 2 else summaries[next(iter(summaries))]
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps(summary))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
