"""Ends as planned: ``exit_plan.py RANK:DELAY:STATUS ...``.

STATUS is an exit code or a signal name (``SIGKILL``) the worker sends itself after DELAY
seconds. Ranks without a plan exit 0 at once.
"""

import os
import signal
import sys
import time

if __name__ == "__main__":
    plans = dict(entry.split(":", 1) for entry in sys.argv[1:])
    delay, status = plans.get(os.environ["RANK"], "0:0").split(":")
    time.sleep(float(delay))
    if status.startswith("SIG"):
        os.kill(os.getpid(), signal.Signals[status])
    sys.exit(int(status))
