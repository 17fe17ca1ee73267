"""Which torch optimizers dtypeplan can run, and the names a config's ``optimizer.type`` gives.

dtypeplan's optimizers hand the inner ``torch.optim`` instance flat fp32 buffers (a bucket's
chunk of many parameters, padding included), at every ZeRO stage, stage 0 too. That is exact
only for an *elementwise* update: one whose result for an element depends on that element's
weight, gradient and state alone (and on scalars every element shares, such as the step
count). :data:`ELEMENTWISE` lists the ``torch.optim`` classes that are, each checked against its
source: every state tensor is ``zeros_like(param)`` and every operation is pointwise.
Everything else is *shaped* (the ``optimizer`` dimension of the table), each for a reason
(:func:`shaped_reason`): Adafactor factors its second moment by rows and columns, Muon
orthogonalizes matrices, LBFGS runs a line search over the whole parameter vector with
closures, SparseAdam needs sparse gradients; an unknown class (a subclass included, since it
may override the update) cannot be checked, so it is shaped too.

Names (:func:`canonical_name`), as DeepSpeed 0.19.8 reads ``optimizer.type``: DeepSpeed's own
names in any case (``adam``, ``AdamW``, ``Adagrad``, ``Lamb``...: it lowercases them), every
other ``torch.optim`` class by its exact name (DeepSpeed looks it up with
``getattr(torch.optim, type)``: ``"RMSprop"``, not ``"rmsprop"``), and ``sgd`` in any case, as
dtypeplan read it before. DeepSpeed's optimizers that ``torch.optim`` does not have (Lamb,
Lion, the mup optimizers) are shaped, each with its reason: the plan is NotSupported, not a bad
config; the 1-bit optimizers DeepSpeed 0.19.8 removed are refused, as DeepSpeed refuses them.
The JSON schema lists the same names (``test_optimizer_names.py`` keeps them in step).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dtypeplan.errors import NotSupportedError, PrecisionConfigError
from dtypeplan.resolver._frozen import FrozenDict

__all__ = [
    "DEEPSPEED_ONLY",
    "ELEMENTWISE",
    "FAST_PATH_ARGS",
    "TORCH_OPTIMIZER_NAMES",
    "any_case_pattern",
    "canonical_name",
    "optimizer_class",
    "optimizer_kind",
    "STATE_KINDS",
    "shaped_reason",
    "state_bytes_per_param",
    "state_kind",
]


def _momentum(hyper: Mapping[str, Any]) -> int:
    return 4 if float(hyper.get("momentum", 0.0)) != 0.0 else 0


ELEMENTWISE: FrozenDict[type[torch.optim.Optimizer], Callable[[Mapping[str, Any]], int]] = (
    FrozenDict(
        {
            # fp32 state bytes per parameter, from each class's hyperparameters.
            torch.optim.SGD: _momentum,
            torch.optim.Adam: lambda h: 8 + (4 if h.get("amsgrad") else 0),
            torch.optim.AdamW: lambda h: 8 + (4 if h.get("amsgrad") else 0),
            torch.optim.Adamax: lambda h: 8,  # exp_avg, exp_inf
            torch.optim.Adagrad: lambda h: 4,  # sum
            torch.optim.Adadelta: lambda h: 8,  # square_avg, acc_delta
            # square_avg, momentum_buffer, grad_avg (centered)
            torch.optim.RMSprop: lambda h: 4 + _momentum(h) + (4 if h.get("centered") else 0),
            torch.optim.NAdam: lambda h: 8,  # exp_avg, exp_avg_sq
            torch.optim.RAdam: lambda h: 8,  # exp_avg, exp_avg_sq
            torch.optim.Rprop: lambda h: 8,  # prev, step_size
            torch.optim.ASGD: lambda h: 4,  # ax
        }
    )
)
"""The elementwise ``torch.optim`` classes, each with its state bytes per parameter."""

STATE_KINDS: FrozenDict[type[torch.optim.Optimizer], str] = FrozenDict(
    {torch.optim.Rprop: "step_sizes", torch.optim.ASGD: "averaged_weights"}
)
"""The elementwise classes whose per-element states are not moments (the table's
``state_kind``): Rprop keeps a step size per element (grown by etaplus, shrunk by etaminus,
clamped to step_sizes) and the last gradient, whose sign picks the next change; ASGD keeps
``ax``, the averaged weights. Every other class keeps running averages or sums of gradients
(``moments``)."""

FAST_PATH_ARGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Arguments that choose an implementation of the same update; dtypeplan sets them itself
(``differentiable=True`` would differentiate through the step, which is refused)."""

_SHAPED_TORCH: dict[str, str] = {
    "Adafactor": "factors its second moment into the row and column statistics of each matrix",
    "LBFGS": "runs a line search over the whole parameter vector, calling the closure several "
    "times per step",
    "Muon": "orthogonalizes each matrix's update (Newton-Schulz iterations over its rows and "
    "columns)",
    "SparseAdam": "needs sparse gradients (nn.Embedding(sparse=True)), which flat buffers "
    "cannot hold",
}
TORCH_OPTIMIZER_NAMES: tuple[str, ...] = tuple(
    sorted({c.__name__ for c in ELEMENTWISE} | set(_SHAPED_TORCH), key=str.lower)
)
"""Every ``torch.optim`` optimizer class of torch 2.13, by the name a config gives it."""

_MUP = (
    "the mup package's optimizer: it scales each parameter's learning rate by that "
    "parameter's infinite-width shape (infshape), which flat shards of many parameters lose"
)
DEEPSPEED_ONLY: FrozenDict[str, tuple[str, str]] = FrozenDict(
    {
        "lamb": (
            "Lamb",
            "DeepSpeed's FusedLamb scales each parameter's update by the ratio of that "
            "parameter's weight norm to its update norm, which flat shards of many parameters "
            "cannot compute, and torch.optim has no Lamb",
        ),
        "lion": (
            "Lion",
            "torch.optim has no Lion (DeepSpeed runs its own FusedLion), and dtypeplan runs "
            "torch.optim's updates on the master weights",
        ),
        "muadam": ("MuAdam", _MUP),
        "muadamw": ("MuAdamW", _MUP),
        "musgd": ("MuSGD", _MUP),
    }
)
"""DeepSpeed's own optimizer names (lowercase, as DeepSpeed reads them) that no ``torch.optim``
class runs: the name a config shows and why dtypeplan does not run it."""

# DeepSpeed's names for torch.optim classes (lowercase), and sgd as dtypeplan read it before.
# DeepSpeed reads "muon" as its MuonWithAuxAdam (Muon on matrices, Adam on the rest): shaped
# either way.
_ANY_CASE = {"adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad", "muon": "Muon", "sgd": "SGD"}
_REMOVED_BY_DEEPSPEED = ("onebitadam", "zerooneadam", "onebitlamb")


def any_case_pattern() -> str:
    """The JSON schema's pattern for the names read in any case (JSON Schema regexes have no
    case-insensitive flag, so each letter is a class: ``[Aa][Dd][Aa][Mm]``)."""
    names = sorted({*_ANY_CASE, *DEEPSPEED_ONLY}, key=lambda n: (-len(n), n))
    classes = ["".join(f"[{c.upper()}{c}]" for c in name) for name in names]
    return "^(" + "|".join(classes) + ")$"


def canonical_name(name: str) -> str:
    """The ``optimizer.type`` a config gives, as dtypeplan names it (``adamw`` -> ``AdamW``,
    ``lamb`` -> ``Lamb``); :class:`PrecisionConfigError` listing the valid names
    for any other."""
    if name in TORCH_OPTIMIZER_NAMES:
        return name
    lower = name.lower()
    if lower in _ANY_CASE:
        return _ANY_CASE[lower]
    if lower in DEEPSPEED_ONLY:
        return DEEPSPEED_ONLY[lower][0]
    if lower in _REMOVED_BY_DEEPSPEED:
        raise PrecisionConfigError(
            f"optimizer.type {name!r} at $.optimizer.type: DeepSpeed 0.19.8 removed its 1-bit "
            "optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb) and refuses the name too (it looks "
            "it up in torch.optim); use Adam or AdamW",
            "$.optimizer.type",
        )
    known = [*TORCH_OPTIMIZER_NAMES, *(shown for shown, _ in DEEPSPEED_ONLY.values())]
    by_lower = {k.lower(): k for k in known}
    close = difflib.get_close_matches(lower, list(by_lower), n=1, cutoff=0.6)
    hint = f"did you mean {by_lower[close[0]]!r}? " if close else ""
    raise PrecisionConfigError(
        f"unknown optimizer.type {name!r} at $.optimizer.type: {hint}dtypeplan reads every "
        f"torch.optim class by its name ({', '.join(TORCH_OPTIMIZER_NAMES)}; exact case, as "
        "DeepSpeed looks them up in torch.optim) and DeepSpeed's own names in any case "
        f"({', '.join(shown for shown, _ in DEEPSPEED_ONLY.values())}: not run here, each "
        "resolves NotSupported with its reason)",
        "$.optimizer.type",
    )


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class of a canonical name; :class:`NotSupportedError` with the
    reason for DeepSpeed's own optimizers (and a class this torch lacks)."""
    for shown, reason in DEEPSPEED_ONLY.values():
        if name == shown:
            raise NotSupportedError(f"optimizer {name}: {reason}")
    found = getattr(torch.optim, name, None)
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise NotSupportedError(
            f"optimizer {name}: torch {torch.__version__} has no torch.optim.{name}"
        )
    return found


def optimizer_kind(torch_class: type | None) -> str:
    """``"elementwise"`` for the classes of :data:`ELEMENTWISE`, else ``"shaped"`` (None: no
    ``torch.optim`` class runs it)."""
    return "elementwise" if torch_class in ELEMENTWISE else "shaped"


def state_kind(torch_class: type | None) -> str:
    """The table's ``state_kind`` of a class: :data:`STATE_KINDS`, else ``"moments"``."""
    return STATE_KINDS.get(torch_class, "moments") if torch_class is not None else "moments"


def shaped_reason(name: str, torch_class: type | None) -> str:
    """Why the optimizer named ``name`` (its class, or None) does not run on flat shards."""
    if torch_class is None:
        lower = name.lower()
        if lower in DEEPSPEED_ONLY:
            return DEEPSPEED_ONLY[lower][1]
        return f"torch {torch.__version__} has no torch.optim.{name}"
    if torch_class in ELEMENTWISE:
        return "each element's update depends on that element alone"
    name_in_torch = torch_class.__name__
    if getattr(torch.optim, name_in_torch, None) is torch_class and name_in_torch in _SHAPED_TORCH:
        return _SHAPED_TORCH[name_in_torch]
    return (
        "not one of torch.optim's elementwise classes (a subclass may override the update), "
        "so dtypeplan cannot check that each element's update depends on that element alone"
    )


def state_bytes_per_param(torch_class: type, hyperparameters: Mapping[str, Any]) -> int:
    """fp32 optimizer-state bytes per parameter of an elementwise class."""
    return ELEMENTWISE[torch_class](hyperparameters)
