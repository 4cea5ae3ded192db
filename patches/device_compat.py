"""Run megatron-core's GPT, DDP, DistributedOptimizer and pipeline schedules off CUDA.

Checked against megatron-core 0.16.1 and 0.19.2 (the call sites below are 0.16.1's line numbers;
0.19.2's new CUDA sites are off the GPT, DDP, distributed-optimizer and pipeline path).

Megatron-Core hard-codes CUDA in four ways; each gets the narrowest redirection that works:

1. ``device=torch.cuda.current_device()`` (about 40 sites) and ``torch.cuda`` helpers (streams,
   synchronize, memory counters, RNG): the ``torch.cuda`` functions Megatron calls are pointed at
   the backend, with ``current_device()`` returning a ``torch.device``; a stream records a real
   event where the backend's stream records none (the MoE alltoall dispatcher synchronises on
   it). No tensor op is intercepted.
2. A literal ``device="cuda"`` in factory calls (about 25 sites in the modules of
   :data:`LITERAL_CUDA_MODULES`): those modules alone see a ``torch`` whose factory functions
   map ``"cuda"`` to the backend's device. Every other module, and user code, sees plain torch.
3. ``Tensor.cuda()`` (shared embeddings, grad scaler, optimizer buffers) returns the tensor
   itself: on a machine without CUDA the call could only fail.
4. ``Tensor.type() == 'torch.cuda.FloatTensor'`` checks: only while the functions of
   :data:`CUDA_TYPE_STRING_FUNCTIONS` run does ``Tensor.type()`` answer with the CUDA name.

The CPU generator doubles as the "CUDA" generator, so dropout inside Megatron's RNG tracker moves
the CPU RNG by design; the tracker's warning about it is dropped.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from typing import Any, Callable

import torch

from .interfaces import DeviceBackend
from .registry import PatchRegistry

LITERAL_CUDA_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.transformer.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.tensor_parallel.data",
    "megatron.core.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.transformer.moe.moe_utils",
)

CUDA_TYPE_STRING_FUNCTIONS = (
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups",
    "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__",
    "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
)

_FACTORY_FUNCTIONS = (
    "arange", "empty", "empty_like", "full", "ones", "ones_like", "rand", "randint", "randn",
    "tensor", "zeros", "zeros_like",
)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


def _device_mapped(factory: Callable, device: torch.device) -> Callable:
    @functools.wraps(factory)
    def create(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = device
        return factory(*args, **kwargs)

    return create


def device_mapped_torch(device: torch.device) -> types.ModuleType:
    """A stand-in for the ``torch`` module whose factories map ``device="cuda"`` to ``device``."""
    proxy = types.ModuleType("torch", torch.__doc__)
    proxy.__dict__.update(vars(torch))
    for name in _FACTORY_FUNCTIONS:
        setattr(proxy, name, _device_mapped(getattr(torch, name), device))
    # torch loads some submodules lazily through a module __getattr__; keep that path.
    proxy.__getattr__ = lambda name: getattr(torch, name)
    return proxy


@contextlib.contextmanager
def _cuda_type_strings():
    true_type = torch.Tensor.type

    def type_as_on_cuda(self, *args, **kwargs):
        name = true_type(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
            return name
        return "torch.cuda." + name.split(".")[-1]

    torch.Tensor.type = type_as_on_cuda
    try:
        yield
    finally:
        torch.Tensor.type = true_type


def _with_cuda_type_strings(function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        with _cuda_type_strings():
            return function(*args, **kwargs)

    return wrapped


def stay_on_device(tensor_or_module, *args, **kwargs):
    """``.cuda(...)`` of a tensor or module off CUDA: it stays where it is."""
    return tensor_or_module


class _DropCpuRngWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed" not in record.getMessage()


def _logging_without_cpu_rng_warning() -> types.ModuleType:
    proxy = types.ModuleType("logging", logging.__doc__)
    proxy.__dict__.update(vars(logging))
    rng_filter = _DropCpuRngWarning()

    def get_logger(name: str | None = None) -> logging.Logger:
        logger = logging.getLogger(name)
        if rng_filter not in logger.filters:
            logger.addFilter(rng_filter)
        return logger

    proxy.getLogger = get_logger
    return proxy


def _stream_with_events(module: types.ModuleType) -> type:
    """The backend's stream class, whose ``record_event`` returns a recorded event where the
    backend's returns none (the CPU stream's is a stub): the alltoall token dispatcher waits on
    the event of its device-to-host stream."""
    stream = module.Stream

    class StreamWithEvents(stream):
        def record_event(self, event=None):
            recorded = super().record_event() if event is None else super().record_event(event)
            if recorded is None:
                recorded = event if event is not None else module.Event()
                recorded.record()
            return recorded

    StreamWithEvents.__name__ = StreamWithEvents.__qualname__ = stream.__name__
    return StreamWithEvents


def _cuda_facade(backend: DeviceBackend) -> dict[str, Any]:
    """Replacements for the ``torch.cuda`` functions Megatron-Core calls."""
    module, device = backend.module, backend.device()
    zero_bytes = lambda *args, **kwargs: 0  # noqa: E731 - the CPU allocator is not tracked
    facade = {
        "Stream": _stream_with_events(module),
        "stream": module.stream,
        "current_stream": module.current_stream,
        "default_stream": module.current_stream,
        # A function of its own: torch.compile keeps one handler per function, and the
        # backend's synchronize already has one.
        "synchronize": lambda device=None: module.synchronize(),
        "device_count": module.device_count,
        "current_device": lambda: device,
        "set_device": lambda *args, **kwargs: None,
        "empty_cache": lambda: None,
        "memory_allocated": zero_bytes,
        "max_memory_allocated": zero_bytes,
        "memory_reserved": zero_bytes,
        "max_memory_reserved": zero_bytes,
        "reset_peak_memory_stats": lambda *args, **kwargs: None,
        "manual_seed": backend.manual_seed,
        "manual_seed_all": backend.manual_seed,
        "get_rng_state": lambda device=None: backend.get_rng_state(),
        "set_rng_state": lambda state, device=None: backend.set_rng_state(state),
    }
    return facade


def register(registry: PatchRegistry, backend: DeviceBackend) -> None:
    """Register the redirections for a non-CUDA ``backend``."""
    if backend.name == "cuda":
        raise ValueError("CUDA needs no device compatibility patches")
    for name, replacement in _cuda_facade(backend).items():
        registry.register(f"torch.cuda.{name}", replacement)
    mapped_torch = device_mapped_torch(backend.device())
    for module_name in LITERAL_CUDA_MODULES:
        registry.register(f"{module_name}.torch", mapped_torch)
    registry.register("torch.Tensor.cuda", stay_on_device)
    for target in CUDA_TYPE_STRING_FUNCTIONS:
        registry.register_wrapper(target, _with_cuda_type_strings)
    registry.register("megatron.core.tensor_parallel.random.logging", _logging_without_cpu_rng_warning())
