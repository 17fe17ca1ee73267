"""Stage 7 of ``load_config``: a valid document under canonical names -> :class:`PrecisionConfig`.

One reader per block, called in a fixed order (the first bad value in that order is the error
reported). The readers apply no table defaults (those live in ``precision_rules.yaml``): a
setting the config leaves out stays ``None`` or its "not used" value, and ``_effective.py``
works out what runs.
"""

from __future__ import annotations

import math
from typing import Any

from dtypeplan.errors import PrecisionConfigError
from dtypeplan.resolver._auto import SHARD_GROUP_SIZE, AutoValue
from dtypeplan.resolver._config import (
    FP8_EXCLUDED_BY_DEFAULT,
    LossScaleConfig,
    OptimizerConfig,
    PrecisionConfig,
)
from dtypeplan.resolver._dimensions import REDUCTION, STATE_DTYPES, states_value, value_text
from dtypeplan.resolver._optimizer_block import OptimizerReading, read_optimizer, read_scheduler

__all__ = ["STATE_SPELLINGS", "read_fields"]


def read_fields(
    document: dict[str, Any],
    *,
    source: str | None,
    auto_values: tuple[AutoValue, ...],
    notes: tuple[str, ...],
    ignored: tuple[str, ...],
) -> PrecisionConfig:
    """The typed settings of ``document``; ``notes`` (the earlier stages' warnings) and
    ``ignored`` (the schema's ignored keys) come first in the config's warnings and ignored
    keys."""
    warnings = list(notes)
    precision = _precision(document, warnings)
    reading = _optimizer(document.get("optimizer"))
    warnings += reading.notes
    zero = _zero(document, auto_values, warnings)
    model_dtype = "bf16" if precision["bf16"] else "fp16" if precision["fp16"] else "fp32"
    moments = _moments(document, model_dtype, zero["offload_optimizer"], reading)
    features = _other_features(document, fp16_on=precision["fp16"])
    fp8_block = document.get("fp8", {})
    if not features["fp8"] and set(fp8_block) - {"enabled"}:
        warnings.append(
            f"$.fp8 sets {', '.join(sorted(set(fp8_block) - {'enabled'}))} but not enabled: "
            "true, so fp8 compute is off and they have no effect"
        )
    scheduler, scheduler_warnings = read_scheduler(document, reading.config, auto_values)
    warnings += scheduler_warnings
    return PrecisionConfig(
        **precision,
        **zero,
        **moments,
        **features,
        optimizer=reading.config,
        optimizer_given=document.get("optimizer") is not None,
        gradient_clipping=float(document.get("gradient_clipping", 0.0)),
        gradient_clipping_given="gradient_clipping" in document,
        collective_timeout_s=float(document.get("collective_timeout_s", 600.0)),
        ignored_keys=(*ignored, *reading.ignored),
        source=source,
        scheduler=scheduler,
        gradient_accumulation_steps=_count(document.get("gradient_accumulation_steps")),
        train_batch_size=_count(document.get("train_batch_size")),
        train_micro_batch_size_per_gpu=_count(document.get("train_micro_batch_size_per_gpu")),
        auto_values=auto_values,
        config_warnings=tuple(warnings),
    )


def _precision(document: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    """bf16 / fp16, the accumulation and communication dtypes, loss scaling."""
    accum_dtype, accum_key, sharded = _accumulation(document)
    fp16 = document.get("fp16", {})
    bf16 = document.get("bf16", {})
    bf16_on, fp16_on = bool(bf16.get("enabled", False)), bool(fp16.get("enabled", False))
    _check_param_dtype(document, bf16_on, fp16_on)
    if fp16.get("auto_cast"):
        warnings.append(
            "$.fp16.auto_cast: DeepSpeed casts the forward's floating inputs to fp16; dtypeplan "
            "does not wrap forward: cast the inputs yourself"
        )
    return {
        "bf16": bf16_on,
        "fp16": fp16_on,
        "loss_scaling": LossScaleConfig(
            **{k: fp16[k] for k in LossScaleConfig.__dataclass_fields__ if k in fp16}
        ),
        "grad_accum_dtype": accum_dtype,
        "grad_accum_dtype_key": accum_key,
        "accumulator_sharded": sharded,
        "comm_dtype": document.get("communication_data_type"),
        "comm_reduction": document.get("communication_reduction", REDUCTION.default_value),
        "check_nonfinite": bool(
            document.get("check_nonfinite", bf16.get("check_grad_overflow", False))
        ),
    }


def _accumulation(document: dict[str, Any]) -> tuple[str | None, str | None, bool | None]:
    """The accumulation dtype, where it was given, and whether the accumulator is sharded:
    ``gradient_accumulation_dtype`` (a dtype or ``{dtype, sharded}``) or DeepSpeed's
    ``data_types.grad_accum_dtype`` (both only when they agree)."""
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
        alias = _dtype_name(alias)
        if accum_dtype is not None and alias != accum_dtype:
            raise PrecisionConfigError(
                f"$.data_types.grad_accum_dtype is {alias!r} but {accum_key} is {accum_dtype!r}: "
                "they are the same setting; keep one of them",
                "$.data_types.grad_accum_dtype",
            )
        if accum_dtype is None:
            accum_dtype, accum_key = alias, "$.data_types.grad_accum_dtype"
    return accum_dtype, accum_key, sharded


def _check_param_dtype(document: dict[str, Any], bf16_on: bool, fp16_on: bool) -> None:
    """DeepSpeed's ``data_types.param_dtype`` must agree with bf16 / fp16 enabled."""
    model_dtype = "bf16" if bf16_on else "fp16" if fp16_on else "fp32"
    data_types = document.get("data_types", {})
    if data_types.get("param_dtype") is not None:
        asked = _dtype_name(data_types["param_dtype"])
        if asked != model_dtype and not (bf16_on and fp16_on):
            raise PrecisionConfigError(
                f"$.data_types.param_dtype is {asked!r} but bf16/fp16 enabled make the "
                f"parameters {model_dtype}: DeepSpeed refuses the mismatch too; make them agree "
                "or drop data_types.param_dtype",
                "$.data_types.param_dtype",
            )


def _optimizer(block: dict[str, Any] | None) -> OptimizerReading:
    """The optimizer block read (``_optimizer_block.py``), or dtypeplan's default without one."""
    if block is None:
        return OptimizerReading(
            config=OptimizerConfig(), notes=(), ignored=(), low_precision_states=False
        )
    return read_optimizer(block)


def _zero(
    document: dict[str, Any], auto_values: tuple[AutoValue, ...], warnings: list[str]
) -> dict[str, Any]:
    """``zero_optimization``: the stage, the bucket, offload, ZeRO++ and the shard groups (and
    the finite-number checks of the keys DeepSpeed reads as floats)."""
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
    offload_optimizer = _offload(zero)
    quantized = [
        kind
        for kind, keys in (
            ("weights", ("zero_quantized_weights", "zero_quantized_nontrainable_weights")),
            ("gradients", ("zero_quantized_gradients",)),
        )
        if any(zero.get(key) for key in keys)
    ]
    shard_group_size, wire_across, wire_key, quantized = _layout(
        document, zero, quantized, auto_values, warnings
    )
    hpz = zero.get("zero_hpz_partition_size", 1)
    if isinstance(hpz, bool) or not isinstance(hpz, int) or hpz < 1:
        path = "zero_optimization.zero_hpz_partition_size"
        raise PrecisionConfigError(
            f"invalid value {hpz!r} at {path}: must be a whole number of ranks, 1 or more "
            "(1: hpZ off; the ranks per node for hpZ)",
            path,
        )
    return {
        "zero_stage": int(zero["stage"]) if "stage" in zero else None,
        "reduce_bucket_size": int(bucket) if bucket is not None else None,
        "offload_optimizer": offload_optimizer,
        "offload_param": _offload_device(zero.get("offload_param")),
        "quantized_communication": (
            "both" if len(quantized) == 2 else quantized[0] if quantized else "none"
        ),
        "hierarchical_partitioning": hpz > 1,
        "hpz_partition_size": hpz,
        "shard_group_size": shard_group_size,
        "wire_across_groups": wire_across,
        "wire_across_groups_key": wire_key,
        "zero_settings": _zero_settings(zero),
    }


ZERO_SETTINGS = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "sub_group_size",
    "overlap_comm",
    "offload_param.pin_memory",
    "offload_optimizer.pin_memory",
)
"""The ``zero_optimization`` keys (canonical names) with which DeepSpeed changes memory or
overlap and dtypeplan does otherwise: ``explain()`` states each one given
(``_differences.zero_differences``)."""


def _zero_settings(zero: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    found = []
    for name in ZERO_SETTINGS:
        block, _, key = name.rpartition(".")
        node = zero.get(block) if block else zero
        if isinstance(node, dict) and key in node:
            found.append((name, node[key]))
    return tuple(found)


def _offload(zero: dict[str, Any]) -> str:
    """The optimizer offload device; ZenFlow and a partial offload are refused."""
    if zero.get("zenflow") is not None:
        path = "$.zero_optimization.zenflow"
        raise PrecisionConfigError(
            f"{path}: ZenFlow updates only the top-k gradient columns each step and the rest "
            "stale, every update_interval steps; dtypeplan updates every parameter every step, "
            "so the numbers would differ: remove the block (or set it to null) to run here",
            path,
        )
    offload_optimizer = _offload_device(zero.get("offload_optimizer"))
    ratio = (zero.get("offload_optimizer") or {}).get("ratio", 1.0)
    if offload_optimizer != "none" and ratio != 1.0:
        path = "$.zero_optimization.offload_optimizer.ratio"
        raise PrecisionConfigError(
            f"{path} {ratio}: a partial optimizer offload (ZeRO-Offload++ ratio below 1) is not "
            "supported; remove the key (whole offload) or the offload block",
            path,
        )
    return offload_optimizer


def _moments(
    document: dict[str, Any], model_dtype: str, offload_optimizer: str, reading: OptimizerReading
) -> dict[str, Any]:
    """The master weights' and the optimizer states' dimension values."""
    bf16 = document.get("bf16", {})
    master = _master_weights(document, bf16, document.get("fp16", {}))
    states = _optimizer_states(document, bf16)
    low_precision_states = reading.low_precision_states
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
    return {"master_weights_dtype": master, "optimizer_states_dtype": states}


def _other_features(document: dict[str, Any], *, fp16_on: bool) -> dict[str, Any]:
    """torch_autocast, gradient prescaling and fp8."""
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
    return {
        "autocast": autocast,
        "autocast_dtype_given": bool(autocast_doc.get("dtype")),
        "gradient_prescaling": prescaling,
        **_fp8(document.get("fp8", {})),
    }


def _fp8(block: dict[str, Any]) -> dict[str, Any]:
    """The fp8 block's fields; the defaults where a key is absent (``_config.py``)."""
    emulate = block.get("emulate", "auto")
    excluded = block.get("exclude_modules")
    return {
        "fp8": bool(block.get("enabled", False)),
        "fp8_recipe": block.get("recipe", "tensorwise"),
        "fp8_all_gather": block.get("all_gather", "param_dtype"),
        "fp8_exclude_modules": (
            FP8_EXCLUDED_BY_DEFAULT if excluded is None else tuple(str(e) for e in excluded)
        ),
        "fp8_emulate": value_text(emulate) if isinstance(emulate, bool) else str(emulate),
    }


def _count(value: Any) -> int | None:
    """A batch count as DeepSpeed reads it: null is absent; 32.0 is 32 (the schema has checked
    that it is a whole number >= 1)."""
    return None if value is None else int(value)


_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

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


STATE_SPELLINGS = {
    **{name: name for name in STATE_DTYPES},
    "fp16": "fp16",
    **{
        f"{prefix}{torch_name}": name
        for name, torch_name in _TORCH_NAMES.items()
        for prefix in ("", "torch.")
    },
}
"""Every accepted spelling of a moment's dtype: the states' dtypes, fp16 (refused with the
reason) and torch's names, as Megatron-core writes them. The schema's ``state_dtype`` enum is
generated from it (``python -m dtypeplan docs --write``)."""


def _state_dtype(spelling: str, path: str) -> str:
    name = STATE_SPELLINGS[spelling]
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
            # Two wires across the groups: both stay in the point, where the table's
            # quantized-gradients-and-wire-across rule answers the contradiction (an Error
            # plan, not a raise: resolve is total).
            return size, wire, wire_key, quantized
        wire, wire_key = "int8", _QGZ
        quantized = [kind for kind in quantized if kind != "gradients"]
        warnings.append(
            f"{_QGZ} with shard groups: the gradients cross the groups as int8 blocks (one fp32 "
            "scale per 256 values, summed in fp32), as communication_data_type_across_groups "
            "int8; DeepSpeed's qgZ also sends int4 within the node, dtypeplan sends "
            "communication_data_type there"
        )
    return size, wire, wire_key, quantized
