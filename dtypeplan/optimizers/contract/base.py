"""The contract every registered optimizer implementation keeps.

A pipeline engine, a training loop and a checkpointer talk to any implementation through these
calls only, which is what lets every ZeRO stage run under a pipeline schedule (DeepSpeed's
``'DeepSpeedZeroOptimizer' object has no attribute 'clear_lp_grads'`` was one implementation
missing one of them). The state half of the contract (``state_dict``, the scalar states) is
``contract/optimizer_state.py``'s, the checking of the given param groups
``contract/param_groups.py``'s, and the tensors held for ``plan.memory()`` ``state/held.py``'s.
"""

from __future__ import annotations

import abc
import inspect
import math
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from dtypeplan.comm import Communicator
from dtypeplan.errors import NotSupportedError, OptimizerUsageError
from dtypeplan.optimizers.contract.hyperparameters import HyperparameterCheck
from dtypeplan.optimizers.contract.model import (
    cast_forward_inputs,
    cast_model,
    give_parameters_own_storage,
    restore_cast_values,
)
from dtypeplan.optimizers.contract.optimizer_state import OptimizerState
from dtypeplan.optimizers.contract.param_groups import (
    IMPLEMENTATION_SWITCHES,
    checked_param_groups,
    refuse_sharded_parameters,
)
from dtypeplan.optimizers.grads.factor import NormProbe, device_gradient_factor
from dtypeplan.optimizers.grads.loss_scaler import LossScaler
from dtypeplan.optimizers.grads.ownership import HookSet, claim, release, user_stacklevel
from dtypeplan.optimizers.grads.pipeline import (
    PipelineLink,
    backward_passes_per_step,
    stage_local_refusal,
    unannounced_pipeline,
)
from dtypeplan.optimizers.kernels.torch_adam import unit_factor
from dtypeplan.optimizers.state.held import HeldTensors

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = [
    "HeldTensors",
    "bare_backward_refusal",
    "constructor_arguments",
    "hyperparameter_defaults",
    "MixedPrecisionOptimizer",
    "inner_optimizer",
    "make_replicas_equal",
    "WrapPolicy",
]

WrapPolicy = Callable[[nn.Module], bool] | Iterable[type[nn.Module]]
"""A callable ``module -> bool``, or the module classes whose instances become units
(``prepare_model``'s ``wrap``, used at ZeRO-3)."""


def hyperparameter_defaults(plan: PrecisionPlan) -> dict[str, Any]:
    """The param groups' defaults: every hyperparameter of the torch class with the config's
    values over the class's own defaults, so that ``param_groups`` hold ``betas``, ``eps``,
    ``momentum``... as in torch (``OneCycleLR(cycle_momentum=True)`` and code that reads or
    sets them rely on it). A signature default of None that the constructor resolves
    (``MuonWithAuxAdamW``'s ``lr``, ``muon_lr``, ``adam_lr``) is the value it resolves to, as
    the class's own ``defaults`` hold it: the groups are copied into the inner optimizer at
    every step, and a None there would reach the update."""
    torch_class = plan.optimizer.torch_class
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(torch_class.__init__).parameters.items()
        if name not in ("self", "params")
        and name not in IMPLEMENTATION_SWITCHES
        and parameter.default is not inspect.Parameter.empty
        and parameter.kind is not inspect.Parameter.VAR_KEYWORD
    }
    defaults.update(plan.optimizer.params)
    unresolved = [name for name, value in defaults.items() if value is None]
    if unresolved:
        try:
            probe = torch_class(
                [torch.zeros(2, 2, requires_grad=True)], **constructor_arguments(plan)
            )
        except Exception:  # noqa: BLE001 - a class that takes no matrix: its Nones stay
            return defaults
        for name in unresolved:
            defaults[name] = probe.defaults.get(name)
    return defaults


def bare_backward_refusal(plan: PrecisionPlan) -> str | None:
    """Why a ``loss.backward()`` that ``opt.backward`` did not begin is refused, or None where
    it is fine: under fp16 loss scaling the step divides the gradients by the loss scale, so
    an unscaled backward would make them that many times too small, without an error. A
    pipeline schedule runs backward itself and multiplies the loss by ``opt.loss_scale``."""
    if plan.loss_scaling is None or plan.pipeline_parallel:
        return None
    return (
        "loss.backward() ran outside opt.backward(loss) under fp16 loss scaling (fp16 "
        "parameters or fp16 torch_autocast): step() divides the gradients by opt.loss_scale, "
        "so gradients of an unscaled loss would come out that many times too small. Call "
        "opt.backward(loss), which scales the loss first; a pipeline schedule that runs "
        "backward itself needs dtypeplan.resolve(..., pipeline_parallel=True) and a loss "
        "multiplied by opt.loss_scale (README: Pipeline parallelism)"
    )


def inner_optimizer(
    plan: PrecisionPlan, groups: list[dict[str, Any]], *, fused: bool
) -> torch.optim.Optimizer:
    """``plan``'s torch class over ``groups``, built with torch's constructor arguments, fused
    where asked and the class has a fused path (Adam, AdamW, SGD, Adagrad); the other
    elementwise classes run their default path.

    The constructor arguments matter beyond the groups' defaults: a class may create state in
    ``__init__`` from them (Adagrad fills ``state["sum"]`` with its constructor's
    ``initial_accumulator_value``, for every param group alike). Of the elementwise classes
    only Adagrad does; the others create their state at a parameter's first gradient.
    Made like a 16-bit master, that state would hold the argument rounded (0.1 as
    0.10009765625 in bf16) whatever dtype the plan stores it in: it is made in fp32, as torch
    holds it for an fp32 parameter (the optimizer stores it in its state dtype afterwards).
    """
    torch_class = plan.optimizer.torch_class
    arguments = constructor_arguments(plan)
    if fused and "fused" in inspect.signature(torch_class.__init__).parameters:
        arguments["fused"] = True
    optimizer = torch_class(groups, **arguments)
    _constructor_states_in_fp32(optimizer, torch_class, arguments)
    return optimizer


@torch.no_grad()
def _constructor_states_in_fp32(
    optimizer: torch.optim.Optimizer,
    torch_class: type[torch.optim.Optimizer],
    arguments: dict[str, Any],
) -> None:
    """Remake the per-element states that ``optimizer``'s constructor made for 16-bit masters
    as the same constructor makes them for an fp32 stand-in of each (one master at a time)."""
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for master in group["params"]:
            slot = optimizer.state.get(master)
            if not slot or master.dtype == torch.float32:
                continue
            stand_in = torch.empty_like(master, dtype=torch.float32)
            made = torch_class([{**hyper, "params": [stand_in]}], **arguments).state[stand_in]
            for name, value in made.items():
                held = slot.get(name)
                if (
                    torch.is_tensor(held)
                    and held.shape == master.shape
                    and held.dtype != value.dtype
                ):
                    slot[name] = value


def constructor_arguments(plan: PrecisionPlan) -> dict[str, Any]:
    """The arguments ``plan``'s torch class is constructed with (the config's or the program's
    hyperparameters), without the implementation switches that dtypeplan chooses."""
    accepted = inspect.signature(plan.optimizer.torch_class.__init__).parameters
    return {
        name: value
        for name, value in plan.optimizer.params.items()
        if name in accepted and name not in IMPLEMENTATION_SWITCHES
    }


@torch.no_grad()
def make_replicas_equal(comm: Communicator, params: Iterable[torch.Tensor]) -> None:
    """Overwrite ``params`` on every rank with the group's first rank's (as DDP does)."""
    for param in params:
        data = param.data
        if data.is_contiguous():
            comm.broadcast_from_first_([data])
        else:
            staged = data.contiguous()
            comm.broadcast_from_first_([staged])
            data.copy_(staged)


class MixedPrecisionOptimizer(OptimizerState):
    """Base class of every implementation that a rules file can name.

    Subclasses are built as ``cls(params, plan=plan, process_group=group)`` and must provide
    the abstract members: :attr:`inner`, the training-loop calls (:meth:`step`,
    :meth:`zero_grad`, :meth:`clear_lp_grads`, and :meth:`_prepare_grad_norm` behind
    :meth:`clip_grad_norm_`), the per-parameter state behind :meth:`state_dict`
    (:meth:`_param_state`, :meth:`_load_param_state`, :meth:`_layout_facts`,
    :meth:`state_names`), the layout-free state (:meth:`full_state`,
    :meth:`load_full_state`) and :meth:`held_tensors`. ``param_groups`` holds the model's
    parameters and the hyperparameters (``lr``, ``weight_decay``, ...) so that LR schedulers
    work unchanged; implementations read them at every step.

    What the base class owns for every implementation, as ``torch.optim`` users expect: refusing
    a parameter listed twice and ``add_param_group`` after build; the hooks' lifetime
    (:attr:`hooks`, :meth:`close`, replacing the previous owner of the parameters:
    ``grads/ownership.py``); the rank check and the first rank's weights on every rank;
    :attr:`last_step_skipped`; :meth:`clip_grad_norm_`; and ``torch.optim``'s state dict layout
    (``contract/optimizer_state.py``). A subclass registers its gradient hooks in :attr:`hooks`
    (holding itself weakly), calls :meth:`_take_ownership` at the end of its ``__init__`` and
    ``_check_open("step()")`` first in :meth:`step`.
    """

    takes_sharded_parameters = False
    """Whether the class is built on parameters FSDP2 sharded (DTensors); the others refuse
    them (``contract/param_groups.py``)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        plan: PrecisionPlan,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        groups = checked_param_groups(params, plan)
        super().__init__(groups, hyperparameter_defaults(plan))
        if not self.takes_sharded_parameters:
            refuse_sharded_parameters(self.param_groups, plan, type(self).__name__)
        # Masters start from the values plan.prepare_model cast down, not from their 16 bits.
        restore_cast_values(p for g in self.param_groups for p in g["params"])
        self.plan = plan
        self.process_group = process_group
        self.skipped_steps = 0
        self.last_step_skipped = False
        """Whether the last ``step()`` skipped the update (fp16 overflow, or a non-finite
        gradient with ``check_nonfinite``). A scheduler should not step then."""
        self._grad_norm: float | None = None
        self._pending_norm: torch.Tensor | None = None
        """The last step's norm while still on the device (read by :attr:`grad_norm`)."""
        self.hyperparameter_check = HyperparameterCheck(self.param_groups, (), 1, 0)
        """The per-step check that the hyperparameters agree across ranks (made for the group
        by :meth:`_check_ranks_agree`; inactive on one rank)."""
        self.norm_probe = NormProbe(lambda: self._warn_nonfinite_once(self.step_count() + 1))
        self._warned_nonfinite = False
        self.clip = plan.gradient_clipping
        self._clip_coef = 1.0
        """The product of the coefficients of this step's ``clip_grad_norm_`` calls (1: none)."""
        self.check_nonfinite = plan.check_nonfinite
        distributed = dist.is_available() and dist.is_initialized()
        ranks = dist.get_world_size(process_group) if distributed else 1
        self.accumulation = backward_passes_per_step(
            plan,
            plan.accumulation_steps(ranks),
            [p for g in self.param_groups for p in g["params"]],
        )
        """Backward passes per step where known (``gradient_accumulation_steps``, or DeepSpeed's
        batch arithmetic on this group's ranks; under a pipeline times this rank's stage
        modules): the flat engine counts backward passes and treats the last one as the
        boundary."""
        mismatch = plan.batch_size_mismatch(ranks)
        if mismatch is not None:
            warnings.warn(mismatch, UserWarning, stacklevel=user_stacklevel())
        self.scaler = LossScaler(plan.loss_scaling)
        self.pipeline: PipelineLink | None = None
        """The other pipeline stages (``build(pipeline_group=...)``): the step's squared norm
        is summed over them too (``grads/pipeline.py``). None: this optimizer's group holds the
        whole model."""
        self._looked_for_stages = False
        """Whether the first step looked for a pipeline stage of a plan without one."""
        self.hooks = HookSet()
        """The optimizer's gradient hooks; removed by :meth:`close` or when it is collected."""
        self.hooks.finalize_with(self)
        self.closed = False
        self._built = True

    def _take_ownership(self) -> None:
        """Become the owner of the trainable parameters; call at the end of a subclass's init.

        A live optimizer that owned any of them is closed (replaced), with a warning.
        """
        claim(self, self.trainable_parameters())

    def close(self) -> None:
        """Remove the optimizer's hooks from the parameters; later steps raise. Idempotent.

        Also done when the optimizer is collected, and when a new optimizer is built on the
        same parameters (which replaces this one).
        """
        if self.closed:
            return
        self.closed = True
        self.hooks.remove()
        release(self, self.trainable_parameters())

    def _check_open(self, call: str) -> None:
        if self.closed:
            raise OptimizerUsageError(
                f"{call} on a closed optimizer: close() was called, or a newer optimizer was "
                "built on the same parameters and replaced it (it now receives the gradients); "
                "use that optimizer, or build a new one"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the flat buffers and shards are laid out once, at build."""
        if getattr(self, "_built", False):
            raise OptimizerUsageError(
                "add_param_group after build is not supported: the parameters' flat buffers, "
                "shards and hooks are laid out when the optimizer is built; build a new "
                "optimizer with every param group (plan.build([group_1, group_2, ...]))"
            )
        super().add_param_group(param_group)

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
        weights (see ``contract/model.py``); cast its forward's floating-point inputs to that dtype;
        and make its ``state_dict()`` give each parameter as its own tensor, though ``build``
        makes them views into one buffer (``contract/model.py``). ZeRO-3 also shards it;
        ``wrap`` chooses its FSDP2 units and means nothing to an implementation that does not
        shard the model.
        """
        cast_forward_inputs(model, plan.param_dtype)
        # build makes the parameters views into one buffer; savers must still see one each.
        give_parameters_own_storage(model)
        return cast_model(model, plan.param_dtype)

    @abc.abstractmethod
    def held_tensors(self) -> HeldTensors:
        """The tensors this rank holds right now, by component (see :class:`HeldTensors`)."""

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
        self._check_open("backward()")
        (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()

    @abc.abstractmethod
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce, check, clip, update the master weights and write them to the parameters.

        The gradients after it, at every stage and on every update path: what torch would
        keep, or refused. ZeRO-3 keeps them as ``torch.optim`` keeps ``.grad`` (the next
        backward adds to them, a ``step()`` without backward applies them again): the sum
        since ``zero_grad`` times the step's clip coefficient (``clip_grad_norm_`` and
        ``gradient_clipping`` clip them as torch's ``clip_grad_norm_`` clips ``.grad`` in
        place; unclipped, the step leaves them untouched), under fp16 in the units of the loss
        scale after the step. ZeRO 0-2 use them up: a backward, ``step()`` or
        ``clip_grad_norm_`` after a step without ``zero_grad()`` raises. A skipped step (fp16
        overflow, ``check_nonfinite``) applies nothing and keeps them (rescaled under fp16).
        """

    @abc.abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the accumulator (and the parameters' own gradients) for the next step."""

    @abc.abstractmethod
    def clear_lp_grads(self) -> None:
        """Clear the parameters' own low-precision ``.grad`` (pipeline engines call this)."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip this step's gradients to ``max_norm``; returns their global norm before this clip.

        As ``FullyShardedDataParallel.clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_``
        cannot see gradients the optimizer has already taken from ``.grad`` into its
        accumulator, so call this one between the last backward and ``step()``. It reduces the
        gradients now (collective: call it on every rank), returns the norm of the mean
        gradient over ranks (unscaled), and the clipping applies in the coming ``step()``.
        Successive calls combine as torch's successive clips do: each sees the gradients as
        the calls before it clipped them (it returns that norm) and multiplies them by
        ``min(1, max_norm / (norm + 1e-6))``; ``gradient_clipping`` then clips the result in the
        step, as DeepSpeed's clipping inside its step. Only the 2-norm.
        """
        self._check_open("clip_grad_norm_()")
        self._refuse_stage_local("clip_grad_norm_()")
        if float(norm_type) != 2.0:
            raise OptimizerUsageError(
                f"clip_grad_norm_(norm_type={norm_type}): only the 2-norm is supported (the "
                "optimizer folds it into the step's one all-reduce); use norm_type=2.0"
            )
        if max_norm <= 0:
            raise OptimizerUsageError(f"clip_grad_norm_(max_norm={max_norm}): must be > 0")
        # The norm of the gradients as the earlier calls of this step left them.
        norm = self._prepare_grad_norm() * self._clip_coef
        if math.isfinite(norm):
            self._clip_coef *= min(1.0, float(max_norm) / (norm + 1e-6))
        return torch.tensor(norm, dtype=torch.float32)

    @abc.abstractmethod
    def _prepare_grad_norm(self) -> float:
        """Reduce this step's gradients now and return their global (unscaled) norm."""

    # --- shared by the implementations ------------------------------------------------------
    def _check_ranks_agree(self, comm: Communicator) -> None:
        """Fail on every rank, naming what differs, if ranks got other plans or parameters.

        Compared: what the flat buffers and collectives will hold. Per param group, every
        parameter's shape, dtype and whether it trains (one rank freezing a parameter the
        others train would pair collectives of other sizes), and the hyperparameters (a
        per-rank ``lr`` would train the replicas apart). The hyperparameters are checked again
        at every step, inside the step's summary all-reduce (:attr:`hyperparameter_check`).
        """
        self.hyperparameter_check = HyperparameterCheck(
            self.param_groups, list(self.defaults), comm.world_size, comm.rank
        )
        comm.check_consistent(
            {
                "plan": self.plan.rank_facts(),
                "implementation": type(self).__name__,
                "param_shapes": [
                    [[list(p.shape), str(p.dtype), p.requires_grad] for p in g["params"]]
                    for g in self.param_groups
                ],
                "hyperparameters": [
                    {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
                ],
            }
        )

    def _make_replicas_equal(self, comm: Communicator) -> None:
        """As DDP at construction: every rank takes the group's first rank's parameters.

        Every parameter of the param groups, frozen ones too, before the master weights are
        taken from them; so the replicas are equal by construction whatever each rank's init.
        """
        make_replicas_equal(comm, [p for g in self.param_groups for p in g["params"]])

    def _refuse_stage_local(self, call: str) -> None:
        """Refuse ``call`` where it would decide from this pipeline stage's gradients alone."""
        if self.pipeline is None:
            reason = stage_local_refusal(self.plan, self.process_group, call)
            if reason is not None:
                raise NotSupportedError(reason)
            params = [p for g in self.param_groups for p in g["params"]]
            unannounced = unannounced_pipeline(self.plan, self.process_group, params, call)
            if unannounced is not None:
                raise OptimizerUsageError(unannounced)

    def _across_pipeline(self, sq_norm: torch.Tensor, divisor: float) -> torch.Tensor:
        """The step's squared norm over the whole model: summed over the other pipeline
        stages where there are any (``sq_norm`` and the result scaled by ``divisor``).

        Without them, the first step looks once for a pipeline stage built after the
        optimizer (``grads/pipeline.py``): every rank raises there alike."""
        if self.pipeline is None:
            if not self._looked_for_stages:
                self._looked_for_stages = True
                self._refuse_stage_local("step()")
            return sq_norm
        return self.pipeline.whole_model_sq_norm(sq_norm, divisor)

    @property
    def grad_norm(self) -> float | None:
        """The last step's global gradient norm (NaN if not finite); read, it syncs once."""
        if self._pending_norm is not None:
            self._grad_norm = float(self._pending_norm)
            self._pending_norm = None
        return self._grad_norm

    @grad_norm.setter
    def grad_norm(self, value: float | None) -> None:
        self._grad_norm = value
        self._pending_norm = None

    def _check_and_clip(
        self, sq_norm: torch.Tensor, divisor: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The factor that unscales, averages and clips the gradients, and its inverse.

        ``sq_norm``: the global squared norm of the gradients as summed (0-dim, on the
        device); ``divisor``: what they must still be divided by (see :meth:`_gradient_factor`).
        Returns 0-dim fp32 device tensors; None skips the step. Only a step that may be skipped
        (fp16, or the non-finite check on) brings the norm to the host: one sync per step.
        Otherwise the norm stays on the device, and a non-finite one is reported by
        :attr:`norm_probe` without waiting for it.
        """
        if self.check_nonfinite:
            host = self._gradient_factor(float(sq_norm), divisor)
            if host is None:
                return None
            if host == 1.0:
                return unit_factor(sq_norm.device)
            factor = torch.full((), host, dtype=torch.float32, device=sq_norm.device)
            return factor, factor.reciprocal()
        device = device_gradient_factor(sq_norm, divisor, self.clip, self._take_clip_coef())
        self.last_step_skipped = False
        self._pending_norm = device.norm
        self.norm_probe.post(device.norm)
        return device.factor, device.inverse

    def _gradient_factor(self, sq_norm: float, divisor: float) -> float | None:
        """Record the step's global norm and return what to multiply the gradients by.

        ``sq_norm`` is the global squared norm of the gradients as summed, ``divisor`` what
        they must still be divided by (loss scale, and world size where the reduction was a
        plain SUM). A non-finite norm means some rank overflowed: with the non-finite check on
        (always under fp16) the step is skipped, counted and the scale lowered, and None is
        returned. Otherwise the factor folds in the clipping of ``clip_grad_norm_`` and of
        ``gradient_clipping``.
        """
        finite = math.isfinite(sq_norm)
        norm = math.sqrt(sq_norm) / divisor if finite else math.inf
        self.grad_norm = norm if finite else float("nan")
        requested = self._take_clip_coef()
        if not finite and self.check_nonfinite:
            self.skipped_steps += 1
            self.last_step_skipped = True
            self.scaler.update(overflow=True)
            return None
        if not finite:
            self._warn_nonfinite_once(self.step_count() + 1)
        self.last_step_skipped = False
        # clip_grad_norm_'s calls first, then gradient_clipping on what they left.
        factor = requested / divisor
        clipped = norm * requested
        if self.clip > 0 and clipped > self.clip:
            factor *= self.clip / (clipped + 1e-6)
        return factor

    def _take_clip_coef(self) -> float:
        """The coefficient of this step's ``clip_grad_norm_`` calls (1: none); used up."""
        coef, self._clip_coef = self._clip_coef, 1.0
        return coef

    def _warn_nonfinite_once(self, step: int) -> None:
        """With the non-finite check off, say once that inf/NaN gradients are being applied.

        The norm it is called for is reduced over the group, so every rank warns alike.
        """
        if self._warned_nonfinite:
            return
        self._warned_nonfinite = True
        warnings.warn(
            f"the global gradient norm is not finite (step {step}): inf or NaN gradients on "
            "some rank are being applied, and the master weights will turn inf/NaN on every "
            'rank. Set "check_nonfinite": true in the config to skip (and count) such steps '
            "instead; this warning is given once",
            RuntimeWarning,
            stacklevel=4,
        )
