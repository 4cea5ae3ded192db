"""Outlives the victims and checks what the launcher recorded about them.

Usage: survivor.py OUT_DIR VICTIMS [--victim-exit CODE] [--hold]

VICTIMS is a comma-separated list of ranks. A victim exits with CODE at once or, without
``--victim-exit``, sleeps until it is killed. Every other rank waits until the job store holds a
death for each victim, checks that it can still write and read the store, and writes what it saw
to ``OUT_DIR/rank<r>.json``; with ``--hold`` it then waits for the test to set
``test/release/<r>`` before exiting 0.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from datetime import timedelta

WAIT_S = 60.0


def give_up(what):
    sys.exit(f"rank {os.environ['RANK']}: no {what} after {WAIT_S} s")


def read_until_dead(store, victims):
    """All death records, read with a cursor until every victim has one."""
    from megatron_elaswave.launch.store import read_deaths

    deaths, deadline = [], time.monotonic() + WAIT_S
    while True:
        deaths += read_deaths(store, start=len(deaths))
        if victims <= {death.rank for death in deaths}:
            return deaths
        if time.monotonic() > deadline:
            give_up("death records for all victims")
        time.sleep(0.02)


def survive(out_dir, victims, hold):
    from megatron_elaswave.launch.store import connect_store

    rank = int(os.environ["RANK"])
    store = connect_store(timeout=timedelta(seconds=WAIT_S))
    deaths = read_until_dead(store, victims)
    seen_at = time.time()
    store.set(f"test/alive/{rank}", str(rank))
    report = {
        "rank": rank,
        "deaths": [asdict(death) for death in deaths],
        "seen_at": seen_at,
        "store_readback": store.get(f"test/alive/{rank}").decode(),
    }
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as out:
        json.dump(report, out)
    os.replace(path + ".tmp", path)
    if hold:
        store.wait([f"test/release/{rank}"])  # the store's timeout bounds the wait


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("victims", type=lambda text: {int(rank) for rank in text.split(",")})
    parser.add_argument("--victim-exit", type=int)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    if int(os.environ["RANK"]) in args.victims:
        if args.victim_exit is not None:
            sys.exit(args.victim_exit)
        while True:
            time.sleep(1)
    survive(args.out_dir, args.victims, args.hold)
