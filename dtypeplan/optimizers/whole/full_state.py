"""The whole-tensor optimizer's layout-free state, for ``dtypeplan.checkpoint``.

Each parameter keeps what its torch class keeps for it, which need not be laid out like the
parameter nor be the same for every parameter: Adafactor's ``row_var`` ``[rows, 1]`` and
``col_var`` ``[1, cols]`` of a matrix, a vector's ``variance``; DeepSpeed's Muon, Muon's
``momentum_buffer`` on the matrices and AdamW's ``step``, ``exp_avg`` and ``exp_avg_sq`` on the
other parameters. So :meth:`WholeTensorOptimizer.full_state` gives each state of its own shape
and every parameter's scalar states (``step``, the stochastic rounding count) as its own
(``scalar.param.{i}.{name}``: none per param group, since the parameters of one group need not
keep the same ones). :func:`kept_states` says what the class keeps for a parameter, so that a
checkpoint whose states it would not keep (another split of DeepSpeed's Muon) is refused
rather than misread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dtypeplan.optimizers.state import keys
from dtypeplan.optimizers.state.values import is_scalar_state, placed_scalar

__all__ = ["kept_states", "restored_slot", "split_payload"]


def split_payload(
    index: int, payload: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Parameter ``index``'s master and states (its owner's) as ``full_state`` entries: the
    tensors (``param.{i}.{name}``: the master and every state of one or more dimensions) and
    the scalar states (``scalar.param.{i}.{name}``)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for name, value in payload.items():
        if torch.is_tensor(value) and (value.dim() > 0 or name == keys.MASTER):
            tensors[keys.param_key(index, name)] = value
        elif is_scalar_state(value):
            scalars[keys.param_scalar_key(index, name)] = value
    return tensors, scalars


def restored_slot(
    index: int,
    master: torch.Tensor,
    state: Mapping[str, Any],
    group_scalars: Mapping[str, Any],
    stored_dtype: Any,
) -> dict[str, Any]:
    """The inner optimizer's slot of parameter ``index`` from a full state: its states (but the
    master and a compensation: the master's values include it) in ``stored_dtype(name)`` on the
    master's device, and its own scalar states, or its group's (``group_scalars``: a checkpoint
    that kept them per group) where it has states but no scalars of its own."""
    slot: dict[str, Any] = {}
    prefix = keys.param_key(index, "")
    for key, value in state.items():
        name = key[len(prefix) :]
        if key.startswith(prefix) and name not in (keys.MASTER, keys.KAHAN_COMPENSATION):
            slot[name] = torch.as_tensor(value).to(master.device, stored_dtype(name), copy=True)
    own = keys.param_scalars(state).get(index, {})
    scalars = own if own or not slot else group_scalars
    for name, value in (scalars or {}).items():
        slot[name] = placed_scalar(name, value, master, False)
    return slot


def kept_states(
    torch_class: type[torch.optim.Optimizer], group: Mapping[str, Any], param: torch.Tensor
) -> dict[str, list[int]] | None:
    """The states (of one or more dimensions) ``torch_class`` keeps for ``param`` with the
    param group's ``group`` hyperparameters, and their shapes; None where that cannot be told.

    Read from one step of a private instance on a zero stand-in of the parameter's rank whose
    dimension ``k`` has ``k + 2`` elements, each state dimension mapped back to the
    parameter's (a size-1 dimension stays 1): the answer without the parameter's cost.
    """
    shape = list(param.shape)
    standin = torch.zeros([k + 2 for k in range(len(shape))])
    if hasattr(param, "use_muon"):  # DeepSpeed's Muon: which side steps it
        standin.use_muon = param.use_muon  # type: ignore[attr-defined]
    standin.grad = torch.zeros_like(standin)
    stepper = torch_class([torch.zeros(1, 1)])  # type: ignore[call-arg]
    stepper.param_groups[0] = {**group, "params": [standin]}
    try:
        with torch.no_grad():
            stepper.step()
    except (RuntimeError, ValueError):
        return None  # a class that takes no parameter of this rank: nothing to check against
    out: dict[str, list[int]] = {}
    for name, value in stepper.state[standin].items():
        if not (torch.is_tensor(value) and value.dim() > 0):
            continue
        dims = []
        for size in value.shape:
            if size == 1:
                dims.append(1)
            elif 2 <= size < len(shape) + 2:
                dims.append(shape[size - 2])
            else:
                return None
        out[name] = dims
    return out
