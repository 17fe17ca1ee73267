"""``"auto"`` values: filled from ``resolve(..., auto=...)`` or with the HF Trainer's defaults.

DeepSpeed itself has no ``"auto"``: the HF Trainer / Accelerate integration replaces each one
before DeepSpeed reads the config (``tests/data/deepspeed_configs/HF_AUTO_DEFAULTS.md``). Here
each ``"auto"`` takes, in order: the value the caller gives in ``auto`` (a mapping of dotted
paths), else the value the HF Trainer writes with default ``TrainingArguments``
(``_hf_auto_defaults.py``), else nothing: the key is dropped and the setting keeps its default,
which is what DeepSpeed's parser does with an ``"auto"`` it is handed (run-time and model-derived
values such as ``train_batch_size`` or ``reduce_bucket_size`` cannot be known here). Every
``"auto"`` is recorded as an :class:`AutoValue`, which ``explain()`` lists.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dtypeplan.errors import PrecisionConfigError
from dtypeplan.resolver import _hf_auto_defaults as hf
from dtypeplan.resolver._deepspeed import closest_hint

__all__ = [
    "AUTO",
    "FROM_CALLER",
    "SHARD_GROUP_SIZE",
    "AutoValue",
    "auto_filled",
    "auto_paths",
    "auto_values_from",
    "fill_auto",
]

AUTO = "auto"
FROM_CALLER = "auto="

# Every dotted path the HF integration fills; a caller's fill for one of these that the config
# does not hold is accepted and does nothing (as HF fills only the keys a file has).
FILLABLE: frozenset[str] = frozenset(
    {*hf.HF_AUTO_FILLS, *hf.HF_AUTO_RUNTIME, *hf.HF_AUTO_FROM_MODEL, *hf.ACCELERATE_AUTO_FILLS}
)


@dataclass(frozen=True, kw_only=True)
class AutoValue:
    """One ``"auto"`` of the config and what it became."""

    path: str
    """The dotted config path, e.g. ``"bf16.enabled"``."""
    value: Any
    """The value used; None when the key was dropped (its default applies)."""
    source: str
    """``"auto="`` (the caller's fill), ``"HF TrainingArguments.<field> default"``, or why the
    key keeps its default."""

    def describe(self) -> str:
        used = "default kept" if self.value is None else f"{self.value!r}"
        return f"{self.path} = {used}  <- {self.source}"


_MISSING = object()


def auto_paths(document: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every ``"auto"`` value in ``document`` (mappings only, in file order)."""
    found: list[str] = []
    if isinstance(document, dict):
        for key, value in document.items():
            path = f"{prefix}{key}"
            if isinstance(value, str) and value == AUTO:
                found.append(path)
            else:
                found.extend(auto_paths(value, f"{path}."))
    return found


def _get(document: dict[str, Any], path: str) -> Any:
    node: Any = document
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _set(document: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = document
    for part in parents:
        node = node[part]
    if value is _MISSING:
        del node[last]
    else:
        node[last] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    numbers = (int, float)
    if (
        isinstance(a, numbers)
        and isinstance(b, numbers)
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
        return float(a) == float(b)
    return type(a) is type(b) and bool(a == b)


SHARD_GROUP_SIZE = "zero_optimization.shard_group_size"


def _ranks_per_node() -> tuple[Any, str]:
    """``shard_group_size: "auto"``: torchrun's ranks per node, read at resolve time."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None:
        return _MISSING, (
            "LOCAL_WORLD_SIZE is not set (not under torchrun), so the layout is flat: one "
            "shard group of every rank"
        )
    try:
        ranks = int(local)
    except ValueError:
        raise PrecisionConfigError(
            f'{SHARD_GROUP_SIZE} "auto": LOCAL_WORLD_SIZE is {local!r}, not a number of ranks',
            f"$.{SHARD_GROUP_SIZE}",
        ) from None
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world.strip() == str(ranks):
        return _MISSING, (
            f"one node (LOCAL_WORLD_SIZE = WORLD_SIZE = {ranks}), so the layout is flat"
        )
    return ranks, "torchrun's LOCAL_WORLD_SIZE (the ranks per node)"


def _hf_default(path: str) -> tuple[Any, str]:
    """What the HF integration writes for ``path`` with default TrainingArguments (for
    dtypeplan's own ``shard_group_size``: the ranks per node)."""
    if path == SHARD_GROUP_SIZE:
        return _ranks_per_node()
    if path in hf.HF_AUTO_FILLS:
        value, field = hf.HF_AUTO_FILLS[path]
        source = (
            "HF integration constant"
            if field == "constant"
            else f"HF TrainingArguments.{field} default"
        )
        return copy.deepcopy(value), source
    if path in hf.ACCELERATE_AUTO_FILLS:
        value, field = hf.ACCELERATE_AUTO_FILLS[path]
        return copy.deepcopy(value), f"Accelerate default: {field}"
    if path in hf.HF_AUTO_RUNTIME:
        return _MISSING, (
            f"filled by the HF Trainer at run time ({hf.HF_AUTO_RUNTIME[path]}); unknown here, "
            f"so unset: pass auto={{{path!r}: ...}}"
        )
    if path in hf.HF_AUTO_FROM_MODEL:
        return _MISSING, (
            f"filled by the HF Trainer from the model ({hf.HF_AUTO_FROM_MODEL[path]}); unknown "
            "here, so dtypeplan's default applies"
        )
    return _MISSING, (
        'not filled by the HF integration; DeepSpeed drops an "auto" here, so the default applies'
    )


def fill_auto(
    document: dict[str, Any], auto: Mapping[str, Any] | None
) -> tuple[dict[str, Any], tuple[AutoValue, ...]]:
    """``document`` with every ``"auto"`` replaced (or dropped), and a record of each.

    A fill for a key the config sets to something else than ``"auto"`` is an error naming the
    key (the HF Trainer refuses such a mismatch too); a fill equal to the config's value is
    accepted. A fill for a path the config does not hold is accepted only for the paths the HF
    integration fills (it then does nothing); any other is an error with the closest path.
    Stage 3 of ``load_config``.
    """
    if auto is not None and not isinstance(auto, Mapping):
        raise PrecisionConfigError(
            f"auto must be a mapping of dotted config paths to values, not {type(auto).__name__}"
        )
    given = dict(auto or {})
    for path in given:
        if not isinstance(path, str):
            raise PrecisionConfigError(f"auto: keys are dotted config paths, not {path!r}", "$")
    found = auto_paths(document)
    for path, value in given.items():
        current = _get(document, path)
        if current is _MISSING:
            if path not in FILLABLE:
                hint = closest_hint(path, [*found, *FILLABLE])
                if "did you mean" not in hint:
                    listed = ", ".join(found) if found else "none"
                    hint = f'the config\'s "auto" entries: {listed}'
                raise PrecisionConfigError(
                    f"auto[{path!r}]: the config has no {path!r} and the HF integration does "
                    f"not fill such a key ({hint})",
                    f"$.{path}",
                )
        elif not (isinstance(current, str) and current == AUTO) and not _same(current, value):
            raise PrecisionConfigError(
                f"auto[{path!r}] = {value!r}, but the config sets {path} to {current!r}, not "
                '"auto": only "auto" entries are filled; change the config or drop the fill',
                f"$.{path}",
            )
    filled = copy.deepcopy(document)
    records: list[AutoValue] = []
    for path in found:
        if path in given:
            value, source = copy.deepcopy(given[path]), FROM_CALLER
        else:
            value, source = _hf_default(path)
        _set(filled, path, value)
        records.append(
            AutoValue(path=path, value=None if value is _MISSING else value, source=source)
        )
    return filled, tuple(records)


def auto_filled(auto_values: tuple[AutoValue, ...], prefix: str) -> list[AutoValue]:
    """The ``"auto"`` values under ``prefix`` that took the HF defaults (not the caller's)."""
    return [a for a in auto_values if a.path.startswith(prefix) and a.source != FROM_CALLER]


def _known(total: int | None, what: str) -> int:
    """The run's step count, which a warmup given as a ratio needs."""
    if total is None:
        raise PrecisionConfigError(
            f"auto_values_from: {what} is a ratio of the run's training steps, which are not "
            "known (max_steps is not set: an epoch-based run); pass "
            "auto_values_from(args, num_training_steps=...) with the Trainer's number of "
            "optimizer steps"
        )
    return total


def _attr(obj: Any, name: str) -> Any:
    return getattr(obj, name, None)


def auto_values_from(training_args: Any, num_training_steps: int | None = None) -> dict[str, Any]:
    """The ``auto`` mapping that the HF Trainer would fill from ``training_args``.

    Duck-typed: reads attributes such as ``bf16``, ``fp16``, ``max_grad_norm``,
    ``learning_rate``, ``adam_beta1`` / ``adam_beta2``, ``adam_epsilon``, ``weight_decay``,
    ``gradient_accumulation_steps``, ``per_device_train_batch_size``, ``warmup_steps`` and
    ``max_steps`` from any object (a ``transformers.TrainingArguments``, a namespace, ...)
    without importing transformers; attributes the object lacks are left out.

    ``num_training_steps``: the optimizer steps of the whole run as the Trainer computes them
    (``max_steps``, or epochs times steps per epoch): it fills ``total_num_steps`` (an
    epoch-based run has ``max_steps = -1``) and the ratio form of ``warmup_steps``. Without
    it, ``max_steps`` stands in when positive. ``warmup_num_steps`` is filled as the Trainer
    fills it, ``max(1, get_warmup_steps(num_training_steps))``: DeepSpeed's warmup schedulers
    refuse 0, and a warmup of 1 step (as of 2) is no warmup at all.
    """
    if num_training_steps is not None and (
        not isinstance(num_training_steps, int)
        or isinstance(num_training_steps, bool)
        or num_training_steps <= 0
    ):
        raise PrecisionConfigError(
            f"auto_values_from(num_training_steps={num_training_steps!r}): the run's number "
            "of optimizer steps must be a positive integer"
        )
    out: dict[str, Any] = {}
    bf16, bf16_eval = _attr(training_args, "bf16"), _attr(training_args, "bf16_full_eval")
    if bf16 is not None or bf16_eval is not None:
        out["bf16.enabled"] = bool(bf16 or bf16_eval)
    fp16, fp16_eval = _attr(training_args, "fp16"), _attr(training_args, "fp16_full_eval")
    if fp16 is not None or fp16_eval is not None:
        out["fp16.enabled"] = bool(fp16 or fp16_eval)
    direct = {
        "max_grad_norm": "gradient_clipping",
        "learning_rate": "optimizer.params.lr",
        "adam_epsilon": "optimizer.params.eps",
        "weight_decay": "optimizer.params.weight_decay",
        "gradient_accumulation_steps": "gradient_accumulation_steps",
        "per_device_train_batch_size": "train_micro_batch_size_per_gpu",
    }
    for attribute, path in direct.items():
        value = _attr(training_args, attribute)
        if value is not None:
            out[path] = value
    learning_rate = _attr(training_args, "learning_rate")
    if learning_rate is not None:
        out["scheduler.params.warmup_max_lr"] = learning_rate
        out["scheduler.params.warmup_min_lr"] = 0
    beta1, beta2 = _attr(training_args, "adam_beta1"), _attr(training_args, "adam_beta2")
    if beta1 is not None and beta2 is not None:
        out["optimizer.params.betas"] = [beta1, beta2]
    max_steps = _attr(training_args, "max_steps")
    total = num_training_steps
    if total is None and isinstance(max_steps, int) and max_steps > 0:
        total = max_steps
    if total is not None:
        out["scheduler.params.total_num_steps"] = total
    # TrainingArguments.get_warmup_steps: an int >= 1 is a step count, a float below 1 a ratio
    # of the training steps (older releases: warmup_ratio); the Trainer fills max(1, that).
    warmup = _attr(training_args, "warmup_steps")
    ratio = _attr(training_args, "warmup_ratio")
    steps: int | None = None
    if isinstance(warmup, (int, float)) and warmup >= 1:
        steps = int(warmup)
    elif isinstance(warmup, float) and 0 < warmup < 1:
        steps = math.ceil(warmup * _known(total, f"warmup_steps={warmup}"))
    elif isinstance(ratio, (int, float)) and ratio > 0:
        steps = math.ceil(ratio * _known(total, f"warmup_ratio={ratio}"))
    elif isinstance(warmup, (int, float)):
        steps = int(warmup)
    if steps is not None:
        out["scheduler.params.warmup_num_steps"] = max(1, steps)
    return out
