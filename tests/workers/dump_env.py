"""Writes this worker's launch environment to ``OUT_DIR/rank<RANK>.json`` and says hello.

Usage: dump_env.py OUT_DIR
"""

import json
import os
import sys

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
    seen.update(pid=os.getpid(), ppid=os.getppid(), argv=sys.argv[2:])
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as out:
        json.dump(seen, out)
    print(f"hello from rank {os.environ['RANK']}")
