"""DeepSpeed's own spellings: removed keys, aliases, deprecated names and unknown keys.

DeepSpeed 0.19.8 accepts several names for one setting (``stage3_prefetch_bucket_size`` for
``prefetch_bucket_size``, the legacy ``bfloat16`` block for ``bf16``, ``cpu_offload: true`` for
``offload_optimizer: {device: cpu}``), refuses a few removed blocks outright, and ignores any
top-level key it does not know. This module turns a raw document into one canonical spelling
with DeepSpeed's meaning, so that ``_fields.py`` reads only canonical names. The key lists are
DeepSpeed's own (``_deepspeed_keys.py``, generated from its config models).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from dtypeplan.errors import PrecisionConfigError
from dtypeplan.resolver import _deepspeed_keys as ds

__all__ = [
    "KEYS_LISTED_IN",
    "canonical_spellings",
    "check_removed",
    "closest_hint",
    "screen",
    "split_unknown_top_level",
]

KEYS_LISTED_IN = (
    "the known keys are listed in dtypeplan/schemas/config.schema.json "
    "(DeepSpeed's own, with their aliases, in dtypeplan/resolver/_deepspeed_keys.py)"
)
# Up to this many known keys are printed in a hint; beyond it the hint says where they are listed.
MAX_LISTED_KEYS = 10


def closest_hint(key: str, known: Iterable[str]) -> str:
    """``did you mean 'x'?``, or the known keys (few), or where they are listed (many)."""
    names = sorted({str(k) for k in known})
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    if len(names) <= MAX_LISTED_KEYS:
        return f"known keys: {', '.join(names)}"
    return KEYS_LISTED_IN


_REMOVED_HINTS = {
    "mics_shard_size": (
        "; MiCS (states sharded within groups of mics_shard_size ranks, replicated across "
        "them) is what zero_optimization.shard_group_size does: set that to the same number"
    ),
    "mics_hierarchical_params_gather": (
        "; with zero_optimization.shard_group_size the parameters are gathered within each "
        "shard group, which is what the hierarchical gather kept inside a node"
    ),
}
"""What replaces a removed key, where dtypeplan has it."""


def check_removed(document: dict[str, Any]) -> None:
    """Refuse the blocks DeepSpeed 0.19.8 removed (it raises DeepSpeedConfigError for them)."""
    for key in ds.REMOVED_TOP_LEVEL_KEYS:
        if key in document:
            raise PrecisionConfigError(
                f"$.{key}: DeepSpeed {ds.DEEPSPEED_VERSION} removed {key!r} too (it raises "
                "DeepSpeedConfigError for it), and dtypeplan does not implement it; a leftover "
                "block would change what the run does: delete the key",
                f"$.{key}",
            )
    zero = document.get("zero_optimization")
    if isinstance(zero, dict):
        for key in ds.REMOVED_ZERO_KEYS:
            if key in zero:
                path = f"$.zero_optimization.{key}"
                raise PrecisionConfigError(
                    f"{path}: DeepSpeed {ds.DEEPSPEED_VERSION} removed {key!r} too (it raises "
                    f"DeepSpeedConfigError for it): delete the key{_REMOVED_HINTS.get(key, '')}",
                    path,
                )


def split_unknown_top_level(
    document: dict[str, Any], known: Iterable[str], *, strict: bool
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Drop top-level keys nobody reads, with a warning each (DeepSpeed ignores them too).

    Under ``strict`` an unknown key is a :class:`PrecisionConfigError` instead.
    """
    known_set = set(known)
    kept: dict[str, Any] = {}
    warnings: list[str] = []
    for key, value in document.items():
        if key in known_set:
            kept[key] = value
            continue
        hint = closest_hint(key, known_set)
        path = f"$.{key}"
        if strict or not isinstance(key, str):  # a YAML key that no JSON config can hold
            raise PrecisionConfigError(f"unknown key {key!r} at {path}: {hint}", path)
        warnings.append(
            f"unknown top-level key {key!r} ignored, as DeepSpeed ignores it ({hint}); "
            "resolve(..., strict=True) makes it an error"
        )
    return kept, tuple(warnings)


def screen(
    document: dict[str, Any], known: Iterable[str], *, strict: bool
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Stage 4 of ``load_config``, before the schema: refuse the removed blocks
    (:func:`check_removed`) and set the unknown top-level keys aside with a warning each
    (:func:`split_unknown_top_level`)."""
    check_removed(document)
    return split_unknown_top_level(document, known, strict=strict)


def _same(a: Any, b: Any) -> bool:
    return bool(a == b)


def _merge_alias(block: dict[str, Any], alias: str, canonical: str, where: str) -> None:
    """Move ``block[alias]`` to ``block[canonical]``; both given and different is an error."""
    if alias not in block:
        return
    value = block.pop(alias)
    if canonical in block and not _same(block[canonical], value):
        raise PrecisionConfigError(
            f"{where}.{alias} is {value!r} but {where}.{canonical} is {block[canonical]!r}: "
            "they are the same DeepSpeed setting; keep one of them",
            f"{where}.{alias}",
        )
    block.setdefault(canonical, value)


def _canonical_zero(zero: dict[str, Any]) -> dict[str, Any]:
    zero = dict(zero)
    where = "$.zero_optimization"
    for canonical, aliases in ds.FIELDS["zero_optimization"].items():
        for alias in aliases:
            _merge_alias(zero, alias, canonical, where)
    # Deprecated names DeepSpeed still accepts (it warns and sets the new field).
    _merge_alias(
        zero,
        "stage3_gather_fp16_weights_on_model_save",
        "gather_16bit_weights_on_model_save",
        where,
    )
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old not in zero:
            continue
        on = zero.pop(old)
        if not on:
            continue
        given = zero.get(new)
        device = given.get("device", "none") if isinstance(given, dict) else "none"
        if device not in ("none", "cpu"):
            raise PrecisionConfigError(
                f"{where}.{old} true asks for CPU offload but {where}.{new}.device is "
                f"{device!r}: keep one of them",
                f"{where}.{old}",
            )
        zero[new] = {**(given or {}), "device": "cpu"}
    # Pinned host memory changes neither numbers nor memory size; DeepSpeed only warns about it.
    zero.pop("cpu_offload_use_pin_memory", None)
    return zero


def canonical_spellings(document: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The document under DeepSpeed's canonical names, and notes on what was rewritten: stage 6
    of ``load_config``.

    Expects a schema-valid document (the schema knows every spelling).
    """
    out = dict(document)
    notes: list[str] = []
    if "bfloat16" in out:
        legacy = out.pop("bfloat16")
        if "bf16" in out:
            notes.append(
                "$.bfloat16 is not read because $.bf16 is given (DeepSpeed reads the legacy "
                "bfloat16 block only without a bf16 block)"
            )
        else:
            out["bf16"] = legacy
    if isinstance(out.get("zero_optimization"), dict):
        out["zero_optimization"] = _canonical_zero(out["zero_optimization"])
    return out, tuple(notes)
