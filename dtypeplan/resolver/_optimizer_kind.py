"""Which torch optimizers dtypeplan can run, and a client's optimizer as an optimizer config.

dtypeplan's optimizers hand the inner ``torch.optim`` instance flat fp32 buffers (a bucket's
chunk of many parameters, padding included), at every ZeRO stage, stage 0 too. That is exact
only for an *elementwise* update: one whose result for an element depends on that element's
weight, gradient and state alone (and on scalars every element shares, such as the step
count). :data:`ELEMENTWISE` lists the ``torch.optim`` classes that are, each checked against its
source: every state tensor is ``zeros_like(param)`` and every operation is pointwise.
Everything else is *shaped* (the ``optimizer`` dimension of the table): Adafactor factors its
second moment by rows and columns, Muon orthogonalizes matrices, LBFGS runs a line search over
the whole parameter vector with closures, SparseAdam needs sparse gradients; an unknown class
(a subclass included, since it may override the update) cannot be checked, so it is shaped too.

:class:`ClientOptimizerConfig` is an :class:`OptimizerConfig` whose class the program passed
(``plan.build(params, optimizer=torch.optim.X, ...)`` or ``plan.wrap(opt)``), so every reader
of ``plan.optimizer.torch_class`` builds it.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dtypeplan.errors import PrecisionConfigError
from dtypeplan.resolver._config import OptimizerConfig
from dtypeplan.resolver._frozen import FrozenDict, freeze

__all__ = [
    "ELEMENTWISE",
    "FAST_PATH_ARGS",
    "ClientOptimizerConfig",
    "client_optimizer_config",
    "optimizer_kind",
    "state_bytes_per_param",
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

FAST_PATH_ARGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Arguments that choose an implementation of the same update; dtypeplan sets them itself
(``differentiable=True`` would differentiate through the step, which is refused)."""


def optimizer_kind(torch_class: type) -> str:
    """``"elementwise"`` for the classes of :data:`ELEMENTWISE`, else ``"shaped"``."""
    return "elementwise" if torch_class in ELEMENTWISE else "shaped"


def state_bytes_per_param(torch_class: type, hyperparameters: Mapping[str, Any]) -> int:
    """fp32 optimizer-state bytes per parameter of an elementwise class."""
    return ELEMENTWISE[torch_class](hyperparameters)


@dataclass(frozen=True, kw_only=True)
class ClientOptimizerConfig(OptimizerConfig):
    """The optimizer the program passed, in place of the config's ``optimizer`` block."""

    client_class: type[torch.optim.Optimizer]
    """The class itself (``type`` holds its name)."""

    @property
    def torch_class(self) -> type[torch.optim.Optimizer]:
        return self.client_class

    @property
    def state_bytes_per_param(self) -> int:
        if self.client_class not in ELEMENTWISE:
            raise ValueError(f"{self.type} is not elementwise: its state bytes are not known")
        return state_bytes_per_param(self.client_class, self.params)


def client_optimizer_config(
    torch_class: type, hyperparameters: Mapping[str, Any]
) -> ClientOptimizerConfig:
    """Check a client's optimizer class and hyperparameters; raise
    :class:`PrecisionConfigError` for arguments the class does not take or rejects.

    A shaped class is kept as given (the table answers NotSupported for it); for an elementwise
    one the fast-path arguments are dropped and the rest are checked by building the class on
    one tensor, as the config's optimizer block is.
    """
    if not (isinstance(torch_class, type) and issubclass(torch_class, torch.optim.Optimizer)):
        raise PrecisionConfigError(
            f"optimizer must be a torch.optim.Optimizer class, got {torch_class!r}"
        )
    hyper = dict(hyperparameters)
    if hyper.get("differentiable"):
        raise PrecisionConfigError(
            f"{torch_class.__name__}(differentiable=True) differentiates through the update; "
            "dtypeplan's optimizers update master weights outside autograd. Leave it False."
        )
    if torch_class in ELEMENTWISE:
        hyper = {k: v for k, v in hyper.items() if k not in FAST_PATH_ARGS}
        accepted = [
            name
            for name in inspect.signature(torch_class.__init__).parameters
            if name not in ("self", "params", *FAST_PATH_ARGS)
        ]
        for key in hyper:
            if key not in accepted:
                close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(accepted)}"
                raise PrecisionConfigError(
                    f"unknown {torch_class.__name__} argument {key!r}: {hint}"
                )
        try:
            torch_class([torch.zeros(1, requires_grad=True)], **hyper)
        except Exception as exc:  # torch raises several types for bad hyperparameters
            raise PrecisionConfigError(
                f"invalid {torch_class.__name__} hyperparameters {hyper}: {exc}"
            ) from exc
    return ClientOptimizerConfig(
        type=torch_class.__name__, params=freeze(hyper), client_class=torch_class
    )
