"""The contract every registered optimizer implementation keeps.

A pipeline engine, a training loop and a checkpointer talk to any implementation through these
calls only, which is what lets every ZeRO stage run under a pipeline schedule (DeepSpeed's
``'DeepSpeedZeroOptimizer' object has no attribute 'clear_lp_grads'`` was one implementation
missing one of them).
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dtypeplan.comm import Communicator
from dtypeplan.errors import NotSupportedError, OptimizerUsageError
from dtypeplan.optimizers import _state_keys as keys
from dtypeplan.optimizers._clip import NormProbe, device_gradient_factor
from dtypeplan.optimizers._hyperparameter_check import HyperparameterCheck
from dtypeplan.optimizers._loss_scaler import LossScaler
from dtypeplan.optimizers._ownership import HookSet, claim, release, user_stacklevel
from dtypeplan.optimizers._model_state import give_parameters_own_storage
from dtypeplan.optimizers._prepare import cast_forward_inputs, cast_model, restore_cast_values
from dtypeplan.optimizers._state_values import (
    is_scalar_state,
    placed_scalar,
    same_scalars,
    scalar_dtype,
    scalars_key,
    stateful_scalars,
)

if TYPE_CHECKING:
    from dtypeplan.optimizers._low_precision_update import LowPrecisionAdamUpdate
    from dtypeplan.optimizers._shard_units import WrapPolicy
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = [
    "HeldTensors",
    "bare_backward_refusal",
    "constructor_arguments",
    "hyperparameter_defaults",
    "MixedPrecisionOptimizer",
    "inner_optimizer",
    "is_adam",
    "make_replicas_equal",
]


_IMPLEMENTATION_SWITCHES = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Arguments of torch optimizers that choose a code path, not the numbers: the inner optimizer's
own (dtypeplan picks its path), never the user-facing param groups'."""


def hyperparameter_defaults(plan: PrecisionPlan) -> dict[str, Any]:
    """The param groups' defaults: every hyperparameter of the torch class with the config's
    values over the class's own defaults, so that ``param_groups`` hold ``betas``, ``eps``,
    ``momentum``... as in torch (``OneCycleLR(cycle_momentum=True)`` and code that reads or
    sets them rely on it)."""
    torch_class = plan.optimizer.torch_class
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(torch_class.__init__).parameters.items()
        if name not in ("self", "params")
        and name not in _IMPLEMENTATION_SWITCHES
        and parameter.default is not inspect.Parameter.empty
        and parameter.kind is not inspect.Parameter.VAR_KEYWORD
    }
    defaults.update(plan.optimizer.params)
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


def is_adam(torch_class: type[torch.optim.Optimizer]) -> bool:
    """Whether the update is Adam or AdamW (a step counter beside its moments, the Triton path)."""
    return issubclass(torch_class, (torch.optim.Adam, torch.optim.AdamW))


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
    """
    torch_class = plan.optimizer.torch_class
    arguments = constructor_arguments(plan)
    if fused and "fused" in inspect.signature(torch_class.__init__).parameters:
        arguments["fused"] = True
    return torch_class(groups, **arguments)


def constructor_arguments(plan: PrecisionPlan) -> dict[str, Any]:
    """The arguments ``plan``'s torch class is constructed with (the config's or the program's
    hyperparameters), without the implementation switches that dtypeplan chooses."""
    accepted = inspect.signature(plan.optimizer.torch_class.__init__).parameters
    return {
        name: value
        for name, value in plan.optimizer.params.items()
        if name in accepted and name not in _IMPLEMENTATION_SWITCHES
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


HOST_COMPONENTS = ("master", "optimizer_states")
"""The components an optimizer offload keeps in host memory."""


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
    on_host: frozenset[str] = frozenset()
    """The components held in host memory rather than on the device (optimizer offload:
    ``master`` and ``optimizer_states``); counted under ``host_<component>`` by :meth:`nbytes`."""

    def items(self) -> Iterator[tuple[str, tuple[torch.Tensor, ...]]]:
        """``(component, tensors)`` in the order of ``plan.memory()``'s keys."""
        for field in fields(self):
            if field.name != "on_host":
                yield field.name, getattr(self, field.name)

    def nbytes(self) -> dict[str, int]:
        """Bytes per component and ``total``, each storage counted once, whole.

        Whole storages include the flat buffers' bucket padding; a storage shared between
        components counts in the first one that holds it, in the order of :meth:`items`. As
        ``plan.memory()``, the device components are ``total``, and those in :attr:`on_host`
        count under ``host_master``, ``host_optimizer_states`` and ``host_total`` (the device
        figure of such a component is 0).
        """
        seen: set[int] = set()
        figures: dict[str, int] = {}
        host = dict.fromkeys(HOST_COMPONENTS, 0)
        for component, tensors in self.items():
            figures[component] = 0
            for tensor in tensors:
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                if component in self.on_host:
                    host[component] += storage.nbytes()
                else:
                    figures[component] += storage.nbytes()
        figures["total"] = sum(figures.values())
        for component, nbytes in host.items():
            figures[f"host_{component}"] = nbytes
        figures["host_total"] = sum(host.values())
        return figures


class MixedPrecisionOptimizer(torch.optim.Optimizer, abc.ABC):
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

    What the base class owns for every implementation, as ``torch.optim`` users expect:
    refusing a parameter listed twice and ``add_param_group`` after build; the hooks' lifetime
    (:attr:`hooks`, :meth:`close`, replacing the previous owner of the parameters:
    ``_ownership.py``); the rank check and the first rank's weights on every rank;
    :attr:`last_step_skipped`; :meth:`clip_grad_norm_`; and ``torch.optim``'s state dict
    layout. A subclass registers its gradient hooks in :attr:`hooks` (holding itself weakly),
    calls :meth:`_take_ownership` at the end of its ``__init__`` and
    ``_check_open("step()")`` first in :meth:`step`.
    """

    STATE_FORMAT: str = "dtypeplan/1"
    """The ``format`` recorded in :meth:`state_dict`'s ``dtypeplan`` entry."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        plan: PrecisionPlan,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        groups = _param_group_dicts(params)
        _refuse_duplicates(groups)
        _refuse_non_real(groups)
        _refuse_inapplicable_switches(groups, plan)
        super().__init__(groups, hyperparameter_defaults(plan))
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
        self._clip_request: float | None = None
        self.check_nonfinite = plan.check_nonfinite
        distributed = dist.is_available() and dist.is_initialized()
        ranks = dist.get_world_size(process_group) if distributed else 1
        self.accumulation = plan.accumulation_steps(ranks)
        """Micro-batches per step where known (``gradient_accumulation_steps``, or DeepSpeed's
        batch arithmetic on this group's ranks): the flat engine counts backward passes and
        treats the last one as the boundary."""
        mismatch = plan.batch_size_mismatch(ranks)
        if mismatch is not None:
            warnings.warn(mismatch, UserWarning, stacklevel=user_stacklevel())
        self.scaler = LossScaler(plan.loss_scaling)
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
        weights (see ``_prepare.py``); cast its forward's floating-point inputs to that dtype;
        and make its ``state_dict()`` give each parameter as its own tensor, though ``build``
        makes them views into one buffer (``_model_state.py``). ZeRO-3 also shards it;
        ``wrap`` chooses its FSDP2 units and means nothing to an implementation that does not
        shard the model.
        """
        cast_forward_inputs(model, plan.param_dtype)
        # build makes the parameters views into one buffer; savers must still see one each.
        give_parameters_own_storage(model)
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
        self._check_open("backward()")
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

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip this step's gradients to ``max_norm``; returns their global norm before clipping.

        As ``FullyShardedDataParallel.clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_``
        cannot see gradients the optimizer has already taken from ``.grad`` into its
        accumulator, so call this one between the last backward and ``step()``. It reduces the
        gradients now (collective: call it on every rank), returns the norm of the mean
        gradient over ranks (unscaled), and the clipping applies in the coming ``step()``
        (together with ``gradient_clipping``: the smaller limit wins). Only the 2-norm.
        """
        self._check_open("clip_grad_norm_()")
        if float(norm_type) != 2.0:
            raise OptimizerUsageError(
                f"clip_grad_norm_(norm_type={norm_type}): only the 2-norm is supported (the "
                "optimizer folds it into the step's one all-reduce); use norm_type=2.0"
            )
        if max_norm <= 0:
            raise OptimizerUsageError(f"clip_grad_norm_(max_norm={max_norm}): must be > 0")
        norm = self._prepare_grad_norm()
        self._clip_request = float(max_norm)
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
            factor = torch.full((), host, dtype=torch.float32, device=sq_norm.device)
            return factor, factor.reciprocal()
        device = device_gradient_factor(sq_norm, divisor, self._effective_clip())
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
        returned. Otherwise the factor folds in clipping to ``gradient_clipping``.
        """
        finite = math.isfinite(sq_norm)
        norm = math.sqrt(sq_norm) / divisor if finite else math.inf
        self.grad_norm = norm if finite else float("nan")
        clip = self._effective_clip() or math.inf
        if not finite and self.check_nonfinite:
            self.skipped_steps += 1
            self.last_step_skipped = True
            self.scaler.update(overflow=True)
            return None
        if not finite:
            self._warn_nonfinite_once(self.step_count() + 1)
        self.last_step_skipped = False
        factor = 1.0 / divisor
        if norm > clip:
            factor *= clip / (norm + 1e-6)
        return factor

    def _effective_clip(self) -> float:
        """This step's clipping norm (0: none): ``gradient_clipping``, or a smaller one asked
        for by :meth:`clip_grad_norm_` since the last step (the request is used up)."""
        clip = min((c for c in (self.clip, self._clip_request or 0.0) if c > 0), default=0.0)
        self._clip_request = None
        return clip

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

    def master_values(self, master: torch.Tensor) -> torch.Tensor:
        """A master chunk or shard as the fp32 values a checkpoint stores (fp32 masters: as is)."""
        return master.float()

    def load_master_(
        self, master: torch.Tensor, values: torch.Tensor, compensation: torch.Tensor | None = None
    ) -> None:
        """Set a master chunk or shard from fp32 ``values`` (a checkpoint load);
        ``compensation``: the Kahan compensation ``values`` include, where saved."""
        master.copy_(values)

    @property
    def low_precision_update(self) -> LowPrecisionAdamUpdate | None:
        """The update that keeps 16-bit masters or low-precision moments (their Kahan
        compensations, quantized codes), or None where masters and states are fp32."""
        return None

    def fp32_states(self) -> contextlib.AbstractContextManager[None]:
        """A context in which every per-element optimizer state is a plain tensor laid out
        like its master, for code that reads or writes states per parameter (checkpoints).
        Optimizers that keep quantized states (int8 / fp8 moments) hold them as fp32 values
        while it lasts and store them back after; the others hold plain tensors anyway."""
        return contextlib.nullcontext()

    def _scalar_state(self) -> dict[str, Any]:
        """The ``scalar.*`` entries of :meth:`full_state` (the scaler's only under fp16),
        the inner optimizer's per-group scalar states included."""
        scalars: dict[str, Any] = {
            keys.scalar_key(keys.STEP): self.step_count(),
            keys.scalar_key(keys.LOSS_SCALE): float(self.scaler.scale),
            keys.scalar_key(keys.SKIPPED_STEPS): int(self.skipped_steps),
        }
        if self.scaler.enabled:
            for field, value in self.scaler.state_dict().items():
                scalars[keys.scaler_key(field)] = value
        scalars.update(self.group_scalar_state())
        scalars.update(self.param_scalar_state())
        return scalars

    def _group_scalars(self) -> list[dict[str, Any] | None]:
        """Per inner param group, the scalar states most of its masters with a state hold
        (the first of those that tie), or None where none of them has a state yet.

        Every chunk of a flat group steps together, so that is each of them; at ZeRO-3, where
        each parameter's shard is a master, it is the value of the parameters that stepped
        every step. Each rank reads its own masters (ranks hold the same parameters' pieces,
        so they agree without communication).
        """
        out: list[dict[str, Any] | None] = []
        for group in self.inner.param_groups:
            counts: dict[tuple[Any, ...], int] = {}
            found: dict[tuple[Any, ...], dict[str, Any]] = {}
            for master in group["params"]:
                scalars = stateful_scalars(self.inner.state.get(master))
                if scalars is None:
                    continue
                key = scalars_key(scalars)
                counts[key] = counts.get(key, 0) + 1
                found.setdefault(key, scalars)
            # max() keeps the first of equal counts; dicts keep insertion (first-seen) order.
            out.append(found[max(counts, key=counts.__getitem__)] if counts else None)
        return out

    def group_scalar_state(self) -> dict[str, torch.Tensor | float | int]:
        """The inner optimizer's scalar states, once per param group: ``scalar.group.{g}.{name}``.

        A group's value is the one most of its masters hold (:meth:`_group_scalars`); the
        parameters whose own differ (``torch.optim``'s lifecycle: a first gradient that came
        late, a skipped step) are :meth:`param_scalar_state`'s. Tensors come as CPU copies of
        their dtype.
        """
        result: dict[str, torch.Tensor | float | int] = {}
        for group_index, found in enumerate(self._group_scalars()):
            for name, value in (found or {}).items():
                result[keys.group_scalar_key(group_index, name)] = _cpu_copy(value)
        return result

    def param_scalar_state(self) -> dict[str, torch.Tensor | float | int]:
        """The scalar states of the parameters of this rank's shard whose own differ from
        their group's (:meth:`group_scalar_state`): ``scalar.param.{i}.{name}``, or
        ``scalar.param.{i}.no_state`` (1) for a parameter without any state (no gradient yet)
        in a group that has one. Without communication; ranks that hold pieces of one
        parameter give the same entries for it. Empty where every parameter follows its group.
        """
        groups = self._group_scalars()
        result: dict[str, torch.Tensor | float | int] = {}
        for index, group, scalars in self._own_param_scalars():
            ours = groups[group]
            if ours is None and scalars is None:
                continue  # no state anywhere in the group: nothing to keep apart
            if scalars is not None and ours is not None and same_scalars(scalars, ours):
                continue
            if scalars is None:
                result[keys.param_scalar_key(index, keys.NO_STATE)] = 1
                continue
            for name, value in scalars.items():
                result[keys.param_scalar_key(index, name)] = _cpu_copy(value)
        return result

    def _own_param_scalars(self) -> Iterator[tuple[int, int, dict[str, Any] | None]]:
        """Per parameter piece this rank holds: its number in ``trainable_parameters()``, its
        inner param group, and its own scalar states (None: no state yet). The flat and ZeRO-3
        implementations give them; without a per-parameter layout to read there is none, and
        :meth:`param_scalar_state` is empty."""
        return iter(())

    def load_param_scalars(self, state: Mapping[str, Any]) -> None:
        """Give each parameter that ``state``'s ``scalar.param.*`` keys name its own scalar
        states, or no state (:meth:`param_scalar_state` wrote them); the others keep their
        group's. After :meth:`reset_update_state` and the per-element states are loaded."""
        found = keys.param_scalars(state)
        if not found:
            return
        count = len(self.trainable_parameters())
        beyond = sorted(i for i in found if i >= count)
        if beyond:
            raise OptimizerUsageError(
                f"the state holds scalar states of parameter {beyond[0]}, but this optimizer "
                f"has {count} trainable parameters"
            )
        self._load_param_scalars(found)

    def _load_param_scalars(self, found: Mapping[int, dict[str, Any] | None]) -> None:
        """Set the parameters' own scalar states (None: no state); implementations whose
        parameters can keep their own histories override this."""
        raise NotSupportedError(
            f"{type(self).__name__} keeps one scalar state per param group, but the state "
            f"gives parameter {min(found)} its own (a first gradient after its group's, or a "
            "skipped step); load it into a dtypeplan optimizer built by plan.build or plan.wrap"
        )

    def group_scalars_from(self, state: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Per inner param group, the scalar states that ``state``'s ``scalar.group.*`` keys
        give, for :meth:`reset_update_state`.

        A state written before they were kept per group has ``scalar.step`` alone (only Adam
        and AdamW, whose step counter it is, could be loaded then): every group gets it, as a
        ``torch.optim`` step counter, when it is above 0.
        """
        count = len(self.inner.param_groups)
        found = keys.group_scalars(state)
        beyond = sorted(g for g in found if g >= count)
        if beyond:
            raise OptimizerUsageError(
                f"the state holds scalar states of param group {beyond[0]}, but this optimizer "
                f"has {count} param groups"
            )
        if not found:
            step = int(state.get(keys.scalar_key(keys.STEP), 0))
            if step > 0:
                return [
                    {keys.STEP: torch.tensor(float(step), dtype=scalar_dtype())}
                    for _ in range(count)
                ]
        return [found.get(g, {}) for g in range(count)]

    def step_count(self) -> int:
        """Steps the inner optimizer has counted (0 before the first step, or without a counter)."""
        for slot in self.inner.state.values():
            if "step" in slot:
                step = slot["step"]
                return int(step.item()) if torch.is_tensor(step) else int(step)
        return 0

    def reset_update_state(
        self, names: Iterable[str], scalars: Sequence[Mapping[str, Any]] = ()
    ) -> None:
        """Drop every optimizer state; give each master zeroed per-element states ``names``
        and its param group's ``scalars`` instead.

        ``scalars[g]`` holds the scalar states (``step``, ``mu_product``...) of inner param
        group ``g`` (:meth:`group_scalars_from`); each chunk gets its own copy, where
        ``torch.optim`` keeps it (the master's device under ``fused``/``capturable``). The
        per-element states are for a loader to fill in place, as :meth:`load_full_state` and a
        sharded checkpoint load do. With neither, the optimizer starts as if it had never
        stepped.
        """
        names = list(names)
        self.inner.state.clear()
        for index, group in enumerate(self.inner.param_groups):
            values = scalars[index] if index < len(scalars) else {}
            if not names and not values:
                continue
            on_device = bool(group.get("fused") or group.get("capturable"))
            for master in group["params"]:
                slot = self.inner.state[master]
                for name in names:
                    slot[name] = torch.zeros_like(master)
                for name, value in values.items():
                    slot[name] = placed_scalar(name, value, master, on_device)

    def _load_scalar_state(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get(keys.scalar_key(keys.SKIPPED_STEPS), 0))
        scaler = keys.scaler_state(state)
        if scaler and self.scaler.enabled:
            self.scaler.load_state_dict(scaler)

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state, in ``torch.optim``'s layout, loadable on the same world size.

        ``{"state": {index: {...}}, "param_groups": [{..., "params": [indices]}]}`` as
        ``torch.optim`` numbers parameters (every parameter of the param groups, in order), plus
        ``"dtypeplan"``: the layout it was saved in (format, world size, shards), the step
        count, the loss scaler and the skipped-step count. ``state[index]`` holds what this
        rank keeps of that parameter (see the implementation's :meth:`_param_state`): at ZeRO
        stages >= 1 a piece of it, so load it into the same world size and stage, or use
        ``dtypeplan.checkpoint`` to reshard.
        """
        self.hyperparameter_check.flush()
        index_of = self._torch_indices()
        param_groups = []
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            hyper = {k: v for k, v in inner_group.items() if k != "params"}
            hyper.update({k: v for k, v in group.items() if k != "params"})
            param_groups.append({**hyper, "params": [index_of[id(p)] for p in group["params"]]})
        return {
            "state": self._param_state(index_of),
            "param_groups": param_groups,
            "dtypeplan": {
                "format": self.STATE_FORMAT,
                "layout": self._layout_facts(),
                "state_names": [n for n in self.state_names() if n != keys.MASTER],
                "step": self.step_count(),
                # Per param group: a rank whose chunk holds only padding has no entry above.
                "group_scalars": self.group_scalar_state(),
                "scaler": self.scaler.state_dict(),
                "skipped_steps": self.skipped_steps,
            },
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (same implementation, world size and layout)."""
        extra = state_dict.get("dtypeplan") if isinstance(state_dict, dict) else None
        if extra is None:
            raise OptimizerUsageError(
                "load_state_dict: not a dtypeplan optimizer's state dict (a plain torch.optim "
                "state dict has neither master weights nor the flat/sharded layout); to load "
                "weights and optimizer states from another optimizer, world size or ZeRO "
                "stage, use dtypeplan.checkpoint (save / load)"
            )
        if extra.get("format") != self.STATE_FORMAT or extra["layout"] != self._layout_facts():
            raise OptimizerUsageError(
                f"load_state_dict: saved as {extra.get('format')} with layout {extra['layout']}"
                f", but this optimizer is {self.STATE_FORMAT} with {self._layout_facts()}; use "
                "dtypeplan.checkpoint to load across world sizes or ZeRO stages"
            )
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        index_of = self._torch_indices()
        scalars = (
            self.group_scalars_from(extra["group_scalars"])
            if "group_scalars" in extra
            else self._entry_scalars(state_dict["state"], index_of)
        )
        self.reset_update_state(extra["state_names"], scalars)
        self._load_param_state(state_dict["state"], index_of)
        self.scaler.load_state_dict(extra["scaler"])
        self.skipped_steps = int(extra["skipped_steps"])

    def _entry_scalars(
        self, state: Mapping[int, Mapping[str, Any]], index_of: dict[int, int]
    ) -> list[dict[str, Any]]:
        """Per param group, the scalar states of its first parameter with any in ``state``
        (a :meth:`state_dict`'s); :meth:`_load_param_state` then copies each parameter's own."""
        out: list[dict[str, Any]] = []
        for group in self.param_groups:
            found: dict[str, Any] = {}
            for param in group["params"]:
                entry = state.get(index_of[id(param)], {})
                found = {n: v for n, v in entry.items() if n != keys.MASTER and is_scalar_state(v)}
                if found:
                    break
            out.append(found)
        return out

    def _torch_indices(self) -> dict[int, int]:
        """``id(param)`` -> its number in ``torch.optim``'s state dict (every param, in order)."""
        params = [p for g in self.param_groups for p in g["params"]]
        return {id(p): i for i, p in enumerate(params)}

    @abc.abstractmethod
    def _layout_facts(self) -> dict[str, Any]:
        """What a state dict of this rank can only be loaded into (world size, shards...)."""

    @abc.abstractmethod
    def _param_state(self, index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
        """Per trainable parameter held here (by torch index): ``master`` and its states."""

    @abc.abstractmethod
    def _load_param_state(self, state: dict[int, dict[str, Any]], index_of: dict[int, int]) -> None:
        """Inverse of :meth:`_param_state`, into states :meth:`reset_update_state` made;
        then write the weights into the parameters."""

    @abc.abstractmethod
    def state_names(self) -> list[str]:
        """``master`` and the names of the optimizer states laid out like the masters."""

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


def _cpu_copy(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


def _param_group_dicts(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
) -> list[dict[str, Any]]:
    """``params`` as torch.optim takes it, as a list of group dicts with listed params."""
    items: list[Any] = list(params)
    if not items or not isinstance(items[0], dict):
        items = [{"params": items}]
    groups = []
    for group in items:
        listed = group["params"]
        listed = [listed] if isinstance(listed, torch.Tensor) else list(listed)
        groups.append({**group, "params": listed})
    return groups


_SWITCHES_REFUSED_ON_CPU = ("capturable",)
"""Switches that change what torch can run, not only how fast: torch refuses ``capturable``
at the first step of a CPU group (its step counters must live on a CUDA-graph device)."""


def _refuse_inapplicable_switches(groups: list[dict[str, Any]], plan: PrecisionPlan) -> None:
    """Refuse, naming the group and the cause, a switch a param group sets that cannot apply
    to where its update runs, and take every switch out of the groups (dtypeplan chooses the
    inner optimizer's path itself, ``inner_optimizer``).

    ``capturable=True`` keeps the step on the device so that it can be captured in a CUDA
    graph: on a CPU group (or with the optimizer offloaded to the host) torch itself fails at
    the first step, so it is refused here rather than dropped. Elsewhere dtypeplan's step does
    its own host work between kernels, so it is not graph-capturable either: a warning says
    the switch is ignored. ``differentiable=True`` would differentiate through the update;
    the masters are updated outside autograd.
    """
    for index, group in enumerate(groups):
        if group.pop("differentiable", False):
            raise NotSupportedError(
                f"param group {index} sets differentiable=True, which differentiates through "
                "the optimizer's update; dtypeplan updates the master weights outside "
                "autograd. Leave differentiable False"
            )
        if not group.pop("capturable", False):
            continue
        tensors = [t[1] if isinstance(t, tuple) else t for t in group["params"]]
        devices = sorted({t.device.type for t in tensors})
        if plan.offload_optimizer != "none" or "cpu" in devices or not devices:
            where = (
                f"offload_optimizer {plan.offload_optimizer} (the update runs on the host)"
                if plan.offload_optimizer != "none"
                else f"parameters on {', '.join(devices) or 'cpu'}"
            )
            raise NotSupportedError(
                f"param group {index} sets capturable=True with {where}: capturable keeps the "
                "step counters on a CUDA-graph device, and torch.optim itself fails at the "
                "first step of a CPU group. Leave capturable False (dtypeplan chooses the "
                "update's path)"
            )
        warnings.warn(
            f"param group {index}: capturable=True is ignored; dtypeplan's step is not "
            "captured in a CUDA graph (it chooses its own update path), and the numbers are "
            "those of capturable=False",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    for group in groups:
        for switch in _IMPLEMENTATION_SWITCHES:
            group.pop(switch, None)


def _refuse_non_real(groups: list[dict[str, Any]]) -> None:
    """Complex or integer parameters: the flat buffers hold one real floating dtype."""
    for group_index, group in enumerate(groups):
        for position, param in enumerate(group["params"]):
            tensor = param[1] if isinstance(param, tuple) else param
            if tensor.is_complex() or not tensor.is_floating_point():
                raise OptimizerUsageError(
                    f"param group {group_index} position {position} is a {tensor.dtype} tensor "
                    f"of shape {tuple(tensor.shape)}: dtypeplan trains real floating-point "
                    "parameters only (the plan casts them to one dtype); keep complex or integer "
                    "tensors out of build(), e.g. as buffers or with torch.view_as_real"
                )


def _refuse_duplicates(groups: list[dict[str, Any]]) -> None:
    """A parameter listed twice would be stepped twice (torch only warns): refuse it."""
    seen: dict[int, tuple[int, int]] = {}
    for group_index, group in enumerate(groups):
        for position, param in enumerate(group["params"]):
            tensor = param[1] if isinstance(param, tuple) else param
            if id(tensor) in seen:
                first_group, first_position = seen[id(tensor)]
                raise OptimizerUsageError(
                    f"a parameter of shape {tuple(tensor.shape)} is listed twice: param group "
                    f"{first_group} position {first_position} and param group {group_index} "
                    f"position {position}; list every parameter once (torch.optim would step "
                    "it twice)"
                )
            seen[id(tensor)] = (group_index, position)
