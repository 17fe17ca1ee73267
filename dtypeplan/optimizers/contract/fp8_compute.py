"""fp8 compute: the plan's eligible ``nn.Linear`` layers converted with torchao, in place.

``prepare_model`` calls :func:`convert_linears` before it casts (and at ZeRO-3 shards) the
model, so FSDP2 sees the converted layers. What the table decided (``resolver/_dimensions.py``:
``fp8``, ``fp8_recipe``, ``fp8_all_gather``, ``fp8_execution``) maps to torchao as follows:

* ``tensorwise`` / ``rowwise`` / ``rowwise_with_gw_hp``: ``convert_to_float8_training`` with
  ``Float8LinearConfig.from_recipe_name(recipe)``, ``emulate`` where the plan says emulated,
  and ``enable_fsdp_float8_all_gather`` where the plan gathers the weights in fp8 (ZeRO-3,
  tensorwise: the weight becomes torchao's ``WeightWithDynamicFloat8CastTensor``, which FSDP2
  casts to e4m3 before the all-gather with the scale :func:`precompute_scales` computed after
  the previous step).
* ``mxfp8``: :class:`MXFP8Linear`, an ``nn.Linear`` whose matmul is torchao's own MXFP8
  training function (``_to_mxfp8_then_scaled_mm``, the one its ``MXFP8TrainingOpConfig``
  weight wrapper dispatches ``F.linear`` to). The class changes, the parameters stay plain
  tensors: the flat ZeRO 0-2 buffers take a parameter's storage, which would drop torchao's
  wrapper subclass (and the wrapper's ``F.linear`` drops the bias), so the module carries the
  recipe instead of the weight.

Eligible: an ``nn.Linear`` (exactly, not a subclass another library gave its own forward) whose
in and out features are multiples of 16 (``torch._scaled_mm``'s requirement; MXFP8: of its
block of 32), not matched by ``fp8.exclude_modules`` (names or fnmatch patterns, against the
module's full name or its last part). torchao is imported only when a plan has fp8 compute.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from dtypeplan._quiet_imports import torchao_import_quiet
from dtypeplan.errors import PrecisionConfigError
from dtypeplan.resolver import PrecisionPlan

__all__ = [
    "MXFP8Linear",
    "convert_linears",
    "eligible_linears",
    "fp8_all_gather_weights",
    "fp8_held",
    "fp8_weight_numels",
    "precompute_scales",
]

MX_BLOCK = 32
"""MXFP8's scaling block along the contraction (and the tokens, for the weight gradient)."""

_GATHERED_IN_FP8: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""The converted layers whose weights FSDP2 gathers in fp8 (for :func:`precompute_scales`,
which the ZeRO-3 optimizer runs after each step on the layers of the weights it updates; FSDP2
replaces each weight by its sharded parameter, so the layer is what is kept)."""


def _multiple(recipe: str) -> int:
    return MX_BLOCK if recipe == "mxfp8" else 16


def _excluded(name: str, patterns: Iterable[str]) -> bool:
    last = name.rpartition(".")[2]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(last, p) for p in patterns)


def eligible_linears(model: torch.nn.Module, plan: PrecisionPlan) -> list[str]:
    """The names of the layers :func:`convert_linears` converts for ``plan`` (see the module
    docstring), in ``named_modules`` order."""
    multiple = _multiple(plan.fp8_recipe)
    return [
        name
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear
        and module.in_features % multiple == 0
        and module.out_features % multiple == 0
        and not _excluded(name, plan.fp8_exclude_modules)
    ]


def convert_linears(
    model: torch.nn.Module, plan: PrecisionPlan, *, sharded_by_fsdp2: bool
) -> list[str]:
    """Convert ``model``'s eligible linear layers for ``plan``'s fp8 compute, in place; returns
    their names (none without fp8). ``sharded_by_fsdp2``: FSDP2 shards the model next, so an
    fp8 all-gather has a gather to act on (ZeRO-3 in one process runs the flat optimizer)."""
    converted_before = _converted_float8(model)
    if not plan.fp8:
        if converted_before:
            raise PrecisionConfigError(
                "plan.prepare_model: the model holds torchao Float8Linear layers "
                f"({', '.join(converted_before)}) but the plan computes without fp8, so "
                "explain() and the plan's figures would not be what runs: enable the config's "
                "fp8 block with their recipe, or pass the model unconverted"
            )
        return []
    if plan.fp8_execution == "unavailable":
        raise PrecisionConfigError(plan.reason)
    names = eligible_linears(model, plan)
    if not names and not converted_before:
        _warn_nothing_converted(model, plan)
    chosen = set(names)
    emulate = plan.fp8_execution == "emulated"
    if plan.fp8_recipe == "mxfp8":
        if converted_before:
            raise PrecisionConfigError(
                f"plan.prepare_model: fp8.recipe mxfp8, but the model holds torchao "
                f"Float8Linear layers ({', '.join(converted_before)}) of another recipe"
            )
        for name in names:
            MXFP8Linear.convert(model.get_submodule(name), emulate=emulate)
        return names
    with torchao_import_quiet():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    gather_fp8 = plan.fp8_all_gather == "fp8" and sharded_by_fsdp2
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(plan.fp8_recipe),
        emulate=emulate,
        enable_fsdp_float8_all_gather=gather_fp8,
    )
    # Layers converted before (a user's own convert_to_float8_training, as Lightning's
    # configure_model does) are taken as they are where their config is the plan's.
    for name in converted_before:
        theirs: Float8LinearConfig = model.get_submodule(name).config
        if dataclasses.replace(theirs, pad_inner_dim=config.pad_inner_dim) != config:
            raise PrecisionConfigError(
                f"plan.prepare_model: the model's layer {name} was converted with torchao's "
                f"{theirs}, but the plan computes {plan.fp8_recipe} (emulated: {emulate}, fp8 "
                f"all-gather: {gather_fp8}) as {config}: state the layers' recipe in the fp8 "
                "block, or pass the model unconverted and let prepare_model convert it"
            )
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, n: n in chosen)
    names = sorted({*names, *converted_before}, key=[n for n, _ in model.named_modules()].index)
    if gather_fp8:
        _GATHERED_IN_FP8.update(model.get_submodule(name) for name in names)
    return names


def _warn_nothing_converted(model: torch.nn.Module, plan: PrecisionPlan) -> None:
    """fp8 on, and no layer to compute in it: the run would be bf16 compute under a plan
    that says fp8. Warn, naming the linear-like layers that are not ``nn.Linear``."""
    import warnings

    others = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if type(m) is not torch.nn.Linear
            and hasattr(m, "weight")
            and "Conv1D" in type(m).__name__
        }
    )
    why = (
        f"its projections are {', '.join(others)} (transformers' GPT-2 layers), not nn.Linear"
        if others
        else f"no nn.Linear has in and out features that are multiples of "
        f"{_multiple(plan.fp8_recipe)} outside fp8.exclude_modules "
        f"{list(plan.fp8_exclude_modules)}"
    )
    warnings.warn(
        f"fp8 compute is enabled but prepare_model converts no layer of this model: {why}; "
        "it computes in the parameter dtype",
        stacklevel=3,
    )


def _converted_float8(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s torchao ``Float8Linear`` layers (none without torchao loaded:
    then nothing can have converted them)."""
    import sys

    module = sys.modules.get("torchao.float8.float8_linear")
    if module is None:
        return []
    return [n for n, m in model.named_modules() if isinstance(m, module.Float8Linear)]


def fp8_all_gather_weights(params: Iterable[torch.Tensor]) -> list[torch.nn.Module]:
    """The converted layers whose weights FSDP2 gathers in fp8 and are among ``params``, in
    the order of ``params``. The order is the all-reduce's: :func:`precompute_scales` stacks
    the layers' maxima into one tensor and reduces it, so every rank must list the same
    layers in the same order (a set's order follows object ids, which differ between ranks
    and between runs: each rank's maximum would meet another layer's, and the shards of one
    weight would be cast with different scales yet gathered under one)."""
    layer_of = {id(layer.weight): layer for layer in list(_GATHERED_IN_FP8)}
    return [layer_of[id(p)] for p in params if id(p) in layer_of]


def fp8_weight_numels(model: torch.nn.Module, plan: PrecisionPlan) -> tuple[int, ...]:
    """The sizes (whole, unsharded) of the weights ``plan`` computes in fp8 in ``model``, in
    ``named_modules`` order: before :meth:`~PrecisionPlan.prepare_model`, of the layers it
    would convert; after it, of the layers it converted. What ``plan.traffic()`` and
    ``plan.memory()`` take as ``fp8_weights``: at ZeRO-3 with ``fp8.all_gather: fp8``, FSDP2
    gathers these weights as one byte a value and each rank holds one fp32 scale for each."""
    if not plan.fp8:
        return ()
    with torchao_import_quiet():
        from torchao.float8.float8_linear import Float8Linear
    chosen = set(eligible_linears(model, plan))
    sizes = []
    for name, module in model.named_modules():
        # isinstance: FSDP2 gives a layer it shards as a unit a class of its own.
        if isinstance(module, (Float8Linear, MXFP8Linear)) or name in chosen:
            sizes.append(module.weight.numel())
    return tuple(sizes)


def fp8_held(
    sharded: Iterable[torch.Tensor], local_shards: Iterable[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors that hold ``local_shards`` (the local shards of the DTensors ``sharded``)
    and the fp32 scales precomputed for the next fp8 all-gather, for ``held_tensors``. A
    weight FSDP2 gathers in fp8 is torchao's ``WeightWithDynamicFloat8CastTensor``, a wrapper
    without a storage of its own (its values are its ``_tensor``); torchao sets the scale on
    the DTensor's own local tensor, which ``to_local`` does not return."""
    plain, scales = [], []
    for param, shard in zip(sharded, local_shards, strict=True):
        inner = getattr(shard, "_tensor", None) if hasattr(shard, "fsdp_pre_all_gather") else None
        plain.append(shard if inner is None else inner)
        scale = getattr(getattr(param, "_local_tensor", None), "_precomputed_scale", None)
        if scale is not None:
            scales.append(scale)
    return plain, scales


def precompute_scales(layers: list[torch.nn.Module]) -> None:
    """torchao's ``precompute_float8_dynamic_scale_for_fsdp`` over ``layers``: each weight's
    tensorwise scale from its shards' absolute maxima (one all-reduce), which the next fp8
    all-gather casts with. Run after every optimizer step that changes the weights."""
    if not layers:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(torch.nn.ModuleList(layers))


class MXFP8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose three matmuls run in MXFP8 (torchao's training function): e4m3
    values with one power-of-two scale per 32 along the contraction, the bias added after in
    the output dtype. ``kernel_preference`` EMULATED where the plan emulates (any device),
    else torchao's AUTO (SM100's block-scaled kernels)."""

    kernel_preference: Any
    wgrad_with_hp: bool = False

    @classmethod
    def convert(cls, module: torch.nn.Module, *, emulate: bool) -> None:
        """Make ``module`` (an ``nn.Linear``) one, in place: parameters, hooks and names kept."""
        with torchao_import_quiet():
            from torchao.quantization.quantize_.common import KernelPreference
        module.__class__ = cls
        module.kernel_preference = KernelPreference.EMULATED if emulate else KernelPreference.AUTO

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
        from torchao.prototype.mx_formats.config import ScaleCalculationMode

        tokens = input.numel() // max(input.shape[-1], 1)
        if tokens % MX_BLOCK:
            raise ValueError(
                f"MXFP8 compute scales the weight gradient per {MX_BLOCK} tokens, but this "
                f"batch has {tokens} (the input's leading dimensions, {tuple(input.shape[:-1])}): "
                f"use a multiple of {MX_BLOCK} tokens, or another fp8.recipe"
            )
        out = _to_mxfp8_then_scaled_mm(
            input,
            self.weight,
            kernel_preference=self.kernel_preference,
            scale_calculation_mode=ScaleCalculationMode.RCEIL,
            wgrad_with_hp=self.wgrad_with_hp,
        )
        return out if self.bias is None else out + self.bias
