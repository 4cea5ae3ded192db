"""Mixtures of experts under ``--elastic``, in Megatron-LM's own loop: step time and MTTR.

Megatron-LM's Mixtral recipe (``examples/mixtral/train_mixtral_8x7b_distributed.sh``, as
``tests/test_moe.py`` scales it down: 8 experts, top-2, the aux loss, the alltoall dispatcher,
GQA, RoPE, SwiGLU, RMSNorm, bf16, the distributed optimizer with ``--overlap-grad-reduce
--overlap-param-gather``; no grouped GEMM, which needs Transformer Engine) on 8 CPU ranks,
TP1 x PP2 x DP4 with expert parallelism 4, run as users run it:
``elaswave-run -m megatron_elaswave.run_megatron_lm pretrain_gpt.py ...``, the training script
being a Megatron-LM checkout's ``pretrain_gpt.py`` (``MEGATRON_LM_PATH``) or, without one,
``tests/megatron_lm_pretrain_gpt.py`` on the training package of the megatron-core 0.19 wheel.
Two measurements:

1. **Step time, ``--elastic`` against Megatron-LM.** Arm ``megatron-lm``: the recipe in
   Megatron-LM's loop; arm ``elastic``: the same command with ``--elastic
   --elastic-rebalance-window 0`` (micro-batches are not re-dealt to follow stragglers, so both
   arms keep one layout on a noisy machine, as in ``overhead.py``). The measure of both is
   Megatron-LM's own log line, ``elapsed time per iteration (ms)`` at ``--log-interval 1``: the
   plain arm has no metrics file, and the log line is what both arms' users read. Time-sliced as
   ``overhead.py`` does (``common.time_sliced``): in each of ``--sets`` sets a new job of each
   arm trains ``--warmup-iters`` iterations and is paused (SIGSTOP of its whole process group);
   then, round after round, each arm in turn (A B, B A, ...) trains a window of iterations while
   the other waits. Two lines after each resume are dropped (the one the pause cut in two
   included). Per round the ratio of the two windows' medians, per set the median of its rounds',
   and the median over sets (target: at most 1.02), with two 95% intervals: over the sets as the
   other benchmarks give it (``common.median_interval``, the sets' whole range below 6 sets) and a
   bootstrap over sets and their rounds (``common.bootstrap_ratio_interval``). With
   ``--sent-arm`` a third arm, ``--elastic`` with ``--elastic-snapshot-shared-memory off``, sends
   every snapshot copy through gloo, as to buddies on other hosts (the first arm's buddies, on
   this one host, map the owners' shared memory).
2. **MTTR, MoE against dense.** The recipe with ``--elastic`` and ``--elastic-metrics-file``,
   and its dense twin (the same ranks, TP/PP, hidden size, layers, heads and flags, one dense
   SwiGLU FFN per layer instead of the experts and router, as wide as the top-2 experts a token
   goes to, so that a token meets the same FFN work); worker ``--fail-rank`` is
   SIGKILLed from outside once Megatron-LM has logged iteration ``--fail-after``. MTTR is the
   ``total_s`` of the job's ``recovery`` record (from the failure to the end of the re-run
   iteration), with its phases (detect, agree, plan, comm, rebuild, migrate, first step) and the
   time from the benchmark's own SIGKILL to that record. The job then has to finish its
   iterations. ``--kills`` per arm, arms alternating (MoE dense dense MoE ...); medians and the
   ratio MoE / dense (target: at most 1.5), with a bootstrap interval over the kills
   (``common.bootstrap_median_ratio``).

    python scripts/bench/moe.py                          # both, at the default size
    python scripts/bench/moe.py --quick --output moe.json
"""

from __future__ import annotations

import argparse
import shlex
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

from common import (
    SCRIPTS,
    MegatronLMJob,
    bootstrap_median_ratio,
    bootstrap_ratio_interval,
    free_port,
    megatron_lm_record,
    time_sliced,
)

REPO = SCRIPTS.parent
ARMS = ("megatron-lm", "elastic")
STEP_TARGET = 1.02
"""The most the ``elastic`` arm's step time may be, as a ratio to ``megatron-lm``."""
MTTR_TARGET = 1.5
"""The most the MoE job's MTTR may be, as a ratio to the dense job's."""
ELASTIC = ["--elastic", "--elastic-rebalance-window", "0"]
SENT_ARM = "elastic-sent"
SENT = ["--elastic-snapshot-shared-memory", "off"]
"""``--sent-arm``: every snapshot copy sent through gloo, as to buddies on other hosts."""
PHASES = ("detect_s", "agree_s", "plan_s", "comm_s", "rebuild_s", "migrate_s", "first_step_s")
CPU = ["--distributed-backend", "gloo", "--transformer-impl", "local",
       "--no-gradient-accumulation-fusion", "--no-persist-layer-norm"]
"""What Megatron-LM needs on CPU ranks (docs/megatron-lm.md)."""

QUICK = dict(hidden_size=64, ffn_hidden_size=128, seq_length=32, sets=1, rounds=1, iterations=2,
             warmup_iters=3, kills=1, fail_after=3)
"""``--quick``: the size of ``tests/test_moe.py`` and one of everything, a smoke run."""
DEFAULT_HIDDEN = 256
DEFAULT_SEQ = 128
"""The default size, hidden 256 with experts of FFN 512 at 128 tokens a sequence: the largest
tried that a 2-core, 23 GiB host time-slices, both arms' jobs held at once (about 5.5 GB of
memory for Megatron-LM's job, 6.4 GB with ``--elastic``; an iteration about 1.6 s). Hidden 512
(FFN 1024) runs alone, 2.5 s an iteration, but its two jobs take 7.9 and 11.2 GB, and the
``--elastic`` one was killed by the kernel's OOM killer beside other work; ``--quick``'s hidden
64 at 32 tokens takes 0.8 s, hidden 1024 7 s."""


TOPK = 2
"""Experts each token is routed to (the Mixtral recipe's ``--moe-router-topk``)."""


def recipe(args: argparse.Namespace, train_iters: int, *, moe: bool = True) -> list[str]:
    """The scaled-down Mixtral recipe (``tests/test_moe.py``'s ``mixtral_recipe`` at the
    benchmark's size); ``moe=False``: its dense twin, the experts and router left out."""
    experts = [
        "--num-experts", str(args.num_experts), "--moe-router-topk", str(TOPK),
        "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
        "--moe-token-dispatcher-type", "alltoall",
        "--expert-model-parallel-size", str(args.ep),
    ] if moe else []
    # The dense twin's FFN does the work of the top-2 experts each token goes to.
    ffn_hidden_size = args.ffn_hidden_size if moe else TOPK * args.ffn_hidden_size
    return [
        "--use-mcore-models", "--disable-bias-linear", "--seq-length", str(args.seq_length),
        "--max-position-embeddings", str(max(64, args.seq_length)),
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--ffn-hidden-size", str(ffn_hidden_size), "--num-attention-heads", "4",
        "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--no-rope-fusion",
        "--swiglu", "--untie-embeddings-and-output-weights", "--group-query-attention",
        "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
        "--rotary-base", "1000000", *experts,
        "--overlap-param-gather", "--overlap-grad-reduce",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
        "--split", "99990,8,2", "--micro-batch-size", "1",
        "--global-batch-size", str(args.global_batch_size),
        "--lr", "1e-4", "--train-iters", str(train_iters), "--lr-decay-iters", "320",
        "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
        "--lr-warmup-iters", "5", "--clip-grad", "1.0", "--bf16",
        "--tensor-model-parallel-size", str(args.tp), "--pipeline-model-parallel-size",
        str(args.pp), "--use-distributed-optimizer", "--log-interval", "1",
        "--eval-interval", "100000", "--eval-iters", "0", *CPU,
    ]


def training_script(given: str | None) -> Path:
    """``--training-script``, else ``MEGATRON_LM_PATH``'s ``pretrain_gpt.py``, else the script
    that runs Megatron-LM's loop from the installed megatron-core's training package (0.19 on),
    as ``tests/test_megatron_adaptor.py`` picks it; exits in one line where there is none."""
    if given:
        return Path(given).resolve()
    if os.environ.get("MEGATRON_LM_PATH"):
        return Path(os.environ["MEGATRON_LM_PATH"], "pretrain_gpt.py")
    probe = subprocess.run([sys.executable, "-c", "import megatron.training.training"],
                           capture_output=True, text=True, cwd=tempfile.gettempdir(),
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if probe.returncode != 0:
        sys.exit("moe.py: no Megatron-LM training package: set MEGATRON_LM_PATH or "
                 "--training-script, or run it in a megatron-core 0.19 environment "
                 "(.venv-mcore0.19.2/bin/python)")
    return REPO / "tests" / "megatron_lm_pretrain_gpt.py"


# -- 1. step time ---------------------------------------------------------------------------------


def step_time(args: argparse.Namespace, script: Path, say) -> dict:
    """Measurement 1 (module docstring)."""
    def arm(extra: list[str]):
        return lambda train_iters: MegatronLMJob(script, [*recipe(args, train_iters), *extra],
                                                 args.nproc)

    arms = {"megatron-lm": arm([]), "elastic": arm(ELASTIC + args.elastic_args)}
    if args.sent_arm:
        arms[SENT_ARM] = arm(ELASTIC + args.elastic_args + SENT)
    times = time_sliced(arms, args.rounds, args.window, args.warmup_iters, sets=args.sets,
                        report=say)

    def ratios(name: str) -> dict:
        low, high = times.ratio_interval(name, "megatron-lm")
        boot_low, boot_high = bootstrap_ratio_interval(times, name, "megatron-lm")
        return {"ratio": times.paired_ratio(name, "megatron-lm"), "interval": [low, high],
                "bootstrap_interval": [boot_low, boot_high],
                "set_ratios": times.set_ratios(name, "megatron-lm"),
                "round_ratios": times.round_ratios(name, "megatron-lm"),
                "pooled_ratio": times.median(name) / times.median("megatron-lm")}

    result = {"median_s": {name: times.median(name) for name in arms},
              "iterations_per_arm": len(times.pooled("megatron-lm")), "target": STEP_TARGET,
              **ratios("elastic"),
              "samples_s": {name: [[r["step_time_s"] for r in run] for run in times.runs[name]]
                            for name in arms}}
    if args.sent_arm:
        result["sent"] = ratios(SENT_ARM)
    return result


# -- 2. MTTR --------------------------------------------------------------------------------------


class KilledJob:
    """One ``--elastic`` job in Megatron-LM's loop under elaswave-run whose worker the
    benchmark SIGKILLs from outside."""

    def __init__(self, script: Path, flags: list[str], workdir: Path, nproc: int,
                 elastic_args: list[str]) -> None:
        self.metrics = workdir / "metrics.jsonl"
        self.log_path = workdir / "job.log"
        self.port = free_port()
        command = [sys.executable, "-m", "megatron_elaswave.launch.run",
                   f"--nproc-per-node={nproc}", f"--master-port={self.port}", "-m",
                   MegatronLMJob.RUNNER, str(script), *flags, *ELASTIC, *elastic_args,
                   "--elastic-metrics-file", str(self.metrics)]
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})

    def fail(self, what: str) -> None:
        self.kill()
        sys.exit(f"moe.py: {what} (see {self.log_path}):\n"
                 f"{self.log_path.read_text(errors='replace')[-3000:]}")

    def wait_until(self, condition, what: str, timeout_s: float = 600):
        deadline = time.monotonic() + timeout_s
        while not (found := condition()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.fail(f"no {what}")
            time.sleep(0.02)
        return found

    def lines(self) -> list[dict]:
        """Megatron-LM's log lines so far, as records."""
        text = self.log_path.read_text(errors="replace")
        return [r for line in text.splitlines() if (r := megatron_lm_record(line)) is not None]

    def logged(self) -> int:
        """The last iteration of Megatron-LM's log lines so far."""
        return max((int(r["iteration"]) for r in self.lines()), default=0)

    def recovery(self) -> dict | None:
        if not self.metrics.exists():
            return None
        for line in self.metrics.read_text().splitlines():
            if line.startswith("{") and (record := json.loads(line))["event"] == "recovery":
                return record
        return None

    def worker_pid(self, rank: int) -> int:
        """The pid of ``rank``'s worker, from the job store (as ``mttr.py`` asks it, before the
        kill, so that the kill costs no lookup)."""
        from torch.distributed import TCPStore

        from megatron_elaswave.launch.store import read_worker

        store = TCPStore("127.0.0.1", self.port, is_master=False,
                         timeout=timedelta(seconds=300))
        return self.wait_until(lambda: (worker := read_worker(store, rank)) and worker.pid,
                               f"worker of rank {rank}", 300)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


def kill_once(args: argparse.Namespace, script: Path, moe: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="moe-mttr-") as workdir:
        job = KilledJob(script, recipe(args, args.fail_after + 4, moe=moe), Path(workdir),
                        args.nproc, args.elastic_args)
        try:
            victim = job.worker_pid(args.fail_rank)
            job.wait_until(lambda: job.logged() >= args.fail_after,
                           f"iteration {args.fail_after}")
            os.kill(victim, signal.SIGKILL)
            killed_at = time.time()
            record = job.wait_until(job.recovery, "recovery record")
            # The job's own step time before the kill, its first two iterations left out.
            before = [r["step_time_s"] for r in job.lines()
                      if 2 < r["iteration"] <= args.fail_after]
            try:
                returncode = job.process.wait(600)
            except subprocess.TimeoutExpired:
                job.fail("end of training after the recovery within 600 s")
            if returncode != 0:
                job.fail(f"clean end after the recovery (status {returncode})")
        finally:
            job.kill()
    return {"total_s": record["total_s"], "phases_s": {k: record[k] for k in PHASES},
            "kill_to_record_s": record["time"] - killed_at,
            "step_s": statistics.median(before) if before else None,
            "bytes_moved": record["bytes_moved"], "failed_ranks": record["failed_ranks"],
            "iteration": record["iteration"], "rolled_back_to": record["rolled_back_to"]}


def mttr(args: argparse.Namespace, script: Path, say) -> dict:
    """Measurement 2 (module docstring)."""
    runs: dict[str, list[dict]] = {"moe": [], "dense": []}
    for kill in range(args.kills):
        for name in (["moe", "dense"] if kill % 2 == 0 else ["dense", "moe"]):
            result = kill_once(args, script, moe=name == "moe")
            runs[name].append(result)
            say(f"  {name:5s} kill {kill + 1}: MTTR {result['total_s']:.2f} s "
                f"(SIGKILL to record {result['kill_to_record_s']:.2f} s; "
                f"{result['bytes_moved'] / 1e6:.1f} MB moved)")
    summary: dict = {}
    for name, results in runs.items():
        summary[name] = {
            "median_total_s": statistics.median(r["total_s"] for r in results),
            "median_kill_to_record_s": statistics.median(r["kill_to_record_s"] for r in results),
            "median_phases_s": {k: statistics.median(r["phases_s"][k] for r in results)
                                for k in PHASES},
            "median_bytes_moved": statistics.median(r["bytes_moved"] for r in results),
            "median_step_s": statistics.median(steps) if (steps := [
                r["step_s"] for r in results if r["step_s"] is not None]) else None,
            "samples": results}
    summary["ratio"] = summary["moe"]["median_total_s"] / summary["dense"]["median_total_s"]
    summary["interval"] = list(bootstrap_median_ratio([r["total_s"] for r in runs["moe"]],
                                                      [r["total_s"] for r in runs["dense"]]))
    summary["target"] = MTTR_TARGET
    # The re-run iteration is one step of each job on fewer ranks; without it, what the
    # recovery itself took (detect to migrate), whose ratio the jobs' step times do not set.
    for name in runs:
        summary[name]["median_before_first_step_s"] = statistics.median(
            r["total_s"] - r["phases_s"]["first_step_s"] for r in runs[name])
    summary["ratio_before_first_step"] = (summary["moe"]["median_before_first_step_s"]
                                          / summary["dense"]["median_before_first_step_s"])
    return summary


# -- the table ------------------------------------------------------------------------------------


def print_table(summary: dict) -> None:
    size = summary["model"]
    print(f"Mixtral recipe scaled down: {size['layout']}, {size['num_layers']} layers, hidden "
          f"{size['hidden_size']}, {size['num_experts']} experts of FFN {size['ffn_hidden_size']} "
          f"(top-2), seq {size['seq_length']}, global batch {size['global_batch_size']}; "
          f"training script {size['training_script']}")
    if "step_time" in summary:
        result = summary["step_time"]
        low, high = result["interval"]
        boot_low, boot_high = result["bootstrap_interval"]
        verdict = "meets" if result["ratio"] <= STEP_TARGET else "misses"
        print(f"step time (Megatron-LM's elapsed time per iteration; {summary['sets']} sets of "
              f"{summary['rounds']} rounds of {summary['window']} iterations, "
              f"{result['iterations_per_arm']} iterations per arm)")
        print(f"  {'megatron-lm':12s} median {result['median_s']['megatron-lm'] * 1e3:8.1f} ms")
        print(f"  {'--elastic':12s} median {result['median_s']['elastic'] * 1e3:8.1f} ms")
        print(f"  ratio --elastic / megatron-lm {result['ratio']:.4f} ({verdict} target <= "
              f"{STEP_TARGET}); 95% interval over sets {low:.4f} to {high:.4f}, bootstrap "
              f"{boot_low:.4f} to {boot_high:.4f}; by set "
              f"{' '.join(f'{r:.4f}' for r in result['set_ratios'])}")
        if "sent" in result:
            sent = result["sent"]
            print(f"  {'copies sent':12s} median {result['median_s'][SENT_ARM] * 1e3:8.1f} ms "
                  f"(--elastic, every snapshot copy through gloo)")
            print(f"  ratio copies sent / megatron-lm {sent['ratio']:.4f}; 95% interval over "
                  f"sets {sent['interval'][0]:.4f} to {sent['interval'][1]:.4f}; by set "
                  f"{' '.join(f'{r:.4f}' for r in sent['set_ratios'])}")
    if "mttr" in summary:
        result = summary["mttr"]
        print(f"MTTR, SIGKILL of rank {summary['fail_rank']} after iteration "
              f"{summary['fail_after']} (recovery record's total_s and phases, median of "
              f"{summary['kills']}, s; kill->rec: from the benchmark's SIGKILL to the record; "
              f"step: the job's iteration before the kill)")
        header = "  " + f"{'job':6s} {'total':>7s} " + " ".join(
            f"{k[:-2]:>8s}" for k in PHASES) + f" {'kill->rec':>9s} {'MB moved':>9s} {'step':>8s}"
        print(header)
        for name in ("moe", "dense"):
            arm = result[name]
            print(f"  {name:6s} {arm['median_total_s']:7.3f} " + " ".join(
                f"{arm['median_phases_s'][k]:8.3f}" for k in PHASES)
                + f" {arm['median_kill_to_record_s']:9.3f} {arm['median_bytes_moved'] / 1e6:9.1f}"
                + (f" {arm['median_step_s']:8.3f}" if arm["median_step_s"] is not None else ""))
        verdict = "meets" if result["ratio"] <= MTTR_TARGET else "misses"
        low, high = result["interval"]
        print(f"  ratio MoE / dense {result['ratio']:.3f} ({verdict} target <= {MTTR_TARGET}; "
              f"95% bootstrap interval {low:.3f} to {high:.3f}); "
              f"without the re-run iteration (detect to migrate: "
              f"{result['moe']['median_before_first_step_s']:.3f} s against "
              f"{result['dense']['median_before_first_step_s']:.3f} s) "
              f"{result['ratio_before_first_step']:.3f}")
    print(f"took {summary['wall_s']:.0f} s")


def main() -> None:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: tests/test_moe.py's size, one set of one round, one "
                             "kill per job (flags given beside it still count)")
    parser.add_argument("--sets", type=int, help="new jobs per arm, one after the other (4)")
    parser.add_argument("--rounds", type=int, help="windows per arm and set (3)")
    parser.add_argument("--iterations", type=int,
                        help="iterations measured per arm and set, split into the rounds' "
                             "windows (12)")
    parser.add_argument("--warmup-iters", type=int,
                        help="iterations of each job before its first window (5; Megatron-LM's "
                             "first two are many times slower than the rest)")
    parser.add_argument("--kills", type=int, help="SIGKILLs per job kind, MoE and dense (3)")
    parser.add_argument("--fail-after", type=int,
                        help="the kill follows the log line of this iteration (5)")
    parser.add_argument("--fail-rank", type=int, default=5,
                        help="rank SIGKILLed (default 5: replica 1's second stage)")
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=4, help="expert parallelism (default 4)")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--ffn-hidden-size", type=int, help="each expert's (and the dense FFN's)")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--seq-length", type=int)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--training-script",
                        help="Megatron-LM's pretrain_gpt.py (default: MEGATRON_LM_PATH's, else "
                             "tests/megatron_lm_pretrain_gpt.py)")
    parser.add_argument("--elastic-args", type=shlex.split, default=[], metavar="FLAGS",
                        help="more flags of the --elastic jobs, as one word "
                             "(--elastic-args='--elastic-snapshot-replicas 1')")
    parser.add_argument("--sent-arm", action="store_true",
                        help="time a third arm, --elastic with every snapshot copy sent through "
                             "the process group (--elastic-snapshot-shared-memory off), as to "
                             "buddies on other hosts; one more job held at once")
    parser.add_argument("--skip-step-time", action="store_true")
    parser.add_argument("--skip-mttr", action="store_true")
    parser.add_argument("--output", help="write the figures to this JSON file")
    parser.add_argument("--json", action="store_true", help="print one JSON object, no table")
    args = parser.parse_args()
    defaults = dict(hidden_size=DEFAULT_HIDDEN, ffn_hidden_size=None, seq_length=DEFAULT_SEQ,
                    sets=4, rounds=3, iterations=12, warmup_iters=5, kills=3, fail_after=5)
    for name, value in (QUICK if args.quick else defaults).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 2 * args.hidden_size
    args.window = max(2, -(-args.iterations // args.rounds))
    if args.fail_after < 2:
        parser.error("--fail-after must be at least 2")
    if not 0 <= args.fail_rank < args.nproc:
        parser.error(f"--fail-rank must name one of the {args.nproc} ranks")
    script = training_script(args.training_script)
    say = (lambda line: None) if args.json else (lambda line: print(line, flush=True))
    dp = args.nproc // (args.tp * args.pp)
    summary: dict = {
        "model": {"layout": f"TP{args.tp}xPP{args.pp}xDP{dp}xEP{args.ep}",
                  "nproc": args.nproc, "num_layers": args.num_layers,
                  "hidden_size": args.hidden_size, "ffn_hidden_size": args.ffn_hidden_size,
                  "num_experts": args.num_experts, "topk": 2, "seq_length": args.seq_length,
                  "global_batch_size": args.global_batch_size, "micro_batch_size": 1,
                  "training_script": str(script)},
        "quick": args.quick, "sets": args.sets, "rounds": args.rounds, "window": args.window,
        "warmup_iters": args.warmup_iters, "kills": args.kills, "fail_after": args.fail_after,
        "fail_rank": args.fail_rank,
    }
    if not args.skip_step_time:
        say("step time: Megatron-LM's loop without and with --elastic, time-sliced")
        summary["step_time"] = step_time(args, script, say)
    if not args.skip_mttr:
        say(f"MTTR: SIGKILL of rank {args.fail_rank}, MoE and dense jobs alternating")
        summary["mttr"] = mttr(args, script, say)
    summary["wall_s"] = time.monotonic() - started
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=1) + "\n")
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)


if __name__ == "__main__":
    main()
