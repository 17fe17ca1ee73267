"""DeepSpeed's ``"Muon"`` optimizer type as a ``torch.optim.Optimizer``: ``torch.optim.Muon`` on
the hidden matrices, ``torch.optim.AdamW`` on every other parameter.

DeepSpeed reads ``"type": "Muon"`` (any case) as its ``MuonWithAuxAdam``: ``deepspeed.initialize``
tags each parameter ``use_muon`` (``set_optimizer_flags``: 2-D or more and no ``embed`` or
``lm_head`` in its name), and the engine puts the tagged ones in a Muon group (``lr`` or
``muon_lr``, ``momentum``, ``weight_decay``) and the rest in an Adam group (``lr`` or
``adam_lr``, ``betas``, ``eps``, ``weight_decay``; decoupled decay). Here the tag is the same,
set by :func:`tag_muon_parameters` (``plan.prepare_model`` calls it for this class), except that
only 2-D parameters take Muon (``torch.optim.Muon`` takes matrices only; DeepSpeed flattens
4-D convolution filters, which :func:`tag_muon_parameters` refuses unless tagged first): a
parameter without the tag takes Muon when it is 2-D. The updates
are torch's: Muon's Newton-Schulz in bf16 (DeepSpeed defaults to its fp16 "gram" variant and
scales by ``max(1, rows / cols) ** 0.5``, as torch's ``adjust_lr_fn=None`` does), AdamW's
bias-corrected moments.

Both classes keep their states in this optimizer's ``state`` under their own names (Muon's
``momentum_buffer``; AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``), and each param group serves
both: an LR scheduler's ``lr`` is Muon's, and AdamW's follows it in proportion
(``adam_lr * lr / muon_lr`` of the group as built).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dtypeplan.errors import NotSupportedError

__all__ = ["MuonWithAuxAdamW", "muon_by_name", "tag_muon_parameters", "takes_muon"]

_NOT_MUON = ("embed", "lm_head")


def tag_muon_parameters(model: torch.nn.Module, *, keep: bool = False) -> None:
    """Set ``use_muon`` on every parameter of ``model`` as DeepSpeed's ``set_optimizer_flags``
    does, matrices only: 2-D and no ``embed`` or ``lm_head`` in its name (any case).
    ``keep``: a parameter already tagged keeps its tag. A parameter beyond 2-D (a filter)
    that DeepSpeed would give Muon (flattened) is refused, untagged: here it would take AdamW,
    and train otherwise than under DeepSpeed without a word."""
    for name, param in model.named_parameters():
        if keep and hasattr(param, "use_muon"):
            continue
        if param.dim() > 2 and not _named_off(name):
            raise NotSupportedError(
                f"DeepSpeed's Muon gives {name} (shape {tuple(param.shape)}) Muon, flattened "
                "to a matrix; dtypeplan runs torch.optim.Muon, which takes 2-D parameters "
                f"only. Tag it first: model.get_parameter({name!r}).use_muon = False (AdamW, "
                "before plan.prepare_model), or give the layer 2-D weights"
            )
        param.use_muon = muon_by_name(name, param.dim())  # type: ignore[attr-defined]


def muon_by_name(name: str, dim: int) -> bool:
    """DeepSpeed's tag for the parameter ``name`` of ``dim`` dimensions: 2-D and no ``embed``
    or ``lm_head`` in its name (any case)."""
    return dim == 2 and not _named_off(name)


def _named_off(name: str) -> bool:
    """DeepSpeed keeps a parameter off Muon by name: ``embed`` or ``lm_head`` in it (any
    case)."""
    lowered = name.lower()
    return any(k in lowered for k in _NOT_MUON)


def takes_muon(param: torch.Tensor) -> bool:
    """Whether ``param`` takes Muon: its ``use_muon`` tag, else whether it is 2-D."""
    return bool(getattr(param, "use_muon", param.dim() == 2)) and param.dim() == 2


class MuonWithAuxAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the parameters that :func:`takes_muon`, ``torch.optim.AdamW`` on
    the others, with DeepSpeed's hyperparameter names and defaults (Muon: lr 0.02, momentum
    0.95, weight_decay 0; Adam: lr 3e-4, betas (0.9, 0.95), eps 1e-10, weight_decay 0;
    ``muon_lr`` and ``adam_lr`` override ``lr`` for one side; ``ns_method`` ``"standard"`` only:
    DeepSpeed's default ``"gram"`` is its own kernel)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | None = None,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-10,
        muon_lr: float | None = None,
        adam_lr: float | None = None,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_method: str = "standard",
    ) -> None:
        if ns_method != "standard":
            raise ValueError(
                f"ns_method={ns_method!r}: torch.optim.Muon runs the standard quintic "
                "Newton-Schulz iteration in bf16; DeepSpeed's 'gram' variant (fp16, on the Gram "
                "matrix) is not available here. Use ns_method 'standard' (or leave it out)"
            )
        muon = muon_lr if muon_lr is not None else lr if lr is not None else 0.02
        adam = adam_lr if adam_lr is not None else lr if lr is not None else 3e-4
        if muon < 0 or adam < 0:
            raise ValueError(f"invalid learning rate: Muon {muon}, Adam {adam}")
        defaults = {
            "lr": muon,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "betas": tuple(betas),
            "eps": eps,
            "muon_lr": muon,
            "adam_lr": adam,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
        }
        super().__init__(params, defaults)
        self._muon = torch.optim.Muon([torch.zeros(1, 1)])
        self._adamw = torch.optim.AdamW([torch.zeros(1)])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A group's ``muon_lr`` and ``adam_lr`` given as None (a wrapper that copies every
        constructor argument into its groups, torch's signature defaults included) follow the
        group's ``lr`` as the constructor's do, so that each side steps with a number. A
        parameter tagged ``use_muon`` that is not 2-D is refused (it would take AdamW)."""
        lr = param_group.get("lr")
        for side in ("muon_lr", "adam_lr"):
            if side in param_group and param_group[side] is None:
                if lr is None:
                    del param_group[side]  # the optimizer's default
                else:
                    param_group[side] = lr
        super().add_param_group(param_group)
        for param in self.param_groups[-1]["params"]:
            if getattr(param, "use_muon", False) and param.dim() != 2:
                self.param_groups.pop()
                raise NotSupportedError(
                    f"a parameter of shape {tuple(param.shape)} is tagged use_muon, but "
                    "torch.optim.Muon takes 2-D parameters only: tag it use_muon = False "
                    "(AdamW) or give the layer 2-D weights"
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            scale = group["lr"] / group["muon_lr"] if group["muon_lr"] else 1.0
            muon = [p for p in group["params"] if takes_muon(p)]
            adam = [p for p in group["params"] if not takes_muon(p)]
            self._run(
                self._muon,
                muon,
                lr=group["lr"],
                momentum=group["momentum"],
                weight_decay=group["weight_decay"],
                nesterov=group["nesterov"],
                ns_steps=group["ns_steps"],
            )
            self._run(
                self._adamw,
                adam,
                lr=group["adam_lr"] * scale,
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )
        return loss

    def _run(
        self, stepper: torch.optim.Optimizer, params: list[torch.Tensor], **settings: Any
    ) -> None:
        """One step of ``stepper``'s class on ``params``, its states in this optimizer's."""
        if not params:
            return
        template = stepper.param_groups[0]
        stepper.param_groups[0] = {**template, **settings, "params": params}
        own_state = stepper.state
        stepper.state = self.state
        try:
            stepper.step()
        finally:
            stepper.state = own_state
            stepper.param_groups[0] = template
