"""fp16 loss scaling with DeepSpeed's semantics (``DynamicLossScaler``).

On an overflow the hysteresis budget is spent first; only when it is down to one does the
scale halve (never below ``min_loss_scale``). After ``loss_scale_window`` steps since the last
overflow the scale doubles and the budget is refilled (after every clean step instead, with
``consecutive_hysteresis``). A static scale never changes. Without fp16 the scale is 1.
"""

from __future__ import annotations

import math
from typing import Any

from dtypeplan.errors import MinimumLossScaleError, PrecisionConfigError
from dtypeplan.resolver import LossScaleConfig

__all__ = ["LossScaler", "MinimumLossScaleError"]


class LossScaler:
    def __init__(self, config: LossScaleConfig | None) -> None:
        if config is not None:
            for name in ("loss_scale", "min_loss_scale"):
                value = getattr(config, name)
                # The schema refuses these; a hand-built LossScaleConfig must be refused too:
                # an infinite scale skips every step, a NaN minimum never stops the decay.
                if (
                    not math.isfinite(value)
                    or value < 0
                    or (name == "min_loss_scale" and not value)
                ):
                    raise PrecisionConfigError(
                        f"fp16.{name} is {value}; it must be a finite number"
                        + (" above 0" if name == "min_loss_scale" else " >= 0"),
                        f"$.fp16.{name}",
                    )
        self.enabled = config is not None
        self.dynamic = config is not None and config.loss_scale == 0
        if config is None:
            self.scale = 1.0
            config = LossScaleConfig()
        elif config.loss_scale > 0:
            self.scale = float(config.loss_scale)
        else:
            self.scale = float(2.0**config.initial_scale_power)
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self.consecutive_hysteresis = config.consecutive_hysteresis
        self.min_scale = float(config.min_loss_scale)
        self.hysteresis_left = self.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        """Account for one step; raises MinimumLossScaleError when the scale cannot go lower."""
        if not self.dynamic:
            self.iteration += 1
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left <= 1:
                if self.scale <= self.min_scale:
                    raise MinimumLossScaleError(
                        f"fp16 gradients overflowed with the loss scale already at its minimum "
                        f"({self.min_scale:g}); the run cannot continue. Lower the learning rate, "
                        "lower fp16.min_loss_scale, or train in bf16"
                    )
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
