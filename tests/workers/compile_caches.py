"""Writes to ``REPORT`` whether torch came preloaded, and which of ``torch.compile``'s
per-process caches this process (which has compiled nothing) finds filled: the CPU's vector
instruction sets probed, the joint-graph passes registered for the CPU as a CPU compilation
asks for them.

Usage: compile_caches.py REPORT
"""

import json
import sys

PRELOADED = "torch" in sys.modules

import torch  # noqa: E402 - after noting what was preloaded
from torch._inductor import cpu_vec_isa  # noqa: E402
from torch._inductor.fx_passes import joint_graph  # noqa: E402

probed = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize > 0
hits = joint_graph.lazy_init.cache_info().hits
joint_graph.lazy_init(torch.device("cpu"))
registered = joint_graph.lazy_init.cache_info().hits == hits + 1
with open(sys.argv[1], "w") as report:
    json.dump({"preloaded": PRELOADED, "vector_isa_probed": probed,
               "joint_graph_passes_registered": registered}, report)
