"""DeepSpeed's ``scheduler`` block as ``torch.optim.lr_scheduler`` objects.

``build_scheduler({"type": ..., "params": {...}}, optimizer)`` builds one of DeepSpeed 0.19.8's
five schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) with the
formulas of ``deepspeed/runtime/lr_schedules.py``, in the same floating-point operation order
so that the learning rates are bit-identical, or any ``torch.optim.lr_scheduler`` class named by
``type`` (built with ``params`` as keyword arguments, as DeepSpeed does). The formulas are written
out in ``tests/data/deepspeed_configs/SCHEDULERS.md``.

Step counting follows DeepSpeed, not torch: ``last_epoch`` is DeepSpeed's
``last_batch_iteration`` ``t``. It is -1 after construction (which sets the lr for ``t = -1``),
and each ``step()`` adds one and then sets the lr for the new ``t``.

Skipped steps, one rule: the scheduler decides, not the loop. DeepSpeed's engine does not step
the scheduler when fp16 overflow skipped the optimizer step; every scheduler built here holds
back by itself instead, so a training loop calls ``scheduler.step()`` after every
``optimizer.step()``, as a plain torch loop does, and gets DeepSpeed's schedule. A ``step()``
does nothing when the optimizer's last step was skipped (``last_step_skipped``) and that skip
has not held the scheduler back yet (the optimizer's ``skipped_steps`` grew since the
scheduler last looked; every dtypeplan optimizer has both). Each skip holds back one
``step()`` at most, the one right after it, so a loop that also guards the call with ``if not
optimizer.last_step_skipped`` (the HF Trainer's) gets the same schedule: it never calls
``step()`` right after a skip, and the next call advances. An optimizer with the flag but no
counter is judged by the flag; a plain torch optimizer, which never skips, always advances.
The counter value last seen is part of ``state_dict()``; restore the optimizer's state with the
scheduler's (if the optimizer's counter restarts below it, the flag decides).
"""

from __future__ import annotations

import abc
import difflib
import inspect
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from dtypeplan.errors import PrecisionConfigError

__all__ = [
    "DEEPSPEED_SCHEDULERS",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]

WARMUP_TYPES = ("log", "linear")
# OneCycle writes (beta1, 0.99) into group["betas"]: DeepSpeed fixes beta2 at 0.99.
ONE_CYCLE_BETA2 = 0.99
_WHERE_LISTED = (
    "the DeepSpeed names are WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest; "
    "any class of torch.optim.lr_scheduler is accepted too"
)


# --- parameter checks (the messages name the config key) --------------------------------------
def _key(name: str) -> str:
    return f"scheduler.params.{name}"


def _fail(name: str, what: str, value: Any) -> PrecisionConfigError:
    return PrecisionConfigError(f"{_key(name)} {what}, got {value!r}", f"$.{_key(name)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _fail(name, "must be a positive integer", value)
    return value


def _number(name: str, value: Any, *, minimum: float | None = None) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise _fail(name, "must be a finite number", value)
    if minimum is not None and value < minimum:
        raise _fail(name, f"must be >= {minimum}", value)
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, "must be true or false", value)
    return value


def _per_group(name: str, value: Any, optimizer: Optimizer) -> list[float]:
    """A number for every group, or a list with one per group (DeepSpeed's _format_param)."""
    count = len(optimizer.param_groups)
    values = list(value) if isinstance(value, (list, tuple)) else [value] * count
    if len(values) != count or not all(_is_number(v) and math.isfinite(v) for v in values):
        raise _fail(name, f"must be a number or a list of {count} numbers (one per group)", value)
    return values


def _warmup_type(value: Any) -> str:
    if value in WARMUP_TYPES:
        return value
    # DeepSpeed warns and falls back to "log"; so do we, naming the closest valid type.
    close = difflib.get_close_matches(str(value), WARMUP_TYPES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    warnings.warn(
        f"{_key('warmup_type')}={value!r} is not one of {WARMUP_TYPES}{hint}; "
        "DeepSpeed uses 'log' then, and so does dtypeplan",
        UserWarning,
        stacklevel=4,
    )
    return "log"


def _iteration(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise _fail("last_batch_iteration", "must be an integer >= -1", value)
    return value


def _set_lrs(optimizer: Optimizer, lrs: Sequence[Any]) -> list[Any]:
    """DeepSpeed's update_lr: a tensor lr is filled in place; returns copies for get_last_lr."""
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr.squeeze() if isinstance(lr, torch.Tensor) else lr)
        else:
            group["lr"] = lr
    return [
        g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
        for g in optimizer.param_groups
    ]


# --- skip awareness ----------------------------------------------------------------------------
class _SkipAware:
    """Mixin: ``step()`` does nothing right after a skipped optimizer step (module docstring)."""

    optimizer: Optimizer
    _skipped_steps_seen: int | None

    def _watch_skips(self, optimizer: Optimizer) -> None:
        count = getattr(optimizer, "skipped_steps", None)
        self._skipped_steps_seen = int(count) if count is not None else None

    def _optimizer_skipped(self) -> bool:
        """Whether this ``step()`` follows a skipped optimizer step that has not held the
        scheduler back yet. Skips the loop already held back for (it did not call ``step()``
        after them) are not counted again: that was the schedule falling two steps behind."""
        count = getattr(self.optimizer, "skipped_steps", None)
        flag = bool(getattr(self.optimizer, "last_step_skipped", None))
        if count is None:
            return flag
        seen, self._skipped_steps_seen = self._skipped_steps_seen, int(count)
        if seen is None or count < seen:
            # No baseline, or the optimizer's counter restarted (its state was not restored).
            return flag
        return flag and count > seen


# --- the DeepSpeed schedules -------------------------------------------------------------------
class _DeepSpeedSchedule(_SkipAware, LRScheduler, abc.ABC):
    """Shared step logic: ``last_epoch`` is DeepSpeed's ``last_batch_iteration``."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int) -> None:
        self._start_iteration = _iteration(last_batch_iteration)
        self._watch_skips(optimizer)
        super().__init__(optimizer, last_epoch=-1)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's name for ``last_epoch``."""
        return self.last_epoch

    def _initial_step(self) -> None:
        # Replaces torch's initial step(): DeepSpeed sets the lr for t = -1 only on a fresh start.
        self._step_count = 0
        self.last_epoch = self._start_iteration
        if self.last_epoch == -1:
            self._apply_initial()
        else:
            self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def _apply_initial(self) -> None:
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def step(self, epoch: int | None = None) -> None:
        """Advance one step and set the lrs, unless the optimizer skipped its last step.

        ``epoch`` (DeepSpeed's ``batch_iteration``) sets ``t`` directly and is never skipped.
        """
        if epoch is None:
            if self._optimizer_skipped():
                return
            self.last_epoch += 1
        else:
            self._watch_skips(self.optimizer)
            self.last_epoch = _iteration(epoch)
        self._step_count += 1
        self._apply()

    def _apply(self) -> None:
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def get_lr(self) -> list[Any]:
        return self._lrs_at(self.last_epoch)

    @abc.abstractmethod
    def _lrs_at(self, t: int) -> list[Any]:
        """Each param group's lr at DeepSpeed's ``last_batch_iteration`` ``t``."""


class WarmupLR(_DeepSpeedSchedule):
    """lr rises from ``warmup_min_lr`` to ``warmup_max_lr`` over ``max(2, warmup_num_steps)``
    steps (log or linear), then stays. ``warmup_max_lr=None``: each group's lr at construction."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _positive_int("warmup_num_steps", warmup_num_steps)
        self.min_lrs = _per_group("warmup_min_lr", warmup_min_lr, optimizer)
        self.max_lrs = (
            [group["lr"] for group in optimizer.param_groups]
            if warmup_max_lr is None
            else _per_group("warmup_max_lr", warmup_max_lr, optimizer)
        )
        self.delta_lrs = [
            big - small for big, small in zip(self.max_lrs, self.min_lrs, strict=True)
        ]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)

    def _lrs_at(self, t: int) -> list[Any]:
        if t < 0:
            return list(self.min_lrs)
        gamma = self._gamma(t)
        return [
            small + (delta * gamma)
            for small, delta in zip(self.min_lrs, self.delta_lrs, strict=True)
        ]

    def _warmup_gamma(self, t: int) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(t + 1)
        return t / self.warmup_num_steps

    def _gamma(self, t: int) -> float:
        return self._warmup_gamma(t) if t < self.warmup_num_steps else 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warmup, then a linear decay to 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _total_num_steps(total_num_steps, warmup_num_steps)
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return self._warmup_gamma(t)
        return max(
            0.0,
            float(self.total_num_steps - t)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


def _total_num_steps(total_num_steps: Any, warmup_num_steps: Any) -> int:
    if (
        not isinstance(total_num_steps, int)
        or isinstance(total_num_steps, bool)
        or total_num_steps < 0
    ):
        raise _fail("total_num_steps", "must be a non-negative integer", total_num_steps)
    if isinstance(warmup_num_steps, int) and total_num_steps < max(2, warmup_num_steps):
        warnings.warn(
            f"{_key('total_num_steps')}={total_num_steps} is less than warmup_num_steps "
            f"{warmup_num_steps}: the schedule never decays below its warmup",
            UserWarning,
            stacklevel=4,
        )
    return total_num_steps


class WarmupCosineLR(_DeepSpeedSchedule):
    """Multiplies each group's lr at construction by a ratio: warmup from ``warmup_min_ratio`` to
    1, then a cosine down to ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _positive_int("warmup_num_steps", warmup_num_steps)
        self.total_num_steps = _total_num_steps(total_num_steps, warmup_num_steps)
        self.warmup_min_ratio = _number("warmup_min_ratio", warmup_min_ratio)
        self.cos_min_ratio = _number("cos_min_ratio", cos_min_ratio)
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [
            g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
            for g in optimizer.param_groups
        ]
        super().__init__(optimizer, last_batch_iteration)

    def lr_ratio(self, t: int) -> float:
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            if self.warmup_type == "log":
                ratio = self.inverse_log_warm_up * math.log(t + 1)
            else:
                ratio = t / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = t - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def _lrs_at(self, t: int) -> list[Any]:
        if t < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.lr_ratio(t)
        return [org_lr * ratio for org_lr in self.org_lrs]


class OneCycle(_DeepSpeedSchedule):
    """1Cycle: lr up from ``cycle_min_lr`` to ``cycle_max_lr`` and back (optionally in stairs),
    then decay; momentum (``betas[0]``, beta2 fixed at 0.99) cycles inversely when the optimizer
    has ``betas``."""

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        first = float(_number("cycle_first_step_size", cycle_first_step_size))
        if first <= 0:
            raise _fail("cycle_first_step_size", "must be positive", cycle_first_step_size)
        second = first
        if cycle_second_step_size is not None:
            second = float(_number("cycle_second_step_size", cycle_second_step_size, minimum=0))
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = _stairs("cycle_first_stair_count", cycle_first_stair_count)
        self.second_stair_count = (
            self.first_stair_count
            if cycle_second_stair_count is None
            else _stairs("cycle_second_stair_count", cycle_second_stair_count)
        )
        self.decay_step_size = _number("decay_step_size", decay_step_size, minimum=0)
        self.decay_lr_rate = _number("decay_lr_rate", decay_lr_rate)
        self.decay_mom_rate = _number("decay_mom_rate", decay_mom_rate)
        self.skip_lr_decay = self.decay_step_size == 0 or self.decay_lr_rate == 0
        self.skip_mom_decay = self.decay_step_size == 0 or self.decay_mom_rate == 0
        self.min_lrs = _per_group("cycle_min_lr", cycle_min_lr, optimizer)
        self.max_lrs = _per_group("cycle_max_lr", cycle_max_lr, optimizer)
        self.cycle_momentum = _flag("cycle_momentum", cycle_momentum)
        self.min_moms: list[tuple[float, float]] = []
        self.max_moms: list[tuple[float, float]] = []
        if self.cycle_momentum:
            if not _has_betas(optimizer):
                warnings.warn(
                    f"{_key('cycle_momentum')} is switched off: {type(optimizer).__name__} has no "
                    "betas in its defaults (DeepSpeed does the same)",
                    UserWarning,
                    stacklevel=3,
                )
                self.cycle_momentum = False
            else:
                for name, value, out in (
                    ("cycle_min_mom", cycle_min_mom, self.min_moms),
                    ("cycle_max_mom", cycle_max_mom, self.max_moms),
                ):
                    out.extend((mom, ONE_CYCLE_BETA2) for mom in _per_group(name, value, optimizer))
        super().__init__(optimizer, last_batch_iteration)

    def _apply_initial(self) -> None:
        # DeepSpeed's constructor: lr = cycle_min_lr and betas = (cycle_min_mom, 0.99).
        self._last_lr = _set_lrs(self.optimizer, self.min_lrs)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.min_moms, strict=True):
                group["betas"] = betas

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            for group, betas in zip(
                self.optimizer.param_groups, self.momentums_at(self.last_epoch), strict=True
            ):
                group["betas"] = betas

    def _scale_factor(self, t: int) -> float:
        batch_iteration = t + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor = x / self.step_ratio
            stair_count = self.first_stair_count
        else:
            scale_factor = (x - 1) / (self.step_ratio - 1)
            stair_count = self.second_stair_count
        if stair_count > 0:
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                position = cycle_iteration * stair_count / self.first_step_size
            else:
                position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(position) / stair_count
        return scale_factor

    def _lrs_at(self, t: int) -> list[Any]:
        if t < self.total_size:
            scale = self._scale_factor(t)
            return [
                small + (big - small) * scale
                for small, big in zip(self.min_lrs, self.max_lrs, strict=True)
            ]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((t - self.total_size + 1) / self.decay_step_size)
        return [small / factor for small in self.min_lrs]

    def momentums_at(self, t: int) -> list[tuple[float, float]]:
        """``(beta1, 0.99)`` per group for step ``t`` (only when momentum cycles)."""
        if t < self.total_size:
            scale = self._scale_factor(t)
            return [
                (big[0] - (big[0] - small[0]) * scale, small[1])
                for small, big in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((t - self.total_size + 1) / self.decay_step_size)
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]


def _has_betas(optimizer: Optimizer) -> bool:
    """DeepSpeed's test for momentum cycling: ``betas`` in the optimizer's defaults. A dtypeplan
    optimizer's defaults hold only the config's params; its update runs in ``inner`` (a torch
    optimizer over the master weights, fed from ``param_groups`` at every step), whose defaults
    have ``betas`` for Adam-type optimizers, as DeepSpeed's own Adam does."""
    inner = getattr(optimizer, "inner", None)
    return "betas" in optimizer.defaults or (
        isinstance(inner, Optimizer) and "betas" in inner.defaults
    )


def _stairs(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _fail(name, "must be a non-negative integer", value)
    return value


class LRRangeTest(_DeepSpeedSchedule):
    """lr = ``min_lr * (1 + step_rate * i)``, ``i`` = steps / ``step_size`` (floored: staircase)."""

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self.min_lrs = _per_group("lr_range_test_min_lr", lr_range_test_min_lr, optimizer)
        self.step_size = _positive_int("lr_range_test_step_size", lr_range_test_step_size)
        self.step_rate = _number("lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = _flag("lr_range_test_staircase", lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def _apply_initial(self) -> None:
        self._last_lr = _set_lrs(self.optimizer, self.min_lrs)

    def _lrs_at(self, t: int) -> list[Any]:
        interval = float(t + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [small * increase for small in self.min_lrs]


DEEPSPEED_SCHEDULERS: dict[str, type[_DeepSpeedSchedule]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}


# --- torch.optim.lr_scheduler classes by name ---------------------------------------------------
def _torch_scheduler_names() -> list[str]:
    module = torch.optim.lr_scheduler
    return sorted(
        name
        for name, value in vars(module).items()
        if inspect.isclass(value)
        and issubclass(value, LRScheduler)
        and value is not LRScheduler
        and not name.startswith("_")
    )


_SKIP_AWARE_TORCH: dict[type[LRScheduler], type[LRScheduler]] = {}


def _skip_aware(cls: type[LRScheduler]) -> type[LRScheduler]:
    """A subclass of ``cls`` whose ``step()`` does nothing after a skipped optimizer step."""
    if cls not in _SKIP_AWARE_TORCH:

        def __init__(self: Any, optimizer: Optimizer, *args: Any, **kwargs: Any) -> None:
            # torch's __init__ calls step() once for the initial lr: that call is never a skip.
            self._watching = False
            self._watch_skips(optimizer)
            cls.__init__(self, optimizer, *args, **kwargs)
            self._watching = True

        def step(self: Any, *args: Any, **kwargs: Any) -> None:
            if self._watching and self._optimizer_skipped():
                return
            cls.step(self, *args, **kwargs)

        namespace = {"__init__": __init__, "step": step, "__doc__": cls.__doc__}
        _SKIP_AWARE_TORCH[cls] = type(cls.__name__, (_SkipAware, cls), namespace)
    return _SKIP_AWARE_TORCH[cls]


def _check_params(name: str, cls: type, params: Mapping[str, Any]) -> None:
    # The class's own __init__ is what is read here, not an instance's.
    signature = inspect.signature(cls.__init__)  # type: ignore[misc]
    accepted = list(signature.parameters)[2:]  # drop self and optimizer
    for key in params:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PrecisionConfigError(
                f"unknown key {_key(key)} for {name}: {hint}{name} takes {', '.join(accepted)}",
                f"$.{_key(key)}",
            )
    missing = [
        p.name
        for p in list(signature.parameters.values())[2:]
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in params
    ]
    if missing:
        raise PrecisionConfigError(
            f"{_key(missing[0])} is required by {name}", f"$.{_key(missing[0])}"
        )


def build_scheduler(
    scheduler_config: Mapping[str, Any] | None, optimizer: Optimizer
) -> LRScheduler | None:
    """Build the config's ``scheduler`` block ``{"type": ..., "params": {...}}`` on ``optimizer``.

    Returns None for no block. ``type`` is one of DeepSpeed's five schedules or the name of a
    ``torch.optim.lr_scheduler`` class; either way the result skips the steps the optimizer
    skipped (module docstring). Raises PrecisionConfigError naming the key for an unknown type,
    an unknown or missing parameter, or a bad value.
    """
    if scheduler_config is None:
        return None
    if not isinstance(scheduler_config, Mapping):
        raise PrecisionConfigError(
            f"scheduler must be an object, got {scheduler_config!r}", "$.scheduler"
        )
    for key in scheduler_config:
        if key not in ("type", "params"):
            close = difflib.get_close_matches(str(key), ["type", "params"], n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PrecisionConfigError(
                f"unknown key scheduler.{key}: {hint}the scheduler block takes type and params",
                f"$.scheduler.{key}",
            )
    name = scheduler_config.get("type")
    params = scheduler_config.get("params") or {}
    if not isinstance(params, Mapping):
        raise PrecisionConfigError(
            f"scheduler.params must be an object, got {params!r}", "$.scheduler.params"
        )
    torch_names = _torch_scheduler_names()
    if name in DEEPSPEED_SCHEDULERS:
        cls: type[LRScheduler] = DEEPSPEED_SCHEDULERS[name]
        _check_params(name, cls, params)
    elif name in torch_names:
        torch_cls = getattr(torch.optim.lr_scheduler, name)
        _check_params(name, torch_cls, params)
        cls = _skip_aware(torch_cls)
    else:
        close = difflib.get_close_matches(str(name), [*DEEPSPEED_SCHEDULERS, *torch_names], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PrecisionConfigError(
            f"unknown scheduler.type {name!r}: {hint}{_WHERE_LISTED}", "$.scheduler.type"
        )
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"build_scheduler needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    try:
        return cls(optimizer, **params)
    except PrecisionConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise PrecisionConfigError(
            f"scheduler {name} refused its params: {error}", "$.scheduler.params"
        ) from error
