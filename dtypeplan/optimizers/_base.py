"""The contract every registered optimizer implementation keeps.

A pipeline engine, a training loop and a checkpointer talk to any implementation through these
calls only, which is what lets every ZeRO stage run under a pipeline schedule (DeepSpeed's
``'DeepSpeedZeroOptimizer' object has no attribute 'clear_lp_grads'`` was one implementation
missing one of them).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["MixedPrecisionOptimizer"]


class MixedPrecisionOptimizer(torch.optim.Optimizer, abc.ABC):
    """Base class of every implementation that a rules file can name.

    Subclasses are built as ``cls(params, plan=plan, process_group=group)`` and must provide
    the abstract methods. ``param_groups`` holds the model's parameters and the
    hyperparameters (``lr``, ``weight_decay``, ...) so that LR schedulers work unchanged;
    implementations read them at every step.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        plan: PrecisionPlan,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(params, dict(plan.optimizer.params))
        self.plan = plan
        self.process_group = process_group
        self.skipped_steps = 0
        self.grad_norm: float | None = None

    @classmethod
    def prepare_model(
        cls,
        model: torch.nn.Module,
        *,
        plan: PrecisionPlan,
        process_group: dist.ProcessGroup | None = None,
    ) -> torch.nn.Module:
        """Make ``model`` ready for this implementation (ZeRO-3 shards it); default: as is."""
        return model

    # --- the training-loop calls -------------------------------------------------------------
    @property
    @abc.abstractmethod
    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless fp16)."""

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch: scale the loss (fp16), run backward, accumulate the gradients."""
        (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()

    @abc.abstractmethod
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce, check, clip, update the master weights and write them to the parameters."""

    @abc.abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the accumulator (and the parameters' own gradients) for the next step."""

    @abc.abstractmethod
    def clear_lp_grads(self) -> None:
        """Clear the parameters' own low-precision ``.grad`` (pipeline engines call this)."""

    # --- state --------------------------------------------------------------------------------
    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This rank's state, loadable by the same plan on the same world size."""

    @abc.abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""

    @abc.abstractmethod
    def full_state(self) -> dict[str, torch.Tensor | float | int]:
        """Layout-free state for resharding checkpoints.

        Keys: ``"param.{i}.{name}"`` with full-shape fp32 tensors for the master weights
        (``name`` = ``master``) and each optimizer state of global parameter ``i`` (numbered
        over all param groups in order), plus scalars under ``"scalar.{name}"``. Every rank
        returns the same dict; the call is collective.
        """

    @abc.abstractmethod
    def load_full_state(self, state: dict[str, torch.Tensor | float | int]) -> None:
        """Inverse of :meth:`full_state`; also writes the weights into the parameters."""

    def full_state_template(self) -> dict[str, torch.Tensor | float | int]:
        """Shapes and dtypes of :meth:`full_state`, without communication or copies."""
        return self.full_state()
