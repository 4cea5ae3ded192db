"""Reports SIGTERM: writes ``OUT_DIR/rank<r>.ready`` once its handler is installed and
``OUT_DIR/rank<r>.term`` when SIGTERM arrives. Rank 0 then exits 0; the others ignore it and
keep sleeping, to be killed by the launcher at the end of its grace period.

Usage: sigterm.py OUT_DIR
"""

import os
import signal
import sys
import time


def on_sigterm(signum, frame):
    open(os.path.join(out_dir, f"rank{rank}.term"), "w").close()
    if rank == 0:
        sys.exit(0)


if __name__ == "__main__":
    out_dir, rank = sys.argv[1], int(os.environ["RANK"])
    signal.signal(signal.SIGTERM, on_sigterm)
    open(os.path.join(out_dir, f"rank{rank}.ready"), "w").close()
    while True:
        time.sleep(0.1)
