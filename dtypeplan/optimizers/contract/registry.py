"""The registry of optimizer implementations, keyed by the names the rules table uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from dtypeplan.errors import RegistryError
from dtypeplan.optimizers.contract.base import MixedPrecisionOptimizer

__all__ = ["get_implementation", "register", "registered_names"]

_REGISTRY: dict[str, type[MixedPrecisionOptimizer]] = {}

T = TypeVar("T", bound="type[MixedPrecisionOptimizer]")


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make an optimizer class buildable under ``name`` from a rules file.

    Registering a name twice raises :class:`RegistryError` (at import time, for the module that
    does it).
    """
    if not isinstance(name, str) or not name:
        raise RegistryError("an implementation name must be a non-empty string")

    def decorate(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, MixedPrecisionOptimizer)):
            raise RegistryError(
                f"@register({name!r}) needs a subclass of dtypeplan.MixedPrecisionOptimizer, "
                f"got {cls!r}"
            )
        if name in _REGISTRY:
            raise RegistryError(
                f"implementation name {name!r} is already registered to "
                f"{_REGISTRY[name].__module__}.{_REGISTRY[name].__qualname__}"
            )
        _REGISTRY[name] = cls
        return cls

    return decorate


def get_implementation(name: str) -> type[MixedPrecisionOptimizer]:
    """The class registered as ``name``; :class:`RegistryError` listing the names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise RegistryError(
            f"no implementation registered as {name!r} (registered: {known})"
        ) from None


def registered_names() -> list[str]:
    """Every registered name, sorted (what ``load_rules(implementations=...)`` takes)."""
    return sorted(_REGISTRY)
