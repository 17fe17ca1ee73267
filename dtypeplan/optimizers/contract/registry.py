"""The registry of optimizer implementations, keyed by the names the rules table uses, each with
the boxes of combinations it declares it serves (``contract/served.py`` for the built-in ones)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from dtypeplan.errors import RegistryError, RulesError
from dtypeplan.optimizers.contract.base import MixedPrecisionOptimizer
from dtypeplan.resolver import Declaration, declaration_boxes

__all__ = [
    "builtin_declarations",
    "get_implementation",
    "register",
    "registered_declarations",
    "registered_names",
]

_REGISTRY: dict[str, type[MixedPrecisionOptimizer]] = {}
_SERVES: dict[str, Declaration | None] = {}

T = TypeVar("T", bound="type[MixedPrecisionOptimizer]")


def register(
    name: str,
    *,
    serves: Sequence[Mapping[str, Any]] | None = None,
    serves_alone: Sequence[Mapping[str, Any]] = (),
) -> Callable[[T], T]:
    """Class decorator: make an optimizer class buildable under ``name`` from a rules file.

    ``serves``: the boxes of combinations the class implements, in the table's dimension
    language (``{"stage": [1, 2], "master": "*", ...}``: a core dimension left out takes any
    value, a feature left out is at its "not used" value). The rules loader refuses an OK rule
    that sends a combination outside them; without ``serves`` no OK rule may name the class.
    ``serves_alone``: boxes it serves only without a process group, as a rule's
    ``single_process_implementation`` (the flat engine runs ZeRO-3's plan in one process).
    Registering a name twice, or a declaration that is not in the table's language, raises
    :class:`RegistryError` (at import time, for the module that does it).
    """
    if not isinstance(name, str) or not name:
        raise RegistryError("an implementation name must be a non-empty string")
    declared = None
    if serves is not None:
        declared = Declaration(
            serves=tuple(dict(box) for box in serves),
            alone=tuple(dict(box) for box in serves_alone),
        )
        try:
            declaration_boxes([*declared.serves, *declared.alone])
        except RulesError as exc:
            raise RegistryError(f"@register({name!r}, serves=...): {exc.message}") from None

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
        _SERVES[name] = declared
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


def registered_declarations() -> dict[str, Declaration | None]:
    """Every registered name with what it serves (what ``load_rules(implementations=...)``
    takes; ``None`` for a class registered without ``serves``)."""
    return {name: _SERVES[name] for name in sorted(_REGISTRY)}


def builtin_declarations() -> dict[str, Declaration | None]:
    """:func:`registered_declarations` of dtypeplan's own implementations only: what the
    generated reference page shows, whatever a user's or a test's module has registered in the
    same process."""
    return {
        name: declared
        for name, declared in registered_declarations().items()
        if _REGISTRY[name].__module__.split(".")[0] == "dtypeplan"
    }
