"""The torch APIs megatron-elaswave relies on, probed in the installed torch, and the check itself.

Checked against torch 2.13.0 (CPU, the whole test suite) and 2.11.0+cu130 (the CUDA path on an
H100), and against the sources of torch 2.1 to 2.13 for the release that brought each API (the
``since`` of every entry of :data:`REQUIRED`). The newest of them sets :data:`MINIMUM_TORCH`,
which ``setup.py`` requires too: ``new_group(sort_ranks=False)``, new in torch 2.12.

Each API is probed by feature (the attribute is there, the parameter is in the signature), not
by comparing version strings, so a pre-release or a vendor build that carries the API passes,
and one that lacks it is named. Torch's own private APIs that the project calls belong here, each
beside the module that uses it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

MINIMUM_TORCH = "2.12"
"""The oldest torch release that has every API of :data:`REQUIRED`."""


class UnsupportedTorch(RuntimeError):
    """The installed torch lacks an API that megatron-elaswave uses."""


@dataclass(frozen=True)
class TorchAPI:
    name: str
    """The API as the refusal names it."""
    since: str | None
    """The torch release that brought it, read in torch's sources; ``None``: already in 2.1,
    the oldest release read."""
    present: Callable[[], bool]
    """Whether the installed torch has it."""


_ABSENT = object()


def _resolve(path: str) -> object:
    """The object at the dotted ``path`` (``torch.`` and the rest), or ``_ABSENT``."""
    import torch

    target: object = torch
    for part in path.split(".")[1:]:
        target = getattr(target, part, _ABSENT)
        if target is _ABSENT:
            break
    return target


def _attribute(path: str) -> Callable[[], bool]:
    """Whether ``path`` resolves."""
    return lambda: _resolve(path) is not _ABSENT


def _parameters(path: str, *names: str) -> Callable[[], bool]:
    """Whether the Python function at ``path`` resolves and takes every parameter of ``names``."""
    def present() -> bool:
        function = _resolve(path)
        if function is _ABSENT:
            return False
        try:
            parameters = inspect.signature(function).parameters
        except (TypeError, ValueError):
            return False
        return all(name in parameters for name in names)

    return present


def _documented_parameter(path: str, name: str) -> Callable[[], bool]:
    """Whether the C++-bound callable at ``path`` names parameter ``name`` in its signature line
    (pybind11 writes the signature into the docstring)."""
    def present() -> bool:
        function = _resolve(path)
        return function is not _ABSENT and f"{name}:" in (getattr(function, "__doc__", None) or "")

    return present


def _world_attribute(name: str) -> Callable[[], bool]:
    def present() -> bool:
        from torch.distributed import distributed_c10d

        return hasattr(getattr(distributed_c10d, "_world", None), name)

    return present


_C10D = "torch.distributed.distributed_c10d"

REQUIRED: tuple[TorchAPI, ...] = (
    # megatron_elaswave.runtime.communicator: group ranks in the layout's order, not sorted.
    TorchAPI("torch.distributed.new_group(sort_ranks=...)", "2.12",
             _parameters("torch.distributed.new_group", "sort_ranks")),
    # patches.distributed_c10d.new_named_group
    TorchAPI(f"{_C10D}.GroupName", "2.10", _attribute(f"{_C10D}.GroupName")),
    TorchAPI(f"{_C10D}._new_process_group_helper(group_desc=..., timeout=...)", "2.4",
             _parameters(f"{_C10D}._new_process_group_helper", "group_name", "timeout",
                         "group_desc")),
    TorchAPI(f"{_C10D}._get_default_group", None, _attribute(f"{_C10D}._get_default_group")),
    TorchAPI(f"{_C10D}._world.pg_group_ranks", None, _world_attribute("pg_group_ranks")),
    TorchAPI(f"{_C10D}._world.group_count", None, _world_attribute("group_count")),
    # megatron_elaswave.runtime.communicator and .world: op timeouts and aborts of live groups.
    TorchAPI("torch.distributed.ProcessGroup.set_timeout", "2.9",
             _attribute("torch.distributed.ProcessGroup.set_timeout")),
    TorchAPI("torch.distributed.ProcessGroup.abort", "2.7",
             _attribute("torch.distributed.ProcessGroup.abort")),
    # patches.p2p_communication.op_timeout
    TorchAPI("torch.distributed.ProcessGroup._get_backend", None,
             _attribute("torch.distributed.ProcessGroup._get_backend")),
    # patches.distributed_work
    TorchAPI("torch.distributed.Work.wait(timeout=...)", None,
             _documented_parameter("torch.distributed.Work.wait", "timeout")),
    TorchAPI("torch.distributed.Work.is_completed", None,
             _attribute("torch.distributed.Work.is_completed")),
    TorchAPI("torch.distributed.Work.get_future", None,
             _attribute("torch.distributed.Work.get_future")),
    # patches.parallel_state
    TorchAPI("torch.distributed.get_process_group_ranks", None,
             _attribute("torch.distributed.get_process_group_ranks")),
    # megatron_elaswave.training.setup.startup
    TorchAPI("torch.distributed.DistError", "2.2", _attribute("torch.distributed.DistError")),
    # megatron_elaswave.launch.store.collect_generations: a generation's keys, found to be deleted
    # (pytorch/pytorch#167883).
    TorchAPI("torch.distributed.Store.list_keys", "2.10",
             _attribute("torch.distributed.Store.list_keys")),
    # megatron_elaswave.launch.launcher: the job store outlives the workers it waits for.
    TorchAPI("torch.distributed.TCPStore(wait_for_workers=...)", None,
             _documented_parameter("torch.distributed.TCPStore.__init__", "wait_for_workers")),
)


def missing_torch_api() -> TorchAPI | None:
    """The first API of :data:`REQUIRED` that the installed torch lacks, or ``None``."""
    return next((api for api in REQUIRED if not api.present()), None)


def check_torch() -> None:
    """Raise :class:`UnsupportedTorch`, one line naming the missing API, where the installed
    torch lacks one that megatron-elaswave uses."""
    api = missing_torch_api()
    if api is not None:
        import torch

        raise UnsupportedTorch(
            f"megatron-elaswave needs torch>={MINIMUM_TORCH}: torch {torch.__version__} has no "
            f"{api.name}" + (f" (new in torch {api.since})" if api.since else "")
        )
