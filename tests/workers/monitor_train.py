"""Trains a toy loop (compute, then a gloo all-reduce) under a FailureMonitor and survives failures.

Usage: monitor_train.py OUT_DIR VICTIMS [--heartbeat-timeout S] [--hold] [--pause-after-decision S]

VICTIMS is a comma-separated list of the ranks the test will kill or stop. Every rank trains and
sets ``test/training/<rank>`` once it has done a few steps. On a failure it agrees with the
others on who failed and forms the next generation's group, round after round until one forms,
then checks it with an all-reduce of the launch ranks; it goes on until its generation excludes
every victim. Then it trains a few more steps and writes ``OUT_DIR/rank<r>.json``: per round,
when its loop was unblocked, the failure notice, its suspects, the decision (and when it read
it) and the check.
``--pause-after-decision`` makes every rank wait between a decision and forming the group, so
that a test can fail one in that gap. With ``--hold`` a survivor waits for the test to set
``test/release`` before exiting 0. A victim that is excluded rather than killed exits with
:class:`~megatron_elaswave.launch.decisions.Excluded`.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_elaswave.launch.decisions import Decision
from megatron_elaswave.launch.store import connect_store
from megatron_elaswave.runtime.agreement import agree
from megatron_elaswave.runtime.monitor import FailureMonitor, MonitorConfig
from megatron_elaswave.runtime.world import init_generation

TIMEOUT = timedelta(seconds=15)
"""Op timeout of the groups: far above the detection latencies the tests expect."""
TRAINING_LIMIT_S = 60.0
STEPS_BEFORE_READY = 5
STEPS_AFTER_RECOVERY = 5


def train_step(monitor, weight, state):
    """Forward-like compute, then a collective; raises on any sign of failure."""
    monitor.raise_if_failed()
    for _ in range(8):
        state = torch.tanh(state @ weight)
    monitor.raise_if_failed()
    dist.all_reduce(state)
    return state / dist.get_world_size()


def recover(store, monitor, rank, error, rounds, pause_after_decision_s):
    """Agree and form the next generation, round after round until one forms; appends what
    each round saw to ``rounds``."""
    while True:
        unblocked_at = time.time()
        monitor.report_error(error)
        notice = monitor.failure
        decision = agree(store, monitor)
        rounds.append(
            {
                "unblocked_at": unblocked_at,
                "decided_at": time.time(),
                "notice": asdict(notice),
                "suspects": {str(r): asdict(s) for r, s in monitor.suspects().items()},
                "decision": asdict(decision),
            }
        )
        monitor.advance(decision)
        time.sleep(pause_after_decision_s)
        try:
            init_generation(decision, store, rank, timeout=TIMEOUT, abort=monitor.failure_detected)
            return decision
        except RuntimeError as formation_error:
            error = formation_error


def check_group(rank):
    """All-reduce the launch ranks over the current group."""
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return {"world_size": dist.get_world_size(), "rank": dist.get_rank(), "sum": total.item()}


def main(out_dir, victims, heartbeat_timeout_s, hold, pause_after_decision_s):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = connect_store(timeout=timedelta(seconds=60))
    config = MonitorConfig(
        heartbeat_interval_s=0.25,
        heartbeat_timeout_s=heartbeat_timeout_s,
        agreement_timeout_s=20.0,
        collective_timeout_s=TIMEOUT.total_seconds(),
    )
    decision = Decision.initial(world_size)
    init_generation(decision, store, rank, timeout=TIMEOUT)
    monitor = FailureMonitor(store, rank, decision, config)
    torch.manual_seed(0)
    weight, state = torch.randn(64, 64) / 8, torch.randn(64, 64)
    rounds, steps, unchecked = [], 0, False
    steps_left = None  # counted down once every victim is excluded
    deadline = time.monotonic() + TRAINING_LIMIT_S
    with monitor:
        while steps_left != 0:
            if time.monotonic() > deadline:
                sys.exit(f"rank {rank}: still training after {TRAINING_LIMIT_S} s")
            try:
                if unchecked:
                    rounds[-1]["check"], unchecked = check_group(rank), False
                state = train_step(monitor, weight, state)
            except RuntimeError as error:
                decision = recover(store, monitor, rank, error, rounds, pause_after_decision_s)
                unchecked = True
                if victims.isdisjoint(decision.survivors):
                    steps_left = STEPS_AFTER_RECOVERY
                continue
            steps += 1
            if steps == STEPS_BEFORE_READY:
                store.set(f"test/training/{rank}", "")
            if steps_left is not None:
                steps_left -= 1
        dist.barrier()
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as out:
        json.dump({"rank": rank, "rounds": rounds}, out)
    os.replace(path + ".tmp", path)
    if hold:
        store.wait(["test/release"])
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("victims", type=lambda text: {int(rank) for rank in text.split(",")})
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--pause-after-decision", type=float, default=0.0)
    args = parser.parse_args()
    main(args.out_dir, args.victims, args.heartbeat_timeout, args.hold, args.pause_after_decision)
