"""The precision truth table: loading ``precision_rules.yaml`` and looking combinations up.

A combination (a *point*) has one value on each dimension of :data:`DIMENSIONS`. A rule's
``when`` maps dimensions to a value, a list of values or ``"*"`` (a missing dimension means
``"*"``). The table is valid only when every point of the space is matched by exactly one rule,
so rule order never matters and no combination falls through to an accident.

Loading follows torchgen's habits: ``yaml.safe_load`` semantics with line numbers kept, every
key checked against ``schemas/rules.schema.json``, cross-rule checks in a second pass, and every
error a :class:`RulesError` naming ``file:line``. Nothing in a rules file is executed: explicit
tags, anchors and aliases are refused before anything is constructed.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import jsonschema
import yaml

from dtypeplan.errors import RulesError

__all__ = [
    "DIMENSIONS",
    "Defaults",
    "Point",
    "Rule",
    "RuleTable",
    "load_rules",
    "default_rules_path",
]

DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "model": ("fp32", "fp16", "bf16", "fp16+bf16"),
    "accum": ("fp32", "fp16", "bf16"),
    "sharded": (False, True),
    "stage": (0, 1, 2, 3),
    "pipeline": (False, True),
    "comm": ("fp32", "fp16", "bf16"),
    "reduction": ("collective", "fp32_sum"),
}
"""Every dimension of the configuration space and its values, in display order.

``model`` is the parameter dtype chosen by ``bf16.enabled`` / ``fp16.enabled`` (``fp16+bf16``
when both are on), ``accum`` the gradient-accumulation dtype, ``sharded`` whether the
accumulator is sharded, ``stage`` the ZeRO stage, ``pipeline`` whether the caller runs pipeline
parallelism, ``comm`` the dtype of gradients on the wire, ``reduction`` how 16-bit gradients are
summed (the backend's collective, or an all-to-all summed in fp32 by the receiver).
"""

Point = Mapping[str, Any]

STATUSES = ("OK", "NotSupported", "Error")


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One row of the table."""

    id: str
    when: Mapping[str, frozenset[Any]]
    """Allowed values per dimension; a dimension absent here matches any value."""
    status: str
    implementation: str | None
    reason: str
    line: int

    def matches(self, point: Point) -> bool:
        return all(point[dim] in allowed for dim, allowed in self.when.items())

    def when_text(self) -> str:
        """The match condition as ``dim=value`` pairs, for tables and messages."""
        if not self.when:
            return "any"
        parts = []
        for dim in DIMENSIONS:
            if dim in self.when:
                values = [v for v in DIMENSIONS[dim] if v in self.when[dim]]
                parts.append(f"{dim}={'|'.join(_text(v) for v in values)}")
        return ", ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Defaults:
    """What applies where the config is silent."""

    grad_accum_dtype: Mapping[str, str]
    """Accumulation dtype by model dtype."""
    accumulator_sharded: Mapping[int, bool]
    """Accumulator sharding by ZeRO stage."""
    communication_data_type: str
    """``"accum"``, ``"model"`` or a dtype name."""
    lines: Mapping[str, int]


@dataclass(frozen=True, kw_only=True)
class RuleTable:
    """A loaded, checked rules file."""

    path: str
    defaults: Defaults
    rules: tuple[Rule, ...]

    def lookup(self, point: Point) -> Rule:
        """The single rule that decides ``point``."""
        for rule in self.rules:
            if rule.matches(point):
                return rule
        raise AssertionError(f"checked table has no rule for {dict(point)}")

    def points(self) -> Iterator[dict[str, Any]]:
        """Every point of the configuration space."""
        for values in itertools.product(*DIMENSIONS.values()):
            yield dict(zip(DIMENSIONS, values, strict=True))

    def location(self, rule: Rule) -> str:
        return f"{os.path.basename(self.path)}:{rule.line}"


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def default_rules_path() -> str:
    return str(resources.files("dtypeplan").joinpath("precision_rules.yaml"))


class _LineMap(dict):
    """A mapping that remembers the line of itself and of each of its keys (1-based)."""

    line: int = 0
    key_lines: dict[Any, int]


class _LineLoader(yaml.SafeLoader):
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


def _parse(text: str, name: str) -> Any:
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if isinstance(token, (yaml.TagToken, yaml.AnchorToken, yaml.AliasToken)):
                kind = {yaml.TagToken: "tag", yaml.AnchorToken: "anchor", yaml.AliasToken: "alias"}
                raise RulesError(
                    f"YAML {kind[type(token)]} {token.value!r} is not allowed in a rules file: "
                    "rules are plain data, nothing in them is constructed or executed",
                    name,
                    token.start_mark.line + 1,
                )
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
            str(k) if not isinstance(k, bool) else _text(k): _plain(v) for k, v in value.items()
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
            key = next((k for k in node if str(k) == str(part) or _text(k) == str(part)), None)
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
    if spec == "*":
        return frozenset(DIMENSIONS[dim])
    values = spec if isinstance(spec, list) else [spec]
    allowed = DIMENSIONS[dim]
    for value in values:
        # bool is an int in Python: keep stage=true from matching stage 1.
        if not any(value == a and type(value) is type(a) for a in allowed):
            choices = ", ".join(_text(a) for a in allowed)
            raise RulesError(
                f"{dim}: unknown value {_text(value)!r} (one of: {choices}, *)", name, line
            )
    return frozenset(values)


def _build_rules(
    document: _LineMap, name: str, registered: frozenset[str] | None
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
        when = {
            dim: _matcher(dim, spec, name, raw["when"].key_lines.get(dim, line))
            for dim, spec in raw["when"].items()
        }
        status = raw["status"]
        implementation = raw.get("implementation")
        if status == "OK":
            if implementation is None:
                raise RulesError(
                    f"rule {raw['id']!r} is OK but names no implementation", name, line
                )
            if registered is not None and implementation not in registered:
                known = ", ".join(sorted(registered)) or "none"
                raise RulesError(
                    f"rule {raw['id']!r} names implementation {implementation!r}, which is not "
                    f"registered (registered: {known})",
                    name,
                    raw.key_lines.get("implementation", line),
                )
        elif implementation is not None:
            raise RulesError(
                f"rule {raw['id']!r} has status {status} but names an implementation; "
                "only OK rules build an optimizer",
                name,
                raw.key_lines.get("implementation", line),
            )
        rules.append(
            Rule(
                id=raw["id"],
                when=when,
                status=status,
                implementation=implementation,
                reason=" ".join(raw["reason"].split()),
                line=line,
            )
        )
    return tuple(rules)


def _check_coverage(rules: tuple[Rule, ...], name: str, rules_line: int) -> None:
    gaps: list[dict[str, Any]] = []
    for values in itertools.product(*DIMENSIONS.values()):
        point = dict(zip(DIMENSIONS, values, strict=True))
        matching = [rule for rule in rules if rule.matches(point)]
        if len(matching) > 1:
            first, second = matching[0], matching[1]
            raise RulesError(
                f"rules {first.id!r} (line {first.line}) and {second.id!r} overlap: both match "
                f"{_point_text(point)}; every combination must be matched by exactly one rule",
                name,
                second.line,
            )
        if not matching:
            gaps.append(point)
    if gaps:
        shown = "; ".join(_point_text(p) for p in gaps[:3])
        more = f" and {len(gaps) - 3} more" if len(gaps) > 3 else ""
        raise RulesError(
            f"{len(gaps)} combination(s) are matched by no rule: {shown}{more}", name, rules_line
        )


def _point_text(point: Point) -> str:
    return ", ".join(f"{dim}={_text(point[dim])}" for dim in DIMENSIONS)


def load_rules(
    path: str | os.PathLike[str] | None = None, *, check_registry: bool = True
) -> RuleTable:
    """Load and check a rules file (the shipped ``precision_rules.yaml`` by default).

    Raises :class:`RulesError` naming ``file:line`` for any problem: YAML syntax, a tag, the
    schema, an unknown dimension value, a gap or overlap between rules, an unknown
    implementation.
    """
    resolved = os.fspath(path) if path is not None else default_rules_path()
    if path is None and check_registry:
        return _load_default()
    return _load(resolved, check_registry)


@cache
def _load_default() -> RuleTable:
    return _load(default_rules_path(), True)


def _load(path: str, check_registry: bool) -> RuleTable:
    name = os.path.basename(path) if path == default_rules_path() else path
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise RulesError(f"cannot read rules file: {exc.strerror}", path) from None
    document = _parse(text, name)
    if not isinstance(document, _LineMap):
        raise RulesError("a rules file must be a mapping with version, defaults and rules", name, 1)
    _validate_schema(document, name)
    registered = None
    if check_registry:
        from dtypeplan.optimizers import registered_names

        registered = frozenset(registered_names())
    rules = _build_rules(document, name, registered)
    _check_coverage(rules, name, document.key_lines["rules"])
    raw = document["defaults"]
    defaults = Defaults(
        grad_accum_dtype=dict(raw["grad_accum_dtype"]),
        accumulator_sharded={int(k): v for k, v in raw["accumulator_sharded"].items()},
        communication_data_type=raw["communication_data_type"],
        lines={key: raw.key_lines[key] for key in raw},
    )
    return RuleTable(path=path, defaults=defaults, rules=rules)
