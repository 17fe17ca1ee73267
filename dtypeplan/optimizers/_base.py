"""The contract every registered optimizer implementation keeps.

A pipeline engine, a training loop and a checkpointer talk to any implementation through these
calls only, which is what lets every ZeRO stage run under a pipeline schedule (DeepSpeed's
``'DeepSpeedZeroOptimizer' object has no attribute 'clear_lp_grads'`` was one implementation
missing one of them).
"""

from __future__ import annotations

import abc
import inspect
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dtypeplan.comm import Communicator
from dtypeplan.optimizers import _state_keys as keys
from dtypeplan.optimizers._loss_scaler import LossScaler
from dtypeplan.optimizers._prepare import cast_model, restore_cast_values

if TYPE_CHECKING:
    from dtypeplan.optimizers._shard_units import WrapPolicy
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["HeldTensors", "MixedPrecisionOptimizer", "inner_optimizer", "is_adam"]


def is_adam(torch_class: type[torch.optim.Optimizer]) -> bool:
    """Whether the update is Adam or AdamW (a step counter beside its moments, the Triton path)."""
    return issubclass(torch_class, (torch.optim.Adam, torch.optim.AdamW))


def inner_optimizer(
    torch_class: type[torch.optim.Optimizer], groups: list[dict[str, Any]], *, fused: bool
) -> torch.optim.Optimizer:
    """``torch_class`` over ``groups``, fused where asked and the class has a fused path
    (Adam, AdamW, SGD, Adagrad); the other elementwise classes run their default path."""
    accepted = inspect.signature(torch_class.__init__).parameters
    return torch_class(groups, **({"fused": True} if fused and "fused" in accepted else {}))


@dataclass(frozen=True, kw_only=True)
class HeldTensors:
    """The tensors one rank holds for the optimizer, by the components of ``plan.memory()``.

    A read-only view for measuring memory: the tensors are the optimizer's own (not copies),
    so count them, never write them. Two components may share a storage (fp32 master weights
    are views of the parameters' flat buffer): count each storage once.
    """

    params: tuple[torch.Tensor, ...]
    """The storage of the parameters the optimizer updates (flat buffers, padding included)."""
    grads: tuple[torch.Tensor, ...]
    """The parameters' own ``.grad`` that exist right now."""
    accumulator: tuple[torch.Tensor, ...]
    """Where micro-batch gradients are summed, with the buffers of reductions under way."""
    master: tuple[torch.Tensor, ...]
    """The fp32 master weights this rank updates (empty where the parameters are the masters)."""
    optimizer_states: tuple[torch.Tensor, ...]
    """Every tensor of the inner ``torch.optim`` state (moments, step counters)."""

    def items(self) -> Iterator[tuple[str, tuple[torch.Tensor, ...]]]:
        """``(component, tensors)`` in the order of ``plan.memory()``'s keys."""
        for field in fields(self):
            yield field.name, getattr(self, field.name)

    def nbytes(self) -> dict[str, int]:
        """Bytes per component and ``total``, each storage counted once, whole.

        Whole storages include the flat buffers' bucket padding; a storage shared between
        components counts in the first one that holds it, in the order of :meth:`items`.
        """
        seen: set[int] = set()
        figures: dict[str, int] = {}
        for component, tensors in self.items():
            figures[component] = 0
            for tensor in tensors:
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                figures[component] += storage.nbytes()
        figures["total"] = sum(figures.values())
        return figures


class MixedPrecisionOptimizer(torch.optim.Optimizer, abc.ABC):
    """Base class of every implementation that a rules file can name.

    Subclasses are built as ``cls(params, plan=plan, process_group=group)`` and must provide
    the abstract members: :attr:`inner`, the training-loop calls (:meth:`step`,
    :meth:`zero_grad`, :meth:`clear_lp_grads`), the state calls (:meth:`state_dict`,
    :meth:`load_state_dict`, :meth:`full_state`, :meth:`load_full_state`) and
    :meth:`held_tensors`. ``param_groups`` holds the model's parameters and the
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
        # Masters start from the values plan.prepare_model cast down, not from their 16 bits.
        restore_cast_values(p for g in self.param_groups for p in g["params"])
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
        wrap: WrapPolicy | None = None,
    ) -> torch.nn.Module:
        """Make ``model`` ready for this implementation, in place; returns it.

        Default: cast it whole to ``plan.param_dtype`` (parameters, frozen ones too, and
        floating-point buffers), keeping the trainable parameters' wider values for the master
        weights (see ``_prepare.py``). ZeRO-3 also shards it; ``wrap`` chooses its FSDP2 units
        and means nothing to an implementation that does not shard the model.
        """
        return cast_model(model, plan.param_dtype)

    # --- what a subclass provides ------------------------------------------------------------
    @property
    @abc.abstractmethod
    def inner(self) -> torch.optim.Optimizer:
        """The ``torch.optim`` instance that runs the update on this rank's master weights.

        Its param groups mirror :attr:`param_groups` (same order, same hyperparameters), and
        its ``state`` holds the optimizer states under torch's names. :meth:`state_dict` and
        the shared helpers below read and write it.
        """

    @abc.abstractmethod
    def held_tensors(self) -> HeldTensors:
        """The tensors this rank holds right now, by component (see :class:`HeldTensors`)."""

    def trainable_parameters(self) -> list[torch.Tensor]:
        """The parameters the optimizer updates, in the numbering of the ``param.{i}`` keys."""
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

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

    # --- shared by the implementations ------------------------------------------------------
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
            keys.scalar_key(keys.STEP): self.step_count(),
            keys.scalar_key(keys.LOSS_SCALE): float(self.scaler.scale),
            keys.scalar_key(keys.SKIPPED_STEPS): int(self.skipped_steps),
        }
        if self.scaler.enabled:
            for field, value in self.scaler.state_dict().items():
                scalars[keys.scaler_key(field)] = value
        return scalars

    def step_count(self) -> int:
        """Steps the inner optimizer has counted (0 before the first step, or without a counter)."""
        for slot in self.inner.state.values():
            if "step" in slot:
                step = slot["step"]
                return int(step.item()) if torch.is_tensor(step) else int(step)
        return 0

    def reset_update_state(self, names: Iterable[str], step: int) -> None:
        """Drop every optimizer state; with ``names``, give each master zeroed states instead.

        The new states (``exp_avg``, ...; Adam also gets its step counter at ``step``, on the
        device its fused and capturable paths expect) are for a loader to fill in place, as
        :meth:`load_full_state` and a sharded checkpoint load do. Without ``names`` the
        optimizer starts as if it had never stepped.
        """
        names = list(names)
        self.inner.state.clear()
        if not names:
            return
        adam = is_adam(self.plan.optimizer.torch_class)
        for group in self.inner.param_groups:
            on_device = bool(group.get("fused") or group.get("capturable"))
            for master in group["params"]:
                slot = self.inner.state[master]
                for name in names:
                    slot[name] = torch.zeros_like(master)
                if adam:
                    device = master.device if on_device else torch.device("cpu")
                    slot["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)

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
        self.skipped_steps = int(state.get(keys.scalar_key(keys.SKIPPED_STEPS), 0))
        scaler = keys.scaler_state(state)
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

        Keys (built by ``_state_keys.py``): ``"param.{i}.{name}"`` with full-shape fp32
        tensors for the master weights (``name`` = ``master``) and each optimizer state of
        parameter ``i`` of :meth:`trainable_parameters`, plus scalars under
        ``"scalar.{name}"``. Every rank returns the same dict; the call is collective.
        """

    @abc.abstractmethod
    def load_full_state(self, state: dict[str, torch.Tensor | float | int]) -> None:
        """Inverse of :meth:`full_state`; also writes the weights into the parameters."""

    def full_state_template(self) -> dict[str, torch.Tensor | float | int]:
        """Shapes and dtypes of :meth:`full_state`, without communication or copies."""
        return self.full_state()
