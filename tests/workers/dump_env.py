"""Writes this worker's launch environment to ``OUT_DIR/rank<RANK>.json`` and says hello.

Usage: dump_env.py OUT_DIR [ARGS ...]. Besides the environment it records what a forked worker
must see as an executed one does (``__name__``, ``sys.argv``, ``sys.path[0]``, the working
directory, an empty stdin), whether torch was already imported when the script started, and
the command line ``ps`` shows for it (its process title).
At exit it writes ``OUT_DIR/rank<RANK>.atexit``.
"""

import atexit
import json
import os
import sys

PRELOADED = "torch" in sys.modules

NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
    "ELASWAVE_STORE_ADDR",
    "ELASWAVE_STORE_PORT",
    "TORCH_CPP_LOG_LEVEL",
)

if __name__ == "__main__":
    out_dir = sys.argv[1]
    seen = {name: os.environ.get(name) for name in NAMES}
    seen.update(pid=os.getpid(), ppid=os.getppid(), argv=sys.argv[2:], argv0=sys.argv[0],
                path0=sys.path[0], cwd=os.getcwd(), stdin=sys.stdin.read(), name=__name__,
                preloaded=PRELOADED,
                title=open("/proc/self/cmdline").read().replace("\0", " ").strip())
    atexit_path = os.path.join(out_dir, f"rank{os.environ['RANK']}.atexit")
    atexit.register(lambda: open(atexit_path, "w").close())
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as out:
        json.dump(seen, out)
    print(f"hello from rank {os.environ['RANK']}")
