"""The state every implementation shares: ``state_dict`` in ``torch.optim``'s layout and the
scalar states (step counters, loss scaler, skipped steps) kept per param group and per parameter.

:class:`OptimizerState` is the layer under ``MixedPrecisionOptimizer`` (``contract/base.py``) that
turns an implementation's per-parameter state (:meth:`~OptimizerState._param_state`) and its
layout-free state (:meth:`~OptimizerState.full_state`, for the resharding checkpoints) into
what ``torch.optim`` users and ``dtypeplan.checkpoint`` read, and back.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dtypeplan.errors import NotSupportedError, OptimizerUsageError
from dtypeplan.optimizers.contract.hyperparameters import HyperparameterCheck
from dtypeplan.optimizers.grads.loss_scaler import LossScaler
from dtypeplan.optimizers.state import keys
from dtypeplan.optimizers.state.values import (
    is_scalar_state,
    placed_scalar,
    same_scalars,
    scalar_dtype,
    scalars_key,
    stateful_scalars,
)

if TYPE_CHECKING:
    from dtypeplan.optimizers.state.low_precision import LowPrecisionState

__all__ = ["OptimizerState"]


class OptimizerState(torch.optim.Optimizer, abc.ABC):
    """``state_dict`` / ``load_state_dict`` and the scalar states of every implementation."""

    STATE_FORMAT: str = "dtypeplan/1"
    """The ``format`` recorded in :meth:`state_dict`'s ``dtypeplan`` entry."""

    scaler: LossScaler
    skipped_steps: int
    hyperparameter_check: HyperparameterCheck

    @property
    @abc.abstractmethod
    def inner(self) -> torch.optim.Optimizer:
        """The ``torch.optim`` instance that runs the update on this rank's master weights.

        Its param groups mirror :attr:`param_groups` (same order, same hyperparameters), and
        its ``state`` holds the optimizer states under torch's names. :meth:`state_dict` and
        the shared helpers below read and write it.
        """

    def trainable_parameters(self) -> list[torch.Tensor]:
        """The parameters the optimizer updates, in the numbering of the ``param.{i}`` keys."""
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    _low_precision: LowPrecisionState | None = None
    """Set by an optimizer whose masters are 16-bit or whose moments are low-precision."""

    def master_values(self, master: torch.Tensor) -> torch.Tensor:
        """A master chunk or shard as the fp32 values a checkpoint stores, whatever the master
        dtype, so that it loads into any other: fp32 masters as they are; Kahan-compensated
        bf16 masters, the weights plus their compensation."""
        if self._low_precision is None:
            return master.float()
        return self._low_precision.master_values(master)

    @torch.no_grad()
    def load_master_(
        self, master: torch.Tensor, values: torch.Tensor, compensation: torch.Tensor | None = None
    ) -> None:
        """Set a master chunk or shard from fp32 ``values`` (a checkpoint load): copied (fp32
        masters), else rounded as the plan says (Kahan: split into the bf16 weights and their
        compensation; ``compensation``: the one ``values`` include, where saved)."""
        if self._low_precision is None:
            master.copy_(values)
            return
        self._low_precision.load_master_(master, values, compensation)

    @property
    def low_precision_update(self) -> LowPrecisionState | None:
        """The update that keeps 16-bit masters or low-precision moments (their Kahan
        compensations, quantized codes), or None where masters and states are fp32."""
        return self._low_precision

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
                "optimizer": self.optimizer_class_name(),
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
        self._refuse_other_class(extra.get("optimizer"))
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

    def optimizer_class_name(self) -> str:
        """The ``torch.optim`` class that updates the masters (``AdamW``, ``SGD``...): what
        :meth:`state_dict` records, and the class a state dict loads into."""
        return type(self.inner).__name__

    def _refuse_other_class(self, saved: str | None) -> None:
        """Refuse a state dict that another optimizer class saved (``dtypeplan.checkpoint.load``
        refuses the same move): its hyperparameters would replace this one's (an SGD trained
        with AdamW's lr and decay) and its states would be dropped or misread without a word.
        A state dict from before the class was recorded (None) is taken as it was."""
        mine = self.optimizer_class_name()
        if saved is None or saved == mine:
            return
        raise OptimizerUsageError(
            f"load_state_dict: the state dict was saved by a {saved} optimizer, but this "
            f"optimizer is {mine}; its hyperparameters and states are {saved}'s. Build the "
            f"optimizer as {saved} (the config's optimizer.type) to resume it, or to switch "
            f"to {mine} keep this optimizer's fresh state and load only the model's weights "
            "(model.load_state_dict)"
        )

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

        Keys (built by ``state/keys.py``): ``"param.{i}.{name}"`` with full-shape fp32
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
