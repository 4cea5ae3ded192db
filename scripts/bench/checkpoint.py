"""What durable checkpoints cost under ``--elastic``, against the plain path's own.

Two measurements, on the same GPT (untied embeddings, the distributed optimizer, mock data) and
layout through ``elaswave-run``:

1. **Step time with periodic saves.** ``plain``: ``pretrain_gpt.py`` without ``--elastic``,
   ``--save DIR --save-interval N`` (megatron-core's ``dist_checkpointing`` from the live
   objects; with ``--async-save`` its background writer, ``--plain-async``); ``elastic``:
   ``--elastic --save DIR --save-interval N`` (every rank writes its per-step snapshot of the
   saved iteration on a thread). Time-sliced as ``overhead.py`` does (``common.time_sliced``):
   per round each arm trains a window of ``N`` iterations while the other is paused, so that
   every window holds exactly one save; the measure of a window is its wall time per iteration
   (the spacing of its metrics records, which a save between iterations lengthens like a slow
   step; the step times the records carry leave it out), the ratio of a round is that of the two
   windows, of a set the median of its rounds', and the result the median over sets with a 95%
   interval (``common.median_interval``). Target: ``elastic`` at most 1.02 times ``plain`` at
   the default interval.
2. **Restart from a checkpoint.** Each arm trains with ``--save-interval N``; once the tracker
   names a checkpoint (and the job has gone on past it) the launcher's whole process group is
   SIGKILLed, and the same job is launched again with ``--load``: the time from the SIGKILL to
   the first iteration after the checkpoint (its log line), ``elastic`` loading its own
   checkpoint against ``plain`` loading the plain path's. Median over ``--repetitions``, arms
   alternating.

    python scripts/bench/checkpoint.py              # both
    python scripts/bench/checkpoint.py --skip-restart --sets 4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import SCRIPTS, Alternated, SlicedJob, time_sliced

ELASTIC = ["--elastic", "--elastic-rebalance-window", "0"]
TARGET = 1.02
WALL = "wall_s"
TRACKER = "latest_checkpointed_iteration.txt"
ITERATION_LINE = re.compile(r"\] iteration +(\d+)/")


def gpt_flags(args: argparse.Namespace, train_iters: int) -> list[str]:
    return [
        "--tensor-model-parallel-size", str(args.tp), "--pipeline-model-parallel-size",
        str(args.pp), "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
        "--micro-batch-size", "2", "--global-batch-size", str(args.global_batch_size),
        "--train-iters", str(train_iters), "--lr", "1e-3", "--mock-data", "--vocab-size", "511",
        "--use-distributed-optimizer", "--eval-interval", "100000",
        "--untie-embeddings-and-output-weights",
    ]


ARMS = ("plain", "elastic", "unsaved")
"""``unsaved``: ``--elastic`` without ``--save``, for what the checkpoints themselves cost
under ``--elastic``."""


def arm_flags(args: argparse.Namespace, arm: str, save: Path) -> list[str]:
    saving = ["--save", str(save), "--save-interval", str(args.save_interval)]
    if arm == "unsaved":
        return ELASTIC
    if arm == "elastic":
        return [*ELASTIC, *saving]
    return [*saving, *(["--async-save"] if args.plain_async else [])]


def window_walls(times: Alternated) -> Alternated:
    """Each window's wall time per iteration, as a one-record window, from the spacing of its
    records."""
    walls = {}
    for arm, windows in times.runs.items():
        walls[arm] = [[{WALL: (window[-1]["time"] - window[0]["time"]) / (len(window) - 1)}]
                      for window in windows]
    return Alternated(walls, rounds_per_set=times.rounds_per_set)


def step_time(args: argparse.Namespace) -> dict:
    """Measurement 1 (module docstring)."""
    scratch = tempfile.TemporaryDirectory()
    runs = iter(range(1_000_000))

    def job(arm: str):
        def start(train_iters: int) -> SlicedJob:
            save = Path(scratch.name) / f"{arm}-{next(runs)}"
            return SlicedJob.pretrain([*gpt_flags(args, train_iters), "--log-interval", "1000",
                                       *arm_flags(args, arm, save)], args.nproc)
        return start

    # A window spans N + 1 records, N intervals between them: exactly one save.
    times = time_sliced({arm: job(arm) for arm in args.arms}, args.rounds,
                        args.save_interval + 1, args.warmup_iters, sets=args.sets,
                        report=(lambda line: None) if args.json else print)
    scratch.cleanup()
    walls = window_walls(times)
    result = {"median_wall_s": {arm: walls.median(arm, WALL) for arm in args.arms},
              "median_step_s": {arm: times.median(arm) for arm in args.arms}, "ratios": {}}
    for arm, base in (("elastic", "plain"), ("elastic", "unsaved"), ("unsaved", "plain")):
        if arm in args.arms and base in args.arms:
            result["ratios"][f"{arm}/{base}"] = {
                "ratio": walls.paired_ratio(arm, base, WALL),
                "interval": walls.ratio_interval(arm, base, WALL),
                "set_ratios": walls.set_ratios(arm, base, WALL),
                "step_ratio": times.paired_ratio(arm, base)}
    return result


class Launch:
    """One ``pretrain_gpt.py`` job whose log is read as it is written."""

    def __init__(self, args: argparse.Namespace, flags: list[str], log: Path) -> None:
        from common import free_port

        command = [sys.executable, "-m", "megatron_elaswave.launch.run", f"--nproc-per-node={args.nproc}",
                   f"--master-port={free_port()}", str(SCRIPTS / "pretrain_gpt.py"), *flags]
        self.log_path = log
        self.log = open(log, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "OMP_NUM_THREADS": "1",
                                             "PYTHONWARNINGS": "ignore"},
                                        start_new_session=True)

    def wait_until(self, condition, what: str, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                sys.exit(f"no {what} (see {self.log_path}):\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.01)

    def iterations(self) -> list[int]:
        return [int(i) for i in ITERATION_LINE.findall(self.log_path.read_text(errors="replace"))]

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()


def restart_once(args: argparse.Namespace, arm: str, workdir: Path) -> dict:
    """SIGKILL a job once it has saved and gone on, launch it again with ``--load``: the time
    from the SIGKILL to the end of the first iteration after the checkpoint."""
    save = workdir / "checkpoints"
    flags = [*gpt_flags(args, args.restart_iters), "--log-interval", "1",
             *arm_flags(args, arm, save)]
    first = Launch(args, flags, workdir / "first.log")
    tracker = save / TRACKER

    def saved_and_past() -> bool:
        if not tracker.is_file() or not tracker.read_text().strip().isdigit():
            return False
        return max(first.iterations(), default=0) > int(tracker.read_text()) + 1

    first.wait_until(saved_and_past, "checkpoint")
    saved = int(tracker.read_text())
    os.killpg(first.process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    first.process.wait()
    first.log.close()
    again = Launch(args, [*flags, "--load", str(save)], workdir / "again.log")
    again.wait_until(lambda: any(i > saved for i in again.iterations()),
                     "iteration after the checkpoint")
    restarted_s = time.monotonic() - killed_at
    again.kill()
    return {"restart_s": restarted_s, "resumed_at": saved}


def restart(args: argparse.Namespace, say) -> dict:
    """Measurement 2 (module docstring)."""
    runs: dict[str, list[dict]] = {"plain": [], "elastic": []}
    for repetition in range(args.repetitions):
        for arm in (["plain", "elastic"] if repetition % 2 == 0 else ["elastic", "plain"]):
            with tempfile.TemporaryDirectory() as workdir:
                result = restart_once(args, arm, Path(workdir))
            runs[arm].append(result)
            say(f"  {arm:8s} restart from iteration {result['resumed_at']}: "
                f"{result['restart_s']:.2f} s from the SIGKILL to the next iteration")
    medians = {arm: statistics.median(r["restart_s"] for r in results)
               for arm, results in runs.items()}
    return {"median_s": medians, "ratio": medians["elastic"] / medians["plain"], "samples": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--save-interval", type=int, default=20,
                        help="iterations between checkpoints, in both arms (default 20)")
    parser.add_argument("--plain-async", action="store_true",
                        help="the plain arm saves with --async-save (megatron-core's writer)")
    parser.add_argument("--warmup-iters", type=int, default=25,
                        help="iterations before the first window: one save of each arm among "
                             "them (the first is the slowest)")
    parser.add_argument("--rounds", type=int, default=3, help="windows per arm and set")
    parser.add_argument("--sets", type=int, default=6, help="runs per arm, one after the other")
    parser.add_argument("--repetitions", type=int, default=3, help="restarts per arm")
    parser.add_argument("--restart-iters", type=int, default=60,
                        help="--train-iters of the restarted jobs")
    parser.add_argument("--arms", default="plain,elastic,unsaved",
                        help=f"arms of the step-time measurement ({', '.join(ARMS)})")
    parser.add_argument("--skip-step-time", action="store_true")
    parser.add_argument("--skip-restart", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.arms = [arm for arm in args.arms.split(",") if arm]
    if set(args.arms) - set(ARMS):
        parser.error(f"arms are {', '.join(ARMS)}")
    say = (lambda line: None) if args.json else (lambda line: print(line, flush=True))
    layout = f"TP{args.tp}xPP{args.pp}xDP{args.nproc // (args.tp * args.pp)}"
    summary: dict = {"layout": layout, "save_interval": args.save_interval,
                     "plain_async": args.plain_async}
    if not args.skip_step_time:
        summary["step_time"] = step_time(args)
    if not args.skip_restart:
        summary["restart"] = restart(args, say)
    if args.json:
        print(json.dumps(summary))
        return
    plain = "plain --async-save" if args.plain_async else "plain"
    if "step_time" in summary:
        result = summary["step_time"]
        names = {"plain": plain, "elastic": "--elastic", "unsaved": "--elastic without --save"}
        print(f"{layout}, hidden {args.hidden_size}, a checkpoint every {args.save_interval} "
              f"iterations; {args.sets} sets of {args.rounds} rounds")
        print("  wall time per iteration: " + ", ".join(
            f"{names[arm]} {wall * 1e3:.1f} ms" for arm, wall in result["median_wall_s"].items()))
        for pair, ratio in result["ratios"].items():
            low, high = ratio["interval"]
            target = f"; target <= {TARGET}" if pair == "elastic/plain" else ""
            print(f"  {pair:16s} {ratio['ratio']:.4f} (95% interval {low:.4f} to {high:.4f}"
                  f"{target}; by set {' '.join(f'{r:.4f}' for r in ratio['set_ratios'])}; "
                  f"step time alone {ratio['step_ratio']:.4f})")
    if "restart" in summary:
        result = summary["restart"]
        print(f"  SIGKILL of the whole job to its first iteration after --load (median of "
              f"{args.repetitions}): {plain} {result['median_s']['plain']:.2f} s, --elastic "
              f"{result['median_s']['elastic']:.2f} s; ratio {result['ratio']:.3f}")


if __name__ == "__main__":
    main()
