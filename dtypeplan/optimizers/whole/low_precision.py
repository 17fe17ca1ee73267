"""bf16 masters and bf16 states of whole parameters: torch's fp32 step on upcast copies.

Where the plan keeps the masters in bf16 (``master_weights``: rounded to nearest, stochastically
or with a Kahan compensation) or the optimizer states in bf16 (``optimizer_states``), each whole
parameter's step runs as :class:`WholeLowPrecisionStep` says: the master loaded into fp32 (with
its compensation, under Kahan), every tensor state of more than one element upcast (Muon's
``momentum_buffer``; Adafactor's ``row_var``, ``col_var`` and ``variance``; AdamW's moments
under DeepSpeed's Muon), one step of a private instance of the torch class with the param
group's settings, then the master rounded back and the states stored in their dtypes again:
the signed ones (``momentum_buffer``, ``exp_avg``) as ``exp_avg_dtype`` says, the others (second
moments, row and column statistics, all non-negative) as ``exp_avg_sq_dtype``. Scalar states
(``step``) stay torch's.

Stochastic rounding hashes (seed, the parameter's number, its own rounding count, element)
(``kernels/rounding.py``); the count is a scalar state (``keys.ROUNDING_STEP``) saved with the
rest, so a resumed run draws the uninterrupted run's bits.
"""

from __future__ import annotations

from typing import Any

import torch

from dtypeplan.optimizers.kernels.rounding import (
    kahan_load,
    kahan_store,
    round_stochastic_hashed,
    step_noise_key,
)
from dtypeplan.optimizers.state import keys

__all__ = ["SIGNED", "WholeLowPrecisionStep"]

SIGNED = frozenset({"momentum_buffer", "exp_avg"})
"""The per-parameter states of the whole-tensor classes that can be negative."""

SEED = 0x3A1E
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class WholeLowPrecisionStep:
    """One whole parameter's step with 16-bit masters or states, in fp32."""

    def __init__(
        self,
        torch_class: type[torch.optim.Optimizer],
        *,
        rounding: str,
        exp_avg_dtype: str,
        exp_avg_sq_dtype: str,
    ) -> None:
        self.torch_class = torch_class
        self.rounding = rounding
        self.signed_dtype = _DTYPES[exp_avg_dtype]
        self.other_dtype = _DTYPES[exp_avg_sq_dtype]
        self._stepper: torch.optim.Optimizer | None = None

    def stored_dtype(self, name: str) -> torch.dtype:
        return self.signed_dtype if name in SIGNED else self.other_dtype

    @torch.no_grad()
    def step(
        self,
        group: dict[str, Any],
        master: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        number: int,
    ) -> dict[str, Any]:
        """Update ``master`` in place from fp32 ``grad``; returns its new state."""
        compensation = state.get(keys.KAHAN_COMPENSATION)
        weights = torch.empty_like(master, dtype=torch.float32)
        if compensation is not None:
            kahan_load(master, compensation, weights)
        else:
            weights.copy_(master)
        if hasattr(master, "use_muon"):
            weights.use_muon = master.use_muon  # type: ignore[attr-defined]
        weights.grad = grad
        rounding_step = state.get(keys.ROUNDING_STEP)
        fp32 = {
            name: value.float() if _per_element(value) else value
            for name, value in state.items()
            if name not in (keys.KAHAN_COMPENSATION, keys.ROUNDING_STEP)
        }
        after = self._step_fp32(group, weights, fp32)
        stored = {
            name: value.to(self.stored_dtype(name)) if _per_element(value) else value
            for name, value in after.items()
        }
        if master.dtype == torch.float32:
            master.copy_(weights)
        elif self.rounding == "kahan":
            if compensation is None:
                compensation = torch.zeros_like(master)
            kahan_store(weights, master, compensation)
            stored[keys.KAHAN_COMPENSATION] = compensation
        elif self.rounding == "stochastic":
            if rounding_step is None:
                rounding_step = torch.zeros((), dtype=torch.int64)
            rounding_step += 1
            key = step_noise_key(SEED, number, rounding_step)
            offset = torch.zeros((), dtype=torch.int64)
            flat = weights.contiguous().view(-1)
            master.copy_(round_stochastic_hashed(flat, key, offset).view_as(master))
            stored[keys.ROUNDING_STEP] = rounding_step
        else:
            master.copy_(weights)
        return stored

    def _step_fp32(
        self, group: dict[str, Any], weights: torch.Tensor, state: dict[str, Any]
    ) -> dict[str, Any]:
        stepper = self._stepper
        if stepper is None:
            stepper = self.torch_class([torch.zeros(1, 1)])  # type: ignore[call-arg]
            self._stepper = stepper
        template = stepper.param_groups[0]
        stepper.param_groups[0] = {**group, "params": [weights]}
        stepper.state.clear()
        if state:
            stepper.state[weights] = state
        try:
            stepper.step()
            return dict(stepper.state[weights])
        finally:
            stepper.state.clear()
            stepper.param_groups[0] = template


def _per_element(value: Any) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.is_floating_point()
