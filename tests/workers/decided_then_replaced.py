"""Rank 1 dies; its replacement is taken in by a decision, and a second decision excludes it
just before it dies too (its join interrupted): ``decided_then_replaced.py DIR HOLD_S``.

Rank 0 runs ``HOLD_S`` seconds and exits 0. Rank 1's first start exits 1. Its second start
commits both decisions to the job store (generation 1 joins rank 1, generation 2 excludes it)
and exits 1 at once, before its launcher reads them. Its third start runs ``HOLD_S`` seconds
and exits 0: a launcher that took the decisions for ones about it would kill it. Every start
appends ``{"rank", "pid", "restart_count"}`` to ``DIR/starts.jsonl``.
"""

import json
import os
import sys
import time

from megatron_elaswave.launch.decisions import Decision
from megatron_elaswave.launch.keys import decision_key
from megatron_elaswave.launch.store import connect_store

if __name__ == "__main__":
    directory, hold_s = sys.argv[1], float(sys.argv[2])
    rank, restart_count = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with open(os.path.join(directory, "starts.jsonl"), "a") as starts:
        starts.write(json.dumps({"rank": rank, "pid": os.getpid(),
                                 "restart_count": restart_count}) + "\n")
    if rank == 1 and restart_count == 0:
        sys.exit(1)
    if rank == 1 and restart_count == 1:
        store = connect_store()
        store.set(decision_key(0), Decision(1, (0, 1), (), joined=(1,), relayout=True).to_json())
        store.set(decision_key(1), Decision(2, (0,), (1,), causes=((1, "exited with 1"),),
                                            failed_at=time.time()).to_json())
        os._exit(1)
    time.sleep(hold_s)
