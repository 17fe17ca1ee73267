"""The precision truth table: loading ``precision_rules.yaml`` and looking combinations up.

A combination (a *point*) has one value on each dimension of :data:`DIMENSIONS` (see
``_dimensions.py``). A rule's ``when`` maps dimensions to a value, a list of values or ``"*"``
(a missing dimension means ``"*"``), so every rule is a *box*: the product of one value set per
dimension. The table is valid only when every point of the space is matched by exactly one rule,
so rule order never matters and no combination falls through to an accident.

The space has about 41 billion points, too many to enumerate, so the check works on the boxes
(:func:`_check_coverage`): it splits the space one dimension at a time, grouping that dimension's
values into classes that the rules still in play treat alike, and recurses into each class with
the rules that contain it. A class no rule contains is a gap; a box every remaining rule covers
whole is decided, by one rule, or it is an overlap of two. The splits form a decision tree,
which is also the lookup index: a point is looked up in one step per split dimension. The cost
grows with the number of distinct boxes the rules cut the space into, not with the space.

A rule may *defer* (``decide_as: {fp8: false}``): it matches its box like any rule, and the
decision is the rule of the same point with those values (fp8 compute changes the matmuls, not
what the optimizer holds, so the optimizer's cell is decided as without it). Its box must
exclude the values it defers to, so a deferral never leads to another; :meth:`RuleTable.lookup`
returns the pair as one rule (``fp8-compute+zero3``: the base's status and implementation, both
reasons).

One precedence holds over every box: a contradiction of the core settings is an Error whatever
features are set. Where the point's *core* (its core dimensions, every feature at its "not used"
value) is an Error, :meth:`RuleTable.lookup` answers that Error, unless the point's own rule is
an Error too (whose reason is about the point itself): a feature's NotSupported (or a deferral)
never hides that the config contradicts itself (stage 0 with a sharded accumulator, stage 2 or 3
with ``"sharded": false``). The boxes still cover every point exactly once; the loader refuses a
rule that the precedence overrules at every point of its box (it would decide nothing).

Loading follows torchgen's habits: ``yaml.safe_load`` semantics with line numbers kept, every
key checked against ``schemas/rules.schema.json``, cross-rule checks in a second pass, and every
error a :class:`RulesError` naming ``file:line``. Nothing in a rules file is executed: explicit
tags, anchors and aliases are refused before anything is constructed. Implementation names are
checked against the names the caller passes (``implementations=``); this package imports no
optimizer code (``dtypeplan.load_rules`` passes the registered names).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import jsonschema
import yaml

from dtypeplan.errors import RulesError
from dtypeplan.resolver._dimensions import (
    COMBINATIONS,
    CORE_DIMENSIONS,
    DIMENSIONS,
    FEATURES_UNUSED,
    Point,
    points,
    value_text,
)
from dtypeplan.resolver._frozen import FrozenDict
from dtypeplan.resolver._input import InputError, InputLimits, check_yaml_events, read_text

__all__ = [
    "DIMENSIONS",
    "MAX_RULES",
    "Defaults",
    "Point",
    "Rule",
    "RuleTable",
    "Status",
    "core_of",
    "default_rules_path",
    "load_rules",
]

MAX_RULES = COMBINATIONS
"""A valid table has at most one rule per point: every rule matches at least one."""

_Index = Any
"""A node of the lookup tree: a rule's position (a leaf), or ``(dimension position, children)``
with one child per value of that dimension (values of one class share their child)."""


class Status(str, enum.Enum):
    """What the table says of a combination. Compares equal to its string."""

    OK = "OK"
    NOT_SUPPORTED = "NotSupported"
    ERROR = "Error"

    def __str__(self) -> str:
        return self.value


# Aliases are refused in rules files, so the value count is the document's own size.
_RULES_LIMITS = InputLimits(max_nodes=50_000_000)


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One row of the table."""

    id: str
    when: FrozenDict[str, frozenset[Any]]
    """Allowed values per dimension; a dimension absent here matches any value."""
    status: Status
    implementation: str | None
    """Registry name of the optimizer an OK rule builds."""
    single_process_implementation: str | None
    """What an OK rule builds without a process group, when that differs (ZeRO-3: FSDP2
    needs a group; one process runs the flat sharded optimizer instead)."""
    reason: str
    line: int
    decide_as: FrozenDict[str, Any] = field(default_factory=FrozenDict)
    """Deferring rules only: the values whose point decides (see the module docstring)."""
    decided_by: tuple[str, ...] = ()
    """A deferral as looked up: the ids of the deferring rule and of the rule deciding."""
    overrules: str | None = None
    """A core Error as looked up at a point with features: the id of the point's own rule,
    which the contradiction of the core settings overrules (see the module docstring)."""

    def matches(self, point: Point) -> bool:
        return all(point[dim] in allowed for dim, allowed in self.when.items())

    def when_text(self) -> str:
        """The match condition as ``dim=value`` pairs, for tables and messages."""
        if not self.when:
            return "any"
        parts = []
        for name in DIMENSIONS:
            if name in self.when:
                values = self.matched_values(name)
                parts.append(f"{name}={'|'.join(value_text(v) for v in values)}")
        return ", ".join(parts)

    def matched_values(self, name: str) -> list[Any]:
        """The values of dimension ``name`` this rule matches, in the dimension's order."""
        allowed = self.when.get(name)
        values = DIMENSIONS[name].values
        return list(values) if allowed is None else [v for v in values if _member(v, allowed)]


@dataclass(frozen=True, kw_only=True)
class Defaults:
    """What applies where the config is silent."""

    grad_accum_dtype: FrozenDict[str, str]
    """Accumulation dtype by parameter dtype."""
    accumulator_sharded: FrozenDict[int, bool]
    """Accumulator sharding by ZeRO stage."""
    communication_data_type: str
    """``"accum"``, ``"params"`` or a dtype name."""
    lines: FrozenDict[str, int]


@dataclass(frozen=True, kw_only=True)
class RuleTable:
    """A loaded, checked rules file."""

    path: str
    defaults: Defaults
    rules: tuple[Rule, ...]
    index: _Index = field(compare=False, repr=False)
    """The decision tree the coverage check built (see the module docstring)."""

    def lookup(self, point: Point) -> Rule:
        """The rule that decides ``point``: its one rule (a deferring rule's match as the
        deferral, :func:`_deferred`), or the Error of the point's core where that rule is not
        an Error itself (:func:`_overruling`; see the module docstring)."""
        rule = self._own(point)
        if rule.status == Status.ERROR:
            return rule
        core = self.core_error(point)
        return rule if core is None else _overruling(core, rule)

    def core_error(self, point: Point) -> Rule | None:
        """The Error rule of ``point``'s core settings (every feature unused), or None where
        they agree."""
        core = self._own(core_of(point))
        return core if core.status == Status.ERROR else None

    def _own(self, point: Point) -> Rule:
        """The decision of the one rule whose box holds ``point``, without the precedence."""
        rule = self.matching(point)
        if not rule.decide_as:
            return rule
        return _deferred(rule, self.matching({**point, **rule.decide_as}))

    def matching(self, point: Point) -> Rule:
        """The one rule whose box holds ``point`` (a deferring rule as it is)."""
        node = self.index
        while isinstance(node, tuple):
            position, children = node
            name = _DIMENSION_NAMES[position]
            value = point[name]
            node = children[_VALUE_INDEX[name][(type(value), value)]]
        return self.rules[node]

    def points(self) -> Iterator[dict[str, Any]]:
        """Every combination of the core dimensions, the features at their "not used" values
        (the whole space, about 41 billion points, is too large to list)."""
        return points()

    def location(self, rule: Rule) -> str:
        return f"{os.path.basename(self.path)}:{rule.line}"


@cache
def _deferred(rule: Rule, base: Rule) -> Rule:
    """A deferring ``rule`` and the ``base`` rule of its point as one decision: the base's
    status and implementations, the deferring rule's conditions over the base's, both reasons."""
    return Rule(
        id=f"{rule.id}+{base.id}",
        when=FrozenDict({**base.when, **rule.when}),
        status=base.status,
        implementation=base.implementation,
        single_process_implementation=base.single_process_implementation,
        reason=f"{base.reason} {rule.reason}",
        line=rule.line,
        decided_by=(rule.id, base.id),
    )


@cache
def _overruling(core: Rule, rule: Rule) -> Rule:
    """The Error ``core`` of a point's core settings, as it decides the point whose own rule is
    ``rule``: its conditions on the core dimensions only (whatever features are set)."""
    return Rule(
        id=core.id,
        when=FrozenDict({name: v for name, v in core.when.items() if name in CORE_DIMENSIONS}),
        status=core.status,
        implementation=None,
        single_process_implementation=None,
        reason=f"{core.reason} The core settings contradict each other, which is an Error "
        f"whatever features are set (here it overrules rule {rule.id}).",
        line=core.line,
        overrules=rule.id,
    )


def core_of(point: Point) -> dict[str, Any]:
    """``point`` with every feature at its "not used" value: the point of its core settings."""
    return {**point, **FEATURES_UNUSED}


def _member(value: Any, allowed: Collection[Any]) -> bool:
    # bool is an int in Python: keep stage=true from matching stage 1.
    return any(value == a and type(value) is type(a) for a in allowed)


_VALUE_INDEX: FrozenDict[str, FrozenDict[tuple[type, Any], int]] = FrozenDict(
    {
        name: FrozenDict({(type(v), v): i for i, v in enumerate(dim.values)})
        for name, dim in DIMENSIONS.items()
    }
)
"""Per dimension, the position of each value (keyed with its type: ``True`` is not ``1``)."""

_DIMENSION_NAMES: tuple[str, ...] = tuple(DIMENSIONS)


def default_rules_path() -> str:
    return str(resources.files("dtypeplan").joinpath("precision_rules.yaml"))


class _LineMap(dict):
    """A mapping that remembers the line of itself and of each of its keys (1-based)."""

    line: int = 0
    key_lines: dict[Any, int]


# libyaml's parser when PyYAML has it: the pure-Python one takes seconds for a long file.
_SafeLoader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _LineLoader(_SafeLoader):
    """SafeLoader that keeps line numbers and refuses duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> _LineMap:
        mapping = _LineMap()
        mapping.line = node.start_mark.line + 1
        mapping.key_lines = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                hash(key)
            except TypeError:
                raise RulesError("a mapping key must be a plain scalar", self.name, line) from None
            if key in mapping:
                raise RulesError(f"duplicate key {key!r}", self.name, line)
            mapping[key] = self.construct_object(value_node, deep=deep)
            mapping.key_lines[key] = line
        return mapping


_LineLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _LineLoader.construct_mapping
)


@cache
def _rules_schema() -> dict[str, Any]:
    return json.loads(
        resources.files("dtypeplan").joinpath("schemas/rules.schema.json").read_text()
    )


def _refuse(what: str, value: Any, name: str, event: yaml.Event) -> RulesError:
    return RulesError(
        f"YAML {what} {value!r} is not allowed in a rules file: rules are plain data, nothing "
        "in them is constructed or executed",
        name,
        _line(event),
    )


def _line(event: yaml.Event) -> int:
    """The 1-based line where ``event`` starts (1 when the parser gave no position)."""
    return event.start_mark.line + 1 if event.start_mark is not None else 1


def _screen(text: str, name: str) -> None:
    """Refuse tags, anchors and aliases, and a table longer than :data:`MAX_RULES`, from the
    parser's events: before anything is constructed, and in time linear in the file."""
    depth = 0
    expect_key = False  # inside the top-level mapping: whether the next node is a key
    key: Any = None
    key_line = 1
    in_rules = False
    count = 0
    for event in yaml.parse(text, Loader=_SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            raise _refuse("alias", event.anchor, name, event)
        if not isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
            if isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
                in_rules = in_rules and depth > 1
            continue
        if event.anchor is not None:
            raise _refuse("anchor", event.anchor, name, event)
        if event.tag is not None:
            raise _refuse("tag", event.tag, name, event)
        if in_rules and depth == 2:
            count += 1
            if count > MAX_RULES:
                raise RulesError(
                    f"more than {MAX_RULES} rules: a valid table has at most one rule per "
                    f"combination ({MAX_RULES}), since every rule matches at least one and none "
                    "may match twice",
                    name,
                    key_line,
                )
        if depth == 1:
            if expect_key:
                key = event.value if isinstance(event, yaml.ScalarEvent) else None
                key_line = _line(event)
            else:
                in_rules = key == "rules" and isinstance(event, yaml.SequenceStartEvent)
            expect_key = not expect_key
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth == 1:
                expect_key = isinstance(event, yaml.MappingStartEvent)


def _parse(text: str, name: str) -> Any:
    try:
        _screen(text, name)
        loader = _LineLoader(text)
        loader.name = name
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise RulesError(f"not valid YAML: {problem}", name, line) from None


def _plain(value: Any) -> Any:
    """The document as JSON data (mapping keys as strings) for schema validation."""
    if isinstance(value, dict):
        return {
            str(k) if not isinstance(k, bool) else value_text(k): _plain(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _line_of(document: Any, path: list[Any]) -> int:
    """The line of the deepest node of ``path`` that carries one."""
    line = getattr(document, "line", 1)
    node = document
    for part in path:
        if isinstance(node, _LineMap):
            key = next((k for k in node if str(k) == str(part) or value_text(k) == str(part)), None)
            if key is None:
                break
            line = node.key_lines.get(key, line)
            node = node[key]
            line = getattr(node, "line", line)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
            line = getattr(node, "line", line)
        else:
            break
    return line


def _validate_schema(document: Any, name: str) -> None:
    validator = jsonschema.Draft202012Validator(_rules_schema())
    errors = list(validator.iter_errors(_plain(document)))
    if not errors:
        return
    error = jsonschema.exceptions.best_match(errors)
    path = list(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = set(error.schema.get("properties", {}))
        extra = sorted(k for k in error.instance if k not in known)
        if extra:
            path.append(extra[0])
            where = ".".join(map(str, path))
            message = f"unknown key {extra[0]!r} at {where} (known: {', '.join(sorted(known))})"
            raise RulesError(message, name, _line_of(document, path))
    where = ".".join(map(str, path)) or "the document"
    raise RulesError(f"{where}: {error.message}", name, _line_of(document, path))


def _matcher(dim: str, spec: Any, name: str, line: int) -> frozenset[Any]:
    known = DIMENSIONS[dim].values
    if spec == "*":
        return frozenset(known)
    values = spec if isinstance(spec, list) else [spec]
    for value in values:
        if not _member(value, known):
            choices = ", ".join(value_text(a) for a in known)
            raise RulesError(
                f"{dim}: unknown value {value_text(value)!r} (one of: {choices}, *)", name, line
            )
    return frozenset(values)


def _check_implementation(
    raw: _LineMap, key: str, name: str, implementations: frozenset[str] | None
) -> str | None:
    implementation = raw.get(key)
    if implementation is None or implementations is None or implementation in implementations:
        return implementation
    known = ", ".join(sorted(implementations)) or "none"
    raise RulesError(
        f"rule {raw['id']!r} names implementation {implementation!r}, which is not registered "
        f"(registered: {known})",
        name,
        raw.key_lines.get(key, raw.line),
    )


def _build_rules(
    document: _LineMap, name: str, implementations: frozenset[str] | None
) -> tuple[Rule, ...]:
    rules: list[Rule] = []
    seen: dict[str, int] = {}
    for raw in document["rules"]:
        line = raw.line
        if raw["id"] in seen:
            raise RulesError(
                f"rule id {raw['id']!r} already used at line {seen[raw['id']]}", name, line
            )
        seen[raw["id"]] = line
        when = FrozenDict(
            {
                dim: _matcher(dim, spec, name, raw["when"].key_lines.get(dim, line))
                for dim, spec in raw["when"].items()
            }
        )
        decide_as = _decide_as(raw, when, name)
        status = Status(raw.get("status", Status.OK))
        implementation = _check_implementation(raw, "implementation", name, implementations)
        single = _check_implementation(raw, "single_process_implementation", name, implementations)
        # A deferring rule's verdict is the rule it defers to (_decide_as refused a status or
        # implementation of its own); the others state theirs.
        if not decide_as and status == Status.OK:
            if implementation is None:
                raise RulesError(
                    f"rule {raw['id']!r} is OK but names no implementation", name, line
                )
        elif not decide_as:
            for key in ("implementation", "single_process_implementation"):
                if key in raw:
                    raise RulesError(
                        f"rule {raw['id']!r} has status {status} but names an {key}; "
                        "only OK rules build an optimizer",
                        name,
                        raw.key_lines[key],
                    )
        rules.append(
            Rule(
                id=raw["id"],
                when=when,
                status=status,
                implementation=implementation,
                single_process_implementation=single,
                reason=" ".join(raw["reason"].split()),
                line=line,
                decide_as=decide_as,
            )
        )
    _check_deferrals(rules, name)
    return tuple(rules)


def _check_deferrals(rules: list[Rule], name: str) -> None:
    """No deferral leads to a deferring rule: each point deferred to lies outside every
    deferring rule's box."""
    deferring = [rule for rule in rules if rule.decide_as]
    for rule in deferring:
        for other in deferring:
            if not any(
                dim in other.when and not _member(value, other.when[dim])
                for dim, value in rule.decide_as.items()
            ):
                raise RulesError(
                    f"rule {rule.id!r} defers to points that rule {other.id!r} (line "
                    f"{other.line}) defers too: a deferral must reach a rule that decides",
                    name,
                    rule.line,
                )


def _decide_as(raw: _LineMap, when: FrozenDict[str, frozenset[Any]], name: str) -> FrozenDict:
    """A deferring rule's ``decide_as``, checked: no status or implementation of its own, and
    its box excludes each value it defers to, so the point deferred to is never deferred again
    (every deferring rule defers on dimensions its own box pins away from those values)."""
    spec = raw.get("decide_as")
    if spec is None:
        if "status" not in raw:
            raise RulesError(f"rule {raw['id']!r} has neither status nor decide_as", name, raw.line)
        return FrozenDict()
    line = raw.key_lines["decide_as"]
    for key in ("status", "implementation", "single_process_implementation"):
        if key in raw:
            raise RulesError(
                f"rule {raw['id']!r} defers (decide_as) and names a {key}: the rule it defers "
                "to decides that",
                name,
                raw.key_lines[key],
            )
    values = {}
    for dim, value in spec.items():
        (values[dim],) = _matcher(dim, value, name, line)
        if dim not in when or _member(values[dim], when[dim]):
            raise RulesError(
                f"rule {raw['id']!r} defers to {dim}={value_text(values[dim])} but its own when "
                f"does not exclude that value: name {dim} with the other values",
                name,
                line,
            )
    return FrozenDict(values)


def _rule_masks(rule: Rule) -> tuple[int, ...]:
    """Per dimension, the set of value positions ``rule`` allows, as a bit mask."""
    masks = []
    for name, dim in DIMENSIONS.items():
        allowed = rule.when.get(name)
        masks.append(
            sum(
                1 << i
                for i, value in enumerate(dim.values)
                if allowed is None or _member(value, allowed)
            )
        )
    return tuple(masks)


def _positions(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


class _Coverage:
    """The recursive split behind :func:`_check_coverage` (see the module docstring)."""

    def __init__(self, rules: tuple[Rule, ...], name: str) -> None:
        self.rules = rules
        self.name = name
        self.masks = [_rule_masks(rule) for rule in rules]
        self.sizes = [len(dim.values) for dim in DIMENSIONS.values()]
        self.full = [(1 << size) - 1 for size in self.sizes]
        self.gaps = 0
        self.first_gap: str | None = None

    def visit(self, live: list[int], box: list[int], parents: list[int], split_by: int) -> _Index:
        """The index for the points of ``box`` (a value mask per dimension), which exactly the
        rules ``live`` (file order) contain on every dimension split so far; ``parents`` are
        the rules of the box before its last split, on dimension ``split_by``."""
        if not live:
            self._gap(box, parents, split_by)
            return None
        best: tuple[int, int, list[tuple[int, list[int]]]] | None = None
        for d, size in enumerate(self.sizes):
            if box[d] != self.full[d]:
                continue  # split already: every live rule contains the box's values here
            by_mask: dict[int, list[int]] = {}
            for r in live:
                by_mask.setdefault(self.masks[r][d], []).append(r)
            if len(by_mask) == 1 and self.full[d] in by_mask:
                continue  # every live rule takes every value: nothing to split
            classes = self._classes(by_mask, size)
            # Split where the fewest rules land in several classes: a rule that takes every
            # value of the dimension is copied into each class, so a dimension most rules name
            # ends the copying soonest (features before the core, in the shipped table).
            copies = sum(len(rules) for _, rules in classes)
            if best is None or copies < best[1]:
                best = (d, copies, classes)
        if best is None:
            if len(live) > 1:
                self._overlap(live[0], live[1], box)
            return live[0]
        split, _, classes = best
        children: list[_Index] = [None] * self.sizes[split]
        for mask, rules in classes:
            inner = list(box)
            inner[split] = mask
            child = self.visit(rules, inner, live, split)
            for value in _positions(mask):
                children[value] = child
        return (split, tuple(children))

    @staticmethod
    def _classes(by_mask: dict[int, list[int]], size: int) -> list[tuple[int, list[int]]]:
        """The values of a dimension grouped by the rules containing them: ``(value mask,
        rules in file order)`` per class, in the order of the classes' first values."""
        keyed: dict[tuple[int, ...], int] = {}
        for value in range(size):
            key = tuple(mask for mask in by_mask if mask >> value & 1)
            keyed[key] = keyed.get(key, 0) | 1 << value
        return [
            (values, sorted(r for mask in key for r in by_mask[mask]))
            for key, values in keyed.items()
        ]

    def _first_point(self, box: list[int]) -> dict[str, Any]:
        return {
            name: dim.values[(mask & -mask).bit_length() - 1]
            for (name, dim), mask in zip(DIMENSIONS.items(), box, strict=True)
        }

    def _gap(self, box: list[int], parents: list[int], split_by: int) -> None:
        count = 1
        for mask in box:
            count *= mask.bit_count()
        self.gaps += count
        if self.first_gap is not None:
            return
        point = self._first_point(box)
        self.first_gap = _point_text(point)
        if parents:
            dim = _DIMENSION_NAMES[split_by]
            near = ", ".join(
                f"{self.rules[r].id!r} (line {self.rules[r].line})" for r in parents[:3]
            )
            self.first_gap += f" (the rules nearest to it leave out {dim}="
            self.first_gap += f"{value_text(point[dim])}: {near})"

    def _overlap(self, first_index: int, second_index: int, box: list[int]) -> None:
        first, second = self.rules[first_index], self.rules[second_index]
        raise RulesError(
            f"rules {first.id!r} (line {first.line}) and {second.id!r} overlap: both "
            f"match {_point_text(self._first_point(box))}; every combination must be matched "
            "by exactly one rule",
            self.name,
            second.line,
        )


def _check_coverage(rules: tuple[Rule, ...], name: str, rules_line: int) -> _Index:
    """The lookup tree; a gap or an overlap raises (see the module docstring)."""
    coverage = _Coverage(rules, name)
    full = list(coverage.full)
    index = coverage.visit(list(range(len(rules))), full, [], 0)
    if coverage.gaps:
        more = f" and {coverage.gaps - 1} more" if coverage.gaps > 1 else ""
        raise RulesError(
            f"{coverage.gaps} combination(s) are matched by no rule: {coverage.first_gap}{more}",
            name,
            rules_line,
        )
    return index


def _check_precedence(table: RuleTable, name: str) -> None:
    """No rule is overruled at every point of its box: a rule other than an Error holds at
    least one core combination whose core point is not an Error (the precedence of the module
    docstring would otherwise leave it nothing to decide)."""
    core_errors = {
        tuple(point[n] for n in CORE_DIMENSIONS)
        for point in points()
        if table.core_error(point) is not None
    }
    for rule in table.rules:
        if rule.status == Status.ERROR:
            continue
        combinations = itertools.product(*(rule.matched_values(n) for n in CORE_DIMENSIONS))
        if all(core in core_errors for core in combinations):
            raise RulesError(
                f"rule {rule.id!r} decides nothing: at every point of its box the core "
                "settings are an Error, which decides whatever features are set; narrow its "
                "core conditions or remove it",
                name,
                rule.line,
            )


def _point_text(point: Point) -> str:
    return ", ".join(f"{dim}={value_text(point[dim])}" for dim in DIMENSIONS)


def load_rules(
    path: str | os.PathLike[str] | None = None,
    *,
    implementations: Collection[str] | None = None,
) -> RuleTable:
    """Load and check a rules file (the shipped ``precision_rules.yaml`` by default).

    ``implementations``: the registered implementation names an OK rule may name; ``None``
    skips that check (``dtypeplan.load_rules`` passes the registry's names). Raises
    :class:`RulesError` naming ``file:line`` for any problem: YAML syntax, a tag, the schema,
    too many rules, an unknown dimension value, a gap or overlap between rules, an unknown
    implementation.
    """
    resolved = os.fspath(path) if path is not None else default_rules_path()
    names = frozenset(implementations) if implementations is not None else None
    if resolved == default_rules_path():
        return _load_shipped(names)
    return _load(resolved, names)


@cache
def _load_shipped(implementations: frozenset[str] | None) -> RuleTable:
    # Only the shipped file is cached: it cannot change under a running program.
    return _load(default_rules_path(), implementations)


def _load(path: str, implementations: frozenset[str] | None) -> RuleTable:
    name = os.path.basename(path) if path == default_rules_path() else path
    try:
        text = read_text(path, _RULES_LIMITS)
        # A YAML syntax error is left to _parse, which reports it with its line.
        with contextlib.suppress(yaml.YAMLError):
            check_yaml_events(text, _RULES_LIMITS)
    except InputError as exc:
        raise RulesError(f"cannot read rules file: {exc}", name, exc.line) from None
    document = _parse(text, name)
    if not isinstance(document, _LineMap):
        raise RulesError("a rules file must be a mapping with version, defaults and rules", name, 1)
    _validate_schema(document, name)
    rules = _build_rules(document, name, implementations)
    index = _check_coverage(rules, name, document.key_lines["rules"])
    raw = document["defaults"]
    defaults = Defaults(
        grad_accum_dtype=FrozenDict(raw["grad_accum_dtype"]),
        accumulator_sharded=FrozenDict({int(k): v for k, v in raw["accumulator_sharded"].items()}),
        communication_data_type=raw["communication_data_type"],
        lines=FrozenDict({key: raw.key_lines[key] for key in raw}),
    )
    table = RuleTable(path=path, defaults=defaults, rules=rules, index=index)
    _check_precedence(table, name)
    return table
