"""Lion (Chen et al. 2023, arXiv 2302.06675) as a ``torch.optim.Optimizer``: DeepSpeed's
``"Lion"`` optimizer type, with DeepSpeed's names (``lr``, ``betas``, ``weight_decay``).

The update of an element reads that element's weight, gradient and momentum alone (the sign of
an interpolation of the momentum and the gradient), so Lion is elementwise: it gets every cell
the ``torch.optim`` elementwise classes have. Its one state, ``exp_avg``, is signed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """``p -= lr * (sign(beta1 * m + (1 - beta1) * g) + weight_decay * p)``, then
    ``m = beta2 * m + (1 - beta2) * g`` (DeepSpeed's FusedLion: decoupled weight decay
    applied as ``p *= 1 - lr * weight_decay`` first)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas) or len(betas) != 2:
            raise ValueError(f"invalid betas: {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(param)
                exp_avg = state["exp_avg"]
                grad = param.grad
                param.mul_(1.0 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1).sign_()
                param.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        return loss
