"""A gradient from autograd to ``step()``: which optimizer owns a parameter, what ``.grad``
holds after the optimizer took it in, the cooperation with DDP, the backward-time reduction
scheduler, parameters without a gradient, the factor (unscale, average, clip) and fp16 loss
scaling."""

from dtypeplan.optimizers.grads.loss_scaler import LossScaler, MinimumLossScaleError

__all__ = [
    "LossScaler",
    "MinimumLossScaleError",
]
