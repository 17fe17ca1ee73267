"""Bounded reading and parsing of config and rules files (and checks of in-memory configs).

:func:`read_text` is also how a checkpoint's ``LATEST`` pointer and manifest are read
(``checkpoint/_directory.py``): one place refuses what is not a regular file.

A config, rules or checkpoint path may name anything: a FIFO (``open`` blocks forever),
``/dev/zero`` (``read`` never ends), a directory, a file of another encoding. A document may be
hostile in shape: 100k levels deep (the parsers and jsonschema recurse, so ``RecursionError``), an
integer of 5000 digits (Python refuses to convert it, ``ValueError``), a YAML "billion laughs"
whose aliases expand to more nodes than memory holds (and jsonschema formats its error messages
from the expanded value). Every one of these is refused here, before or while parsing, with an
:class:`InputError` that the caller turns into its own error type (``PrecisionConfigError``,
``RulesError``). Nothing here recurses over the document, so no limit is enforced after the
fact.

The limits (:class:`InputLimits`) are far above any real config or rules table: a DeepSpeed
config has a few hundred nodes and a depth below 10.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from dtypeplan.errors import PrecisionConfigError

__all__ = [
    "InputError",
    "InputLimits",
    "check_document",
    "parse_json",
    "json_path",
    "parse_yaml_config",
    "read_config",
    "read_text",
    "regular_file",
    "check_yaml_events",
]


@dataclass(frozen=True, kw_only=True)
class InputLimits:
    """The bounds on one input document."""

    max_bytes: int = 32 * 2**20
    """File size in bytes."""
    max_depth: int = 64
    """Nesting of mappings and lists."""
    max_int_digits: int = 100
    """Decimal digits of an integer (no setting needs more; Python refuses over 4300)."""
    max_nodes: int = 1_000_000
    """Values in the document with every YAML alias (or shared dict object) expanded."""


DEFAULT_LIMITS = InputLimits()
# A DeepSpeed config has a few hundred values; these bounds leave room and keep error
# formatting (jsonschema quotes offending values whole) cheap.
CONFIG_LIMITS = InputLimits(max_bytes=4 * 2**20, max_nodes=100_000)

# A JSON string (skipped whole, brackets inside it do not count) or a bracket.
_JSON_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
# YAML 1.1 integers: decimal (with _ and sexagesimal :), hex, binary.
_YAML_INT = re.compile(r"[-+]?(?:[0-9][0-9_:]*|0x[0-9a-fA-F_]+|0b[01_]+)")


class InputError(ValueError):
    """The input is not a document dtypeplan will read; ``line`` is 1-based when known."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, for an error message."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def regular_file(path: str) -> os.stat_result:
    """``os.stat(path)`` of a regular file; :class:`InputError` saying what ``path`` is
    otherwise (missing, a directory, a FIFO, a device, a socket). Opens nothing, so never
    blocks."""
    try:
        info = os.stat(path)
    except ValueError as exc:  # a NUL byte in the path
        raise InputError(f"not a usable path: {exc}") from None
    except OSError as exc:
        raise InputError(exc.strerror or str(exc)) from None
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"is {_kind(info.st_mode)}, not a regular file")
    return info


def read_text(path: str, limits: InputLimits = DEFAULT_LIMITS) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limits.max_bytes`` long.

    The file is checked with ``stat`` before it is opened, and opened without blocking (a FIFO
    swapped in between is caught by ``fstat`` on the open descriptor), so nothing here waits.
    """
    info = regular_file(path)
    _check_size(info.st_size, limits)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise InputError(exc.strerror or str(exc)) from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"is {_kind(info.st_mode)}, not a regular file")
        data = handle.read(limits.max_bytes + 1)
    _check_size(len(data), limits)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError(
            f"is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} "
            f"({exc.reason}); save the file as UTF-8",
            line,
        ) from None


def _check_size(size: int, limits: InputLimits) -> None:
    if size > limits.max_bytes:
        raise InputError(f"is larger than {limits.max_bytes} bytes ({size})")


def _int_too_long(digits: str, limits: InputLimits, line: int | None) -> None:
    count = sum(ch.isalnum() for ch in digits)
    if count > limits.max_int_digits:
        raise InputError(
            f"an integer of {count} digits; at most {limits.max_int_digits} are accepted", line
        )


def _json_depth(text: str, limits: InputLimits) -> None:
    depth = 0
    for match in _JSON_BRACKETS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > limits.max_depth:
                line = text.count("\n", 0, match.start()) + 1
                raise InputError(
                    f"nested more than {limits.max_depth} levels deep",
                    line,
                )
        elif token in "]}":
            depth -= 1


def parse_json(text: str, limits: InputLimits = DEFAULT_LIMITS) -> Any:
    """``text`` as JSON, refusing deep nesting, long integers and duplicate keys.

    NaN and Infinity (which Python's ``json`` accepts) come back as floats: the schema refuses
    them where a number is meant, naming the key.
    """
    _json_depth(text, limits)

    def parse_int(digits: str) -> int:
        _int_too_long(digits, limits, None)
        return int(digits)

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise InputError(f"duplicate key {key!r}: each key may appear once in a mapping")
            out[key] = value
        return out

    try:
        return json.loads(text, parse_int=parse_int, object_pairs_hook=pairs)
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON: {exc.msg} (column {exc.colno})", exc.lineno) from None


def check_yaml_events(text: str, limits: InputLimits = DEFAULT_LIMITS) -> None:
    """Refuse deep nesting, long integers and alias bombs, from the YAML event stream.

    The event parser is iterative (no recursion), and an alias is counted as the size of the
    node it names, so the document's expanded size is known before anything is constructed.
    """
    loader = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader
    sizes: dict[str, int] = {}
    open_nodes: list[tuple[str | None, int]] = []  # (anchor, node count when it opened)
    total = 0
    for event in yaml.parse(text, Loader=loader):
        line = event.start_mark.line + 1 if event.start_mark is not None else None
        if isinstance(event, yaml.AliasEvent):
            total += sizes.get(event.anchor or "", 1)
        elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            total += 1
            open_nodes.append((event.anchor, total))
            if len(open_nodes) > limits.max_depth:
                raise InputError(
                    f"nested more than {limits.max_depth} levels deep",
                    line,
                )
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, opened = open_nodes.pop()
            if anchor is not None:
                sizes[anchor] = total - opened + 1
        elif isinstance(event, yaml.ScalarEvent):
            total += 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
            if event.implicit[0] and _YAML_INT.fullmatch(event.value):
                _int_too_long(event.value, limits, line)
        if total > limits.max_nodes:
            raise InputError(
                f"expands to more than {limits.max_nodes} values (YAML aliases repeat what "
                "they name); write the values out or drop the aliases",
                line,
            )


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML lets the last win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        self.flatten_mapping(node)
        seen: set[Any] = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                raise InputError(
                    "a mapping key must be a plain value", key_node.start_mark.line + 1
                ) from None
            if duplicate:
                raise InputError(
                    f"duplicate key {key!r}: each key may appear once in a mapping",
                    key_node.start_mark.line + 1,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_mapping
)


def parse_yaml_config(text: str, limits: InputLimits = DEFAULT_LIMITS) -> Any:
    """``text`` as YAML (safe constructors only), bounded as :func:`check_yaml_events` says."""
    try:
        check_yaml_events(text, limits)
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise InputError(
            f"not valid YAML: {problem}", mark.line + 1 if mark is not None else None
        ) from None


def check_document(
    document: Any, limits: InputLimits = DEFAULT_LIMITS, *, path: Callable[[list[Any]], str]
) -> None:
    """Bound an in-memory document (a config passed as a dict) as files are bounded.

    Walks with an explicit stack, so a self-containing dict or one 100k levels deep is refused
    by the depth limit, and one that shares sub-objects many times over by the value count.
    ``path`` formats the location of a bad value.
    """
    stack: list[tuple[Any, list[Any]]] = [(document, [])]
    count = 0
    while stack:
        value, where = stack.pop()
        count += 1
        if count > limits.max_nodes:
            raise InputError(
                f"holds more than {limits.max_nodes} values (counting shared objects each "
                "time they appear)"
            )
        if isinstance(value, (dict, list, tuple)):
            if len(where) >= limits.max_depth:
                raise InputError(
                    f"nested more than {limits.max_depth} levels deep at {path(where[:8])}..."
                )
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((item, [*where, key]) for key, item in items)
        elif isinstance(value, int) and not isinstance(value, bool):
            # 3.33 bits per decimal digit; avoids converting a huge int to text.
            if value.bit_length() > limits.max_int_digits * 3.33:
                raise InputError(
                    f"an integer of more than {limits.max_int_digits} digits at {path(where)}"
                )


def json_path(parts: Any) -> str:
    """``["zero_optimization", "stage"]`` -> ``"$.zero_optimization.stage"`` (``[0]`` for
    list indices)."""
    path = "$"
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def read_config(config: Any) -> tuple[dict[str, Any], str | None]:
    """Stages 1 and 2 of ``load_config``: the document ``config`` is (a dict, or a path to a
    .json / .yaml file), bounded by :data:`CONFIG_LIMITS`, and the file it came from.

    A file is bounded while it is parsed (bytes, depth, integer digits, YAML aliases, duplicate
    keys); a dict by :func:`check_document`. Raises :class:`PrecisionConfigError`.
    """
    source = None
    if isinstance(config, (str, os.PathLike)):
        source = os.fspath(config)
        document = _read_file(source)
    else:
        document = config
        try:
            check_document(document, CONFIG_LIMITS, path=json_path)
        except InputError as exc:
            raise PrecisionConfigError(f"config: {exc}") from None
    if not isinstance(document, dict):
        raise PrecisionConfigError(
            f"a config must be a mapping of keys to values, not {type(document).__name__}"
        )
    return document, source


def _read_file(path: str) -> Any:
    is_yaml = path.endswith((".yaml", ".yml"))
    try:
        text = read_text(path, CONFIG_LIMITS)
        return (
            parse_yaml_config(text, CONFIG_LIMITS) if is_yaml else parse_json(text, CONFIG_LIMITS)
        )
    except InputError as exc:
        line = f":{exc.line}" if exc.line is not None else ""
        raise PrecisionConfigError(f"cannot read config file {path}{line}: {exc}") from None
