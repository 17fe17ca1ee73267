"""Stage 5 of ``load_config``: the JSON Schema, on the document as the user wrote it.

The JSON Schema in ``schemas/config.schema.json`` is the single source of truth for what a
config may hold; it ships with the package so editors can validate configs too. It runs before
DeepSpeed's aliases are folded (``_deepspeed.canonical_spellings``, which expects a schema-valid
document), so an error names the key the user wrote
(``$.zero_optimization.stage3_prefetch_bucket_size``). Keys marked ``x-dtypeplan-ignored``
there change neither numbers nor memory: they are accepted and reported by ``explain()``; keys
marked ``x-dtypeplan-caller`` are model-side DeepSpeed features dtypeplan does not run:
accepted with a warning.
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import jsonschema

from dtypeplan.errors import PrecisionConfigError
from dtypeplan.resolver import _deepspeed_keys as ds_keys
from dtypeplan.resolver._deepspeed import closest_hint
from dtypeplan.resolver._input import json_path
from dtypeplan.resolver._optimizer_kind import canonical_name

__all__ = ["Marks", "config_schema", "top_level_keys", "validate"]

# Schema markers: accepted keys that change neither numbers nor memory, and model-side
# DeepSpeed features that dtypeplan does not run (accepted with a warning).
_IGNORED = "x-dtypeplan-ignored"
_CALLER = "x-dtypeplan-caller"

_SHORT_REPR = reprlib.Repr()  # keyword arguments need Python 3.12
_SHORT_REPR.maxlevel, _SHORT_REPR.maxdict, _SHORT_REPR.maxlist = 2, 4, 4
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 30


@dataclass(frozen=True, kw_only=True)
class Marks:
    """What the schema's markers say about a valid document."""

    ignored: tuple[str, ...]
    """JSON paths of the keys marked ``x-dtypeplan-ignored``."""
    warnings: tuple[str, ...]
    """One per model-side key (``x-dtypeplan-caller``) that is not off."""


def validate(document: dict[str, Any]) -> Marks:
    """Raise :class:`PrecisionConfigError` for the first schema error (by path), naming the
    key as the user wrote it; else the document's ignored and caller-side keys."""
    schema = config_schema()
    errors = sorted(
        _Validator(schema).iter_errors(document), key=lambda e: (list(map(str, e.path)), e.message)
    )
    if errors:
        raise _schema_error(jsonschema.exceptions.best_match(errors))
    ignored = [path for path, _, _ in _marked_paths(document, schema, schema, [], _IGNORED)]
    warnings = [
        f"{path}: {message}"
        for path, message, value in _marked_paths(document, schema, schema, [], _CALLER)
        if not _is_off(value)
    ]
    return Marks(ignored=tuple(ignored), warnings=tuple(warnings))


def top_level_keys() -> list[str]:
    """The top-level keys anyone reads: the schema's and DeepSpeed's own."""
    return sorted({*config_schema()["properties"], *ds_keys.TOP_LEVEL_KEYS})


@cache
def config_schema() -> dict[str, Any]:
    """The JSON Schema of a config (``schemas/config.schema.json``)."""
    text = resources.files("dtypeplan").joinpath("schemas/config.schema.json").read_text()
    return json.loads(text)


def _is_finite_number(checker: Any, instance: Any) -> bool:
    """JSON's number: NaN and Infinity (which Python's json and dict configs allow) are not."""
    if not jsonschema.Draft202012Validator.TYPE_CHECKER.is_type(instance, "number"):
        return False
    return not isinstance(instance, float) or math.isfinite(instance)


def _is_array(checker: Any, instance: Any) -> bool:
    """JSON's array: a dict config written in Python may hold tuples (``"betas": (0.9, 0.99)``)."""
    return isinstance(instance, (list, tuple))


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"number": _is_finite_number, "array": _is_array}
    ),
)


def _schema_error(error: jsonschema.ValidationError) -> PrecisionConfigError:
    path = json_path(error.absolute_path)
    if path == "$.optimizer.type" and isinstance(error.instance, str):
        try:
            canonical_name(error.instance)  # raises naming the valid names
        except PrecisionConfigError as exc:
            return exc
    if isinstance(error.instance, float) and not math.isfinite(error.instance):
        return PrecisionConfigError(
            f"invalid value {error.instance} at {path}: must be a finite number", path
        )
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        schema = error.schema if isinstance(error.schema, dict) else {}
        known = sorted(schema.get("properties", {}))
        unknown = sorted((k for k in error.instance if k not in known), key=str)
        key = unknown[0] if unknown else "?"
        hint = closest_hint(str(key), known)
        return PrecisionConfigError(
            f"unknown key {key!r} at {json_path([*error.absolute_path, key])}: {hint}",
            json_path([*error.absolute_path, key]),
        )
    if error.validator in ("oneOf", "anyOf") and error.context:
        # Report the branch whose type fits the value (a misspelt key inside the mapping
        # form, say), not the generic "is not valid under any of the given schemas".
        fitting = [e for e in error.context if e.validator not in ("type", "$ref")]
        misspelt = [e for e in fitting if e.validator == "additionalProperties"]
        if misspelt:
            return _schema_error(misspelt[0])
        if fitting:
            return _schema_error(jsonschema.exceptions.best_match(fitting))
    if isinstance(error.instance, (dict, list)):
        value = _SHORT_REPR.repr(error.instance)
    else:
        value = json.dumps(error.instance, default=repr)
    if len(value) > 60:
        value = value[:57] + "..."
    # jsonschema's message quotes the whole value; the value is bounded (_input), the text too.
    message = error.message if len(error.message) <= 200 else error.message[:197] + "..."
    return PrecisionConfigError(f"invalid value {value} at {path}: {message}", path)


def _resolve_ref(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return schema["$defs"][ref.removeprefix("#/$defs/")]
    return node


def _object_properties(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """The ``properties`` of ``node``, through a ``$ref`` and the object branch of an anyOf."""
    node = _resolve_ref(schema, node)
    if "properties" in node:
        return node["properties"]
    for branch in node.get("anyOf", ()):
        branch = _resolve_ref(schema, branch)
        if "properties" in branch:
            return branch["properties"]
    return {}


def _marked_paths(
    document: Any, schema: dict[str, Any], node: dict[str, Any], prefix: list[Any], mark: str
) -> list[tuple[str, Any, Any]]:
    """(JSON path, schema marker, value) of every key in ``document`` whose schema has ``mark``."""
    found: list[tuple[str, Any, Any]] = []
    if not isinstance(document, dict):
        return found
    properties = _object_properties(schema, node)
    for key, value in document.items():
        sub = properties.get(key)
        if sub is None:
            continue
        if sub.get(mark):
            found.append((json_path([*prefix, key]), sub[mark], value))
        else:
            found.extend(_marked_paths(value, schema, sub, [*prefix, key], mark))
    return found


def _is_off(value: Any) -> bool:
    """A model-side block that is absent in effect: false, null, empty, or enabled false."""
    if value is None or value is False or value == {} or value == []:
        return True
    return isinstance(value, dict) and value.get("enabled") is False
