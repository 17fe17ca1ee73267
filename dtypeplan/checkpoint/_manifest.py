"""``manifest.json``: what a snapshot holds beyond DCP's own metadata.

Built at save (format, shapes, state names, scalars, hyperparameters, the plan, and the size of
every data file), validated key by key at load, and compared with the loading optimizer.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from dtypeplan.checkpoint._adapters import (
    CODES_PREFIX,
    GROUP_STATES,
    PARAM_STATES,
    Adapter,
    Tensors,
    elementwise_tensors,
)
from dtypeplan.checkpoint._errors import CheckpointError
from dtypeplan.optimizers.contract import MixedPrecisionOptimizer
from dtypeplan.optimizers.state import NO_STATE, parse_group_scalar_key, parse_param_scalar_key

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "DIGEST",
    "build_manifest",
    "check_manifest",
    "differences",
    "hyperparameter_problems",
    "restore_hyperparameters",
    "stored_tensors",
]

FORMAT = "dtypeplan.checkpoint"
FORMAT_VERSION = 3
"""2: ``scalars.param_states``, the parameters' own scalar states where they differ from their
group's. A version-1 manifest has none (every parameter followed its group's one count).
3: ``tensors``, per parameter the tensors stored of it and their shapes (``{"master": [4, 3],
"row_var": [4, 1], ...}``), for optimizers whose states are not laid out like the parameter or
differ between parameters (Adafactor, DeepSpeed's Muon). Before it, every parameter held every
name of ``states``, of its own shape (:func:`stored_tensors` reads both)."""
READABLE_VERSIONS = (1, 2, 3)
DIGEST = "sha256"
"""The hash of every data file, recorded at save and checked at load (``load(verify=True)``)."""

_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "format": str,
    "version": int,
    "world_size": int,
    "optimizer": dict,
    "param_groups": list,
    "shapes": list,
    "states": list,
    "scalars": dict,
    "files": dict,
}


def _torch_class_name(opt: MixedPrecisionOptimizer) -> str:
    return opt.plan.optimizer.torch_class.__name__


def _jsonable(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _jsonable_dict(params: Any) -> dict[str, Any]:
    return {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(params).items() if _jsonable(v)
    }


def _hyperparameters(opt: MixedPrecisionOptimizer) -> list[dict[str, Any]]:
    return [_jsonable_dict({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups]


def build_manifest(
    opt: MixedPrecisionOptimizer,
    adapter: Adapter,
    names: list[str],
    scalars: dict[str, Any],
    world_size: int,
    codes: list[str] | None = None,
    tensors: Tensors | None = None,
) -> dict[str, Any]:
    """The manifest of a save; ``files`` is filled in when the snapshot is committed.
    ``codes``: the keys of quantized moments saved as they are (``_adapters.CODES_PREFIX``);
    ``tensors``: each parameter's stored tensors and shapes (default: ``names``, laid out like
    the parameters)."""
    plan = opt.plan
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
        "world_size": world_size,
        "written_as": adapter.layout,
        "implementation": plan.implementation,
        "optimizer_class": type(opt).__name__,
        "optimizer": {
            "type": _torch_class_name(opt),
            "params": _jsonable_dict(plan.optimizer.params),
        },
        "param_groups": _hyperparameters(opt),
        "shapes": adapter.shapes(),
        "tensors": tensors if tensors is not None else elementwise_tensors(names, adapter.shapes()),
        "param_dtypes": [str(p.dtype).removeprefix("torch.") for p in params],
        "states": names,
        "codes": list(codes or []),
        "scalars": scalars,
        "plan": plan.to_dict(),
        "files": {},
    }


def check_manifest(manifest: Any, where: str) -> dict[str, Any]:
    """``manifest`` if it is a valid manifest, else a :class:`CheckpointError` naming ``where``."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: the manifest is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{where}: not a dtypeplan checkpoint manifest (format {manifest.get('format')!r})"
        )
    version = manifest.get("version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise CheckpointError(
            f"{where}: manifest version {version!r}; this dtypeplan reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    if version < 2 and PARAM_STATES in manifest.get("scalars", {}):
        raise CheckpointError(
            f"{where}: a version-{version} manifest with scalars.{PARAM_STATES}, which version 2 "
            "introduced"
        )
    for key, kind in _REQUIRED.items():
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"{where}: the manifest's {key!r} is missing or not a {kind}")
    if not _is_int(manifest["world_size"], 1):
        raise CheckpointError(f"{where}: the manifest's world_size is not a positive integer")
    shapes = manifest["shapes"]
    if not all(isinstance(s, list) and all(_is_int(d, 0) for d in s) for s in shapes):
        raise CheckpointError(f"{where}: the manifest's 'shapes' is not a list of shapes")
    states = manifest["states"]
    if (
        "master" not in states
        or not all(isinstance(s, str) and s and "." not in s for s in states)
        or len(set(states)) != len(states)
    ):
        raise CheckpointError(f"{where}: the manifest's 'states' {states!r} is not valid")
    _check_tensors(manifest, version, where)
    codes = manifest.get("codes", [])
    if not isinstance(codes, list) or not all(
        isinstance(key, str) and key.startswith(CODES_PREFIX) for key in codes
    ):
        raise CheckpointError(f"{where}: the manifest's 'codes' is not a list of codes keys")
    _check_scalars(manifest["scalars"], where)
    _check_scalar_states(
        manifest["scalars"],
        GROUP_STATES,
        parse_group_scalar_key,
        len(manifest["param_groups"]),
        "param groups",
        where,
    )
    _check_scalar_states(
        manifest["scalars"],
        PARAM_STATES,
        parse_param_scalar_key,
        len(shapes),
        "trainable parameters",
        where,
    )
    if not isinstance(manifest["optimizer"].get("type"), str):
        raise CheckpointError(f"{where}: the manifest's optimizer.type is missing")
    for index, group in enumerate(manifest["param_groups"]):
        if not isinstance(group, dict) or not all(_is_plain(v) for v in group.values()):
            raise CheckpointError(
                f"{where}: the manifest's param_groups[{index}] is not a mapping of finite "
                "hyperparameters"
            )
    _check_files(manifest, where)
    return manifest


def _check_tensors(manifest: dict[str, Any], version: int, where: str) -> None:
    """``tensors`` (version 3): per parameter, names of ``states`` with their shapes, the
    master among them with the parameter's shape. Before version 3 it is not read
    (:func:`stored_tensors`: every state laid out like its parameter)."""
    if version < 3:
        return
    tensors, shapes, states = manifest.get("tensors"), manifest["shapes"], manifest["states"]
    if not isinstance(tensors, list) or len(tensors) != len(shapes):
        raise CheckpointError(
            f"{where}: the manifest's 'tensors' is missing or not a list of one entry per parameter"
        )
    for index, (stored, shape) in enumerate(zip(tensors, shapes, strict=True)):
        if (
            not isinstance(stored, dict)
            or not set(stored) <= set(states)
            or stored.get("master") != shape
            or not all(
                isinstance(s, list) and all(_is_int(d, 0) for d in s) for s in stored.values()
            )
        ):
            raise CheckpointError(
                f"{where}: the manifest's tensors[{index}] {stored!r} is not a mapping of its "
                "states to their shapes with the parameter's master"
            )


def stored_tensors(manifest: dict[str, Any]) -> Tensors:
    """Per parameter, the tensors a checkpoint holds of it and their shapes (before version 3:
    every state of ``states``, laid out like the parameter)."""
    if manifest["version"] >= 3:
        return [{n: list(s) for n, s in stored.items()} for stored in manifest["tensors"]]
    return elementwise_tensors(list(manifest["states"]), manifest["shapes"])


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_plain(value: Any) -> bool:
    """A JSON scalar (numbers finite) or a list of them, as hyperparameters are saved."""
    if isinstance(value, list):
        return all(_is_plain(v) and not isinstance(v, list) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (bool, int, str))


# The loss scaler's state, as LossScaler.state_dict() writes it: key -> (check, what it must be).
_SCALER: dict[str, tuple[Any, str]] = {
    "scale": (lambda v: _is_finite(v) and v > 0, "a finite number above 0"),
    "hysteresis_left": (lambda v: _is_int(v, 0), "an integer >= 0"),
    "iteration": (lambda v: _is_int(v, 0), "an integer >= 0"),
    "last_overflow_iteration": (lambda v: _is_int(v, -1), "an integer >= -1"),
}


def _check_scalars(scalars: dict[str, Any], where: str) -> None:
    checks: list[tuple[str, bool, str]] = [
        ("step", _is_int(scalars.get("step"), 0), "an integer >= 0"),
        ("skipped_steps", _is_int(scalars.get("skipped_steps"), 0), "an integer >= 0"),
        (
            "loss_scale",
            _is_finite(scalars.get("loss_scale")) and scalars["loss_scale"] > 0,
            "a finite number above 0",
        ),
        ("scaler", isinstance(scalars.get("scaler"), dict), "a mapping"),
        (
            "scaler_enabled",
            isinstance(scalars.get("scaler_enabled", False), bool),
            "true or false",
        ),
    ]
    for key, ok, must in checks:
        if not ok:
            raise CheckpointError(
                f"{where}: the manifest's scalars.{key} is {scalars.get(key)!r}; it must be {must}"
            )
    scaler = scalars["scaler"]
    required = bool(scalars.get("scaler_enabled")) or bool(scaler)
    for key, (check, must) in _SCALER.items():
        if (key in scaler or required) and not check(scaler.get(key)):
            raise CheckpointError(
                f"{where}: the manifest's scalars.scaler.{key} is {scaler.get(key)!r}; "
                f"it must be {must}"
            )


def _check_scalar_states(
    scalars: dict[str, Any],
    entry_name: str,
    parse: Callable[[str], tuple[int, str] | None],
    count: int,
    what: str,
    where: str,
) -> None:
    """``scalars[entry_name]`` (absent before it was written): the inner optimizer's scalar
    states per param group (``group_states``) or per parameter (``param_states``), each a
    finite number with a torch dtype (or none: a Python number); a parameter's ``no_state``
    mark is ``{"value": 1}``."""
    states = scalars.get(entry_name, {})
    if not isinstance(states, dict):
        raise CheckpointError(f"{where}: the manifest's scalars.{entry_name} is not a mapping")
    for key, entry in states.items():
        try:
            parsed = parse(key)
        except ValueError:
            parsed = None
        if parsed is None or parsed[0] >= count:
            raise CheckpointError(
                f"{where}: the manifest's scalars.{entry_name} key {key!r} is not the scalar "
                f"state of one of its {count} {what}"
            )
        if parsed[1] == NO_STATE and entry_name == PARAM_STATES:
            if entry != {"value": 1}:
                raise CheckpointError(
                    f"{where}: the manifest's scalars.{entry_name}[{key!r}] is {entry!r}; it "
                    'must be {"value": 1}'
                )
            continue
        name = entry.get("dtype") if isinstance(entry, dict) else None
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        value = entry.get("value") if isinstance(entry, dict) else None
        fits = (
            isinstance(entry, dict)
            and set(entry) <= {"value", "dtype"}
            and _is_finite(value)
            and (
                "dtype" not in entry
                or (
                    isinstance(dtype, torch.dtype)
                    and (dtype.is_floating_point or isinstance(value, int))
                    and not dtype.is_complex
                )
            )
        )
        if not fits:
            raise CheckpointError(
                f"{where}: the manifest's scalars.{entry_name}[{key!r}] is {entry!r}; it must "
                'be {"value": a finite number, "dtype": a real torch dtype (optional)}'
            )


def _check_files(manifest: dict[str, Any], where: str) -> None:
    files = manifest["files"]
    for entry, size in files.items():
        if os.path.basename(entry) != entry or entry in ("", ".", "..") or not _is_int(size, 0):
            raise CheckpointError(f"{where}: the manifest's file entry {entry!r} is not valid")
    digests = manifest.get("digests")
    if digests is None:  # written before digests were recorded: sizes are checked only
        return
    if (
        not isinstance(digests, dict)
        or digests.get("algorithm") != DIGEST
        or not isinstance(digests.get("files"), dict)
        or set(digests["files"]) != set(files)
        or not all(
            isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)
            for v in digests["files"].values()
        )
    ):
        raise CheckpointError(
            f"{where}: the manifest's 'digests' is not a {DIGEST} digest of every listed file"
        )


def hyperparameter_problems(manifest: dict[str, Any], opt: MixedPrecisionOptimizer) -> list[str]:
    """Saved hyperparameters whose kind differs from the optimizer's (``lr: "boom"``)."""
    saved = manifest["param_groups"]
    if len(saved) != len(opt.param_groups):
        return []  # not restored (restore_hyperparameters warns)
    out = []
    for index, (group, values) in enumerate(zip(opt.param_groups, saved, strict=True)):
        for key, value in values.items():
            if key not in group or group[key] is None:
                continue
            mine = group[key]
            if isinstance(mine, bool):
                fits = isinstance(value, bool)
            elif isinstance(mine, (int, float)):
                fits = _is_finite(value)
            elif isinstance(mine, torch.Tensor):
                fits = _is_finite(value) and mine.numel() == 1
            elif isinstance(mine, (tuple, list)):
                fits = (
                    isinstance(value, list)
                    and len(value) == len(mine)
                    # Adafactor's eps is (None, 1e-3): None where the optimizer has None.
                    and all(
                        _is_finite(v) or (v is None and m is None)
                        for v, m in zip(value, mine, strict=True)
                    )
                )
            elif isinstance(mine, str):
                fits = isinstance(value, str)
            else:
                fits = True
            if not fits:
                out.append(
                    f"param_groups[{index}].{key}: the checkpoint has {value!r}, which cannot "
                    f"replace this optimizer's {mine!r}"
                )
    return out


def differences(
    manifest: dict[str, Any], opt: MixedPrecisionOptimizer, shapes: list[list[int]]
) -> list[str]:
    """Why the checkpoint does not fit ``opt``, one line each; empty when it fits."""
    out = []
    saved_type, mine = manifest["optimizer"]["type"], _torch_class_name(opt)
    if saved_type != mine:
        out.append(f"optimizer type: the checkpoint has {saved_type}, this optimizer is {mine}")
    saved_groups, my_groups = len(manifest["param_groups"]), len(opt.param_groups)
    if manifest["scalars"].get(GROUP_STATES) and saved_groups != my_groups:
        out.append(
            f"param groups: the checkpoint has {saved_groups} param groups with their own "
            f"optimizer scalar states (step...), this optimizer {my_groups}"
        )
    saved = manifest["shapes"]
    if len(saved) != len(shapes):
        out.append(
            f"parameter count: the checkpoint has {len(saved)} trainable parameters, "
            f"this optimizer {len(shapes)}"
        )
    pairs = enumerate(zip(saved, shapes, strict=False))
    differing = [(i, s, m) for i, (s, m) in pairs if list(s) != list(m)]
    for i, s, m in differing[:5]:
        out.append(f"parameter {i} shape: the checkpoint has {s}, this optimizer {m}")
    if len(differing) > 5:
        out.append(f"... and {len(differing) - 5} more parameters with other shapes")
    return out


def restore_hyperparameters(opt: MixedPrecisionOptimizer, saved: list[dict[str, Any]]) -> None:
    """Set the saved param groups' hyperparameters on ``opt``, if the group count matches."""
    if len(saved) != len(opt.param_groups):
        warnings.warn(
            f"the checkpoint has {len(saved)} param groups and the optimizer "
            f"{len(opt.param_groups)}; "
            "keeping the optimizer's hyperparameters",
            # Points at the caller of load().
            stacklevel=3,
        )
        return
    for group, values in zip(opt.param_groups, saved, strict=True):
        for key, value in values.items():
            group[key] = (
                tuple(value)
                if isinstance(group.get(key), tuple) and isinstance(value, list)
                else value
            )
