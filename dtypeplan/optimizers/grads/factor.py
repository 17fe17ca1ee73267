"""The step's gradient factor (unscale, average, clip) computed on the device.

The factor every gradient is multiplied by is ``c * min(1, clip / (c * norm + 1e-6)) / divisor``
(``c``: the product of this step's ``clip_grad_norm_`` coefficients, 1 without any), where
``norm`` is the global norm of the gradients as reduced divided by ``divisor`` (the loss scale
times what the reduction left undivided, see ``Communicator.reduction_divisor``). The host
version, :meth:`MixedPrecisionOptimizer._gradient_factor`, needs the squared norm as a Python
float: one device-to-host sync per step. Where the step cannot be skipped (no fp16, no
non-finite check) nothing on the host needs the number, so it stays a 0-dim tensor: the fused
update reads it from device memory, and ``grad_norm`` syncs only when someone reads it.

Where the host knows the factor is exactly 1 without reading it (no clipping asked for, nothing
left to divide by: one process, one micro-batch, no loss scale, the plain torch loop), the step
gets ``kernels/torch_adam.unit_factor``'s tensors, and torch's fused kernels no ``grad_scale``
(``kernel_grad_scale``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from dtypeplan.optimizers.kernels.torch_adam import unit_factor

__all__ = [
    "DeviceGradientFactor",
    "NormProbe",
    "chunk_sq_norms",
    "device_gradient_factor",
    "sum_sq_norms",
]

_CPU_NORM_CHUNK = 1 << 20
"""Elements of a 16-bit gradient converted at a time on CPU (into a 4 MiB fp32 scratch)."""


def chunk_sq_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's squared 2-norm, a 0-dim fp64 tensor on its device.

    The norm is taken in fp32 and squared in fp64 (fp32 tensors, and all off the CPU, in one
    ``_foreach_norm``). 16-bit gradients on CPU are converted a piece at a time into one
    scratch that stays in cache: the CPU kernel of ``_foreach_norm(..., dtype=float32)`` on
    16-bit input runs several times slower than a conversion followed by an fp32 norm
    (measured on AMD EPYC, one core). A tensor's value does not depend on which others it is
    taken with, so a norm taken early (a bucket reduced inside backward) sums to the same bits.
    """
    wide = [g for g in grads if _is_wide(g)]
    wide_norms = iter(torch._foreach_norm(wide, 2.0, dtype=torch.float32) if wide else [])
    narrow = [g for g in grads if not _is_wide(g)]
    scratch = torch.empty(
        min(_CPU_NORM_CHUNK, max((g.numel() for g in narrow), default=0)), dtype=torch.float32
    )
    squares = []
    for grad in grads:
        if _is_wide(grad):
            squares.append(next(wide_norms).double().square())
            continue
        if grad.numel() == 0:  # a rank's empty shard of a small parameter (ZeRO-3)
            squares.append(torch.zeros((), dtype=torch.float64, device=grad.device))
            continue
        pieces = []
        flat = grad.reshape(-1)
        for begin in range(0, flat.numel(), scratch.numel()):
            piece = flat[begin : begin + scratch.numel()]
            converted = scratch[: piece.numel()]
            converted.copy_(piece)
            pieces.append(torch.linalg.vector_norm(converted))
        squares.append(torch.stack(pieces).double().square().sum())
    return squares


def sum_sq_norms(squares: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The sum of :func:`chunk_sq_norms` values as a 0-dim fp32 tensor (0 on ``device`` if none)."""
    if not squares:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(squares).sum().float()


def _is_wide(grad: torch.Tensor) -> bool:
    return grad.dtype == torch.float32 or grad.device.type != "cpu"


class DeviceGradientFactor(NamedTuple):
    """The step's factor and norm as 0-dim device tensors."""

    factor: torch.Tensor
    """fp32: what the summed gradients are multiplied by."""
    inverse: torch.Tensor
    """fp32: ``1 / factor``, the ``grad_scale`` that torch's fused optimizers divide by."""
    norm: torch.Tensor
    """fp64: the global gradient norm after unscaling and averaging (NaN when not finite)."""


def device_gradient_factor(
    sq_norm: torch.Tensor, divisor: float, clip: float, requested: float = 1.0
) -> DeviceGradientFactor:
    """The factor of ``_gradient_factor`` for a step that is not skipped, without a host sync.

    ``requested``: the coefficient of the step's ``clip_grad_norm_`` calls, applied first;
    ``clip`` (``gradient_clipping``, 0: none) then clips the norm they left. Same semantics
    in fp64: a non-finite norm clips with an infinite norm (factor 0, as the host version),
    and ``norm`` is NaN then.
    """
    sq = sq_norm.reshape(()).double()
    finite = torch.isfinite(sq)
    norm = torch.where(finite, sq.sqrt() / divisor, torch.inf)
    reported = torch.where(finite, norm, torch.nan)
    if clip <= 0 and requested == 1.0 and divisor == 1.0:
        return DeviceGradientFactor(*unit_factor(sq.device), reported)
    factor = torch.full_like(sq, requested / divisor)
    if clip > 0:
        clipped = norm * requested
        factor = torch.where(clipped > clip, factor * (clip / (clipped + 1e-6)), factor)
    factor32 = factor.float()
    return DeviceGradientFactor(factor32, factor32.reciprocal(), reported)


class NormProbe:
    """Tells the host that a step's gradient norm was not finite, without waiting for it.

    With the non-finite check off, nothing on the host needs the norm, and reading it would
    make the step wait for the device. Each norm is copied to host memory asynchronously with
    an event after it; a later :meth:`post` (or :meth:`poll`) looks only at the copies whose
    event has completed. On the CPU the value is there at once: reading it waits for nothing.
    ``on_nonfinite()`` is called for the first non-finite norm seen; then the probe stops.
    """

    def __init__(self, on_nonfinite: Callable[[], None]) -> None:
        self.on_nonfinite = on_nonfinite
        self.enabled = True
        """Off once a non-finite norm was reported (and where a test counts host reads)."""
        self._pending: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []

    def post(self, norm: torch.Tensor) -> None:
        if not self.enabled:
            return
        if norm.device.type == "cpu":
            self._pending.append((norm, None))
        else:
            host = torch.empty((), dtype=norm.dtype, pin_memory=True)
            host.copy_(norm, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((host, event))
        self.poll()

    def poll(self) -> None:
        while self.enabled and self._pending:
            value, event = self._pending[0]
            if event is not None and not event.query():
                return
            self._pending.pop(0)
            if not math.isfinite(float(value)):
                self.enabled = False
                self._pending.clear()
                self.on_nonfinite()
