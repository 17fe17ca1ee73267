"""Finding the dtypeplan optimizer inside a framework's wrapper, and the checkpoint layout."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import torch
import yaml

from dtypeplan._quiet_imports import torchao_import_quiet
from dtypeplan.errors import NotSupportedError, OptimizerUsageError, PrecisionConfigError
from dtypeplan.optimizers import MixedPrecisionOptimizer

OPTIMIZER_DIR = "dtypeplan_optimizer"
"""The subdirectory of a framework checkpoint that holds a dtypeplan.checkpoint snapshot."""


def find_optimizer(optimizer: Any) -> MixedPrecisionOptimizer | None:
    """The dtypeplan optimizer that ``optimizer`` is or wraps (Accelerate's
    ``AcceleratedOptimizer`` holds it as ``.optimizer``, Lightning's ``LightningOptimizer`` as
    ``._optimizer``), or None.

    Wrappers are unwrapped first: a ``LightningOptimizer`` is an instance of the class it wraps
    (Lightning subclasses it on the fly) but holds a copy of its attributes taken at wrap time,
    so reading ``grad_norm`` or clipping through it would use stale state.
    """
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            optimizer = inner
            continue
        return optimizer if isinstance(optimizer, MixedPrecisionOptimizer) else None
    return None


def optimizer_dir(root: str | os.PathLike[str], index: int = 0) -> str:
    """Where optimizer ``index`` of a framework checkpoint at ``root`` lives."""
    name = OPTIMIZER_DIR if index == 0 else f"{OPTIMIZER_DIR}_{index}"
    return os.path.join(os.fspath(root), name)


def refuse_loss_scaling(optimizer: MixedPrecisionOptimizer, framework: str) -> None:
    """Refuse a plan with fp16 loss scaling (fp16 parameters or fp16 autocast): it needs the
    loss scaled inside the framework's backward and a scheduler that does not step on a step an
    overflow skipped, which the integrations do not wire yet."""
    if optimizer.loss_scale != 1.0:
        raise OptimizerUsageError(
            f"{framework}: this plan scales the loss (fp16, loss scale {optimizer.loss_scale:g}); "
            "the integration does not scale the loss in the framework's backward yet, so the "
            'gradients would be wrong. Use bf16 ("bf16": {"enabled": true}) or fp32, or drive '
            "the optimizer yourself with optimizer.backward(loss)"
        )


def record_saved_dtype(output_dir: str, dtype: torch.dtype) -> None:
    """Make ``config.json`` in ``output_dir`` name ``dtype``, that of the weights written there.

    ``save_pretrained`` records the live model's dtype (``"bfloat16"`` for a bf16 plan), and
    ``from_pretrained(dir)`` without a dtype argument loads in the recorded one, so the fp32
    masters written came back rounded to bf16. The file is rewritten as transformers writes
    it (``json.dumps(indent=2, sort_keys=True)``)."""
    path = os.path.join(output_dir, "config.json")
    if not os.path.isfile(path):
        return
    name = str(dtype).removeprefix("torch.")
    with open(path, encoding="utf-8") as handle:
        document = json.load(handle)
    keys = [key for key in ("dtype", "torch_dtype") if key in document] or ["dtype"]
    if all(document.get(key) == name for key in keys):
        return
    for key in keys:
        document[key] = name
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(document, indent=2, sort_keys=True) + "\n")


def record_state_dtype_on_save(model: torch.nn.Module) -> None:
    """Make an HF model's ``save_pretrained(dir, state_dict=...)`` record the dtype of the
    state it writes in ``config.json``, not its parameters' dtype.

    transformers writes ``model.dtype`` (its first floating parameter's) as ``config.dtype``,
    and ``from_pretrained(dir)`` loads in that dtype: bf16 parameters saved with the fp32
    masters as ``state_dict`` would come back rounded to bf16. A model without
    ``save_pretrained`` is left as it is.
    """
    original = getattr(model, "save_pretrained", None)
    config = getattr(model, "config", None)
    if original is None or config is None or getattr(original, "_dtypeplan", False):
        return

    def save_pretrained(save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        state = kwargs.get("state_dict")
        # Read before saving: transformers takes entries out of the dict it writes.
        dtypes = {
            t.dtype for t in (state or {}).values() if torch.is_tensor(t) and t.is_floating_point()
        }
        result = original(save_directory, *args, **kwargs)
        if len(dtypes) == 1 and kwargs.get("is_main_process", True):
            record_saved_dtype(os.fspath(save_directory), dtypes.pop())
        return result

    save_pretrained._dtypeplan = True  # type: ignore[attr-defined]
    # An instance attribute: only this model, only while it lives.
    object.__setattr__(model, "save_pretrained", save_pretrained)


def config_document(config: Mapping[str, Any] | str | os.PathLike[str]) -> Mapping[str, Any]:
    """The config as a mapping, read only to see what it sets (resolve reads it again, with
    its bounds and checks)."""
    if isinstance(config, Mapping):
        return config
    with open(config, encoding="utf-8") as handle:
        text = handle.read()
    loaded = json.loads(text) if os.fspath(config).endswith(".json") else yaml.safe_load(text)
    return loaded if isinstance(loaded, Mapping) else {}


def fills_for_auto(
    config: Mapping[str, Any] | str | os.PathLike[str], fills: Mapping[str, Any]
) -> dict[str, Any]:
    """The entries of ``fills`` (dotted path -> value) whose key the config leaves ``"auto"``:
    what a framework's own setting fills. A value the config sets itself is the config's, and
    the resolver refuses a fill of it."""
    document = config_document(config)
    out = {}
    for path, value in fills.items():
        node: Any = document
        for part in path.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node == "auto":
            out[path] = value
    return out


FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""The fp8.recipe names that are torchao's ``Float8LinearConfig.from_recipe_name`` recipes."""


def fp8_block_from_torchao(config: Any, *, all_gather_fp8: bool, source: str) -> dict[str, Any]:
    """torchao's ``Float8LinearConfig`` (what Accelerate's ``AORecipeKwargs`` carries, or
    what a user's own ``convert_to_float8_training`` took) as the config's ``fp8`` block.

    The config must be one of torchao's named recipes, up to the settings the block states
    its own way: ``emulate`` (true stays true; false is ``"auto"``: native where the device
    has fp8 kernels, which ``explain()`` says), ``enable_fsdp_float8_all_gather`` (the fp8
    all-gather where ``all_gather_fp8``: ZeRO-3, whose FSDP2 is the only gather that
    flag acts on) and ``pad_inner_dim`` (dtypeplan leaves the layers whose sizes are not
    multiples of 16 unconverted instead of padding them). Another config is refused: no
    block would say what it computes."""
    with torchao_import_quiet():
        from torchao.float8 import Float8LinearConfig

    for recipe in FLOAT8_RECIPES:
        reference = Float8LinearConfig.from_recipe_name(recipe)
        comparable = dataclasses.replace(
            config,
            emulate=reference.emulate,
            enable_fsdp_float8_all_gather=reference.enable_fsdp_float8_all_gather,
            pad_inner_dim=reference.pad_inner_dim,
        )
        if comparable == reference:
            break
    else:
        raise NotSupportedError(
            f"{source}: torchao's Float8LinearConfig {config} is none of the recipes dtypeplan "
            f"computes ({', '.join(FLOAT8_RECIPES)}: Float8LinearConfig.from_recipe_name), so "
            "no plan would say what it computes; use one of them, or the config's fp8 block"
        )
    block: dict[str, Any] = {"enabled": True, "recipe": recipe}
    if config.emulate:
        block["emulate"] = True
    if all_gather_fp8 and config.enable_fsdp_float8_all_gather and recipe == "tensorwise":
        block["all_gather"] = "fp8"
    return block


def with_fp8_block(
    config: Mapping[str, Any] | str | os.PathLike[str], block: Mapping[str, Any], source: str
) -> dict[str, Any]:
    """The config (read) with ``block`` as its ``fp8`` block: the keys the config's own block
    leaves out are filled from ``block``; a key it sets otherwise, or fp8 turned off, is
    refused (the framework and the config would disagree about what computes in fp8)."""
    document = dict(config_document(config))
    given = document.get("fp8")
    if given is None:
        return {**document, "fp8": dict(block)}
    if not isinstance(given, Mapping) or given.get("enabled") is False:
        raise PrecisionConfigError(
            f"{source} asks for fp8 compute, but the config's fp8 block is {given!r}: set "
            '"fp8": {"enabled": true} (or remove the block), or ask the framework for bf16'
        )
    differ = {
        key: (given[key], value) for key, value in block.items() if given.get(key, value) != value
    }
    if differ:
        detail = ", ".join(
            f"fp8.{k}: config {a!r}, framework {b!r}" for k, (a, b) in differ.items()
        )
        raise PrecisionConfigError(
            f"{source} and the config's fp8 block disagree ({detail}); say it in one place"
        )
    return {**document, "fp8": {**block, **given}}


def stage_of(config: Mapping[str, Any] | str | os.PathLike[str]) -> int | None:
    """``zero_optimization.stage`` as the config sets it (None: unset or not a number)."""
    zero = config_document(config).get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    return stage if isinstance(stage, int) else None
