"""Time to recover from a failure: ElasWave against restart-from-checkpoint and TorchFT.

Every arm trains the same GPT on 8 CPU ranks (TP2 x PP2 x DP2, 8 layers) and loses rank
``--fail-rank`` to a SIGKILL sent from outside the job once iteration ``--fail-at - 1`` is in
the metrics file. MTTR is the time from that SIGKILL to the moment the iteration it broke is
completed again:

* ``elaswave``: ``pretrain_gpt.py --elastic``; the survivors recover in place and re-run the
  broken iteration; its end is the timestamp of the ``recovery`` record, written right after it
  (an ``--elastic`` iteration record waits for the next step, so the kill lands one iteration
  later than in the other arm).
* ``restart``: ``pretrain_gpt.py --save DIR --save-interval N`` without ``--elastic``; the kill
  lands in iteration ``--fail-at``, completed again when its record appears. As
  torchrun does when a worker dies, every worker is stopped at once, then all are launched again
  with ``--load DIR``; the iterations since the last checkpoint are computed again (counted as
  ``lost_iterations``).
* ``torchft``: ``scripts/bench/torchft_mttr.py`` (the ``torchft`` package) on the same GPT and
  as many processes: 8 replicas of one process each, each holding the whole model (TorchFT is
  fault tolerant across data-parallel replicas; it does not reshard a TP x PP replica), the
  same global batch (2 sequences per replica), random tokens; the last replica is SIGKILLed
  mid-step. Reported as that script measures it, when torchft is installed.
* ``elaswave_hang``: the ``elaswave`` arm with the victim SIGSTOPped instead, never resumed,
  and ``--elastic-heartbeat-timeout`` set to TorchFT's Lighthouse heartbeat timeout
  (``--hang-heartbeat-s``, 5 s): both then find the failure by a silence of the same length,
  where a SIGKILL is seen by ElasWave's launcher at once and by TorchFT only through that
  silence. The like-for-like comparison of the two.
* ``elaswave_12`` (with ``--scale``): the ``elaswave`` arm on 12 ranks (TP2 x PP2 x DP3, the
  same 8 samples per replica and iteration), to show how recovery grows with the job; the ratio
  12 / 8 ranks is printed.

Arms alternate; medians over ``--repetitions`` and the ratio restart / elaswave are printed;
``--json`` prints one object.

    python scripts/bench/mttr.py --repetitions 3
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

from torch.distributed import TCPStore

from megatron_elaswave.launch.store import read_worker

REPO = SCRIPTS.parent
NPROC = 8
SAMPLES_PER_REPLICA = 8
GPT_SHAPE = ("--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4",
             "--seq-length", "128")
"""The GPT of every arm. The demo corpus's 257 byte ids are padded by megatron-core to a
vocabulary of 512 at TP2, the TorchFT arm's vocabulary."""


def global_batch(nproc: int) -> int:
    return SAMPLES_PER_REPLICA * nproc // 4  # TP2 x PP2: 4 ranks per replica


def model_flags(data: str, train_iters: int, nproc: int = NPROC) -> list[str]:
    return [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", *GPT_SHAPE,
        "--micro-batch-size", "2", "--global-batch-size", str(global_batch(nproc)),
        "--train-iters", str(train_iters), "--lr", "1e-3", "--seed", "1234",
        "--use-distributed-optimizer", "--untie-embeddings-and-output-weights",
        "--data-path", data, "--split", "98,2,0", "--log-interval", "1", "--eval-interval", "100000",
    ]


class Job:
    """One ``pretrain_gpt.py`` launch whose workers the benchmark can signal."""

    def __init__(self, flags: list[str], metrics: Path, log: Path, nproc: int = NPROC) -> None:
        self.metrics = metrics
        self.port = free_port()
        command = [sys.executable, "-m", "megatron_elaswave.launch.run", f"--nproc-per-node={nproc}",
                   f"--master-port={self.port}", str(SCRIPTS / "pretrain_gpt.py"), *flags,
                   "--elastic-metrics-file", str(metrics)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        self.log = open(log, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)

    def records(self) -> list[dict]:
        if not self.metrics.exists():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line]

    def wait_for_iteration(self, iteration: int, timeout: float = 600) -> dict:
        return self.wait_for_record("iteration", f"iteration {iteration}", timeout,
                                    lambda record: record["iteration"] == iteration)

    def wait_for_record(self, event: str, what: str, timeout: float = 600,
                        matches=lambda record: True) -> dict:
        """The first ``event`` record that ``matches``; exits with a message after
        ``timeout`` seconds or if training ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for record in self.records():
                if record["event"] == event and matches(record):
                    return record
            if self.process.poll() is not None:
                sys.exit(f"training ended (status {self.process.returncode}) before {what}; "
                         f"see {self.log.name}")
            time.sleep(0.02)
        sys.exit(f"no {what} within {timeout} s; see {self.log.name}")

    def worker_pid(self, rank: int, timeout: float = 300) -> int:
        """The pid of ``rank``'s worker, once its launcher has published it in the job store.
        Asked before the moment of the kill, so that the kill itself costs no lookup."""
        store = TCPStore("127.0.0.1", self.port, is_master=False,
                         timeout=timedelta(seconds=timeout))
        deadline = time.monotonic() + timeout
        while (worker := read_worker(store, rank)) is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"no worker of rank {rank}; see {self.log.name}")
            time.sleep(0.05)
        return worker.pid

    def stop(self) -> None:
        """What torchrun does once a worker died: stop every worker of the job."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def finish(self, timeout: float = 600) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
        self.log.close()


def elaswave(data: str, workdir: Path, fail_at: int, fail_rank: int, nproc: int = NPROC,
             hang_heartbeat_s: float | None = None) -> dict:
    """``hang_heartbeat_s``: SIGSTOP the victim instead of SIGKILL, with that heartbeat timeout."""
    flags = [*model_flags(data, fail_at + 3, nproc), "--elastic"]
    if hang_heartbeat_s is not None:
        flags += ["--elastic-heartbeat-timeout", f"{hang_heartbeat_s:g}"]
    job = Job(flags, workdir / "elaswave.jsonl", workdir / "elaswave.log", nproc)
    victim = job.worker_pid(fail_rank)
    job.wait_for_iteration(fail_at - 1)
    os.kill(victim, signal.SIGKILL if hang_heartbeat_s is None else signal.SIGSTOP)
    killed_at = time.time()
    recovery = job.wait_for_record("recovery", "the recovery")
    if hang_heartbeat_s is not None:
        os.kill(victim, signal.SIGKILL)  # its launcher would fence it after the exclusion grace
    job.finish()
    return {"mttr_s": recovery["time"] - killed_at, "lost_iterations": 0,
            "breakdown": {k: v for k, v in recovery.items() if k.endswith("_s")}}


def restart(data: str, workdir: Path, fail_at: int, fail_rank: int, save_interval: int) -> dict:
    checkpoints = workdir / "checkpoints"
    flags = [*model_flags(data, fail_at + 2), "--save", str(checkpoints),
             "--save-interval", str(save_interval)]
    job = Job(flags, workdir / "restart.jsonl", workdir / "restart.log")
    victim = job.worker_pid(fail_rank)
    job.wait_for_iteration(fail_at - 1)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    job.stop()
    again = Job([*flags, "--load", str(checkpoints)], workdir / "restarted.jsonl",
                workdir / "restarted.log")
    done = again.wait_for_iteration(fail_at)
    again.finish()
    resumed_from = min(r["iteration"] for r in again.records() if r["event"] == "iteration") - 1
    return {"mttr_s": done["time"] - killed_at, "lost_iterations": fail_at - 1 - resumed_from}


def torchft(repetitions: int) -> dict | None:
    """``torchft_mttr.py`` on the GPT of the other arms and as many processes: one replica of
    the whole model per process (TorchFT's fault tolerance is across data-parallel replicas),
    the same global batch, random tokens instead of the corpus."""
    script = SCRIPTS / "bench" / "torchft_mttr.py"
    per_replica = global_batch(NPROC) // NPROC
    with tempfile.TemporaryDirectory() as directory:
        summary = Path(directory) / "torchft.json"
        command = [sys.executable, str(script), "--repetitions", str(repetitions), "--json-out",
                   str(summary), "--replicas", str(NPROC), *GPT_SHAPE, "--vocab-size", "512",
                   "--untie-embeddings-and-output-weights", "--batch-size", str(per_replica)]
        result = subprocess.run(command, capture_output=True, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        if result.returncode != 0 or not summary.exists():
            print("torchft arm skipped: "
                  f"{(result.stderr or result.stdout).strip().splitlines()[-1:]}", file=sys.stderr)
            return None
        return json.loads(summary.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--fail-at", type=int, default=8, help="iteration during which a rank dies")
    parser.add_argument("--fail-rank", type=int, default=5)
    parser.add_argument("--save-interval", type=int, default=5,
                        help="checkpoint interval of the restart arm")
    parser.add_argument("--workdir", default="runs/bench-mttr")
    parser.add_argument("--skip-restart", action="store_true")
    parser.add_argument("--skip-torchft", action="store_true")
    parser.add_argument("--skip-hang", action="store_true",
                        help="skip the arm that SIGSTOPs the victim (found by its heartbeat)")
    parser.add_argument("--hang-heartbeat-s", type=float, default=5.0,
                        help="heartbeat timeout of the SIGSTOP arm: TorchFT's Lighthouse default")
    parser.add_argument("--scale", action="store_true",
                        help="also recover on 12 ranks (DP3) and print the ratio 12 / 8 ranks")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.fail_at < 2:
        sys.exit("--fail-at must be at least 2")
    say = (lambda line: None) if args.json else (lambda line: print(line, flush=True))
    workdir = Path(args.workdir)
    data = demo_corpus(workdir)
    runs: dict[str, list[dict]] = {"elaswave": []} if args.skip_restart else {"elaswave": [], "restart": []}
    if not args.skip_hang:
        runs["elaswave_hang"] = []
    if args.scale:
        runs["elaswave_12"] = []
    for repetition in range(args.repetitions):
        order = list(runs) if repetition % 2 == 0 else list(runs)[::-1]
        for arm in order:
            with tempfile.TemporaryDirectory(dir=workdir) as scratch:
                if arm == "elaswave":
                    result = elaswave(data, Path(scratch), args.fail_at, args.fail_rank)
                elif arm == "elaswave_12":
                    result = elaswave(data, Path(scratch), args.fail_at, args.fail_rank, 12)
                elif arm == "elaswave_hang":
                    result = elaswave(data, Path(scratch), args.fail_at, args.fail_rank,
                                      hang_heartbeat_s=args.hang_heartbeat_s)
                else:
                    result = restart(data, Path(scratch), args.fail_at, args.fail_rank,
                                     args.save_interval)
            runs[arm].append(result)
            say(f"  {arm:11s} MTTR {result['mttr_s']:7.2f} s  (lost iterations "
                f"{result['lost_iterations']})")
    summary = {f"{arm}_mttr_s": statistics.median(r["mttr_s"] for r in results)
               for arm, results in runs.items()}
    if not args.skip_restart:
        summary["restart_over_elaswave"] = summary["restart_mttr_s"] / summary["elaswave_mttr_s"]
        summary["restart_lost_iterations"] = statistics.median(r["lost_iterations"]
                                                               for r in runs["restart"])
    summary["hang_heartbeat_s"] = args.hang_heartbeat_s
    if args.scale:
        summary["elaswave_12_over_8"] = summary["elaswave_12_mttr_s"] / summary["elaswave_mttr_s"]
    breakdowns = [r["breakdown"] for r in runs["elaswave"] if r["breakdown"]]
    summary["elaswave_breakdown_s"] = {
        key: statistics.median(b[key] for b in breakdowns) for key in breakdowns[0]} if breakdowns else {}
    if not args.skip_torchft:
        measured = torchft(args.repetitions)
        if measured is not None:
            summary["torchft"] = measured
            summary["torchft_mttr_s"] = measured.get("torchft_mttr_s")
    summary["samples"] = runs
    if args.json:
        print(json.dumps(summary))
        return
    print(f"ElasWave MTTR {summary['elaswave_mttr_s']:.2f} s (median of {args.repetitions})")
    if not args.skip_restart:
        print(f"restart-from-checkpoint {summary['restart_mttr_s']:.2f} s, "
              f"{summary['restart_over_elaswave']:.1f}x longer "
              f"({summary['restart_lost_iterations']:.0f} iterations recomputed)")
    if args.scale:
        print(f"ElasWave on 12 ranks {summary['elaswave_12_mttr_s']:.3f} s, "
              f"{summary['elaswave_12_over_8']:.3f}x the 8-rank MTTR "
              f"({summary['elaswave_mttr_s']:.3f} s)")
    if "elaswave_hang_mttr_s" in summary:
        print(f"ElasWave with the victim SIGSTOPped, found by a {args.hang_heartbeat_s:g} s "
              f"heartbeat timeout: {summary['elaswave_hang_mttr_s']:.2f} s")
    if summary.get("torchft_mttr_s") is not None:
        print(f"TorchFT (torchft package, {NPROC} DDP replicas of the same GPT): "
              f"{summary['torchft_mttr_s']:.2f} s")
    if summary["elaswave_breakdown_s"]:
        print("ElasWave breakdown (median s): " + ", ".join(
            f"{k} {v:.2f}" for k, v in summary["elaswave_breakdown_s"].items()))


if __name__ == "__main__":
    main()
