"""Ends as planned per start: ``rejoin_plan.py DIR RANK:STATUS[@DELAY][,...] ...``.

The k-th start of RANK ends with the k-th STATUS (the last one repeats) after DELAY seconds
(default 0.2): an exit code, or a signal name it sends itself. Ranks without a plan sleep 3 s and exit 0. Every start appends
``{"rank", "pid", "rejoin", "restart_count"}`` to ``DIR/starts.jsonl``.
"""

import json
import os
import signal
import sys
import time

if __name__ == "__main__":
    directory, *entries = sys.argv[1:]
    plans = {rank: statuses.split(",") for rank, statuses in (e.split(":", 1) for e in entries)}
    rank, restart_count = os.environ["RANK"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with open(os.path.join(directory, "starts.jsonl"), "a") as starts:
        starts.write(json.dumps({"rank": int(rank), "pid": os.getpid(),
                                 "rejoin": os.environ.get("ELASWAVE_REJOIN"),
                                 "restart_count": restart_count}) + "\n")
    if rank not in plans:
        time.sleep(3)
        sys.exit(0)
    statuses = plans[rank]
    status, _, delay = statuses[min(restart_count, len(statuses) - 1)].partition("@")
    time.sleep(float(delay or 0.2))
    if status.startswith("SIG"):
        os.kill(os.getpid(), signal.Signals[status])
    sys.exit(int(status))
