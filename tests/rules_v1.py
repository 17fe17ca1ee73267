"""The version-1 rules file's semantics, as an oracle: the table as it stood before version 2
(``tests/data/rules/precision_rules_v1.yaml``), evaluated by a linear scan, independent of the
loader.

Version 1: every rule is a box, a dimension it leaves out matching any value; every point is
matched by exactly one rule; a rule with ``decide_as`` defers to the point with those values;
and a point whose core (every feature at its "not used" value) is an Error is that Error unless
its own rule is an Error too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dtypeplan.resolver._dimensions import DIMENSIONS, FEATURES_UNUSED

V1_RULES = Path(__file__).parent / "data" / "rules" / "precision_rules_v1.yaml"

Verdict = tuple[str, str | None, str | None]
"""(status, implementation, single-process implementation)."""


@dataclass(frozen=True)
class V1Rule:
    id: str
    when: dict[str, frozenset[Any]]
    status: str | None
    implementation: str | None
    single: str | None
    decide_as: dict[str, Any]

    def matches(self, point: dict[str, Any]) -> bool:
        return all(_member(point[d], allowed) for d, allowed in self.when.items())


def _member(value: Any, allowed: frozenset[Any]) -> bool:
    return any(value == a and type(value) is type(a) for a in allowed)


def load_v1() -> list[V1Rule]:
    document = yaml.safe_load(V1_RULES.read_text())
    rules = []
    for raw in document["rules"]:
        when = {}
        for dim, spec in raw["when"].items():
            values = DIMENSIONS[dim].values if spec == "*" else spec
            when[dim] = frozenset(values if isinstance(values, (list, tuple)) else [values])
        rules.append(
            V1Rule(
                id=raw["id"],
                when=when,
                status=raw.get("status"),
                implementation=raw.get("implementation"),
                single=raw.get("single_process_implementation"),
                decide_as=dict(raw.get("decide_as") or {}),
            )
        )
    return rules


def _own(rules: list[V1Rule], point: dict[str, Any]) -> V1Rule:
    (rule,) = [r for r in rules if r.matches(point)]
    if not rule.decide_as:
        return rule
    return _own(rules, {**point, **rule.decide_as})


def v1_verdict(rules: list[V1Rule], point: dict[str, Any]) -> tuple[Verdict, str]:
    """The old table's verdict at ``point`` and the id of the rule that gave it."""
    rule = _own(rules, point)
    if rule.status != "Error":
        core = _own(rules, {**point, **FEATURES_UNUSED})
        if core.status == "Error":
            rule = core
    return (rule.status or "", rule.implementation, rule.single), rule.id
