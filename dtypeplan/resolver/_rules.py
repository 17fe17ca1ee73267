"""The precision truth table: loading ``precision_rules.yaml`` and looking combinations up.

A combination (a *point*) has one value on each dimension of :data:`DIMENSIONS` (see
``_dimensions.py``). The file (version 2) has two parts, each a list of boxes (the product of
one value set per dimension):

1. ``gates``, in order: refusals (NotSupported or Error), each with its reason and the setting
   that lifts it. The first gate whose ``when`` holds a point decides it. A gate names only
   what it refuses: a dimension it does not name takes any value.
2. ``rules``, the grid: what runs (OK, with its implementation) and what is left. Every point
   no gate takes must be matched by exactly one grid rule, so their order never matters and no
   combination falls through to an accident. A grid rule describes a cell: a *core* dimension
   it does not name takes any value, a *feature* dimension it does not name is at its "not
   used" value ("any value" is written ``"*"`` where meant).

A matcher is a value, a list, ``"*"``, ``{not: ...}`` or the name of a value set declared under
``sets``. The loader checks the boxes, not the points (:mod:`dtypeplan.resolver._boxes`): the
decision tree it builds is the proof that every point has exactly one decision, and the lookup
index. A rule that decides nothing (the gates before it take every point of its box) is
refused too.

A gate may *defer* (``decide_as: {fp8: false}``): the decision is the one of the same point
with those values (fp8 compute changes the matmuls, not what the optimizer holds, so the
optimizer's cell is decided as without it). Its box must exclude the values it defers to, so a
deferral never leads to another; :meth:`RuleTable.lookup` returns the pair as one rule
(``fp8-compute+zero3``: the decision's status and implementation, both reasons).

Implementations declare what they serve (``@dtypeplan.register(name, serves=[...])``, boxes in
the grid's language). The loader refuses an OK rule that decides a point outside its
implementation's declaration, naming the rule, the implementation and the point: an edited
table cannot claim what no code does.

Loading follows torchgen's habits: ``yaml.safe_load`` semantics with line numbers kept, every
key checked against ``schemas/rules.schema.json``, cross-rule checks in a second pass, and every
error a :class:`RulesError` naming ``file:line``. Nothing in a rules file is executed: explicit
tags, anchors and aliases are refused before anything is constructed. Implementation names and
declarations come from the caller (``implementations=``); this package imports no optimizer
code (``dtypeplan.load_rules`` passes the registry's declarations).
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import yaml

from dtypeplan.errors import RulesError
from dtypeplan.resolver._boxes import (
    FULL,
    Box,
    Coverage,
    Index,
    Leaf,
    box_text,
    first_point,
    intersect,
    leaves_within,
    outside,
    point_text,
    remaining,
    size,
    subtract,
    with_values,
)
from dtypeplan.resolver._dimensions import (
    DIMENSIONS,
    FEATURES_UNUSED,
    Point,
    points,
    value_text,
)
from dtypeplan.resolver._frozen import FrozenDict
from dtypeplan.resolver._input import InputError, InputLimits, check_yaml_events, read_text
from dtypeplan.resolver._rules_file import MAX_RULES, LineMap, parse, validate_schema

__all__ = [
    "DIMENSIONS",
    "MAX_RULES",
    "Declaration",
    "Defaults",
    "Point",
    "Rule",
    "RuleTable",
    "Status",
    "core_of",
    "declaration_boxes",
    "default_rules_path",
    "grid_when",
    "load_rules",
]


@dataclass(frozen=True)
class Declaration:
    """What an implementation declares it serves, as boxes in the grid's language."""

    serves: Sequence[Mapping[str, Any]] = ()
    alone: Sequence[Mapping[str, Any]] = ()
    """Boxes it serves only without a process group: what a rule's
    ``single_process_implementation`` sends it (ZeRO-3's plan in one process)."""


Implementations = Mapping[str, "Declaration | Sequence[Mapping[str, Any]] | None"]
"""Registered implementation names, each with what it declares it serves (a sequence: the
boxes it serves; ``None``: it declares nothing, so no OK rule may send a combination to it)."""


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
    """One row of the table: a gate or a rule of the grid."""

    id: str
    when: FrozenDict[str, frozenset[Any]]
    """Allowed values per dimension; a dimension absent here matches any value (a grid rule's
    unnamed features are filled in with their "not used" value on load)."""
    status: Status
    implementation: str | None
    """Registry name of the optimizer an OK rule builds."""
    single_process_implementation: str | None
    """What an OK rule builds without a process group, when that differs (ZeRO-3: FSDP2
    needs a group; one process runs the flat sharded optimizer instead)."""
    reason: str
    line: int
    gate: bool = False
    """A gate (ordered, first match decides) rather than a rule of the grid."""
    named: tuple[str, ...] = ()
    """The dimensions the file names in ``when``, in display order."""
    fix: str | None = None
    """The setting that lifts a refusal, as the file states it."""
    unless: FrozenDict[str, frozenset[Any]] | None = None
    """Gates only: the box within ``when`` the gate leaves to the rules after it."""
    decide_as: FrozenDict[str, Any] = field(default_factory=FrozenDict)
    """Deferring gates only: the values whose point decides (see the module docstring)."""
    decided_by: tuple[str, ...] = ()
    """A deferral as looked up: the ids of the deferring gate and of the rule deciding."""

    @property
    def explanation(self) -> str:
        """The reason, and for a refusal the setting that lifts it: what a plan says."""
        return f"{self.reason} To change it: {self.fix}." if self.fix else self.reason

    def when_text(self) -> str:
        """The match condition as ``dim=value`` pairs, as the file names them."""
        parts = []
        for name in DIMENSIONS:
            if name in self.named:
                values = self.matched_values(name)
                if len(values) < len(DIMENSIONS[name].values):
                    parts.append(f"{name}={'|'.join(value_text(v) for v in values)}")
        return ", ".join(parts) or "any"

    def matched_values(self, name: str) -> list[Any]:
        """The values of dimension ``name`` this rule matches, in the dimension's order."""
        allowed = self.when.get(name)
        values = DIMENSIONS[name].values
        return list(values) if allowed is None else [v for v in values if _member(v, allowed)]

    def box(self) -> Box:
        """The rule's box as value masks (see ``_boxes.py``)."""
        return _mask(self.when)

    def region(self) -> list[Box]:
        """Disjoint boxes of the points the rule claims: its box, less a gate's ``unless``."""
        if self.unless is None:
            return [self.box()]
        return subtract(self.box(), _mask(self.unless))

    def matches(self, point: Point) -> bool:
        inside = all(point[dim] in allowed for dim, allowed in self.when.items())
        return inside and not (
            self.unless is not None
            and all(point[dim] in allowed for dim, allowed in self.unless.items())
        )


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
    gates: tuple[Rule, ...]
    grid: tuple[Rule, ...]
    sets: FrozenDict[str, tuple[Any, ...]] = field(default_factory=FrozenDict)
    index: Index = field(compare=False, repr=False)
    """The grid's decision tree, which the coverage check built (see ``_boxes.py``)."""
    leaves: tuple[Leaf, ...] = field(compare=False, repr=False, default=())
    """Its leaves; ``decided_by`` is a position in :attr:`grid`."""

    @property
    def rules(self) -> tuple[Rule, ...]:
        """Every gate, in order, then the grid."""
        return self.gates + self.grid

    def lookup(self, point: Point) -> Rule:
        """The rule that decides ``point``: the first gate that holds it, else its one grid
        rule; a deferring gate as the deferral (:func:`_deferred`)."""
        rule = self.matching(point)
        if not rule.decide_as:
            return rule
        return _deferred(rule, self.matching({**point, **rule.decide_as}))

    def core_error(self, point: Point) -> Rule | None:
        """The Error of ``point``'s core settings (every feature unused), or None where they
        agree."""
        core = self.lookup(core_of(point))
        return core if core.status == Status.ERROR else None

    def matching(self, point: Point) -> Rule:
        """The gate or grid rule that decides ``point`` (a deferring gate as it is)."""
        for gate in self.gates:
            if gate.matches(point):
                return gate
        node = self.index
        while isinstance(node, tuple):
            position, children = node
            name = _DIMENSION_NAMES[position]
            value = point[name]
            node = children[_VALUE_INDEX[name][(type(value), value)]]
        decided_by = self.leaves[node].decided_by
        assert decided_by is not None, "a loaded table has no gap past its gates"
        return self.grid[decided_by]

    def decided(self, rule: Rule) -> list[Box]:
        """Disjoint boxes of the points ``rule`` decides (a deferring gate: that it defers):
        a gate's region less the gates before it, a grid rule's leaves less every gate."""
        if rule.gate:
            position = self.gates.index(rule)
            earlier = [box for gate in self.gates[:position] for box in gate.region()]
            return [piece for box in rule.region() for piece in remaining(box, earlier)]
        position = self.grid.index(rule)
        gates = [box for gate in self.gates for box in gate.region()]
        return [
            piece
            for leaf in self.leaves
            if leaf.decided_by == position
            for piece in remaining(leaf.box, gates)
        ]

    def points(self) -> Iterator[dict[str, Any]]:
        """Every combination of the core dimensions, the features at their "not used" values
        (the whole space is too large to list: see ``COMBINATIONS``)."""
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
        named=tuple(n for n in DIMENSIONS if n in base.named or n in rule.named),
        fix=base.fix,
        decided_by=(rule.id, base.id),
    )


def core_of(point: Point) -> dict[str, Any]:
    """``point`` with every feature at its "not used" value: the point of its core settings."""
    return {**point, **FEATURES_UNUSED}


def _member(value: Any, allowed: Collection[Any]) -> bool:
    # bool is an int in Python: keep stage=true from matching stage 1.
    return any(value == a and type(value) is type(a) for a in allowed)


def _mask(when: Mapping[str, Collection[Any]]) -> Box:
    """The box of a ``when`` (a dimension it leaves out: every value)."""
    masks = []
    for name, dim in DIMENSIONS.items():
        allowed = when.get(name)
        masks.append(
            sum(
                1 << i
                for i, value in enumerate(dim.values)
                if allowed is None or _member(value, allowed)
            )
        )
    return tuple(masks)


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


def _values(
    dim: str, spec: Any, sets: Mapping[str, tuple[Any, ...]], name: str, line: int
) -> list[Any]:
    """The values a matcher lists: plain values and set names, checked against the dimension."""
    known = DIMENSIONS[dim].values
    values: list[Any] = []
    for item in spec if isinstance(spec, list) else [spec]:
        if isinstance(item, str) and item in sets:
            values.extend(v for v in sets[item] if _member(v, known))
            continue
        if not _member(item, known):
            choices = ", ".join(value_text(a) for a in known)
            named = f"; sets: {', '.join(sets)}" if sets else ""
            raise RulesError(
                f"{dim}: unknown value {value_text(item)!r} (one of: {choices}, *{named})",
                name,
                line,
            )
        values.append(item)
    return values


def _matcher(
    dim: str, spec: Any, name: str, line: int, sets: Mapping[str, tuple[Any, ...]] = FrozenDict()
) -> frozenset[Any]:
    """The values a matcher allows: a value, a list, ``"*"``, a set name or ``{not: ...}``."""
    known = DIMENSIONS[dim].values
    if spec == "*":
        return frozenset(known)
    if isinstance(spec, Mapping):
        excluded = _values(dim, spec["not"], sets, name, line)
        allowed = frozenset(v for v in known if not _member(v, excluded))
    else:
        allowed = frozenset(_values(dim, spec, sets, name, line))
    if not allowed:
        raise RulesError(f"{dim}: the matcher allows no value", name, line)
    return allowed


def grid_when(
    spec: Mapping[str, Any],
    *,
    name: str = "<declaration>",
    line: int = 1,
    sets: Mapping[str, tuple[Any, ...]] = FrozenDict(),
    key_lines: Mapping[str, int] = FrozenDict(),
) -> FrozenDict[str, frozenset[Any]]:
    """A box in the grid's language: the named dimensions' matchers, every unnamed feature at
    its "not used" value (what grid rules and implementation declarations say)."""
    unknown = [dim for dim in spec if dim not in DIMENSIONS]
    if unknown:
        raise RulesError(
            f"unknown dimension {unknown[0]!r} (known: {', '.join(DIMENSIONS)})", name, line
        )
    when = {
        dim: _matcher(dim, matcher, name, key_lines.get(dim, line), sets)
        for dim, matcher in spec.items()
    }
    for dim, unused in FEATURES_UNUSED.items():
        if dim not in when and not _requirement_unmet(dim, when):
            when[dim] = frozenset([unused])
    return FrozenDict(when)


def _requirement_unmet(dim: str, when: Mapping[str, frozenset[Any]]) -> bool:
    """Whether ``when`` excludes where ``dim`` means anything (``fp8_recipe`` in a box with
    ``fp8`` false): such a dimension is left at any value, as the config reader ignores it."""
    return any(
        required not in when.get(other, frozenset([FEATURES_UNUSED.get(other)]))
        for other, required in DIMENSIONS[dim].requires.items()
    )


def declaration_boxes(serves: Sequence[Mapping[str, Any]]) -> tuple[Box, ...]:
    """An implementation's declaration (``serves=``) as boxes; :class:`RulesError` for a
    declaration that is not in the table's dimension language."""
    return tuple(_mask(grid_when(box)) for box in serves)


def _check_implementation(
    raw: LineMap, key: str, name: str, implementations: Implementations | None
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


def _sets(document: LineMap, name: str) -> FrozenDict[str, tuple[Any, ...]]:
    """The file's named value sets; a name that is also a value would be ambiguous."""
    raw = document.get("sets")
    if raw is None:
        return FrozenDict()
    every_value = {(type(v), v) for dim in DIMENSIONS.values() for v in dim.values}
    for set_name, values in raw.items():
        line = raw.key_lines.get(set_name, raw.line)
        if (str, set_name) in every_value or set_name == "*":
            raise RulesError(
                f"set name {set_name!r} is also a dimension value: name the set otherwise",
                name,
                line,
            )
        unknown = [v for v in values if (type(v), v) not in every_value]
        if unknown:
            raise RulesError(
                f"set {set_name!r}: {value_text(unknown[0])!r} is a value of no dimension",
                name,
                line,
            )
    return FrozenDict({k: tuple(v) for k, v in raw.items()})


def _build_rule(
    raw: LineMap,
    *,
    gate: bool,
    name: str,
    sets: Mapping[str, tuple[Any, ...]],
    implementations: Implementations | None,
) -> Rule:
    line = raw.line
    key_lines = raw["when"].key_lines
    if gate:
        when = FrozenDict(
            {
                dim: _matcher(dim, spec, name, key_lines.get(dim, line), sets)
                for dim, spec in raw["when"].items()
            }
        )
    else:
        when = grid_when(raw["when"], name=name, line=line, sets=sets, key_lines=key_lines)
    unless = _unless(raw, when, name, sets) if gate else None
    decide_as = _decide_as(raw, when, name)
    status = Status(raw["status"]) if "status" in raw else Status.OK
    implementation = _check_implementation(raw, "implementation", name, implementations)
    single = _check_implementation(raw, "single_process_implementation", name, implementations)
    if status == Status.OK and not decide_as and implementation is None:
        raise RulesError(f"rule {raw['id']!r} is OK but names no implementation", name, line)
    if status != Status.OK or decide_as:
        for key in ("implementation", "single_process_implementation"):
            if key in raw:
                raise RulesError(
                    f"rule {raw['id']!r} has status {status} but names an {key}; "
                    "only OK rules build an optimizer",
                    name,
                    raw.key_lines[key],
                )
    return Rule(
        id=raw["id"],
        when=when,
        status=status,
        implementation=implementation,
        single_process_implementation=single,
        reason=" ".join(raw["reason"].split()),
        line=line,
        gate=gate,
        named=tuple(n for n in DIMENSIONS if n in raw["when"]),
        fix=" ".join(raw["fix"].split()) if "fix" in raw else None,
        unless=unless,
        decide_as=decide_as,
    )


def _unless(
    raw: LineMap,
    when: FrozenDict[str, frozenset[Any]],
    name: str,
    sets: Mapping[str, tuple[Any, ...]],
) -> FrozenDict[str, frozenset[Any]] | None:
    """A gate's ``unless``: a box (dimensions it does not name: any value) the gate leaves to
    the rules after it; it must leave the gate something and take something from it."""
    spec = raw.get("unless")
    if spec is None:
        return None
    line = raw.key_lines["unless"]
    unless = FrozenDict(
        {
            dim: _matcher(dim, m, name, spec.key_lines.get(dim, line), sets)
            for dim, m in spec.items()
        }
    )
    box, cut = _mask(when), _mask(unless)
    if intersect(box, cut) is None:
        problem = "shares no combination with its when: it excepts nothing"
    elif not subtract(box, cut):
        problem = "holds its whole when: the gate would refuse nothing"
    else:
        return unless
    raise RulesError(f"gate {raw['id']!r}: its unless {problem}", name, line)


def _build_rules(
    document: LineMap, name: str, implementations: Implementations | None
) -> tuple[tuple[Rule, ...], tuple[Rule, ...], FrozenDict[str, tuple[Any, ...]]]:
    sets = _sets(document, name)
    seen: dict[str, int] = {}
    built: dict[str, list[Rule]] = {"gates": [], "rules": []}
    for part in ("gates", "rules"):
        for raw in document.get(part) or []:
            if raw["id"] in seen:
                raise RulesError(
                    f"rule id {raw['id']!r} already used at line {seen[raw['id']]}", name, raw.line
                )
            seen[raw["id"]] = raw.line
            built[part].append(
                _build_rule(
                    raw, gate=part == "gates", name=name, sets=sets, implementations=implementations
                )
            )
    _check_deferrals(built["gates"], name)
    return tuple(built["gates"]), tuple(built["rules"]), sets


def _check_deferrals(rules: list[Rule], name: str) -> None:
    """No deferral leads to a deferring gate: each point deferred to lies outside every
    deferring gate's box."""
    deferring = [rule for rule in rules if rule.decide_as]
    for rule in deferring:
        for other in deferring:
            if not any(
                dim in other.when and not _member(value, other.when[dim])
                for dim, value in rule.decide_as.items()
            ):
                raise RulesError(
                    f"gate {rule.id!r} defers to points that gate {other.id!r} (line "
                    f"{other.line}) defers too: a deferral must reach a rule that decides",
                    name,
                    rule.line,
                )


def _decide_as(raw: LineMap, when: FrozenDict[str, frozenset[Any]], name: str) -> FrozenDict:
    """A deferring gate's ``decide_as``, checked: no status of its own, and its box excludes
    each value it defers to, so the point deferred to is never deferred again (every deferring
    gate defers on dimensions its own box pins away from those values)."""
    spec = raw.get("decide_as")
    if spec is None:
        if "status" not in raw:
            raise RulesError(f"gate {raw['id']!r} has neither status nor decide_as", name, raw.line)
        return FrozenDict()
    line = raw.key_lines["decide_as"]
    if "status" in raw:
        raise RulesError(
            f"gate {raw['id']!r} defers (decide_as) and names a status: the rule it defers "
            "to decides that",
            name,
            raw.key_lines["status"],
        )
    values = {}
    for dim, value in spec.items():
        (values[dim],) = _matcher(dim, value, name, line)
        if dim not in when or _member(values[dim], when[dim]):
            raise RulesError(
                f"gate {raw['id']!r} defers to {dim}={value_text(values[dim])} but its own when "
                f"does not exclude that value: name {dim} with the other values",
                name,
                line,
            )
    return FrozenDict(values)


def _check_coverage(
    gates: tuple[Rule, ...], grid: tuple[Rule, ...], name: str, rules_line: int
) -> tuple[Index, tuple[Leaf, ...]]:
    """The grid's decision tree; a gap or an overlap past the gates, or a rule that decides
    nothing, raises (see the module docstring)."""
    coverage = Coverage([rule.box() for rule in grid])
    index = coverage.build()
    taken = [box for gate in gates for box in gate.region()]
    for box, live in coverage.overlaps:
        beyond = outside(box, taken)
        if beyond is not None:
            first, second = grid[live[0]], grid[live[1]]
            raise RulesError(
                f"rules {first.id!r} (line {first.line}) and {second.id!r} overlap: both match "
                f"{point_text(first_point(beyond))} and no gate takes it; every combination "
                "past the gates must be matched by exactly one rule",
                name,
                second.line,
            )
    gaps = [
        p for leaf in coverage.leaves if leaf.decided_by is None for p in remaining(leaf.box, taken)
    ]
    if gaps:
        count = sum(size(box) for box in gaps)
        more = f" and {count - 1} more" if count > 1 else ""
        raise RulesError(
            f"{count} combination(s) are matched by no gate and no rule: "
            f"{point_text(first_point(gaps[0]))}{more} (the combinations: {box_text(gaps[0])})",
            name,
            rules_line,
        )
    _check_each_decides(gates, grid, coverage.leaves, taken, name)
    return index, tuple(coverage.leaves)


def _check_each_decides(
    gates: tuple[Rule, ...],
    grid: tuple[Rule, ...],
    leaves: list[Leaf],
    taken: list[Box],
    name: str,
) -> None:
    """Refuse a gate the gates before it cover, and a grid rule the gates cover."""
    earlier: list[Box] = []
    for gate in gates:
        region = gate.region()
        if all(outside(box, earlier) is None for box in region):
            raise RulesError(
                f"gate {gate.id!r} decides nothing: the gates before it take every point of its "
                "box; narrow them or remove it",
                name,
                gate.line,
            )
        earlier.extend(region)
    by_rule: dict[int | None, list[Box]] = {}
    for leaf in leaves:
        by_rule.setdefault(leaf.decided_by, []).append(leaf.box)
    for position, rule in enumerate(grid):
        if all(outside(box, taken) is None for box in by_rule.get(position, [])):
            covering = [g.id for g in gates if _overlaps(g, rule)]
            raise RulesError(
                f"rule {rule.id!r} decides nothing: the gates ({', '.join(covering[:4])}) take "
                "every point of its box; narrow them or remove it",
                name,
                rule.line,
            )


def _overlaps(a: Rule, b: Rule) -> bool:
    return intersect(a.box(), b.box()) is not None


def _check_declarations(table: RuleTable, implementations: Mapping[str, _Boxes], name: str) -> None:
    """Every point an OK rule decides (deferred points included) lies inside what its
    implementations declare they serve (see the module docstring)."""
    declared = implementations
    taken = [box for gate in table.gates for box in gate.region()]
    for leaf in table.leaves:
        if leaf.decided_by is None:
            continue  # the gates take it all (checked on load)
        _check_served(table.grid[leaf.decided_by], leaf.box, taken, declared, name)
    for gate in table.gates:
        if not gate.decide_as:
            continue
        # The points it defers whose deferred point is taken by a gate are decided there.
        deferred_taken = [
            with_values(box, {dim: None for dim in gate.decide_as})
            for box in taken
            if intersect(box, with_values(FULL, gate.decide_as)) is not None
        ]
        for piece in table.decided(gate):
            target = with_values(piece, gate.decide_as)
            for base in leaves_within(table.index, target, table.leaves.__getitem__):
                if base.decided_by is None:
                    continue
                widened = with_values(base.box, {dim: None for dim in gate.decide_as})
                common = intersect(piece, widened)
                if common is not None:
                    rule = table.grid[base.decided_by]
                    _check_served(rule, common, deferred_taken, declared, name, gate)


def _check_served(
    rule: Rule,
    box: Box,
    taken: list[Box],
    declared: Mapping[str, _Boxes],
    name: str,
    deferring: Rule | None = None,
) -> None:
    """The points of ``box`` that ``taken`` leaves to ``rule`` lie in its implementations'
    declarations."""
    if rule.status != Status.OK:
        return
    for impl, alone in ((rule.implementation, False), (rule.single_process_implementation, True)):
        if impl is None or impl not in declared:
            continue
        serves, serves_alone = declared[impl] or ((), ())
        boxes = (*serves, *serves_alone) if alone else serves
        beyond = outside(box, [*taken, *boxes])
        if beyond is None:
            continue
        via = f" (through gate {deferring.id!r}, line {deferring.line})" if deferring else ""
        what = "declares nothing it serves" if not boxes else "does not declare"
        if not alone and outside(box, [*taken, *serves, *serves_alone]) is None:
            what = "serves only without a process group, not"
        raise RulesError(
            f"rule {rule.id!r} sends {point_text(first_point(beyond))}{via} to implementation "
            f"{impl!r}, which {what} that combination: the rule claims more than the code does. "
            "Narrow the rule (or keep the gate that refused it), or register an implementation "
            f"whose serves= holds it (the combinations beyond it here: {box_text(beyond)})",
            name,
            (deferring or rule).line,
        )


def load_rules(
    path: str | os.PathLike[str] | None = None,
    *,
    implementations: Implementations | Collection[str] | None = None,
) -> RuleTable:
    """Load and check a rules file (the shipped ``precision_rules.yaml`` by default).

    ``implementations``: the registered implementations an OK rule may name, each with the
    boxes it declares it serves (a plain collection of names checks the names only; ``None``
    skips both checks). ``dtypeplan.load_rules`` passes the registry's declarations. Raises
    :class:`RulesError` naming ``file:line`` for any problem: YAML syntax, a tag, the schema,
    too many rules, an unknown dimension value, a gap or overlap, a rule that decides nothing,
    an unknown implementation, an OK rule beyond its implementation's declaration.
    """
    resolved = os.fspath(path) if path is not None else default_rules_path()
    declared: FrozenDict[str, Any] | None = None
    if isinstance(implementations, Mapping):
        declared = FrozenDict({k: _declared_boxes(v) for k, v in implementations.items()})
    elif implementations is not None:
        declared = FrozenDict({impl: _UNCHECKED for impl in implementations})
    if resolved == default_rules_path():
        return _load_shipped(declared)
    return _load(resolved, declared)


_Boxes = tuple[tuple[Box, ...], tuple[Box, ...]] | None
"""A declaration as boxes: (served, served only without a process group); None: nothing."""

_UNCHECKED: Any = "unchecked"
"""A name given without its declaration (``implementations=`` as a plain collection)."""


def _declared_boxes(declared: Declaration | Sequence[Mapping[str, Any]] | None) -> _Boxes:
    if declared is None:
        return None
    if not isinstance(declared, Declaration):
        declared = Declaration(serves=declared)
    return declaration_boxes(declared.serves), declaration_boxes(declared.alone)


@cache
def _load_shipped(implementations: FrozenDict[str, Any] | None) -> RuleTable:
    # Only the shipped file is cached: it cannot change under a running program.
    return _load(default_rules_path(), implementations)


def _load(path: str, implementations: FrozenDict[str, Any] | None) -> RuleTable:
    name = os.path.basename(path) if path == default_rules_path() else path
    try:
        text = read_text(path, _RULES_LIMITS)
        # A YAML syntax error is left to _parse, which reports it with its line.
        with contextlib.suppress(yaml.YAMLError):
            check_yaml_events(text, _RULES_LIMITS)
    except InputError as exc:
        raise RulesError(f"cannot read rules file: {exc}", name, exc.line) from None
    document = parse(text, name)
    if not isinstance(document, LineMap):
        raise RulesError(
            "a rules file must be a mapping with version, defaults, gates and rules", name, 1
        )
    validate_schema(document, name)
    gates, grid, sets = _build_rules(document, name, implementations)
    index, leaves = _check_coverage(gates, grid, name, document.key_lines["rules"])
    raw = document["defaults"]
    defaults = Defaults(
        grad_accum_dtype=FrozenDict(raw["grad_accum_dtype"]),
        accumulator_sharded=FrozenDict({int(k): v for k, v in raw["accumulator_sharded"].items()}),
        communication_data_type=raw["communication_data_type"],
        lines=FrozenDict({key: raw.key_lines[key] for key in raw}),
    )
    table = RuleTable(
        path=path,
        defaults=defaults,
        gates=gates,
        grid=grid,
        sets=sets,
        index=index,
        leaves=leaves,
    )
    if implementations is not None:
        checked = {k: v for k, v in implementations.items() if v is not _UNCHECKED}
        _check_declarations(table, checked, name)
    return table
