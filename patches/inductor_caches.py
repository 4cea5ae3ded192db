"""What ``torch.compile`` learns once per process on a CPU, learnt before workers are forked:
``torch._inductor.cpu_vec_isa``, ``torch._inductor.codecache`` and ``torch._inductor.fx_passes``.

Checked against torch 2.13.0 (the CPU build, and the CUDA build on a host without a GPU, with
triton).

megatron-core wraps its fused kernels in ``torch.compile`` (``megatron.core.jit.jit_fuser``), so
every worker compiles them, even when it finds them in Inductor's on-disk cache. Before its first
compilation on a CPU a process fills caches that are the same in every worker of a host: it probes
which vector instruction sets the CPU runs (a C++ probe built and loaded in a new interpreter, per
instruction set), hashes torch's sources (and triton's), and registers Inductor's pattern
passes: about 2 s of CPU (1.87 s measured in one process), paid by the node's workers all at once
at their first step. Filled in the fork server, they are inherited by every worker.
"""

from __future__ import annotations

import functools


def warm_cpu_compile_caches() -> None:
    """Fill the per-process caches of ``torch.compile``'s first CPU compilation in this process.

    Each is a ``functools`` cache keyed as a CPU compilation calls it, so a process forked
    afterwards finds it filled. Touches no CUDA or HIP runtime, starts no thread and leaves no
    child process. A cache this torch lacks (a release that renamed it) or that fails to fill is
    left to the workers, and the others are still filled: this never raises.
    """
    try:
        import torch
        from torch._inductor import codecache, cpu_vec_isa
        from torch._inductor.fx_passes import joint_graph, post_grad, pre_grad
    except Exception:  # noqa: BLE001 - no Inductor here: the workers do without it too
        return
    warmers = (
        cpu_vec_isa.valid_vec_isa_list,
        codecache.torch_key,
        codecache.triton_key,
        pre_grad.lazy_init,
        # compile_fx passes the first input's device, positionally: the same cache key.
        functools.partial(joint_graph.lazy_init, torch.device("cpu")),
        post_grad.lazy_init,
    )
    for warm in warmers:
        try:
            warm()
        except Exception:  # noqa: BLE001 - a cache left empty is filled by the worker itself
            continue
