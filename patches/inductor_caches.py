"""What ``torch.compile`` learns once per process on a CPU, learnt before workers are forked:
``torch._inductor.cpu_vec_isa``, ``torch._inductor.codecache`` and ``torch._inductor.fx_passes``.

Checked against torch 2.13.0 (the CPU build, and the CUDA build without a device, with triton).

megatron-core wraps its fused kernels in ``torch.compile`` (``megatron.core.jit.jit_fuser``), so
every worker compiles them, even when it finds them in Inductor's on-disk cache. Before its first
compilation on a CPU a process fills caches that are the same in every worker of a host: it probes
which vector instruction sets the CPU runs (a C++ probe built and loaded in a new interpreter, per
instruction set), hashes torch's sources and the system, and registers Inductor's pattern
passes: about 2 s of CPU (1.87 s measured in one process), paid by the node's workers all at once
at their first step. Filled in the fork server, they are inherited by every worker.
"""

from __future__ import annotations


def warm_cpu_compile_caches() -> None:
    """Fill the per-process caches of ``torch.compile``'s first CPU compilation in this process.

    Each is a ``functools`` cache or a run-once initialiser, so a process forked afterwards has
    them filled. Starts no thread and leaves no child process. Does nothing where this torch lacks
    one of them (a release that renamed it), and never raises: a failure only means the workers
    fill them themselves.
    """
    try:
        from torch._inductor import codecache, cpu_vec_isa
        from torch._inductor.fx_passes import joint_graph, post_grad, pre_grad

        warmers = (cpu_vec_isa.valid_vec_isa_list, codecache.torch_key,
                   codecache.CacheBase.get_system, pre_grad.lazy_init, joint_graph.lazy_init,
                   post_grad.lazy_init)
    except (ImportError, AttributeError):
        return
    for warm in warmers:
        try:
            warm()
        except Exception:  # noqa: BLE001 - a cache left empty is filled by the worker itself
            return
