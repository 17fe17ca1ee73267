"""Loading and validating a DeepSpeed-style config into a :class:`PrecisionConfig`.

The JSON Schema in ``schemas/config.schema.json`` is the single source of truth for what a
config may hold; it ships with the package so editors can validate configs too. Keys marked
``x-dtypeplan-ignored`` there are DeepSpeed settings that do not bear on precision: they are
accepted and reported by ``explain()``. This module only turns a schema-valid document into
typed values; it applies no defaults (those live in ``precision_rules.yaml``).
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
import os
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import jsonschema
import torch
import yaml

from dtypeplan.errors import PrecisionConfigError
from dtypeplan.resolver._dimensions import REDUCTION
from dtypeplan.resolver._frozen import FrozenDict, freeze

__all__ = ["LossScaleConfig", "OptimizerConfig", "PrecisionConfig", "config_schema", "load_config"]

OptimizerClass = type[torch.optim.Optimizer]
"""A ``torch.optim`` class (an alias: ``OptimizerConfig.type`` shadows the builtin there)."""

_OPTIMIZER_CLASSES: dict[str, OptimizerClass] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}
# Chosen by dtypeplan, not by the user: the implementation sets them itself.
_RESERVED_OPTIMIZER_ARGS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """fp16 loss scaling, with DeepSpeed's names and defaults."""

    loss_scale: float = 0.0
    """0 selects dynamic scaling; a positive value is a static scale."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at ``2 ** initial_scale_power``."""
    loss_scale_window: int = 1000
    """Consecutive steps without overflow after which the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated (each one only spends budget) before the scale halves."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every step without overflow, not only at growth."""
    min_loss_scale: float = 1.0
    """The scale never drops below this value."""


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Which ``torch.optim`` update the master weights get, with torch's argument names."""

    type: str = "AdamW"
    """``"AdamW"``, ``"Adam"`` or ``"SGD"``."""
    params: FrozenDict[str, Any] = field(default_factory=lambda: FrozenDict({"lr": 1e-3}))
    """Keyword arguments of the torch optimizer (``lr``, ``betas``, ``weight_decay``, ...);
    lists given in the config are tuples here, so the config is hashable."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", freeze(self.params))

    @property
    def torch_class(self) -> OptimizerClass:
        return _OPTIMIZER_CLASSES[self.type.lower()]

    @property
    def state_bytes_per_param(self) -> int:
        """fp32 optimizer-state bytes per parameter (Adam: m and v; SGD: momentum if any)."""
        if self.type.lower() in ("adam", "adamw"):
            return 8 + (4 if self.params.get("amsgrad") else 0)
        return 4 if float(self.params.get("momentum", 0.0)) != 0.0 else 0


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """The precision-relevant settings of a config, as given (``None`` = not set)."""

    bf16: bool = False
    fp16: bool = False
    loss_scaling: LossScaleConfig = field(default_factory=LossScaleConfig)
    grad_accum_dtype: str | None = None
    """``"fp32"``, ``"fp16"`` or ``"bf16"``; ``None`` lets the rules table choose."""
    grad_accum_dtype_key: str | None = None
    """Where ``grad_accum_dtype`` was given (a JSON path), for ``explain()``."""
    accumulator_sharded: bool | None = None
    comm_dtype: str | None = None
    comm_reduction: str = REDUCTION.default_value
    zero_stage: int | None = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    optimizer_given: bool = False
    gradient_clipping: float = 0.0
    reduce_bucket_size: int | None = None
    check_nonfinite: bool = False
    ignored_keys: tuple[str, ...] = ()
    """JSON paths of DeepSpeed keys that were accepted but do not bear on precision."""
    source: str | None = None
    """The file the config came from, if any."""
    # Issue 11's feature settings (ISSUE11_SHARED.md), read by the resolver; defaults = not used.
    master_weights_dtype: str = "fp32"
    optimizer_states_dtype: str = "fp32"
    autocast: str = "none"
    offload_optimizer: str = "none"
    offload_param: str = "none"
    quantized_communication: str = "none"
    hierarchical_partitioning: bool = False
    gradient_prescaling: str = "none"
    fp8: bool = False
    scheduler: FrozenDict[str, Any] | None = None


@cache
def config_schema() -> dict[str, Any]:
    """The JSON Schema of a config (``schemas/config.schema.json``)."""
    text = resources.files("dtypeplan").joinpath("schemas/config.schema.json").read_text()
    return json.loads(text)


def _json_path(parts: Any) -> str:
    path = "$"
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _schema_error(error: jsonschema.ValidationError) -> PrecisionConfigError:
    path = _json_path(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        schema = error.schema if isinstance(error.schema, dict) else {}
        known = sorted(schema.get("properties", {}))
        unknown = sorted((k for k in error.instance if k not in known), key=str)
        key = unknown[0] if unknown else "?"
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
        return PrecisionConfigError(
            f"unknown key {key!r} at {_json_path([*error.absolute_path, key])}: {hint}",
            _json_path([*error.absolute_path, key]),
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
    value = json.dumps(error.instance, default=repr)
    if len(value) > 60:
        value = value[:57] + "..."
    return PrecisionConfigError(f"invalid value {value} at {path}: {error.message}", path)


def _read_file(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise PrecisionConfigError(f"cannot read config file {path!r}: {exc.strerror}") from exc
    except ValueError as exc:  # a NUL in the path, or a file that is not UTF-8 text
        raise PrecisionConfigError(f"cannot read config file {path!r}: {exc}") from exc
    try:
        if path.endswith((".yaml", ".yml")):
            return yaml.safe_load(text)
        return json.loads(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise PrecisionConfigError(
            f"{path}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'}: {exc}"
        ) from exc


def _ignored_paths(document: Any, schema: dict[str, Any], prefix: list[Any]) -> list[str]:
    found: list[str] = []
    if not isinstance(document, dict):
        return found
    properties = schema.get("properties", {})
    for key, value in document.items():
        sub = properties.get(key)
        if sub is None:
            continue
        if sub.get("x-dtypeplan-ignored"):
            found.append(_json_path([*prefix, key]))
        else:
            found.extend(_ignored_paths(value, sub, [*prefix, key]))
    return found


def _check_optimizer_params(kind: str, params: dict[str, Any]) -> None:
    torch_class = _OPTIMIZER_CLASSES[kind.lower()]
    accepted = [
        name
        for name in inspect.signature(torch_class.__init__).parameters
        if name not in ("self", *_RESERVED_OPTIMIZER_ARGS)
    ]
    for key in params:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(accepted)}"
            path = f"$.optimizer.params.{key}"
            raise PrecisionConfigError(
                f"unknown {torch_class.__name__} argument {key!r} at {path}: {hint}", path
            )
    try:
        torch_class([torch.zeros(1, requires_grad=True)], **params)
    except Exception as exc:  # torch raises several types for bad hyperparameters
        raise PrecisionConfigError(
            f"invalid optimizer params at $.optimizer.params: {exc}", "$.optimizer.params"
        ) from exc


def load_config(config: dict[str, Any] | str | os.PathLike[str]) -> PrecisionConfig:
    """Validate ``config`` (a dict, or a path to a .json / .yaml file) and return its settings.

    Raises :class:`PrecisionConfigError` naming the JSON path of the first bad value.
    """
    source = None
    if isinstance(config, (str, os.PathLike)):
        source = os.fspath(config)
        document = _read_file(source)
    else:
        document = config
    if not isinstance(document, dict):
        raise PrecisionConfigError(
            f"a config must be a mapping of keys to values, not {type(document).__name__}"
        )
    schema = config_schema()
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(
        validator.iter_errors(document), key=lambda e: (list(map(str, e.path)), e.message)
    )
    if errors:
        raise _schema_error(jsonschema.exceptions.best_match(errors))

    accum_given = document.get("gradient_accumulation_dtype")
    accum_dtype: str | None = None
    sharded: bool | None = None
    accum_key: str | None = None
    if isinstance(accum_given, str):
        accum_dtype, accum_key = accum_given, "$.gradient_accumulation_dtype"
    elif isinstance(accum_given, dict):
        accum_dtype = accum_given["dtype"]
        sharded = accum_given.get("sharded")
        accum_key = "$.gradient_accumulation_dtype.dtype"
    alias = document.get("data_types", {}).get("grad_accum_dtype")
    if alias is not None:
        if accum_dtype is not None and alias != accum_dtype:
            raise PrecisionConfigError(
                f"$.data_types.grad_accum_dtype is {alias!r} but {accum_key} is {accum_dtype!r}: "
                "they are the same setting; keep one of them",
                "$.data_types.grad_accum_dtype",
            )
        if accum_dtype is None:
            accum_dtype, accum_key = alias, "$.data_types.grad_accum_dtype"

    fp16 = document.get("fp16", {})
    bf16 = document.get("bf16", {})
    scaling = LossScaleConfig(
        **{k: fp16[k] for k in LossScaleConfig.__dataclass_fields__ if k in fp16}
    )
    optimizer_doc = document.get("optimizer")
    optimizer = OptimizerConfig()
    if optimizer_doc is not None:
        params = dict(optimizer_doc.get("params", {}))
        if "betas" in params and isinstance(params["betas"], list):
            params["betas"] = tuple(params["betas"])
        _check_optimizer_params(optimizer_doc["type"], params)
        canonical = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}[optimizer_doc["type"].lower()]
        optimizer = OptimizerConfig(type=canonical, params=freeze(params))
    zero = document.get("zero_optimization", {})
    bucket = zero.get("reduce_bucket_size")
    for path, value in (
        ("$.zero_optimization.reduce_bucket_size", bucket),
        ("$.gradient_clipping", document.get("gradient_clipping")),
    ):
        if value is not None and not math.isfinite(value):
            raise PrecisionConfigError(
                f"invalid value {value} at {path}: must be a finite number", path
            )
    return PrecisionConfig(
        bf16=bool(bf16.get("enabled", False)),
        fp16=bool(fp16.get("enabled", False)),
        loss_scaling=scaling,
        grad_accum_dtype=accum_dtype,
        grad_accum_dtype_key=accum_key,
        accumulator_sharded=sharded,
        comm_dtype=document.get("communication_data_type"),
        comm_reduction=document.get("communication_reduction", REDUCTION.default_value),
        zero_stage=int(zero["stage"]) if "stage" in zero else None,
        optimizer=optimizer,
        optimizer_given=optimizer_doc is not None,
        gradient_clipping=float(document.get("gradient_clipping", 0.0)),
        reduce_bucket_size=int(bucket) if bucket is not None else None,
        check_nonfinite=bool(
            document.get("check_nonfinite", bf16.get("check_grad_overflow", False))
        ),
        ignored_keys=tuple(_ignored_paths(document, schema, [])),
        source=source,
    )
