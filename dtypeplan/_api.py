"""Where the two layers meet: the resolver's entry points with the optimizer registry filled in.

``dtypeplan.resolver`` is inert data and imports nothing of ``dtypeplan.optimizers``; the
optimizers read the resolver's data. This module joins them (the package root imports it for
``resolve`` / ``load_rules``; ``PrecisionPlan.build`` imports it where nothing has): it
installs the optimizers' builder behind ``PrecisionPlan.build`` / ``prepare_model``, and gives
``resolve`` / ``load_rules`` the registered implementation names, so a rules file naming an
unregistered implementation is refused without the resolver importing the registry.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dtypeplan import resolver
from dtypeplan.optimizers import build_optimizer, prepare_model, registered_declarations
from dtypeplan.resolver import PrecisionPlan, RuleTable

__all__ = ["load_rules", "resolve"]

resolver.install_builder(build_optimizer=build_optimizer, prepare_model=prepare_model)


def load_rules(path: str | os.PathLike[str] | None = None) -> RuleTable:
    """Load and check a rules file (default: the shipped one) against the registered names.

    Raises :class:`dtypeplan.RulesError` naming ``file:line`` (see
    :func:`dtypeplan.resolver.load_rules`).
    """
    return resolver.load_rules(path, implementations=registered_declarations())


def resolve(
    config: dict[str, Any] | str | os.PathLike[str],
    pipeline_parallel: bool = False,
    rules: str | os.PathLike[str] | None = None,
    auto: Mapping[str, Any] | None = None,
    strict: bool = False,
) -> PrecisionPlan:
    """Validate ``config`` and return its :class:`PrecisionPlan` (see docs/api.md).

    ``auto`` fills the config's ``"auto"`` values (dotted path -> value, e.g. from
    :func:`dtypeplan.auto_values_from`); unfilled ones take the HF Trainer's defaults.
    ``strict`` makes every unknown key an error (else an unknown top-level key is a warning).
    """
    return resolver.resolve(
        config, pipeline_parallel, rules, auto, strict, implementations=registered_declarations()
    )
