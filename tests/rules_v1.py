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


def v1_regions(rules: list[V1Rule]) -> list:
    """The version-1 table as disjoint boxes with one verdict each (see
    ``dtypeplan.resolver._diff``): every rule's box (the boxes are disjoint in a valid version-1
    file), cut where the core settings are an Error (that Error decides there, unless the rule
    is an Error too), a deferring rule's boxes cut by where their points land."""
    from dtypeplan.resolver._boxes import FULL, intersect, remaining, with_values
    from dtypeplan.resolver._diff import Region, deferred
    from dtypeplan.resolver._rules import _mask

    core_errors = [
        (with_values(_mask(r.when), {d: None for d in FEATURES_UNUSED}), r)
        for r in rules
        if r.status == "Error"
        and intersect(_mask(r.when), with_values(FULL, FEATURES_UNUSED)) is not None
    ]
    core_boxes = [
        intersect(box, with_values(_mask(r.when), dict(FEATURES_UNUSED))) for box, r in core_errors
    ]
    # A core Error rule's region: the core combinations it holds, with any features.
    core = [
        (with_values(c, {d: None for d in FEATURES_UNUSED}), r)
        for c, (_, r) in zip(core_boxes, core_errors, strict=True)
        if c is not None
    ]

    def verdict(rule: V1Rule) -> Verdict:
        return (rule.status or "", rule.implementation, rule.single)

    plain, deferring = [], []
    for rule in rules:
        box = _mask(rule.when)
        if rule.status == "Error":
            plain.append(Region(box, verdict(rule), rule.id))
            continue
        for core_box, error in core:
            common = intersect(box, core_box)
            if common is not None:
                plain.append(Region(common, verdict(error), error.id))
        for piece in remaining(box, [c for c, _ in core]):
            if rule.decide_as:
                deferring.append((rule, piece))
            else:
                plain.append(Region(piece, verdict(rule), rule.id))
    out = list(plain)
    for rule, piece in deferring:
        out.extend(deferred(piece, rule.decide_as, plain, rule.id))
    return out
