"""The Megatron-Core versions these patches were checked against, and the check itself."""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

SUPPORTED_MEGATRON_CORE = SpecifierSet(">=0.16.1,<0.20")
"""Every module in this package was read and tested against megatron-core 0.16.1 and 0.19.2;
0.17.1 and 0.18.2 passed the recovery and oracle tests of the README's versions subset. 0.17
and later need Python 3.12 or newer."""


class UnsupportedMegatronVersion(RuntimeError):
    """The installed megatron-core is outside :data:`SUPPORTED_MEGATRON_CORE`."""


def installed_megatron_core_version() -> Version | None:
    try:
        return Version(metadata.version("megatron-core"))
    except metadata.PackageNotFoundError:
        return None


def check_megatron_core_version(version: Version | None = None) -> Version:
    """Return the installed version, or raise :class:`UnsupportedMegatronVersion` with the fix."""
    version = version if version is not None else installed_megatron_core_version()
    install = f"pip install 'megatron-core{SUPPORTED_MEGATRON_CORE}'"
    if version is None:
        raise UnsupportedMegatronVersion(f"megatron-core is not installed; run: {install}")
    if version not in SUPPORTED_MEGATRON_CORE:
        raise UnsupportedMegatronVersion(
            f"megatron-elaswave supports megatron-core {SUPPORTED_MEGATRON_CORE}, "
            f"found {version}; run: {install}"
        )
    return version
