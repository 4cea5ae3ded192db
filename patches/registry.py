"""A registry of monkey patches addressed by dotted name.

Guarantees:

* A patch names its target by a dotted path (``"pkg.module.Class.method"`` or
  ``"pkg.module.function"``); the longest importable prefix is the module.
* A name an import fallback forgot can be *defined* (:meth:`PatchRegistry.define`): set where its
  owner lacks it, left alone where it has it, deleted again by ``remove()``.
* A target may get one *replacement* and any number of *wrappers*. Wrappers stack, in
  registration order, on top of the replacement (or of the original when there is none): the
  installed object is ``wrapper_n(...wrapper_1(replacement or original))``.
* ``apply()`` is idempotent, and patches registered after an ``apply()`` are installed by the
  next one. For module-level targets it also replaces aliases that other loaded modules made with
  ``from module import name``, since those bind the original object directly.
* ``remove()`` restores every original object, aliases included, in reverse order.
* ``classmethod`` and ``staticmethod`` descriptors are preserved: wrappers see the plain function.
"""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

Wrapper = Callable[[Any], Any]


class PatchTargetError(LookupError):
    """A patch names something that cannot be found."""


def resolve(dotted_name: str, *, missing_ok: bool = False) -> tuple[Any, str]:
    """Return ``(owner, attribute)`` for a dotted name; importing the longest module prefix.
    With ``missing_ok`` the owner need not have the attribute yet."""
    parts = dotted_name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            for part in parts[split:-1]:
                owner = getattr(owner, part)
        except AttributeError as error:
            raise PatchTargetError(f"cannot patch {dotted_name}: {error}") from None
        if not missing_ok and not hasattr(owner, parts[-1]):
            raise PatchTargetError(f"cannot patch {dotted_name}: {module_name} has no such attribute")
        return owner, parts[-1]
    raise PatchTargetError(f"cannot patch {dotted_name}: no importable module in its name")


def _raw_attribute(owner: Any, name: str) -> Any:
    """The attribute as stored, descriptors included (``Class.__dict__`` for classes)."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in klass.__dict__:
                return klass.__dict__[name]
    return getattr(owner, name)


@dataclass
class _Patch:
    target: str
    replacement: Any = None
    wrappers: list[Wrapper] = field(default_factory=list)
    only_where_missing: bool = False
    # Set while applied: where the original lived, and every alias we overwrote.
    owner: Any = None
    original: Any = None
    owner_had_own_attribute: bool = False
    aliases: list[tuple[dict, str]] = field(default_factory=list)

    @property
    def applied(self) -> bool:
        return self.owner is not None

    def build(self, original: Any) -> Any:
        descriptor = type(original) if isinstance(original, (classmethod, staticmethod)) else None
        obj = self.replacement if self.replacement is not None else original
        if descriptor is not None and isinstance(obj, descriptor):
            obj = obj.__func__
        for wrapper in self.wrappers:
            obj = wrapper(obj)
        return descriptor(obj) if descriptor is not None else obj


class PatchRegistry:
    """Named patches that can be applied and removed as a set."""

    def __init__(self) -> None:
        self._patches: dict[str, _Patch] = {}

    def register(self, target: str, replacement: Any) -> None:
        """Replace ``target`` with ``replacement`` when applied."""
        patch = self._patches.setdefault(target, _Patch(target))
        if patch.applied:
            raise RuntimeError(f"{target} is applied; remove() before registering a replacement")
        if patch.replacement is not None and patch.replacement is not replacement:
            raise ValueError(f"{target} already has a different replacement")
        patch.replacement = replacement

    def define(self, target: str, value: Any) -> None:
        """Set ``target`` to ``value`` when applied, where its owner lacks the attribute (a name
        an import fallback forgot); where the owner has it, leave it as it is."""
        self.register(target, value)
        self._patches[target].only_where_missing = True

    def register_wrapper(self, target: str, wrapper: Wrapper) -> None:
        """Wrap ``target`` when applied: ``wrapper(current)`` must return the new object."""
        patch = self._patches.setdefault(target, _Patch(target))
        if patch.applied:
            raise RuntimeError(f"{target} is applied; remove() before adding a wrapper")
        if wrapper not in patch.wrappers:
            patch.wrappers.append(wrapper)

    @property
    def targets(self) -> list[str]:
        return list(self._patches)

    def is_applied(self, target: str) -> bool:
        return target in self._patches and self._patches[target].applied

    def apply(self) -> None:
        """Install every registered patch that is not installed yet."""
        pending = [p for p in self._patches.values() if not p.applied]
        replaced_functions: dict[int, tuple[Any, Any, _Patch]] = {}
        for patch in pending:
            owner, name = resolve(patch.target, missing_ok=patch.only_where_missing)
            if patch.only_where_missing:
                patch.owner_had_own_attribute = hasattr(owner, name)
                patch.original = getattr(owner, name, None)
                if not patch.owner_had_own_attribute:
                    setattr(owner, name, patch.replacement)
                patch.owner = owner
                continue
            original = _raw_attribute(owner, name)
            new = patch.build(original)
            patch.owner_had_own_attribute = not isinstance(owner, type) or name in owner.__dict__
            setattr(owner, name, new)
            patch.owner, patch.original = owner, original
            # Modules are shared by everyone: only functions and classes are re-bound by alias.
            if isinstance(owner, types.ModuleType) and not isinstance(original, types.ModuleType):
                replaced_functions[id(original)] = (original, new, patch)
        if replaced_functions:
            self._replace_aliases(replaced_functions)

    @staticmethod
    def _replace_aliases(replaced: dict[int, tuple[Any, Any, _Patch]]) -> None:
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for name, value in list(namespace.items()):
                entry = replaced.get(id(value))
                if entry is None or entry[0] is not value:
                    continue
                original, new, patch = entry
                if namespace is patch.owner.__dict__ and name == patch.target.rsplit(".", 1)[1]:
                    continue
                namespace[name] = new
                patch.aliases.append((namespace, name))

    def remove(self) -> None:
        """Restore every original object, most recently applied first."""
        for patch in reversed(list(self._patches.values())):
            if not patch.applied:
                continue
            name = patch.target.rsplit(".", 1)[1]
            for namespace, alias in patch.aliases:
                namespace[alias] = patch.original
            if patch.owner_had_own_attribute:
                setattr(patch.owner, name, patch.original)
            else:
                delattr(patch.owner, name)
            patch.owner, patch.original, patch.aliases = None, None, []
