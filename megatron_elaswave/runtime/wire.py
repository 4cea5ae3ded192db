"""What ranks read from each other and from the job store is loaded without running code.

The small state of a snapshot (the iteration, the LR schedule, the RNG states) and its header
travel between ranks, and a restore publishes it in the job store. Whoever can write there (a
``TCPStore`` has no authentication; an etcd cluster may be shared) must not be able to run code
in every worker, as a plain ``pickle.loads`` would let them. :func:`loads` reads pickles of plain
data only: the builtin containers and scalars, numpy arrays (the RNG state of numpy), torch
dtypes and sizes (tensor layouts); any other class or function a pickle names is refused with
:class:`UnsafePayload`.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

_ALLOWED = frozenset({
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"),
    ("builtins", "complex"), ("builtins", "slice"), ("collections", "OrderedDict"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("torch", "Size"),
})


class UnsafePayload(pickle.UnpicklingError):
    """A payload names a class or function that is not plain data."""


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafePayload(f"refused to load {module}.{name}: only plain data is read from "
                            f"peers and the job store")


def dumps(value: Any) -> bytes:
    """``value`` (plain data, :func:`loads`) as bytes."""
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    """The plain data of ``data``; raises :class:`UnsafePayload` if it names anything else."""
    return _PlainDataUnpickler(io.BytesIO(data)).load()
