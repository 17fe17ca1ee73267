"""Stage 7b of ``load_config``: the ``optimizer`` and ``scheduler`` blocks.

The optimizer block has DeepSpeed's meaning (``_deepspeed_keys.ADAM_PARAMS``: ``"Adam"`` runs
AdamW unless ``adam_w_mode`` is false, a few engine switches are ignored or refused) and
torch's argument names, checked against the class's signature and by building it once. The
scheduler block is built once on a throwaway optimizer, so that DeepSpeed's checks run at
resolve time.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from dtypeplan.errors import NotSupportedError, PrecisionConfigError
from dtypeplan.resolver._auto import AutoValue, auto_filled
from dtypeplan.resolver._config import OptimizerConfig
from dtypeplan.resolver._deepspeed import closest_hint
from dtypeplan.resolver._deepspeed_keys import ADAM_PARAMS
from dtypeplan.resolver._frozen import FrozenDict, freeze
from dtypeplan.resolver._optimizer_kind import canonical_name, optimizer_class

__all__ = ["OptimizerReading", "read_optimizer", "read_scheduler"]

# Chosen by dtypeplan, not by the user: the implementation sets them itself.
_RESERVED_OPTIMIZER_ARGS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


def _check_optimizer_params(name: str, params: dict[str, Any]) -> None:
    """torch's argument names and values for the class named ``name`` (``"Muon"``: DeepSpeed's
    MuonWithAuxAdam, ``dtypeplan/muon.py``, with DeepSpeed's names; DeepSpeed's own optimizers
    that nothing here runs keep DeepSpeed's params unchecked: they resolve NotSupported)."""
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


@dataclass(frozen=True)
class OptimizerReading:
    config: OptimizerConfig
    notes: tuple[str, ...]
    ignored: tuple[str, ...]
    low_precision_states: bool
    """``fp32_optimizer_states: false``: DeepSpeed's CPU Adam keeps moments in the param dtype."""


_FAST_PATH_CHOICES = ("foreach", "fused")
"""torch's choices of an implementation of the same update: accepted and left to dtypeplan,
which runs the update on its flat chunks as its kernels say (build and wrap drop them too)."""

# DeepSpeed's Adam/AdamW params that torch.optim does not take (ADAM_PARAMS in
# _deepspeed_keys.py); what each becomes is decided in read_optimizer.
_DEEPSPEED_ADAM_ONLY = ("adam_w_mode", "torch_adam", "bias_correction", "fp32_optimizer_states")
# Engine bookkeeping with no effect on the update.
_DEEPSPEED_ADAM_IGNORED = ("torch_adam", "set_grad_none")


def _fill_adamw_weight_decay(params: dict[str, Any], notes: list[str]) -> None:
    """An absent weight decay as DeepSpeed fills it for the AdamW it runs: 0, its FusedAdam's
    (and DeepSpeedCPUAdam's) default, unless ``torch_adam`` asks for torch.optim.AdamW, whose
    own default is 0.01."""
    if "weight_decay" in params:
        return
    if params.get("torch_adam") is True:
        notes.append(
            "optimizer.params.weight_decay absent: torch.optim.AdamW's default 0.01 "
            "(DeepSpeed with torch_adam true runs torch's class)"
        )
        return
    params["weight_decay"] = ADAM_PARAMS["weight_decay"]
    notes.append(
        "optimizer.params.weight_decay absent: 0, the default of DeepSpeed's FusedAdam "
        "(torch.optim.AdamW's own default would be 0.01)"
    )


def _read_adam_params(
    name: str, params: dict[str, Any], notes: list[str], ignored: list[str]
) -> tuple[str, bool]:
    """DeepSpeed's Adam/AdamW params read into torch's (``params`` changed in place): the
    class that runs (``"Adam"`` is AdamW unless ``adam_w_mode`` is false) and whether
    ``fp32_optimizer_states`` is false."""
    for key in _DEEPSPEED_ADAM_ONLY:
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
    low_precision_states = params.pop("fp32_optimizer_states", None) is False
    if adam_w_mode or name == "AdamW":
        _fill_adamw_weight_decay(params, notes)
    for key in _DEEPSPEED_ADAM_IGNORED:
        if key in params:
            params.pop(key)
            ignored.append(f"$.optimizer.params.{key}")
    if name == "Adam" and adam_w_mode:
        notes.append(
            'optimizer type "Adam" runs AdamW (decoupled weight decay), as in DeepSpeed, '
            "whose adam_w_mode defaults to true; set optimizer.params.adam_w_mode false for "
            "torch.optim.Adam (L2 weight decay)"
        )
        return "AdamW", low_precision_states
    if name == "AdamW" and not adam_w_mode:
        notes.append(
            'optimizer.params.adam_w_mode false does not apply to type "AdamW", which '
            'DeepSpeed always runs as AdamW; use type "Adam" for L2 weight decay'
        )
    return name, low_precision_states


def read_optimizer(document: dict[str, Any]) -> OptimizerReading:
    """The optimizer block with DeepSpeed's meaning (see ``_deepspeed_keys.ADAM_PARAMS``)."""
    params = dict(document.get("params", {}))
    if "betas" in params and isinstance(params["betas"], list):
        params["betas"] = tuple(params["betas"])
    name = canonical_name(document["type"])
    notes: list[str] = []
    ignored: list[str] = []
    low_precision_states = False
    if name in ("Adam", "AdamW"):
        name, low_precision_states = _read_adam_params(name, params, notes, ignored)
    for key in _FAST_PATH_CHOICES:
        # As build(optimizer=...) and wrap() do: the same update, run as dtypeplan chooses.
        if key in params:
            path = f"$.optimizer.params.{key}"
            if params[key] is not None and not isinstance(params[key], bool):
                raise PrecisionConfigError(
                    f"invalid value {params[key]!r} at {path}: must be true, false or null", path
                )
            params.pop(key)
            ignored.append(path)
    _check_optimizer_params(name, params)
    return OptimizerReading(
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


def read_scheduler(
    document: dict[str, Any], optimizer: OptimizerConfig, auto_values: tuple[AutoValue, ...]
) -> tuple[FrozenDict[str, Any] | None, tuple[str, ...]]:
    """The validated ``scheduler`` block (None without one), and a warning when it cannot be
    built only because of the HF defaults of its ``"auto"`` values."""
    scheduler = document.get("scheduler")
    if scheduler is None:
        return None, ()
    warnings: list[str] = []
    try:
        _check_scheduler(scheduler, optimizer)
    except PrecisionConfigError as error:
        filled = auto_filled(auto_values, "scheduler.")
        if not filled:
            raise
        # The HF defaults (total_num_steps unknown before the Trainer counts) leave DeepSpeed's
        # schedulers unbuildable too; the plan still resolves and says what to fill.
        warnings.append(
            f'$.scheduler cannot be built with the HF defaults of its "auto" values '
            f"({', '.join(a.path for a in filled)}): {error}; DeepSpeed 0.19.8 refuses it "
            "the same way: give them with resolve(..., auto={...}) before build_scheduler"
        )
    return freeze(scheduler), tuple(warnings)
