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
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dtypeplan.errors import NotSupportedError, PrecisionConfigError, RegistryError
from dtypeplan.lion import Lion
from dtypeplan.muon import MuonWithAuxAdamW
from dtypeplan.resolver._frozen import FrozenDict

__all__ = [
    "DEEPSPEED_ONLY",
    "ELEMENTWISE",
    "FAST_PATH_ARGS",
    "RegisteredOptimizer",
    "TORCH_OPTIMIZER_NAMES",
    "any_case_pattern",
    "canonical_name",
    "is_elementwise",
    "needs_whole",
    "registered_optimizer",
    "register_optimizer",
    "optimizer_class",
    "optimizer_kind",
    "STATE_KINDS",
    "shaped_reason",
    "state_bytes_per_param",
    "state_kind",
    "update_dtype",
    "WholeStates",
    "whole_states",
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

WHOLE = "whole"
"""The ``kind`` of a class that needs each parameter whole (its shape): Muon, Adafactor."""


@dataclass(frozen=True)
class RegisteredOptimizer:
    """What :func:`register_optimizer` was told about a class."""

    kind: str
    """``"elementwise"`` or :data:`WHOLE`."""
    signed_states: tuple[str, ...] | None
    """The per-element states that can be negative (stored as ``exp_avg_dtype`` says); None
    when the states were not declared."""
    non_negative_states: tuple[str, ...] | None
    """The per-element states that never are (stored as ``exp_avg_sq_dtype`` says)."""

    @property
    def declared(self) -> bool:
        """Whether the states were declared (else only fp32 states serve the class)."""
        return self.signed_states is not None

    @property
    def states(self) -> tuple[str, ...]:
        return (*(self.signed_states or ()), *(self.non_negative_states or ()))


_REGISTERED: dict[type, RegisteredOptimizer] = {
    Lion: RegisteredOptimizer("elementwise", ("exp_avg",), ()),
}
"""The classes registered with :func:`register_optimizer`, dtypeplan's own Lion first."""


def register_optimizer(
    cls: type[torch.optim.Optimizer],
    *,
    kind: str,
    signed_states: Iterable[str] | None = None,
    non_negative_states: Iterable[str] | None = None,
) -> type[torch.optim.Optimizer]:
    """Tell the table what the ``torch.optim.Optimizer`` subclass ``cls`` needs; returns ``cls``
    (so it also serves as a decorator through ``functools.partial``).

    ``kind="elementwise"``: each element's update reads only that element's weight, gradient
    and per-element states (and scalars every element shares), so the class gets every cell
    the elementwise ``torch.optim`` classes have. ``signed_states`` and
    ``non_negative_states`` name its per-element states (the keys of ``optimizer.state[p]``
    laid out like ``p``): the signed ones are stored as ``exp_avg_dtype`` says, the
    non-negative ones as ``exp_avg_sq_dtype``. Undeclared, the class runs with fp32 states
    only (the table says why). ``kind="whole"``: the update needs each parameter whole (as
    Muon's and Adafactor's do); dtypeplan runs it on whole parameters, each owned by one rank.

    Registering a class twice, or one of dtypeplan's built-in classes, raises
    :class:`RegistryError`.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise RegistryError(f"register_optimizer needs a torch.optim.Optimizer class, got {cls!r}")
    if kind not in ("elementwise", WHOLE):
        raise RegistryError(
            f"register_optimizer({cls.__name__}, kind={kind!r}): kind is 'elementwise' (each "
            "element's update reads that element alone) or 'whole' (the update needs each "
            "parameter whole)"
        )
    if cls in ELEMENTWISE or cls in _REGISTERED or cls in _WHOLE_TORCH:
        raise RegistryError(f"{cls.__module__}.{cls.__qualname__} is already registered")
    declared = signed_states is not None or non_negative_states is not None
    signed = tuple(signed_states or ())
    non_negative = tuple(non_negative_states or ())
    if declared and kind != "elementwise":
        raise RegistryError(
            f"register_optimizer({cls.__name__}, kind={kind!r}): states are declared for the "
            "elementwise low-precision state cells only"
        )
    if set(signed) & set(non_negative):
        raise RegistryError(
            f"register_optimizer({cls.__name__}): {sorted(set(signed) & set(non_negative))} "
            "declared both signed and non-negative"
        )
    _REGISTERED[cls] = RegisteredOptimizer(
        kind, signed if declared else None, non_negative if declared else None
    )
    return cls


def registered_optimizer(torch_class: type | None) -> RegisteredOptimizer | None:
    """What :func:`register_optimizer` was told about ``torch_class`` (None: nothing)."""
    return _REGISTERED.get(torch_class) if torch_class is not None else None


def is_elementwise(torch_class: type | None) -> bool:
    """Whether each element's update reads that element alone: a class of :data:`ELEMENTWISE`
    or one registered ``kind="elementwise"`` (dtypeplan's Lion included)."""
    found = registered_optimizer(torch_class)
    return torch_class in ELEMENTWISE or (found is not None and found.kind == "elementwise")


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
_WHOLE_TORCH = frozenset(
    found
    for found in (getattr(torch.optim, name, None) for name in ("Adafactor", "Muon"))
    if found is not None
) | {MuonWithAuxAdamW}
"""The shaped classes dtypeplan runs on whole parameters: torch's Adafactor and Muon, and
DeepSpeed's ``"Muon"`` (``dtypeplan/muon.py``: Muon on the hidden matrices, AdamW on the rest)."""
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
        "muadam": ("MuAdam", _MUP),
        "muadamw": ("MuAdamW", _MUP),
        "musgd": ("MuSGD", _MUP),
    }
)
"""DeepSpeed's own optimizer names (lowercase, as DeepSpeed reads them) that no ``torch.optim``
class runs: the name a config shows and why dtypeplan does not run it."""

# DeepSpeed's names for torch.optim classes (lowercase), and sgd as dtypeplan read it before.
# DeepSpeed reads "muon" as its MuonWithAuxAdam (Muon on matrices, Adam on the rest): so does
# dtypeplan (dtypeplan/muon.py); torch.optim.Muon is passed to build(optimizer=...).
# DeepSpeed's "lion" is dtypeplan's own Lion (``dtypeplan/lion.py``), elementwise.
_ANY_CASE = {
    "adam": "Adam",
    "adamw": "AdamW",
    "adagrad": "Adagrad",
    "lion": "Lion",
    "muon": "Muon",
    "sgd": "SGD",
}
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
    known = [
        *TORCH_OPTIMIZER_NAMES,
        Lion.__name__,
        *(shown for shown, _ in DEEPSPEED_ONLY.values()),
    ]
    by_lower = {k.lower(): k for k in known}
    close = difflib.get_close_matches(lower, list(by_lower), n=1, cutoff=0.6)
    hint = f"did you mean {by_lower[close[0]]!r}? " if close else ""
    raise PrecisionConfigError(
        f"unknown optimizer.type {name!r} at $.optimizer.type: {hint}dtypeplan reads every "
        f"torch.optim class by its name ({', '.join(TORCH_OPTIMIZER_NAMES)}; exact case, as "
        "DeepSpeed looks them up in torch.optim), its own Lion, and DeepSpeed's own names in "
        "any case "
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
    if name == Lion.__name__:
        return Lion
    if name == "Muon":  # DeepSpeed's "Muon": its MuonWithAuxAdam (torch.optim.Muon via build)
        return MuonWithAuxAdamW
    found = getattr(torch.optim, name, None)
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise NotSupportedError(
            f"optimizer {name}: torch {torch.__version__} has no torch.optim.{name}"
        )
    return found


def optimizer_kind(torch_class: type | None) -> str:
    """``"elementwise"`` for the classes of :func:`is_elementwise`, else ``"shaped"`` (None: no
    ``torch.optim`` class runs it)."""
    return "elementwise" if is_elementwise(torch_class) else "shaped"


def needs_whole(torch_class: type | None) -> bool:
    """Whether the class runs on whole parameters: torch's Muon and Adafactor, and classes
    registered ``kind="whole"``."""
    found = registered_optimizer(torch_class)
    return torch_class in _WHOLE_TORCH or (found is not None and found.kind == WHOLE)


_BF16_UPDATES = frozenset(
    found for found in (getattr(torch.optim, "Muon", None), MuonWithAuxAdamW) if found is not None
)
"""Classes whose update is computed in bf16 whatever the parameters' dtype: torch's Muon runs
its Newton-Schulz iterations in bf16 (so does DeepSpeed's, in fp16 or bf16)."""


def update_dtype(torch_class: type | None) -> torch.dtype:
    """The dtype the class computes its update in: bf16 for :data:`_BF16_UPDATES`, else fp32
    (the master's). Two correct runs whose gradients differ in the last fp32 bits may round a
    bf16 update differently, so a parity bound counts its unit roundoff (dtypeplan/prove.py)."""
    return torch.bfloat16 if torch_class in _BF16_UPDATES else torch.float32


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
    if is_elementwise(torch_class):
        return "each element's update depends on that element alone"
    if needs_whole(torch_class) and registered_optimizer(torch_class) is not None:
        return "registered with kind='whole': its update needs each parameter whole"
    if torch_class is MuonWithAuxAdamW:
        return (
            "DeepSpeed's Muon: torch.optim.Muon orthogonalizes each hidden matrix's update "
            "(Newton-Schulz iterations over its rows and columns), AdamW updates the rest"
        )
    name_in_torch = torch_class.__name__
    if getattr(torch.optim, name_in_torch, None) is torch_class and name_in_torch in _SHAPED_TORCH:
        return _SHAPED_TORCH[name_in_torch]
    return (
        "not one of torch.optim's elementwise classes (a subclass may override the update), "
        "so dtypeplan cannot check that each element's update depends on that element alone"
    )


def state_bytes_per_param(torch_class: type, hyperparameters: Mapping[str, Any]) -> int:
    """fp32 optimizer-state bytes per parameter of an elementwise class (a registered one
    without declared states: :class:`NotSupportedError`, its states are not known)."""
    if torch_class in ELEMENTWISE:
        return ELEMENTWISE[torch_class](hyperparameters)
    found = registered_optimizer(torch_class)
    if found is None or not found.declared:
        raise NotSupportedError(
            f"{torch_class.__name__}'s per-element states were not declared "
            "(dtypeplan.register_optimizer(..., signed_states=..., non_negative_states=...)): "
            "their bytes are not known"
        )
    return 4 * len(found.states)


SIGNED_WHOLE_STATES = frozenset({"momentum_buffer", "exp_avg"})
"""The per-element states of the whole-tensor classes that can be negative: stored as
``exp_avg_dtype`` says, the others (second moments, row and column statistics) as
``exp_avg_sq_dtype`` (``optimizers/whole/low_precision.SIGNED``)."""


@dataclass(frozen=True)
class WholeStates:
    """What one whole parameter's update keeps under a class (torch's own state creation)."""

    values: FrozenDict[str, int]
    """Each per-element state tensor by its name, and its number of values."""
    scalar_bytes: int
    """Bytes of its 0-dim state tensors (the fp32 ``step`` of Adafactor and of AdamW)."""


def _adafactor_states(shape: tuple[int, ...], muon: bool) -> WholeStates:
    # torch's Adafactor: a matrix (or more) keeps its row factor (the last dimension reduced
    # to 1) and its column factor (the one before it reduced); a vector its full variance.
    if len(shape) >= 2:
        rows = math.prod(shape[:-1])
        columns = math.prod(shape[:-2]) * shape[-1]
        return WholeStates(FrozenDict({"row_var": rows, "col_var": columns}), 4)
    return WholeStates(FrozenDict({"variance": math.prod(shape)}), 4)


def _muon_states(shape: tuple[int, ...], muon: bool) -> WholeStates:
    if len(shape) != 2:
        raise NotSupportedError(
            f"torch.optim.Muon takes 2-D parameters only, not one of shape {list(shape)} (its "
            "constructor refuses it): give the others to another optimizer, or use DeepSpeed's "
            'Muon ("type": "Muon"), which runs AdamW on them'
        )
    return WholeStates(FrozenDict({"momentum_buffer": math.prod(shape)}), 0)


def _muon_with_adamw_states(shape: tuple[int, ...], muon: bool) -> WholeStates:
    # dtypeplan/muon.py: Muon's momentum on the tagged matrices, AdamW's two moments and its
    # fp32 step on the rest.
    if muon and len(shape) == 2:
        return _muon_states(shape, muon)
    n = math.prod(shape)
    return WholeStates(FrozenDict({"exp_avg": n, "exp_avg_sq": n}), 4)


_WHOLE_STATES: dict[type, Callable[[tuple[int, ...], bool], WholeStates]] = {
    MuonWithAuxAdamW: _muon_with_adamw_states,
    **{
        found: rule
        for name, rule in (("Adafactor", _adafactor_states), ("Muon", _muon_states))
        if (found := getattr(torch.optim, name, None)) is not None
    },
}
"""Each built-in whole-tensor class's states, from a parameter's shape and whether it takes
Muon (DeepSpeed's ``use_muon`` tag; only :class:`MuonWithAuxAdamW` reads it)."""


def whole_states(torch_class: type, shape: tuple[int, ...], muon: bool = True) -> WholeStates:
    """The states one parameter of ``shape`` keeps under the whole-tensor class
    ``torch_class`` (:class:`NotSupportedError` for a class registered ``kind="whole"``,
    whose states are not known, and for a shape the class refuses)."""
    rule = _WHOLE_STATES.get(torch_class)
    if rule is None:
        raise NotSupportedError(
            f"{torch_class.__name__} runs on whole parameters, but its states (how many values "
            "each parameter keeps) are not known to dtypeplan: plan.memory() cannot count "
            "them; optimizer.held_tensors() measures them"
        )
    states = rule(tuple(shape), muon)
    if not shape:
        # A 0-dim parameter's states are 0-dim too: scalar states, torch's fp32 (the 16-bit
        # storage of optimizers/whole/low_precision.py is for states of more than one value).
        return WholeStates(FrozenDict(), states.scalar_bytes + 4 * sum(states.values.values()))
    return states
