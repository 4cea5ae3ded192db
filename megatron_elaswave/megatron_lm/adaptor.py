"""Adapt Megatron-LM's own training loop: check it, patch it for this machine, add ``--elastic``.

Importing this module is the whole setup; ``import megatron_elaswave.megatron_adaptor``, the
documented name, does so at the top of a Megatron-LM ``pretrain_gpt.py``, and the runner
(:mod:`.runner`) for an untouched script, which ``elaswave-run`` picks for a script at the root
of a Megatron-LM checkout::

    elaswave-run --nproc-per-node 4 /path/to/Megatron-LM/pretrain_gpt.py <its usual flags>

On import the adaptor finds Megatron-LM (``megatron.training``, from a checkout on ``PYTHONPATH``
or beside the script), checks that its megatron-core is a version this project was checked
against, and on a machine without CUDA applies the device compatibility patches
(``patches.device_compat`` for megatron-core, ``patches.megatron_lm`` for the training loop), so
the same command trains on CPU with ``--distributed-backend gloo``. It also adds ``--elastic``
and the ``--elastic-*`` flags to Megatron-LM's parser; with ``--elastic`` the run survives
failed ranks inside Megatron-LM's own ``train()`` (``patches.megatron_lm_elastic``, calling into
:mod:`.hooks`). Anything missing or unsupported ends the process with a one-line message, before
training starts.
"""

from __future__ import annotations

import importlib

from packaging.version import InvalidVersion, Version

from megatron_elaswave import patches
from megatron_elaswave.device import DeviceUnavailableError, resolve_device_backend
from megatron_elaswave.patches import megatron_lm, megatron_lm_elastic

from .hooks import ElasticHooks

CHECKED_CHECKOUT = "core_v0.16.1 to core_v0.19.0"
"""The Megatron-LM releases the adaptor was read and tested against: the tags core_v0.16.1,
core_v0.17.1, core_v0.18.2 and core_v0.19.0, and the release branch core_r0.19.0."""


class AdaptorError(SystemExit):
    """Megatron-LM cannot be adapted: the process ends with this message (no traceback), named
    after the documented entry point."""

    def __init__(self, message: str) -> None:
        super().__init__(f"megatron_elaswave.megatron_adaptor: {message}")


def megatron_lm_version() -> Version:
    """The version of the megatron-core inside the Megatron-LM that ``import megatron`` finds."""
    try:
        importlib.import_module("megatron.training")
    except ImportError as error:
        raise AdaptorError(
            f"Megatron-LM's training package is not importable ({error}): put a Megatron-LM "
            f"checkout ({CHECKED_CHECKOUT}) on PYTHONPATH, with its own requirements installed"
        ) from None
    package_info = importlib.import_module("megatron.core.package_info")
    try:
        return Version(package_info.__version__)
    except InvalidVersion:
        raise AdaptorError(f"cannot read Megatron-LM's version ({package_info.__version__!r})") from None


def adapt() -> patches.PatchRegistry:
    """Check Megatron-LM and apply what this machine needs and the ``--elastic`` hooks; the
    applied patches."""
    try:  # first: a torch without an API the project uses may not even import Megatron-LM
        patches.check_torch()
    except patches.UnsupportedTorch as error:
        raise AdaptorError(str(error)) from None
    version = megatron_lm_version()
    if version not in patches.SUPPORTED_MEGATRON_CORE:
        raise AdaptorError(
            f"this Megatron-LM has megatron-core {version}; megatron-elaswave supports "
            f"{patches.SUPPORTED_MEGATRON_CORE}: use a checkout of {CHECKED_CHECKOUT}")
    try:
        backend = resolve_device_backend()
    except DeviceUnavailableError as error:
        raise AdaptorError(str(error)) from None
    registry = patches.compatibility_registry(backend, megatron_core_version=version)
    hooks = ElasticHooks(backend)
    megatron_lm_elastic.register(registry, backend, hooks)
    megatron_lm.register_prebuilt_dataset_helpers(registry)
    if backend.name != "cuda":
        megatron_lm.register(registry, backend, distributed=hooks.distributed)
    try:
        registry.apply()
    except patches.PatchTargetError as error:
        raise AdaptorError(f"{error}: this Megatron-LM differs from {CHECKED_CHECKOUT}, "
                           f"which the adaptor was checked against") from None
    return registry


applied = adapt()
"""The patches this import applied."""
