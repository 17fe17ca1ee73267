"""Loading and validating a DeepSpeed-style config into a :class:`PrecisionConfig`.

The JSON Schema in ``schemas/config.schema.json`` is the single source of truth for what a
config may hold; it ships with the package so editors can validate configs too. Keys marked
``x-dtypeplan-ignored`` there change neither numbers nor memory: they are accepted and reported
by ``explain()``; keys marked ``x-dtypeplan-caller`` are model-side DeepSpeed features dtypeplan
does not run: accepted with a warning. Before validation, ``"auto"`` values are filled
(``_auto.py``), removed DeepSpeed blocks refused and unknown top-level keys set aside with a
warning (``_deepspeed.py``); after it, DeepSpeed's aliases are folded into canonical names. This
module then turns the document into typed values; it applies no table defaults (those live in
``precision_rules.yaml``).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import jsonschema
import torch

from dtypeplan.errors import NotSupportedError, PrecisionConfigError
from dtypeplan.resolver import _deepspeed_keys as ds_keys
from dtypeplan.resolver._auto import FROM_CALLER, SHARD_GROUP_SIZE, AutoValue, fill_auto
from dtypeplan.resolver._deepspeed import (
    canonical_spellings,
    check_removed,
    closest_hint,
    split_unknown_top_level,
)
from dtypeplan.resolver._dimensions import REDUCTION, STATE_DTYPES, states_value
from dtypeplan.resolver._frozen import FrozenDict, freeze
from dtypeplan.resolver._input import (
    InputError,
    InputLimits,
    check_document,
    parse_json,
    parse_yaml_config,
    read_text,
)
from dtypeplan.resolver._optimizer_kind import (
    canonical_name,
    optimizer_class,
    optimizer_kind,
    shaped_reason,
    state_bytes_per_param,
)

__all__ = [
    "AutoValue",
    "LossScaleConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "config_schema",
    "load_config",
]

# Schema markers: accepted keys that change neither numbers nor memory, and model-side
# DeepSpeed features that dtypeplan does not run (accepted with a warning).
_IGNORED = "x-dtypeplan-ignored"
_CALLER = "x-dtypeplan-caller"

OptimizerClass = type[torch.optim.Optimizer]
"""A ``torch.optim`` class (an alias: ``OptimizerConfig.type`` shadows the builtin there)."""

# A DeepSpeed config has a few hundred values; these bounds leave room and keep error
# formatting (jsonschema quotes offending values whole) cheap.
_CONFIG_LIMITS = InputLimits(max_bytes=4 * 2**20, max_nodes=100_000)
_SHORT_REPR = reprlib.Repr()  # keyword arguments need Python 3.12
_SHORT_REPR.maxlevel, _SHORT_REPR.maxdict, _SHORT_REPR.maxlist = 2, 4, 4
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 30
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
    """The optimizer's name as dtypeplan spells it (``_optimizer_kind.canonical_name``): a
    ``torch.optim`` class (``"AdamW"``, ``"RMSprop"``, ``"Adafactor"``...) or one of DeepSpeed's
    own optimizers that ``torch.optim`` lacks (``"Lamb"``, ``"Lion"``...)."""
    params: FrozenDict[str, Any] = field(default_factory=lambda: FrozenDict({"lr": 1e-3}))
    """Keyword arguments of the torch optimizer (``lr``, ``betas``, ``weight_decay``, ...);
    lists given in the config are tuples here, so the config is hashable."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", freeze(self.params))

    @property
    def torch_class(self) -> OptimizerClass:
        """The ``torch.optim`` class; :class:`NotSupportedError` with the reason for one of
        DeepSpeed's own optimizers, which no ``torch.optim`` class runs."""
        return optimizer_class(self.type)

    def _class_or_none(self) -> OptimizerClass | None:
        try:
            return self.torch_class
        except NotSupportedError:
            return None

    @property
    def kind(self) -> str:
        """The table's ``optimizer`` dimension: ``"elementwise"`` or ``"shaped"``."""
        return optimizer_kind(self._class_or_none())

    @property
    def kind_reason(self) -> str:
        """Why the optimizer is of its kind (for a shaped one: why flat shards cannot run it)."""
        return shaped_reason(self.type, self._class_or_none())

    @property
    def state_bytes_per_param(self) -> int:
        """fp32 optimizer-state bytes per parameter (Adam: m and v; SGD: momentum if any);
        :class:`NotSupportedError` for a shaped optimizer, which dtypeplan does not run."""
        if self.kind != "elementwise":
            raise NotSupportedError(
                f"the optimizer {self.type} is shaped ({self.kind_reason}): dtypeplan does not "
                "run it, so no state bytes are counted for it"
            )
        return state_bytes_per_param(self.torch_class, self.params)


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
    gradient_clipping_given: bool = False
    """Whether the config has the key (DeepSpeed clips at 1.0 without it; dtypeplan does not)."""
    reduce_bucket_size: int | None = None
    check_nonfinite: bool = False
    collective_timeout_s: float = 600.0
    """How long a collective waits for a stalled or dead peer before it fails."""
    ignored_keys: tuple[str, ...] = ()
    """JSON paths of DeepSpeed keys that were accepted and change neither numbers nor memory."""
    source: str | None = None
    """The file the config came from, if any."""
    master_weights_dtype: str = "fp32"
    """The master dimension's value: ``"fp32"``; ``"bf16"`` (round to nearest:
    ``bf16.bf16_master_weights_and_grads`` or ``master_weights: {dtype: bf16}``), ``"bf16_sr"``
    (``rounding: stochastic``), ``"bf16_kahan"`` (``rounding: kahan``); ``"fp16"``
    (``fp16.fp16_master_weights_and_grads``)."""
    optimizer_states_dtype: str = "fp32"
    """The states dimension's value (``_dimensions.STATE_PAIRS``): one dtype for both moments
    (``"fp32"``, ``"bf16"``, ``"int8"``, ``"fp8"``) or ``"exp_avg/exp_avg_sq"`` (``"bf16/fp32"``),
    from ``optimizer_states``, ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` or
    ``bf16.bf16_optimizer_states`` (or ``fp32_optimizer_states: false`` under optimizer
    offload, where DeepSpeed's CPU Adam keeps the moments in the parameter dtype)."""
    autocast: str = "none"
    """``"bf16"`` / ``"fp16"``: ``torch_autocast`` enabled with that dtype; ``"none"``."""
    autocast_dtype_given: bool = False
    """Whether ``torch_autocast.dtype`` was given (without it dtypeplan picks one; DeepSpeed
    passes None on to ``torch.autocast``: see ``_differences.py``)."""
    offload_optimizer: str = "none"
    """``"cpu"`` / ``"nvme"``: ``zero_optimization.offload_optimizer.device`` (or
    ``cpu_offload``); ``"none"``."""
    offload_param: str = "none"
    """``"cpu"`` / ``"nvme"``: ``zero_optimization.offload_param.device``; ``"none"``."""
    quantized_communication: str = "none"
    """``"weights"``, ``"gradients"`` or ``"both"`` (ZeRO++ ``zero_quantized_*``); ``"none"``."""
    hierarchical_partitioning: bool = False
    """ZeRO++ ``zero_hpz_partition_size`` above 1."""
    shard_group_size: int | None = None
    """``zero_optimization.shard_group_size`` (``"auto"`` filled from ``LOCAL_WORLD_SIZE``);
    None: the flat layout."""
    wire_across_groups: str | None = None
    """``communication_data_type_across_groups`` (or ``"int8"`` from ZeRO++'s
    ``zero_quantized_gradients`` with shard groups); None: the communication dtype."""
    wire_across_groups_key: str | None = None
    """Where :attr:`wire_across_groups` came from (a JSON path), for ``explain()``."""
    gradient_prescaling: str = "none"
    """``"prescale"`` (``prescale_gradients``), ``"predivide"`` (``gradient_predivide_factor``
    other than 1) or ``"none"``."""
    fp8: bool = False
    """The ``fp8`` block enabled."""
    scheduler: FrozenDict[str, Any] | None = None
    """DeepSpeed's ``scheduler`` block (``{"type", "params"}``), validated; None without one."""
    gradient_accumulation_steps: int | None = None
    """DeepSpeed's ``gradient_accumulation_steps`` (the caller runs the micro-batches)."""
    train_batch_size: int | None = None
    """DeepSpeed's ``train_batch_size``: samples per step over all data-parallel ranks."""
    train_micro_batch_size_per_gpu: int | None = None
    """DeepSpeed's ``train_micro_batch_size_per_gpu``: samples per micro-batch on one rank."""
    auto_values: tuple[AutoValue, ...] = ()
    """Every ``"auto"`` of the config, the value used and where it came from."""
    config_warnings: tuple[str, ...] = ()
    """Unknown top-level keys (with the closest known key), model-side DeepSpeed settings that
    dtypeplan does not run, and other readings of the config worth a look."""


# (PrecisionConfig field, its "not used" default, the DeepSpeed key that sets it): the
# settings that change numbers or memory beyond the original dimensions of the table.
DEEPSPEED_PRECISION_FIELDS: tuple[tuple[str, Any, str], ...] = (
    ("master_weights_dtype", "fp32", "bf16.bf16_master_weights_and_grads"),
    ("optimizer_states_dtype", "fp32", "bf16.bf16_optimizer_states"),
    ("autocast", "none", "torch_autocast"),
    ("offload_optimizer", "none", "zero_optimization.offload_optimizer"),
    ("offload_param", "none", "zero_optimization.offload_param"),
    ("quantized_communication", "none", "zero_optimization.zero_quantized_*"),
    ("hierarchical_partitioning", False, "zero_optimization.zero_hpz_partition_size"),
    ("gradient_prescaling", "none", "prescale_gradients / gradient_predivide_factor"),
    ("fp8", False, "fp8"),
)


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
    path = _json_path(error.absolute_path)
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
    if isinstance(error.instance, (dict, list)):
        value = _SHORT_REPR.repr(error.instance)
    else:
        value = json.dumps(error.instance, default=repr)
    if len(value) > 60:
        value = value[:57] + "..."
    # jsonschema's message quotes the whole value; the value is bounded (_input), the text too.
    message = error.message if len(error.message) <= 200 else error.message[:197] + "..."
    return PrecisionConfigError(f"invalid value {value} at {path}: {message}", path)


def _read_file(path: str) -> Any:
    is_yaml = path.endswith((".yaml", ".yml"))
    try:
        text = read_text(path, _CONFIG_LIMITS)
        return (
            parse_yaml_config(text, _CONFIG_LIMITS) if is_yaml else parse_json(text, _CONFIG_LIMITS)
        )
    except InputError as exc:
        line = f":{exc.line}" if exc.line is not None else ""
        raise PrecisionConfigError(f"cannot read config file {path}{line}: {exc}") from None


def _check_optimizer_params(name: str, params: dict[str, Any]) -> None:
    """torch's argument names and values for the class named ``name`` (DeepSpeed's own
    optimizers, which no torch class runs, keep DeepSpeed's params unchecked: they resolve
    NotSupported)."""
    if name == "Muon":
        # DeepSpeed reads "muon" in any case as its own MuonWithAuxAdam, with its own params.
        return
    try:
        torch_class = optimizer_class(name)
    except NotSupportedError:
        return
    accepted = [
        name
        for name in inspect.signature(torch_class.__init__).parameters
        if name not in ("self", *_RESERVED_OPTIMIZER_ARGS)
    ]
    for key in params:
        if key not in accepted:
            hint = closest_hint(key, accepted)
            path = f"$.optimizer.params.{key}"
            raise PrecisionConfigError(
                f"unknown {torch_class.__name__} argument {key!r} at {path}: {hint}", path
            )
    try:
        torch_class([_probe_tensor()], **params)
    except Exception as exc:  # torch raises several types for bad hyperparameters
        raise PrecisionConfigError(
            f"invalid optimizer params at $.optimizer.params: {exc}", "$.optimizer.params"
        ) from exc


def _probe_tensor() -> torch.Tensor:
    # A matrix: Muon refuses anything else; every other class takes any shape.
    return torch.zeros(1, 1, requires_grad=True)


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
            found.append((_json_path([*prefix, key]), sub[mark], value))
        else:
            found.extend(_marked_paths(value, schema, sub, [*prefix, key], mark))
    return found


def _count(value: Any) -> int | None:
    """A batch count as DeepSpeed reads it: null is absent; 32.0 is 32 (the schema has checked
    that it is a whole number >= 1)."""
    return None if value is None else int(value)


def _is_off(value: Any) -> bool:
    """A model-side block that is absent in effect: false, null, empty, or enabled false."""
    if value is None or value is False or value == {} or value == []:
        return True
    return isinstance(value, dict) and value.get("enabled") is False


_DS_DTYPES = {
    "fp32": ("fp32", "torch.float32", "float32", "float"),
    "fp16": ("fp16", "torch.float16", "float16", "half"),
    "bf16": ("bf16", "torch.bfloat16", "bfloat16"),
}


def _dtype_name(spelling: str) -> str:
    """dtypeplan's name for one of DeepSpeed's DtypeEnum spellings (the schema checked it)."""
    return next(name for name, spellings in _DS_DTYPES.items() if spelling in spellings)


# master_weights.rounding -> the master dimension's value for bf16 masters.
_BF16_MASTER_VALUES = {"nearest": "bf16", "stochastic": "bf16_sr", "kahan": "bf16_kahan"}


def _master_weights(document: dict[str, Any], bf16: dict[str, Any], fp16: dict[str, Any]) -> str:
    """The master dimension's value: dtypeplan's ``master_weights`` block or DeepSpeed's keys.

    ``bf16.bf16_master_weights_and_grads`` is DeepSpeed's spelling of ``{"dtype": "bf16",
    "rounding": "nearest"}``; both may be given when they agree.
    """
    deepspeed = (
        "bf16"
        if bf16.get("bf16_master_weights_and_grads")
        else "fp16"
        if fp16.get("fp16_master_weights_and_grads")
        else None
    )
    block = document.get("master_weights")
    if block is None:
        return deepspeed or "fp32"
    rounding = block.get("rounding")
    if block["dtype"] == "fp32":
        if rounding is not None:
            path = "$.master_weights.rounding"
            raise PrecisionConfigError(
                f"{path}: fp32 master weights take each update as it is, with no rounding to "
                "choose; remove rounding, or set master_weights.dtype bf16",
                path,
            )
        ours = "fp32"
    else:
        ours = _BF16_MASTER_VALUES[rounding or "nearest"]
    if deepspeed is not None and not (deepspeed == "bf16" and ours.startswith("bf16")):
        path = "$.master_weights"
        key = f"{deepspeed}.{deepspeed}_master_weights_and_grads"
        raise PrecisionConfigError(
            f"{path} asks for {block['dtype']} master weights but {key} is true: they are the "
            "same setting; keep one of them (master_weights also sets the rounding)",
            path,
        )
    return ours


_STATE_SPELLINGS = {
    **{name: name for name in STATE_DTYPES},
    **{spelling: name for name, spellings in _DS_DTYPES.items() for spelling in spellings},
}
"""Every accepted spelling of a moment's dtype (Megatron-core writes torch's names)."""


def _state_dtype(spelling: str, path: str) -> str:
    name = _STATE_SPELLINGS[spelling]
    if name == "fp16":
        raise PrecisionConfigError(
            f"{path} is {spelling!r}: fp16 moments are not offered. The second moment holds "
            "squared gradients, which leave fp16's range (6e-8 .. 65504) within ordinary "
            "training,. "
            "Use bf16 (fp32's range, 2 bytes), or int8 / fp8 (blockwise scaled, 1 byte)",
            path,
        )
    return name


def _optimizer_states(document: dict[str, Any], bf16: dict[str, Any]) -> str:
    """The states dimension's value: ``optimizer_states``, Megatron-core's ``exp_avg_dtype`` /
    ``exp_avg_sq_dtype``, or DeepSpeed's ``bf16.bf16_optimizer_states`` (both moments bf16).

    Each moment may be given by at most one of them, unless they agree; a moment given by none
    is fp32.
    """
    given: dict[str, dict[str, str]] = {"exp_avg": {}, "exp_avg_sq": {}}
    block = document.get("optimizer_states")
    if isinstance(block, str):
        for moment in given:
            given[moment]["$.optimizer_states"] = _state_dtype(block, "$.optimizer_states")
    elif isinstance(block, dict):
        for moment, spelling in block.items():
            path = f"$.optimizer_states.{moment}"
            given[moment][path] = _state_dtype(spelling, path)
    for moment in given:
        spelling = document.get(f"{moment}_dtype")
        if spelling is not None:
            path = f"$.{moment}_dtype"
            given[moment][path] = _state_dtype(spelling, path)
    if bf16.get("bf16_optimizer_states"):
        for moment in given:
            given[moment]["$.bf16.bf16_optimizer_states"] = "bf16"
    chosen = []
    for moment, by_path in given.items():
        names = set(by_path.values())
        if len(names) > 1:
            settings = ", ".join(f"{path} {name}" for path, name in by_path.items())
            path = next(iter(by_path))
            raise PrecisionConfigError(
                f"the {moment} dtype is set twice, differently ({settings}): they are the same "
                "setting; keep one of them",
                path,
            )
        chosen.append(names.pop() if names else "fp32")
    return states_value(*chosen)


def _offload_device(block: Any) -> str:
    return str(block.get("device", "none")) if isinstance(block, dict) else "none"


@dataclass(frozen=True)
class _OptimizerReading:
    config: OptimizerConfig
    notes: tuple[str, ...]
    ignored: tuple[str, ...]
    low_precision_states: bool
    """``fp32_optimizer_states: false``: DeepSpeed's CPU Adam keeps moments in the param dtype."""


# DeepSpeed's Adam/AdamW params that torch.optim does not take (ADAM_PARAMS in
# _deepspeed_keys.py); what each becomes is decided in _read_optimizer.
_DEEPSPEED_ADAM_ONLY = ("adam_w_mode", "torch_adam", "bias_correction", "fp32_optimizer_states")
# Engine bookkeeping with no effect on the update.
_DEEPSPEED_ADAM_IGNORED = ("torch_adam", "set_grad_none")


def _read_optimizer(document: dict[str, Any]) -> _OptimizerReading:
    """The optimizer block with DeepSpeed's meaning (see ``_deepspeed_keys.ADAM_PARAMS``)."""
    params = dict(document.get("params", {}))
    if "betas" in params and isinstance(params["betas"], list):
        params["betas"] = tuple(params["betas"])
    name = canonical_name(document["type"])
    notes: list[str] = []
    ignored: list[str] = []
    low_precision_states = False
    if name in ("Adam", "AdamW"):
        for key in ("adam_w_mode", "torch_adam", "bias_correction", "fp32_optimizer_states"):
            if key in params and not isinstance(params[key], bool):
                path = f"$.optimizer.params.{key}"
                raise PrecisionConfigError(
                    f"invalid value {params[key]!r} at {path}: must be true or false", path
                )
        adam_w_mode = params.pop("adam_w_mode", True)
        if params.pop("bias_correction", True) is False:
            path = "$.optimizer.params.bias_correction"
            raise PrecisionConfigError(
                f"{path} false: DeepSpeed's FusedAdam skips Adam's bias correction, which "
                "torch.optim's Adam/AdamW (dtypeplan's update) always applies; the first steps "
                "would take different sizes. Remove the key (bias correction on) to run here",
                path,
            )
        if params.pop("fp32_optimizer_states", None) is False:
            low_precision_states = True
        for key in _DEEPSPEED_ADAM_IGNORED:
            if key in params:
                params.pop(key)
                ignored.append(f"$.optimizer.params.{key}")
        if name == "Adam" and adam_w_mode:
            name = "AdamW"
            notes.append(
                'optimizer type "Adam" runs AdamW (decoupled weight decay), as in DeepSpeed, '
                "whose adam_w_mode defaults to true; set optimizer.params.adam_w_mode false for "
                "torch.optim.Adam (L2 weight decay)"
            )
        elif name == "AdamW" and not adam_w_mode:
            notes.append(
                'optimizer.params.adam_w_mode false does not apply to type "AdamW", which '
                'DeepSpeed always runs as AdamW; use type "Adam" for L2 weight decay'
            )
    _check_optimizer_params(name, params)
    return _OptimizerReading(
        config=OptimizerConfig(type=name, params=freeze(params)),
        notes=tuple(notes),
        ignored=tuple(ignored),
        low_precision_states=low_precision_states,
    )


def _check_scheduler(block: dict[str, Any], optimizer: OptimizerConfig) -> None:
    """Build the block once on a throwaway optimizer: DeepSpeed's checks, at resolve time."""
    from dtypeplan.schedulers import build_scheduler  # one-way: schedulers imports no resolver

    try:
        probe = optimizer.torch_class([_probe_tensor()], **optimizer.params)
    except NotSupportedError:
        # DeepSpeed's own optimizers have no torch class; an Adam-like one stands in (the plan
        # is NotSupported, but a bad scheduler block is still an error).
        probe = torch.optim.AdamW([_probe_tensor()])
    try:
        build_scheduler(block, probe)
    except PrecisionConfigError as error:
        path = error.path or "$.scheduler"
        if path in str(error):
            raise
        raise PrecisionConfigError(f"{path}: {error}", path) from error


def _auto_filled(auto_values: tuple[AutoValue, ...], prefix: str) -> list[AutoValue]:
    return [a for a in auto_values if a.path.startswith(prefix) and a.source != FROM_CALLER]


def _known_top_level(schema: dict[str, Any]) -> list[str]:
    return sorted({*schema["properties"], *ds_keys.TOP_LEVEL_KEYS})


_ACROSS = "$.communication_data_type_across_groups"
_QGZ = "$.zero_optimization.zero_quantized_gradients"


def _layout(
    document: dict[str, Any],
    zero: dict[str, Any],
    quantized: list[str],
    auto_values: tuple[AutoValue, ...],
    warnings: list[str],
) -> tuple[int | None, str | None, str | None, list[str]]:
    """The shard group size, the wire across groups and where it came from, and the ZeRO++
    quantization left for the table (qgZ with shard groups is the int8 wire across them)."""
    size = zero.get("shard_group_size")
    wire = document.get("communication_data_type_across_groups")
    wire_key = _ACROSS if wire is not None else None
    auto = next((a for a in auto_values if a.path == SHARD_GROUP_SIZE), None)
    if size is None and wire is not None:
        if auto is not None:
            # "auto" fell back to the flat layout (one node, or not under torchrun): the same
            # config runs on one machine and on several, so the wire is dropped, not refused.
            warnings.append(
                f'{_ACROSS} {wire} is not used: {SHARD_GROUP_SIZE} "auto" gave the flat '
                f"layout ({auto.source}), which has no link across groups"
            )
            return None, None, None, quantized
        raise PrecisionConfigError(
            f"{_ACROSS} is {wire!r} but $.{SHARD_GROUP_SIZE} is not set: without shard groups "
            "every collective spans the whole group and there is no link across groups to put "
            "that wire on. Set zero_optimization.shard_group_size (the ranks per node, or "
            '"auto" under torchrun) or remove the key',
            _ACROSS,
        )
    if auto is not None and size is None:
        warnings.append(f'{SHARD_GROUP_SIZE} "auto": {auto.source}')
    if "gradients" in quantized and size is not None:
        # qgZ quantizes the gradients' reduction; across the groups that is the int8 wire.
        if wire not in (None, "int8"):
            raise PrecisionConfigError(
                f"{_QGZ} (ZeRO++ qgZ: int8 gradients across the nodes) and {_ACROSS} "
                f"{wire!r} ask for two wires across the shard groups; keep one of them",
                _ACROSS,
            )
        wire, wire_key = "int8", _QGZ
        quantized = [kind for kind in quantized if kind != "gradients"]
        warnings.append(
            f"{_QGZ} with shard groups: the gradients cross the groups as int8 blocks (one fp32 "
            "scale per 256 values, summed in fp32), as communication_data_type_across_groups "
            "int8; DeepSpeed's qgZ also sends int4 within the node, dtypeplan sends "
            "communication_data_type there"
        )
    return size, wire, wire_key, quantized


def load_config(
    config: dict[str, Any] | str | os.PathLike[str],
    *,
    auto: Mapping[str, Any] | None = None,
    strict: bool = False,
) -> PrecisionConfig:
    """Validate ``config`` (a dict, or a path to a .json / .yaml file) and return its settings.

    ``auto`` fills the config's ``"auto"`` values (see ``_auto.py``); ``strict`` makes an
    unknown top-level key an error instead of a warning. Raises :class:`PrecisionConfigError`
    naming the JSON path of the first bad value.
    """
    source = None
    if isinstance(config, (str, os.PathLike)):
        source = os.fspath(config)
        document = _read_file(source)
    else:
        document = config
        try:
            check_document(document, _CONFIG_LIMITS, path=_json_path)
        except InputError as exc:
            raise PrecisionConfigError(f"config: {exc}") from None
    if not isinstance(document, dict):
        raise PrecisionConfigError(
            f"a config must be a mapping of keys to values, not {type(document).__name__}"
        )
    if auto is not None and not isinstance(auto, Mapping):
        raise PrecisionConfigError(
            f"auto must be a mapping of dotted config paths to values, not {type(auto).__name__}"
        )
    document, auto_values = fill_auto(document, auto)
    check_removed(document)
    schema = config_schema()
    document, warnings = split_unknown_top_level(document, _known_top_level(schema), strict=strict)
    config_warnings = list(warnings)
    validator = _Validator(schema)
    errors = sorted(
        validator.iter_errors(document), key=lambda e: (list(map(str, e.path)), e.message)
    )
    if errors:
        raise _schema_error(jsonschema.exceptions.best_match(errors))
    ignored = [path for path, _, _ in _marked_paths(document, schema, schema, [], _IGNORED)]
    for path, message, value in _marked_paths(document, schema, schema, [], _CALLER):
        if not _is_off(value):
            config_warnings.append(f"{path}: {message}")
    document, notes = canonical_spellings(document)
    config_warnings += notes

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
    data_types = document.get("data_types", {})
    alias = data_types.get("grad_accum_dtype")
    if alias is not None:
        alias = _dtype_name(alias)
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
    bf16_on, fp16_on = bool(bf16.get("enabled", False)), bool(fp16.get("enabled", False))
    model_dtype = "bf16" if bf16_on else "fp16" if fp16_on else "fp32"
    if data_types.get("param_dtype") is not None:
        asked = _dtype_name(data_types["param_dtype"])
        if asked != model_dtype and not (bf16_on and fp16_on):
            raise PrecisionConfigError(
                f"$.data_types.param_dtype is {asked!r} but bf16/fp16 enabled make the "
                f"parameters {model_dtype}: DeepSpeed refuses the mismatch too; make them agree "
                "or drop data_types.param_dtype",
                "$.data_types.param_dtype",
            )
    if fp16.get("auto_cast"):
        config_warnings.append(
            "$.fp16.auto_cast: DeepSpeed casts the forward's floating inputs to fp16; dtypeplan "
            "does not wrap forward: cast the inputs yourself"
        )
    scaling = LossScaleConfig(
        **{k: fp16[k] for k in LossScaleConfig.__dataclass_fields__ if k in fp16}
    )
    optimizer_doc = document.get("optimizer")
    optimizer = OptimizerConfig()
    low_precision_states = False
    if optimizer_doc is not None:
        reading = _read_optimizer(optimizer_doc)
        optimizer = reading.config
        config_warnings += reading.notes
        ignored += reading.ignored
        low_precision_states = reading.low_precision_states

    zero = document.get("zero_optimization", {})
    bucket = zero.get("reduce_bucket_size")
    for path, value in (
        ("$.zero_optimization.reduce_bucket_size", bucket),
        ("$.gradient_clipping", document.get("gradient_clipping")),
        ("$.gradient_predivide_factor", document.get("gradient_predivide_factor")),
    ):
        if value is not None and not math.isfinite(value):
            raise PrecisionConfigError(
                f"invalid value {value} at {path}: must be a finite number", path
            )
    if zero.get("zenflow") is not None:
        path = "$.zero_optimization.zenflow"
        raise PrecisionConfigError(
            f"{path}: ZenFlow updates only the top-k gradient columns each step and the rest "
            "stale, every update_interval steps; dtypeplan updates every parameter every step, "
            "so the numbers would differ: remove the block (or set it to null) to run here",
            path,
        )
    offload_optimizer = _offload_device(zero.get("offload_optimizer"))
    offload_param = _offload_device(zero.get("offload_param"))
    ratio = (zero.get("offload_optimizer") or {}).get("ratio", 1.0)
    if offload_optimizer != "none" and ratio != 1.0:
        path = "$.zero_optimization.offload_optimizer.ratio"
        raise PrecisionConfigError(
            f"{path} {ratio}: a partial optimizer offload (ZeRO-Offload++ ratio below 1) is not "
            "supported; remove the key (whole offload) or the offload block",
            path,
        )
    quantized = [
        kind
        for kind, keys in (
            ("weights", ("zero_quantized_weights", "zero_quantized_nontrainable_weights")),
            ("gradients", ("zero_quantized_gradients",)),
        )
        if any(zero.get(key) for key in keys)
    ]
    shard_group_size, wire_across, wire_key, quantized = _layout(
        document, zero, quantized, auto_values, config_warnings
    )
    master = _master_weights(document, bf16, fp16)
    states = _optimizer_states(document, bf16)
    if low_precision_states and offload_optimizer != "none" and model_dtype == "fp16":
        path = "$.optimizer.params.fp32_optimizer_states"
        raise PrecisionConfigError(
            f"{path} false with fp16 parameters: DeepSpeed's CPU Adam would keep fp16 moments, "
            "and the table has no fp16 optimizer states (fp16's range cannot hold Adam's second "
            "moment); remove the key to keep fp32 states",
            path,
        )
    if low_precision_states and offload_optimizer != "none" and model_dtype != "fp32":
        states = model_dtype
    autocast_doc = document.get("torch_autocast", {})
    autocast = "none"
    if autocast_doc.get("enabled"):
        # DeepSpeed's default autocast dtype is the model's 16-bit dtype, else bf16.
        given = autocast_doc.get("dtype")
        autocast = _dtype_name(given) if given else "fp16" if fp16_on else "bf16"
    predivide = float(document.get("gradient_predivide_factor", 1.0))
    prescaling = (
        "prescale"
        if document.get("prescale_gradients")
        else "predivide"
        if predivide != 1.0
        else "none"
    )
    scheduler = document.get("scheduler")
    if scheduler is not None:
        try:
            _check_scheduler(scheduler, optimizer)
        except PrecisionConfigError as error:
            filled = _auto_filled(auto_values, "scheduler.")
            if not filled:
                raise
            # The HF defaults (total_num_steps unknown before the Trainer counts) leave DeepSpeed's
            # schedulers unbuildable too; the plan still resolves and says what to fill.
            config_warnings.append(
                f'$.scheduler cannot be built with the HF defaults of its "auto" values '
                f"({', '.join(a.path for a in filled)}): {error}; DeepSpeed 0.19.8 refuses it "
                "the same way: give them with resolve(..., auto={...}) before build_scheduler"
            )
    steps = document.get("gradient_accumulation_steps")
    return PrecisionConfig(
        bf16=bf16_on,
        fp16=fp16_on,
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
        gradient_clipping_given="gradient_clipping" in document,
        reduce_bucket_size=int(bucket) if bucket is not None else None,
        check_nonfinite=bool(
            document.get("check_nonfinite", bf16.get("check_grad_overflow", False))
        ),
        collective_timeout_s=float(document.get("collective_timeout_s", 600.0)),
        ignored_keys=tuple(ignored),
        source=source,
        master_weights_dtype=master,
        optimizer_states_dtype=states,
        autocast=autocast,
        autocast_dtype_given=bool(autocast_doc.get("dtype")),
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        quantized_communication=(
            "both" if len(quantized) == 2 else quantized[0] if quantized else "none"
        ),
        hierarchical_partitioning=int(zero.get("zero_hpz_partition_size", 1)) > 1,
        shard_group_size=shard_group_size,
        wire_across_groups=wire_across,
        wire_across_groups_key=wire_key,
        gradient_prescaling=prescaling,
        fp8=bool(document.get("fp8", {}).get("enabled", False)),
        scheduler=freeze(scheduler) if scheduler is not None else None,
        gradient_accumulation_steps=_count(steps),
        train_batch_size=_count(document.get("train_batch_size")),
        train_micro_batch_size_per_gpu=_count(document.get("train_micro_batch_size_per_gpu")),
        auto_values=auto_values,
        config_warnings=tuple(config_warnings),
    )
