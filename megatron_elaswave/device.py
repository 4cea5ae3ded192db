"""The device a rank computes on, and the collective library that goes with it.

One :class:`DeviceBackend` answers every device question the runtime asks (which device, which
``torch.distributed`` backend, RNG state, synchronisation, memory), so the rest of the code never
names CUDA. Three backends exist:

==========  ======================  ============================================
name        collectives             needs
==========  ======================  ============================================
``cpu``     gloo                    nothing (the default where no accelerator is)
``cuda``    nccl                    a CUDA build of torch and a visible GPU
``npu``     hccl                    ``torch_npu`` (imported only when asked for)
==========  ======================  ============================================

The choice is, in order: an explicit name (``--elastic-device``), the ``ELASWAVE_DEVICE``
environment variable, then auto-detection (CUDA, then NPU, then CPU).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

import torch

DEVICE_ENV_VAR = "ELASWAVE_DEVICE"
BACKEND_NAMES = ("cpu", "cuda", "npu")
_DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
_ASYNC_ERROR_HANDLING = {
    # torch's NCCL watchdog tears the process down when a communicator errors (its default, 3):
    # 2 aborts the communicator only, so the failed operation raises where the runtime recovers.
    "cuda": ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", ("0", "2")),
    # torch_npu's HCCL watchdog ends the process on some errors when it is on (its default, 1).
    "npu": ("HCCL_ASYNC_ERROR_HANDLING", "0", ("0",)),
}
"""Per device: the collective library's error-handling variable, the value that keeps a process
whose communicator saw a peer fail alive, and the values that already do."""


class DeviceUnavailableError(RuntimeError):
    """The requested device cannot be used on this machine."""


def _npu_module() -> ModuleType | None:
    """``torch.npu`` after importing ``torch_npu``, or ``None`` where it is not installed."""
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return None
    return getattr(torch, "npu", None)


@dataclass(frozen=True)
class DeviceBackend:
    """A device type and its collective library."""

    name: str
    """``cpu``, ``cuda`` or ``npu``."""

    def __post_init__(self) -> None:
        if self.name not in BACKEND_NAMES:
            raise ValueError(f"unknown device {self.name!r}; choose one of {', '.join(BACKEND_NAMES)}")

    @property
    def dist_backend(self) -> str:
        """The ``torch.distributed`` backend: gloo, nccl or hccl."""
        return _DIST_BACKENDS[self.name]

    @property
    def module(self) -> ModuleType:
        """``torch.cpu``, ``torch.cuda`` or ``torch.npu``."""
        if self.name == "npu":
            module = _npu_module()
            if module is None:
                raise DeviceUnavailableError("the npu device needs torch_npu: pip install torch-npu")
            return module
        return getattr(torch, self.name)

    @property
    def is_accelerator(self) -> bool:
        return self.name != "cpu"

    def device(self, local_rank: int | None = None) -> torch.device:
        """The device of a local rank (the current one when ``local_rank`` is None)."""
        if not self.is_accelerator:
            return torch.device("cpu")
        index = self.module.current_device() if local_rank is None else local_rank
        return torch.device(self.name, index)

    def set_device(self, local_rank: int) -> None:
        if self.is_accelerator:
            self.module.set_device(local_rank)

    def synchronize(self) -> None:
        self.module.synchronize()

    def keep_survivors_alive(self) -> str | None:
        """Make the collective library leave a process alive when one of its communicators sees
        a peer fail, which it otherwise ends: with ``--elastic`` the survivors must live to
        recover. Sets the variable of :data:`_ASYNC_ERROR_HANDLING` for this process (and those
        it starts); call it before the backend's first process group is created. Returns what
        it overrode, to be said, when the environment asked for a value that ends survivors."""
        if self.name not in _ASYNC_ERROR_HANDLING:
            return None
        variable, value, surviving = _ASYNC_ERROR_HANDLING[self.name]
        given = os.environ.get(variable)
        os.environ[variable] = value if given not in surviving else given
        if given is None or given in surviving:
            return None
        return (f"{variable}={given} would end the survivors of a failure; --elastic sets "
                f"{variable}={value}")

    @property
    def generator(self) -> torch.Generator:
        """The default generator of the current device; on CPU, torch's default generator."""
        if not self.is_accelerator:
            return torch.default_generator
        return self.module.default_generators[self.module.current_device()]

    def manual_seed(self, seed: int) -> None:
        self.generator.manual_seed(int(seed))

    def get_rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """Whether training in ``dtype`` is supported on this device with its collectives."""
        return self.is_accelerator or dtype == torch.float32

    def memory_allocated(self) -> int:
        """Bytes allocated by tensors on the current device (0 on CPU, which does not track it)."""
        return self.module.memory_allocated() if self.is_accelerator else 0


def _available(name: str) -> bool:
    if name == "cpu":
        return True
    if name == "cuda":
        return torch.cuda.is_available()
    module = _npu_module()
    return module is not None and module.is_available()


def resolve_device_backend(requested: str | None = None) -> DeviceBackend:
    """Pick the backend: ``requested``, else ``$ELASWAVE_DEVICE``, else the best available.

    ``auto`` (or nothing) means auto-detection. An explicit choice that this machine cannot serve
    raises :class:`DeviceUnavailableError` rather than silently falling back.
    """
    choice = (requested or os.environ.get(DEVICE_ENV_VAR) or "auto").strip().lower()
    if choice == "auto":
        return DeviceBackend(next(name for name in ("cuda", "npu", "cpu") if _available(name)))
    backend = DeviceBackend(choice)
    if not _available(choice):
        hint = "install torch-npu" if choice == "npu" else "no CUDA device is visible"
        raise DeviceUnavailableError(f"device {choice!r} is not available here ({hint})")
    return backend
