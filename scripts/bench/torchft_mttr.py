"""TorchFT baseline for the MTTR benchmark: from a replica's SIGKILL to the survivors' next step.

What runs
    A torchft Lighthouse (``torchft.coordination.LighthouseServer``, in a helper process) and
    ``--replicas`` replica groups of one process each, all on this machine. Every replica builds
    the same megatron-core ``GPTModel`` (TP1 PP1, CPU, float32, made runnable on CPU by
    ``megatron_elaswave.patches.install``; default shape that of ``plain_gpt.py``: 4 layers,
    hidden 256, 4 heads, seq 128, vocab 512, tied embeddings) and trains it the way torchft's own
    ``train_ddp.py`` does: torchft ``Manager`` (``ProcessGroupGloo``, ``WorldSizeMode.DYNAMIC``,
    ``min_replica_size=1``, async quorum) + torchft ``DistributedDataParallel`` +
    ``torch.optim.AdamW`` stepped only when ``manager.should_commit()``. Megatron's DDP and
    distributed optimizer are not used: that is exactly the layer torchft replaces.

    One patch to torchft 0.2.0 is needed (see :func:`fault_tolerant_ddp`): its DDP comm hook
    crashes the *surviving* replica inside ``backward()`` when the gloo all-reduce fails, so
    without it no survivor lives to take a step. The patch changes nothing on the healthy path.

    Each replica trains ``--batch-size`` random-token sequences per step, so the global batch is
    ``batch_size x participating replicas``; torchft averages gradients over the participants,
    so after a loss the survivors train on a smaller global batch (reported, not compensated).
    Each replica appends one JSON line per step attempt to its log: start and end wall time
    (``time.time()``; one host, one clock), whether torchft committed it, the torchft step, the
    participant count, the quorum id and a parameter checksum.

What is measured, per repetition
    Once the victim (the last replica) has committed step ``--kill-step``, the driver waits
    ``--kill-phase`` x (median step time so far), so the kill lands mid-step, and sends the
    victim's process SIGKILL (its torchft ManagerServer, which heartbeats to the Lighthouse, dies
    with it). ``t_kill`` is read just before ``os.kill``.

    ``failure_to_next_step_s`` (the MTTR): from ``t_kill`` to the end of the first step that
    every survivor has committed in a quorum *without* the victim (a step is complete when the
    last survivor commits it). Steps committed after the kill that still counted the victim (the
    kill landed after that step's all-reduce) are not recovery; their number is
    ``stale_commits``. ``detect_s`` / ``last_rejected_s``: from ``t_kill`` to the end of the first
    / last survivor step attempt that torchft rejected (``should_commit() == False``) before
    recovery; None if none was. ``step_s``: median interval between consecutive committed steps
    of the survivors before the kill (after ``--warmup`` steps, all replicas in); ``step_after_s``
    the same after recovery. ``survivors_agree``: equal parameter checksums at equal steps.

    ``--repetitions`` fresh runs (new Lighthouse, new processes); ``--json`` prints one object
    whose ``torchft_mttr_s``, ``step_s`` ... are medians over repetitions, every run attached.

What dominates, and the knobs
    torchft needs two things before the survivors can step again:

    1. The Lighthouse must stop counting the victim: it forms a quorum without a member of the
       last one only once that member's last heartbeat is older than ``heartbeat_timeout_ms``
       (until then the victim is a "healthy straggler", and with 2 or 3 replicas the split-brain
       rule, more than half of the heartbeating replicas, also needs it gone).
    2. Every survivor must leave the failed step. A survivor whose gloo all-reduce talks to the
       dead process fails at once ("Connection reset/closed by peer"), but in the ring a survivor
       may be waiting on *another survivor* that has already given up; it waits for the
       ProcessGroupGloo timeout (torchft does not abort the group on error), and the Lighthouse
       waits for it (split-brain rule).

    So the MTTR is about ``max(heartbeat_timeout_ms, [pg timeout when a survivor is stranded])``
    plus a gloo rebuild and a step. Defaults here are torchft's own example setup: the README's
    Lighthouse command (``--quorum_tick_ms 100 --join_timeout_ms 10000``, heartbeat timeout left
    at 5000 ms) and ``train_ddp.py``'s CPU settings (``ProcessGroupGloo(timeout=5 s)``, Manager
    ``timeout=30 s``); the rest are library defaults (quorum and connect timeouts 60 s, heartbeat
    every 100 ms). With the *library* defaults (gloo timeout 60 s, equal to the quorum timeout) a
    stranded survivor makes the MTTR 60 s, or the other survivor's quorum call times out first
    and that replica dies. Every knob is an option; shorter ``--heartbeat-timeout-ms`` and
    ``--pg-timeout-s`` shorten torchft's MTTR nearly one for one, at the price of declaring
    slow-but-alive replicas dead, so quote the settings with the number.

Needs torchft (``pip install -e .[bench]``). CPU and gloo only; ``OMP_NUM_THREADS=1`` per process.
The driver starts this same file as ``--worker`` and ``--lighthouse-server``; every child runs in
its own session and is SIGKILLed (with its process group) when a run ends, fails or is
interrupted, and exits by itself if the driver disappears. Every wait has a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

INSTALL_HINT = "torchft is not installed; install the benchmark extras: pip install -e .[bench]"


def require_torchft():
    try:
        import torchft
        from torchft.coordination import LighthouseServer  # noqa: F401
    except ImportError as error:
        sys.exit(f"{INSTALL_HINT}\n({error})")
    return torchft


def torchft_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("torchft", "torchft-nightly"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


# --------------------------------------------------------------------------------------------
# Worker: one replica group of one process.
# --------------------------------------------------------------------------------------------


def die_with_driver(driver_pid: int) -> None:
    """Get SIGKILL when the driver dies (Linux), even while blocked in torchft or gloo."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the loops below still notice a vanished driver
    if os.getppid() != driver_pid:
        os._exit(1)


def build_gpt(args):
    """megatron-core GPTModel, TP1 PP1, on CPU, in this single process."""
    import torch
    import torch.distributed as dist

    from megatron_elaswave.device import resolve_device_backend
    from megatron_elaswave.patches import install

    backend = resolve_device_backend("cpu")
    install(backend)
    # megatron-core's parallel state needs a default process group: a private one of size 1
    # (torchft's cross-replica group is separate and reconfigurable).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    # Same seed on every replica: identical initial weights, so torchft's init_sync is not needed.
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
    )
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size, max_sequence_length=args.seq_length,
        pre_process=True, post_process=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )


def fault_tolerant_ddp():
    """torchft's ``DistributedDataParallel`` with its comm hook made to survive a failed all-reduce.

    In torchft 0.2.0 the hook asserts on the managed future, which is empty when the gloo
    all-reduce raised (a peer died: "Connection reset by peer"), and the later buckets get a plain
    future from ``_DummyWork``; either way the survivor crashes inside ``backward()``. torchft has
    already recorded the error by then (``should_commit()`` will return False), so the fix only
    hands DDP a completed future with the (unused) bucket instead.
    """
    import torch
    from torchft import DistributedDataParallel

    class FaultTolerantDDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            work.wait()
            future = work.get_future()
            inner = getattr(future, "_fut", future)
            if inner is None:
                inner = torch.futures.Future()
                inner.set_result(bucket.buffer())
            return inner

    return FaultTolerantDDP


def worker(args) -> None:
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.manager import WorldSizeMode

    torch.set_num_threads(1)
    parent = args.driver_pid
    run_dir = Path(args.run_dir)
    gpt = build_gpt(args)
    adam = torch.optim.AdamW(gpt.parameters(), lr=1e-4)

    def state_dict():
        return {"model": gpt.state_dict(), "optim": adam.state_dict()}

    def load_state_dict(state):
        gpt.load_state_dict(state["model"])
        adam.load_state_dict(state["optim"])

    # The replica group's own store (torchft expects one per group, normally torchrun's).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=args.timeout_s))
    timeout = timedelta(seconds=args.timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s)),
        load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=1, world_size_mode=WorldSizeMode.DYNAMIC, use_async_quorum=True,
        timeout=timeout, quorum_timeout=timedelta(seconds=args.quorum_timeout_s),
        connect_timeout=timedelta(seconds=args.connect_timeout_s), rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=store.port,
        lighthouse_addr=args.lighthouse, replica_id=f"replica_{args.replica}",
        hostname="localhost", init_sync=False,
        heartbeat_interval=timedelta(milliseconds=args.heartbeat_interval_ms),
    )
    model = fault_tolerant_ddp()(manager, gpt)
    checked = next(gpt.parameters())  # its sum, logged per step, shows the replicas agree

    # Start together, so that the first quorum holds every replica.
    (run_dir / f"ready{args.replica}").touch()
    deadline = time.monotonic() + args.startup_timeout_s
    while not (run_dir / "go").exists():
        if os.getppid() != parent:
            sys.exit(f"replica {args.replica}: the driver is gone")
        if time.monotonic() > deadline:
            sys.exit(f"replica {args.replica}: no go signal after {args.startup_timeout_s} s")
        time.sleep(0.01)

    generator = torch.Generator().manual_seed(1000 + args.replica)
    positions = torch.arange(args.seq_length).unsqueeze(0).expand(args.batch_size, -1)
    log = open(run_dir / f"replica{args.replica}.jsonl", "a", buffering=1)
    attempt = 0
    # Ends at the driver's stop file, or when the driver is gone.
    while (attempt < args.max_attempts and not (run_dir / "stop").exists()
           and os.getppid() == parent):
        attempt += 1
        start = time.time()
        manager.start_quorum()
        adam.zero_grad(set_to_none=True)
        tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_length),
                               generator=generator)
        loss = model(tokens, positions, None, labels=tokens).mean()
        loss.backward()
        committed = manager.should_commit()
        if committed:
            adam.step()
        log.write(json.dumps({
            "attempt": attempt, "start": start, "end": time.time(), "committed": committed,
            "step": manager.current_step(), "participants": manager.num_participants(),
            "quorum_id": manager._quorum_id, "loss": loss.item(),
            "param_sum": checked.detach().double().sum().item(),
        }) + "\n")
    log.close()
    manager.shutdown(wait=False)


def lighthouse_server(args) -> None:
    """Host the Lighthouse (its Rust log goes to this process's stderr, a file of the driver's)."""
    from torchft.coordination import LighthouseServer

    parent = args.driver_pid
    server = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    port = server.address().rsplit(":", 1)[1]
    address_file = Path(args.run_dir) / "lighthouse"
    address_file.with_suffix(".tmp").write_text(f"http://localhost:{port}")
    address_file.with_suffix(".tmp").replace(address_file)
    while os.getppid() == parent:  # until the driver kills it, or is gone
        time.sleep(0.2)
    server.shutdown()


# --------------------------------------------------------------------------------------------
# Driver.
# --------------------------------------------------------------------------------------------


class Failed(RuntimeError):
    """The benchmark could not run (setup, before any kill): stop."""


class RecoveryFailed(Failed):
    """torchft did not recover from the kill (a survivor died, or no step in time): recorded."""


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return records


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def median_interval(records: list[dict]) -> float | None:
    ends = [r["end"] for r in records]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return statistics.median(gaps) if gaps else None


def one_run(args, repetition: int) -> dict:
    n, victim = args.replicas, args.replicas - 1
    survivors = range(n - 1)
    procs: dict[object, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="torchft_mttr_") as tmp:
        run_dir = Path(tmp)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONUNBUFFERED": "1"}
        for name in ("TORCHFT_TIMEOUT_SEC", "TORCHFT_QUORUM_TIMEOUT_SEC",
                     "TORCHFT_CONNECT_TIMEOUT_SEC", "TORCHFT_QUORUM_RETRIES",
                     "TORCHFT_LIGHTHOUSE", "TORCHFT_MANAGER_PORT"):
            env.pop(name, None)  # would override what is set here

        def start(key, flags):
            with open(run_dir / f"stderr{key}", "w") as out:
                procs[key] = subprocess.Popen(
                    [sys.executable, __file__, "--run-dir", str(run_dir),
                     "--driver-pid", str(os.getpid()), *flags],
                    stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

        def check_alive(expected_dead=()):
            for key, proc in procs.items():
                if key not in expected_dead and proc.poll() is not None:
                    raise Failed(f"{'replica ' if key != 'lighthouse' else ''}{key} exited with "
                                 f"{proc.returncode}:\n{tail(run_dir / f'stderr{key}')}")

        def wait_for(condition, what, limit_s, expected_dead=()):
            deadline = time.monotonic() + limit_s
            while not condition():
                check_alive(expected_dead)
                if time.monotonic() > deadline:
                    raise Failed(f"timed out after {limit_s} s waiting for {what}")
                time.sleep(0.01)

        try:
            start("lighthouse", [
                "--lighthouse-server", "--join-timeout-ms", str(args.join_timeout_ms),
                "--quorum-tick-ms", str(args.quorum_tick_ms),
                "--heartbeat-timeout-ms", str(args.heartbeat_timeout_ms)])
            wait_for(lambda: (run_dir / "lighthouse").exists(), "the Lighthouse", 60)
            address = (run_dir / "lighthouse").read_text()
            model_flags = []
            for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                         "vocab_size", "batch_size", "seed", "timeout_s", "quorum_timeout_s",
                         "connect_timeout_s", "pg_timeout_s", "heartbeat_interval_ms",
                         "startup_timeout_s"):
                model_flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
            max_attempts = args.kill_step + args.steps_after + 1000
            for replica in range(n):
                start(replica, ["--worker", "--replica", str(replica), "--lighthouse", address,
                                "--max-attempts", str(max_attempts), *model_flags])
            wait_for(lambda: all((run_dir / f"ready{r}").exists() for r in range(n)),
                     "the replicas to build their models", args.startup_timeout_s)
            (run_dir / "go").touch()

            victim_log = run_dir / f"replica{victim}.jsonl"

            def victim_committed():
                return [r for r in read_log(victim_log) if r["committed"]]

            wait_for(lambda: any(r["step"] >= args.kill_step for r in victim_committed()),
                     f"the victim to commit step {args.kill_step}", args.startup_timeout_s)
            committed = victim_committed()
            if any(r["participants"] != n for r in committed[args.warmup:]):
                raise Failed(f"not every replica took part before the kill: {committed}")
            step_so_far = median_interval(committed[args.warmup:]) or 0.0
            time.sleep(args.kill_phase * step_so_far)
            t_kill = time.time()
            os.kill(procs[victim].pid, signal.SIGKILL)
            procs[victim].wait(timeout=30)

            def recovered_steps(replica):
                return [r for r in read_log(run_dir / f"replica{replica}.jsonl")
                        if r["committed"] and r["end"] > t_kill and r["participants"] == n - 1]

            try:
                wait_for(lambda: all(len(recovered_steps(r)) >= args.steps_after
                                     for r in survivors),
                         f"{args.steps_after} steps of the survivors after the kill",
                         args.recovery_timeout_s, expected_dead=(victim,))
            except Failed as error:
                raise RecoveryFailed(f"{time.time() - t_kill:.1f} s after the kill: {error}")
            (run_dir / "stop").touch()
            logs = {r: read_log(run_dir / f"replica{r}.jsonl") for r in survivors}
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for proc in procs.values():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            if args.keep_logs:
                shutil.copytree(run_dir, Path(args.keep_logs) / f"run{repetition}",
                                dirs_exist_ok=True)

    before, after, first_new, first_failed, last_failed, stale = [], [], [], [], [], set()
    for replica, records in logs.items():
        done = [r for r in records if r["committed"]]
        pre = [r for r in done if r["end"] <= t_kill]
        before.append(median_interval(pre[args.warmup:]))
        post = [r for r in done if r["end"] > t_kill and r["participants"] == n - 1]
        after.append(median_interval(post))
        first_new.append(post[0]["end"])
        stale |= {r["step"] for r in done if t_kill < r["end"] < post[0]["end"]}
        failed = [r for r in records if not r["committed"] and t_kill < r["end"] < post[0]["end"]]
        if failed:
            first_failed.append(failed[0]["end"])
            last_failed.append(failed[-1]["end"])
    # Same torchft step, same weights on every survivor (a sanity check that training is real).
    sums: dict[int, set] = {}
    for records in logs.values():
        for r in records:
            if r["committed"]:
                sums.setdefault(r["step"], set()).add(r["param_sum"])
    survivors_agree = all(len(values) == 1 for values in sums.values())
    before = [s for s in before if s is not None]
    after = [s for s in after if s is not None]
    return {
        "repetition": repetition,
        "failure_to_next_step_s": max(first_new) - t_kill,
        "detect_s": (min(first_failed) - t_kill) if first_failed else None,
        "last_rejected_s": (max(last_failed) - t_kill) if last_failed else None,
        "stale_commits": len(stale),
        "survivors_agree": survivors_agree,
        "step_s": statistics.median(before),
        "step_after_s": statistics.median(after) if after else None,
        "kill_after_step": args.kill_step,
        "global_batch_before": n * args.batch_size,
        "global_batch_after": (n - 1) * args.batch_size,
    }


def run_all(args) -> dict:
    """Every repetition; kills what is left of a run on any way out (error, Ctrl-C, SIGTERM)."""
    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    runs, failed = [], []
    for repetition in range(args.repetitions):
        try:
            run = one_run(args, repetition)
        except RecoveryFailed as error:
            failed.append({"repetition": repetition, "error": str(error)[-2000:]})
            print(f"  run {repetition}: torchft did not recover: {str(error)[-2000:]}",
                  file=sys.stderr, flush=True)
            continue
        except Failed as error:
            sys.exit(f"repetition {repetition} failed: {error}")
        runs.append(run)
        if not args.json:
            detect = "-" if run["detect_s"] is None else f"{run['detect_s']:.3f}"
            print(f"  run {repetition}: failure_to_next_step {run['failure_to_next_step_s']:.3f} s "
                  f"(detect {detect} s), step {run['step_s'] * 1e3:.0f} ms -> "
                  f"{(run['step_after_s'] or float('nan')) * 1e3:.0f} ms, global batch "
                  f"{run['global_batch_before']} -> {run['global_batch_after']}", flush=True)
    if not runs:
        sys.exit(f"no repetition recovered: {failed}")
    detects = [r["detect_s"] for r in runs if r["detect_s"] is not None]
    afters = [r["step_after_s"] for r in runs if r["step_after_s"] is not None]
    return {
        "torchft_mttr_s": statistics.median(r["failure_to_next_step_s"] for r in runs),
        "step_s": statistics.median(r["step_s"] for r in runs),
        "step_after_s": statistics.median(afters) if afters else None,
        "detect_s": statistics.median(detects) if detects else None,
        "global_batch_before": runs[0]["global_batch_before"],
        "global_batch_after": runs[0]["global_batch_after"],
        "replicas": args.replicas,
        "repetitions": args.repetitions,
        "recovered_repetitions": len(runs),
        "torchft_version": torchft_version(),
        "knobs": {
            "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
            "join_timeout_ms": args.join_timeout_ms,
            "quorum_tick_ms": args.quorum_tick_ms,
            "heartbeat_interval_ms": args.heartbeat_interval_ms,
            "manager_timeout_s": args.timeout_s,
            "quorum_timeout_s": args.quorum_timeout_s,
            "connect_timeout_s": args.connect_timeout_s,
            "pg_timeout_s": args.pg_timeout_s,
        },
        "model": {name: getattr(args, name) for name in (
            "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
            "batch_size", "untie_embeddings_and_output_weights")},
        "runs": runs,
        "failed_runs": failed,
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3, help="replica groups (>= 2)")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=10,
                        help="kill the victim once it has committed this step")
    parser.add_argument("--kill-phase", type=float, default=0.5,
                        help="then wait this fraction of a step before the SIGKILL")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of step_s")
    parser.add_argument("--steps-after", type=int, default=5,
                        help="survivor steps to record after recovery")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--json-out", metavar="PATH",
                        help="write the result as JSON to PATH (the Lighthouse and the replicas "
                             "share stdout, and may break a long line printed there)")
    parser.add_argument("--keep-logs", metavar="DIR",
                        help="copy each run's logs (per-step JSON lines, stderr) to DIR/run<k>")
    # torchft knobs. Defaults: torchft's own example setup (README's Lighthouse command,
    # train_ddp.py's Manager and CPU process group); the help gives the library default too.
    knob = "(default %(default)s; torchft library default {})".format
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                        help="Lighthouse: a replica is dead after this long without a heartbeat "
                        + knob(5000))
    parser.add_argument("--join-timeout-ms", type=int, default=10000,
                        help="Lighthouse: wait this long for healthy stragglers " + knob(60000))
    parser.add_argument("--quorum-tick-ms", type=int, default=100, help="Lighthouse " + knob(100))
    parser.add_argument("--heartbeat-interval-ms", type=int, default=100,
                        help="Manager " + knob(100))
    parser.add_argument("--timeout-s", type=float, default=30.0,
                        help="Manager: should_commit, futures, recovery " + knob(60))
    parser.add_argument("--quorum-timeout-s", type=float, default=60.0, help="Manager " + knob(60))
    parser.add_argument("--connect-timeout-s", type=float, default=60.0,
                        help="Manager " + knob(60))
    parser.add_argument("--pg-timeout-s", type=float, default=5.0,
                        help="ProcessGroupGloo, per collective " + knob(60))
    # Driver limits.
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--recovery-timeout-s", type=float, default=300.0)
    # Model (plain_gpt.py's shape) and per-replica batch.
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per replica per step")
    parser.add_argument("--seed", type=int, default=1234)
    # Worker side (set by the driver).
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--max-attempts", type=int, default=10000, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--driver-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not (args.worker or args.lighthouse_server):
        if args.replicas < 2:
            parser.error("--replicas must be at least 2")
        if args.kill_step <= args.warmup + 1:
            parser.error("--kill-step must exceed --warmup + 1 (step_s needs two steps)")
        if not 0 <= args.kill_phase < 1:
            parser.error("--kill-phase must be in [0, 1)")
    return args


def main() -> None:
    args = parse_args()
    if args.driver_pid is not None:
        die_with_driver(args.driver_pid)
    require_torchft()
    if args.lighthouse_server:
        lighthouse_server(args)
        return
    if args.worker:
        worker(args)
        return
    try:
        result = run_all(args)
    except KeyboardInterrupt:
        sys.exit("interrupted; the runs' processes were killed")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"torchft {result['torchft_version']}, {args.replicas} replicas, "
              f"heartbeat_timeout_ms={args.heartbeat_timeout_ms}: median failure_to_next_step "
              f"{result['torchft_mttr_s']:.3f} s over {len(result['runs'])} recovered runs "
              f"(of {args.repetitions}), step "
              f"{result['step_s'] * 1e3:.0f} ms, global batch {result['global_batch_before']} -> "
              f"{result['global_batch_after']}")


if __name__ == "__main__":
    main()
