"""The keys of the layout-free optimizer state: ``param.{i}.{name}`` and ``scalar.{name}``.

:meth:`MixedPrecisionOptimizer.full_state` and the checkpoint files name every tensor
``param.{i}.{name}`` (``i`` numbers the trainable parameters over all param groups in order;
``name`` is ``master`` or a per-element ``torch.optim`` state such as ``exp_avg``) and every
scalar ``scalar.{name}`` (``step``, ``loss_scale``, ``skipped_steps``, ``scaler.{field}``).
The inner optimizer's per-chunk scalar states (``step``, NAdam's ``mu_product``, ASGD's ``eta``
and ``mu``...) are one per param group, ``scalar.group.{g}.{name}`` (the value most of the
group's parameters hold), and per parameter where a parameter's differ from its group's
(``torch.optim``'s lifecycle: a parameter whose first gradient came late, or that skipped a
step, counts its own steps): ``scalar.param.{i}.{name}``, or ``scalar.param.{i}.no_state``
for a parameter that has had no gradient yet while its group has a state. This module is the
only place that spells those strings; everything else builds and parses them here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "KAHAN_COMPENSATION",
    "MASTER",
    "MOMENTS",
    "ELEMENT_STATES",
    "SIGNED_STATES",
    "LOSS_SCALE",
    "NO_STATE",
    "ROUNDING_STEP",
    "SKIPPED_STEPS",
    "STEP",
    "group_scalar_key",
    "group_scalars",
    "param_index",
    "param_key",
    "param_scalar_key",
    "param_scalars",
    "param_state_names",
    "parse_group_scalar_key",
    "parse_param_key",
    "parse_param_scalar_key",
    "scaler_key",
    "scaler_state",
    "scalar_key",
]

_PARAM = "param."
_SCALAR = "scalar."
_SCALER = "scaler."
_GROUP = "group."
_PARAM_SCALAR = "param."

MASTER = "master"
"""The state name of the fp32 master weights."""
KAHAN_COMPENSATION = "kahan_compensation"
"""The state name of the Kahan compensation buffer (bf16, laid out like the master chunk)."""

MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam's moments under torch's names; the first is signed, the second is not."""

SIGNED_STATES = ("exp_avg", "momentum_buffer", "grad_avg", "prev", "ax")
"""The per-element states of the elementwise ``torch.optim`` classes that can be negative:
first moments and momenta (Adam family, SGD, RMSprop's ``momentum_buffer`` and centered
``grad_avg``), Rprop's last gradient ``prev``, ASGD's averaged weights ``ax``. They are stored
as ``exp_avg_dtype`` says (the signed int8 code table)."""

ELEMENT_STATES = (
    *SIGNED_STATES,
    "exp_avg_sq",
    "max_exp_avg_sq",
    "sum",
    "square_avg",
    "acc_delta",
    "exp_inf",
    "step_size",
)
"""Every per-element state of the elementwise ``torch.optim`` classes (torch 2.13): the signed
ones, then the non-negative ones (second moments and accumulators: Adam's ``exp_avg_sq`` and
amsgrad's ``max_exp_avg_sq``, Adagrad's ``sum``, RMSprop's and Adadelta's ``square_avg``,
Adadelta's ``acc_delta``, Adamax's ``exp_inf``, Rprop's ``step_size``), stored as
``exp_avg_sq_dtype`` says (the unsigned int8 code table). Scalar states (``step``, NAdam's
``mu_product``, ASGD's ``eta`` and ``mu``) stay as torch keeps them."""

STEP = "step"
LOSS_SCALE = "loss_scale"
SKIPPED_STEPS = "skipped_steps"
ROUNDING_STEP = "rounding_step"
"""The scalar state that counts the stochastic roundings of a 16-bit master (or of a parameter's
piece with its own history) whose optimizer class keeps no step count (SGD): its noise is keyed
on it as other classes' is on ``step`` (``rounding.step_noise_key``), and it is saved and loaded
as any scalar state, so a resumed run draws the uninterrupted run's bits. An int64 0-dim tensor
on the master's device; no ``torch.optim`` class keeps a state of that name."""
NO_STATE = "no_state"
"""The per-parameter scalar name that marks a parameter without any state (no gradient yet);
no ``torch.optim`` class keeps a state of that name."""


def param_key(index: int, name: str) -> str:
    """The key of state ``name`` of global parameter ``index``."""
    return f"{_PARAM}{index}.{name}"


def parse_param_key(key: str) -> tuple[int, str] | None:
    """``(index, name)`` of a ``param.{i}.{name}`` key; None for any other key."""
    if not key.startswith(_PARAM):
        return None
    index, _, name = key[len(_PARAM) :].partition(".")
    return int(index), name


def param_index(key: str) -> int:
    """The parameter index of a ``param.{i}.{name}`` key (ValueError for another key)."""
    parsed = parse_param_key(key)
    if parsed is None:
        raise ValueError(f"{key!r} is not a param.{{i}}.{{name}} key")
    return parsed[0]


def param_state_names(keys: Iterable[str], index: int | None = None) -> list[str]:
    """The state names among ``param.*`` keys, in first-seen order (of parameter ``index``)."""
    names: list[str] = []
    for key in keys:
        parsed = parse_param_key(key)
        if parsed is not None and (index is None or parsed[0] == index):
            if parsed[1] not in names:
                names.append(parsed[1])
    return names


def scalar_key(name: str) -> str:
    """The key of scalar ``name`` (``step``, ``loss_scale``, ``skipped_steps``)."""
    return f"{_SCALAR}{name}"


def group_scalar_key(group: int, name: str) -> str:
    """The key of the inner optimizer's scalar state ``name`` (``step``...) of param group
    ``group``."""
    return scalar_key(f"{_GROUP}{group}.{name}")


def parse_group_scalar_key(key: str) -> tuple[int, str] | None:
    """``(group, name)`` of a ``scalar.group.{g}.{name}`` key; None for any other key
    (ValueError for a malformed one)."""
    prefix = scalar_key(_GROUP)
    if not key.startswith(prefix):
        return None
    group, _, name = key[len(prefix) :].partition(".")
    if not group.isdigit() or not name:
        raise ValueError(f"{key!r} is not a {prefix}{{g}}.{{name}} key")
    return int(group), name


def group_scalars(state: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """The ``scalar.group.*`` entries of ``state``: group -> name -> value (empty if none)."""
    out: dict[int, dict[str, Any]] = {}
    for key, value in state.items():
        parsed = parse_group_scalar_key(key)
        if parsed is not None:
            out.setdefault(parsed[0], {})[parsed[1]] = value
    return out


def param_scalar_key(index: int, name: str) -> str:
    """The key of parameter ``index``'s own scalar state ``name`` (or :data:`NO_STATE`)."""
    return scalar_key(f"{_PARAM_SCALAR}{index}.{name}")


def parse_param_scalar_key(key: str) -> tuple[int, str] | None:
    """``(index, name)`` of a ``scalar.param.{i}.{name}`` key; None for any other key
    (ValueError for a malformed one)."""
    prefix = scalar_key(_PARAM_SCALAR)
    if not key.startswith(prefix):
        return None
    index, _, name = key[len(prefix) :].partition(".")
    if not index.isdigit() or not name:
        raise ValueError(f"{key!r} is not a {prefix}{{i}}.{{name}} key")
    return int(index), name


def param_scalars(state: Mapping[str, Any]) -> dict[int, dict[str, Any] | None]:
    """The ``scalar.param.*`` entries of ``state``: parameter -> its own scalar states, or
    None where it has no state (:data:`NO_STATE`); parameters that follow their group are
    absent."""
    out: dict[int, dict[str, Any] | None] = {}
    for key, value in state.items():
        parsed = parse_param_scalar_key(key)
        if parsed is None:
            continue
        index, name = parsed
        if name == NO_STATE:
            out[index] = None
        else:
            found = out.setdefault(index, {})
            if found is not None:
                found[name] = value
    return out


def scaler_key(field: str) -> str:
    """The key of one field of the loss scaler's state (fp16 only)."""
    return scalar_key(_SCALER + field)


def scaler_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The loss scaler's fields found in ``state`` (empty when it holds none)."""
    prefix = scaler_key("")
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
