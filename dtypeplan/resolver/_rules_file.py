"""Reading a rules file: YAML with each mapping's and key's line kept, duplicate keys, tags,
anchors, aliases and over-long tables refused from the parser's events before anything is
constructed, and every key checked against ``schemas/rules.schema.json``. Every error is a
:class:`RulesError` naming ``file:line``; what the rules mean is ``_rules.py``'s."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

import jsonschema
import yaml

from dtypeplan.errors import RulesError
from dtypeplan.resolver._dimensions import COMBINATIONS, value_text

__all__ = ["MAX_RULES", "LineMap", "parse", "validate_schema"]

MAX_RULES = COMBINATIONS
"""A valid table has at most one rule per point: every rule decides at least one."""


class LineMap(dict):
    """A mapping that remembers the line of itself and of each of its keys (1-based)."""

    line: int = 0
    key_lines: dict[Any, int]


# libyaml's parser when PyYAML has it: the pure-Python one takes seconds for a long file.
_SafeLoader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _LineLoader(_SafeLoader):
    """SafeLoader that keeps line numbers and refuses duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> LineMap:
        mapping = LineMap()
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
                in_rules = key in ("gates", "rules") and isinstance(event, yaml.SequenceStartEvent)
            expect_key = not expect_key
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth == 1:
                expect_key = isinstance(event, yaml.MappingStartEvent)


def parse(text: str, name: str) -> Any:
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
        if isinstance(node, LineMap):
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


def validate_schema(document: Any, name: str) -> None:
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
