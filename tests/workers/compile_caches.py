"""Writes to ``REPORT`` whether torch came preloaded and whether this process's
``torch.compile`` has probed the CPU's vector instruction sets yet (it has not compiled anything).

Usage: compile_caches.py REPORT
"""

import json
import sys

PRELOADED = "torch" in sys.modules

from torch._inductor import cpu_vec_isa  # noqa: E402 - after noting what was preloaded

probed = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize > 0
with open(sys.argv[1], "w") as report:
    json.dump({"preloaded": PRELOADED, "vector_isa_probed": probed}, report)
