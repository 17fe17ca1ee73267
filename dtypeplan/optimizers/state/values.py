"""What an inner optimizer's state holds, per element and per chunk, and how a saved one loads.

A state value is per element (a tensor laid out like its master chunk or local shard:
``exp_avg``, ``sum``...) and saved per parameter, or scalar (``step``, NAdam's ``mu_product``)
and saved per param group, and per parameter where a parameter's own differ (its first gradient
came late, or it skipped a step). These helpers tell them apart, name them, and place saved values
back where ``torch.optim`` keeps them (device, dtype), for every implementation's state calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch

from dtypeplan.optimizers.state import keys
from dtypeplan.optimizers.state.keys import KAHAN_COMPENSATION

__all__ = [
    "ShardPiece",
    "element_state_names",
    "is_element_state",
    "is_scalar_state",
    "load_slot",
    "placed_scalar",
    "same_scalar",
    "same_scalars",
    "scalar_dtype",
    "scalars_key",
    "stateful_scalars",
]


class ShardPiece(NamedTuple):
    """Where this rank's master chunks hold part of one parameter."""

    index: int  # type: ignore[assignment]  # shadows tuple.index; it is the parameter number
    """The parameter's number in ``trainable_parameters()`` (and in the ``param.{i}`` keys)."""
    begin: int
    """First element of the flattened parameter held here."""
    end: int
    """One past the last element held here."""
    master: torch.Tensor
    """The master chunk that holds them (also the inner optimizer's key for its states)."""
    offset: int
    """Where element ``begin`` sits in ``master``."""

    def of(self, chunk: torch.Tensor) -> torch.Tensor:
        """The view of ``chunk`` (``master`` or a state laid out like it) that this piece covers."""
        return chunk[self.offset : self.offset + self.end - self.begin]


def is_element_state(value: Any, master: torch.Tensor) -> bool:
    """Whether ``value`` is a per-element state of ``master`` (a flat chunk or a local shard):
    a tensor laid out like it (``exp_avg``, ``sum``, ``ax``...), saved per parameter."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == master.shape


def element_state_names(inner: torch.optim.Optimizer, tensors: Iterable[torch.Tensor]) -> list[str]:
    """``master`` and the names of ``inner``'s per-element states of ``tensors`` (``exp_avg``...),
    in the order first met. A Kahan compensation has no name of its own: it is folded into the
    master's values."""
    names = [keys.MASTER]
    for tensor in tensors:
        for name, value in inner.state.get(tensor, {}).items():
            if is_element_state(value, tensor) and name not in names and name != KAHAN_COMPENSATION:
                names.append(name)
    return names


def is_scalar_state(value: Any) -> bool:
    """Whether ``value`` is a per-chunk scalar state: a 0-dim tensor or a Python number
    (``step``, NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``), saved per param group and
    per parameter where they differ from its group's."""
    if torch.is_tensor(value):
        return value.dim() == 0
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalar_dtype() -> torch.dtype:
    """The dtype ``torch.optim`` gives its step counters (``_get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def same_scalar(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (
            torch.is_tensor(a)
            and torch.is_tensor(b)
            and a.dtype == b.dtype
            and torch.equal(a.detach().cpu(), b.detach().cpu())
        )
    return type(a) is type(b) and a == b


def placed_scalar(
    name: str, value: Any, master: torch.Tensor, fused_or_capturable: bool
) -> torch.Tensor | float | int:
    """A new copy of scalar state ``value`` for ``master``, where ``torch.optim`` keeps it.

    As ``Optimizer.load_state_dict`` places values: ``step`` on the master's device as float32
    under ``fused``/``capturable``, else on the CPU; the others on the master's device. Each
    keeps its saved dtype otherwise. A copy per chunk: torch increments ``step`` in place.
    """
    if not torch.is_tensor(value):
        return value
    value = value.detach()
    if name == keys.STEP:
        if fused_or_capturable:
            return value.to(device=master.device, dtype=torch.float32, copy=True)
        return value.to(device="cpu", copy=True)
    return value.to(device=master.device, copy=True)


def load_slot(slot: dict[str, Any], entry: Mapping[str, Any], where: slice | None = None) -> None:
    """Copy ``entry``'s states into ``slot`` (made by ``reset_update_state``), in place.

    Per-element states go into ``where`` of each (the whole tensor when None); scalar states
    whole, keeping the device and dtype ``slot`` has. States ``entry`` lacks stay as they are.
    """
    for name, value in slot.items():
        if name not in entry:
            continue
        given = entry[name]
        if not torch.is_tensor(value):
            slot[name] = given
        elif value.dim() == 0:
            if torch.is_tensor(given):
                value.copy_(given)
            else:
                value.fill_(given)
        else:
            (value if where is None else value[where]).copy_(given)


def same_scalars(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two sets of scalar states are the same (names, dtypes, values)."""
    return a.keys() == b.keys() and all(same_scalar(a[n], b[n]) for n in a)


def stateful_scalars(slot: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The scalar states of a master's slot, or None where it has no state torch would have
    created (none, or only a Kahan compensation, which is the master's own)."""
    if not slot or all(name == KAHAN_COMPENSATION for name in slot):
        return None
    return {n: v for n, v in slot.items() if is_scalar_state(v)}


def scalars_key(scalars: Mapping[str, Any]) -> tuple[Any, ...]:
    """A hashable key that two sets of scalar states share exactly when they are the same."""
    return tuple(
        (n, str(v.dtype), v.item()) if torch.is_tensor(v) else (n, type(v).__name__, v)
        for n, v in sorted(scalars.items())
    )
