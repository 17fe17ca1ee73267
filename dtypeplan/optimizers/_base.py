"""The contract every registered optimizer implementation keeps.

A pipeline engine, a training loop and a checkpointer talk to any implementation through these
calls only, which is what lets every ZeRO stage run under a pipeline schedule (DeepSpeed's
``'DeepSpeedZeroOptimizer' object has no attribute 'clear_lp_grads'`` was one implementation
missing one of them).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dtypeplan.comm import Communicator
from dtypeplan.optimizers._loss_scaler import LossScaler

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
        self.clip = plan.gradient_clipping
        self.check_nonfinite = plan.check_nonfinite
        self.scaler = LossScaler(plan.loss_scaling)

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
    def loss_scale(self) -> float:
        """The current loss scale (1.0 unless fp16)."""
        return self.scaler.scale

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool = False) -> None:
        """One micro-batch: scale the loss (fp16), run backward, accumulate the gradients.

        ``last_micro_batch=True`` says that ``step()`` comes next: an implementation may then
        start the step's gradient reduction inside this backward, overlapping it with compute.
        """
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

    # --- shared by the implementations (they keep their update in ``self.inner``, a torch
    # optimizer over the master weights) --------------------------------------------------------
    def _check_ranks_agree(self, comm: Communicator) -> None:
        """Fail on every rank, naming what differs, if ranks got other plans or shapes."""
        comm.check_consistent(
            {
                "plan": self.plan.rank_facts(),
                "implementation": type(self).__name__,
                "param_shapes": [[list(p.shape) for p in g["params"]] for g in self.param_groups],
            }
        )

    def _gradient_factor(self, sq_norm: float, divisor: float) -> float | None:
        """Record the step's global norm and return what to multiply the gradients by.

        ``sq_norm`` is the global squared norm of the gradients as summed, ``divisor`` what
        they must still be divided by (loss scale, and world size where the reduction was a
        plain SUM). A non-finite norm means some rank overflowed: with the non-finite check on
        (always under fp16) the step is skipped, counted and the scale lowered, and None is
        returned. Otherwise the factor folds in clipping to ``gradient_clipping``.
        """
        finite = math.isfinite(sq_norm)
        norm = math.sqrt(sq_norm) / divisor if finite else math.inf
        self.grad_norm = norm if finite else float("nan")
        if not finite and self.check_nonfinite:
            self.skipped_steps += 1
            self.scaler.update(overflow=True)
            return None
        factor = 1.0 / divisor
        if self.clip > 0 and norm > self.clip:
            factor *= self.clip / (norm + 1e-6)
        return factor

    def _scalar_state(self) -> dict[str, float | int]:
        """The ``scalar.*`` entries of :meth:`full_state` (the scaler's only under fp16)."""
        scalars: dict[str, float | int] = {
            "scalar.loss_scale": float(self.scaler.scale),
            "scalar.skipped_steps": int(self.skipped_steps),
        }
        if self.scaler.enabled:
            for key, value in self.scaler.state_dict().items():
                scalars[f"scalar.scaler.{key}"] = value
        return scalars

    def _update_state(self) -> dict[str, Any]:
        """The part of :meth:`state_dict` every implementation shares (the inner optimizer's)."""
        return {
            "inner": self.inner.state_dict(),
            "hyperparameters": [
                {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
            "scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def _load_update_state(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict["inner"])
        for group, saved in zip(self.param_groups, state_dict["hyperparameters"], strict=True):
            group.update(saved)
        self.scaler.load_state_dict(state_dict["scaler"])
        self.skipped_steps = int(state_dict["skipped_steps"])

    def _load_scalar_state(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("scalar.skipped_steps", 0))
        prefix = "scalar.scaler."
        scaler = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if scaler and self.scaler.enabled:
            self.scaler.load_state_dict(scaler)

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
