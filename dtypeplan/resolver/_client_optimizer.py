"""A client's optimizer as an optimizer config.

:class:`ClientOptimizerConfig` is an :class:`OptimizerConfig` whose class the program passed
(``plan.build(params, optimizer=torch.optim.X, ...)`` or ``plan.wrap(opt)``), so every reader
of ``plan.optimizer.torch_class`` builds it.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dtypeplan.errors import PrecisionConfigError
from dtypeplan.resolver._config import OptimizerConfig
from dtypeplan.resolver._frozen import freeze
from dtypeplan.resolver._optimizer_kind import FAST_PATH_ARGS, is_elementwise

__all__ = ["ClientOptimizerConfig", "client_optimizer_config"]


@dataclass(frozen=True, kw_only=True)
class ClientOptimizerConfig(OptimizerConfig):
    """The optimizer the program passed, in place of the config's ``optimizer`` block."""

    client_class: type[torch.optim.Optimizer]
    """The class itself (``type`` holds its name)."""

    @property
    def torch_class(self) -> type[torch.optim.Optimizer]:
        return self.client_class


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
    if is_elementwise(torch_class):
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
