"""The step's gradient factor (unscale, average, clip) computed on the device.

The factor every gradient is multiplied by is ``min(1, clip / (norm + 1e-6)) / divisor``, where
``norm`` is the global norm of the gradients as reduced divided by ``divisor`` (the loss scale
times what the reduction left undivided, see ``Communicator.reduction_divisor``). The host
version, :meth:`MixedPrecisionOptimizer._gradient_factor`, needs the squared norm as a Python
float: one device-to-host sync per step. Where the step cannot be skipped (no fp16, no
non-finite check) nothing on the host needs the number, so it stays a 0-dim tensor: the fused
update reads it from device memory, and ``grad_norm`` syncs only when someone reads it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DeviceGradientFactor", "device_gradient_factor"]


class DeviceGradientFactor(NamedTuple):
    """The step's factor and norm as 0-dim device tensors."""

    factor: torch.Tensor
    """fp32: what the summed gradients are multiplied by."""
    inverse: torch.Tensor
    """fp32: ``1 / factor``, the ``grad_scale`` that torch's fused optimizers divide by."""
    norm: torch.Tensor
    """fp64: the global gradient norm after unscaling and averaging (NaN when not finite)."""


def device_gradient_factor(
    sq_norm: torch.Tensor, divisor: float, clip: float
) -> DeviceGradientFactor:
    """The factor of ``_gradient_factor`` for a step that is not skipped, without a host sync.

    Same semantics in fp64: a non-finite norm clips with an infinite norm (factor 0, as the host
    version), and ``norm`` is NaN then.
    """
    sq = sq_norm.reshape(()).double()
    finite = torch.isfinite(sq)
    norm = torch.where(finite, sq.sqrt() / divisor, torch.inf)
    factor = torch.full_like(sq, 1.0 / divisor)
    if clip > 0:
        factor = torch.where(norm > clip, factor * (clip / (norm + 1e-6)), factor)
    factor32 = factor.float()
    return DeviceGradientFactor(
        factor32, factor32.reciprocal(), torch.where(finite, norm, torch.nan)
    )
