"""``manifest.json``: what a snapshot holds beyond DCP's own metadata.

Built at save (format, shapes, state names, scalars, hyperparameters, the plan, and the size of
every data file), validated key by key at load, and compared with the loading optimizer.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

from dtypeplan.checkpoint._adapters import Adapter
from dtypeplan.checkpoint._errors import CheckpointError
from dtypeplan.optimizers._base import MixedPrecisionOptimizer

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "build_manifest",
    "check_manifest",
    "differences",
    "restore_hyperparameters",
]

FORMAT = "dtypeplan.checkpoint"
FORMAT_VERSION = 1

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
) -> dict[str, Any]:
    """The manifest of a save; ``files`` is filled in when the snapshot is committed."""
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
        "param_dtypes": [str(p.dtype).removeprefix("torch.") for p in params],
        "states": names,
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
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: manifest version {manifest.get('version')!r}; this dtypeplan reads version "
            f"{FORMAT_VERSION}"
        )
    for key, kind in _REQUIRED.items():
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"{where}: the manifest's {key!r} is missing or not a {kind}")
    shapes = manifest["shapes"]
    if not all(
        isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes
    ):
        raise CheckpointError(f"{where}: the manifest's 'shapes' is not a list of shapes")
    states = manifest["states"]
    if "master" not in states or not all(isinstance(s, str) and "." not in s for s in states):
        raise CheckpointError(f"{where}: the manifest's 'states' {states!r} is not valid")
    scalars = manifest["scalars"]
    for key, kind in (
        ("step", int),
        ("skipped_steps", int),
        ("loss_scale", (int, float)),
        ("scaler", dict),
    ):
        if not isinstance(scalars.get(key), kind):
            raise CheckpointError(f"{where}: the manifest's scalars.{key} is missing or not valid")
    if not isinstance(manifest["optimizer"].get("type"), str):
        raise CheckpointError(f"{where}: the manifest's optimizer.type is missing")
    return manifest


def differences(
    manifest: dict[str, Any], opt: MixedPrecisionOptimizer, shapes: list[list[int]]
) -> list[str]:
    """Why the checkpoint does not fit ``opt``, one line each; empty when it fits."""
    out = []
    saved_type, mine = manifest["optimizer"]["type"], _torch_class_name(opt)
    if saved_type != mine:
        out.append(f"optimizer type: the checkpoint has {saved_type}, this optimizer is {mine}")
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
