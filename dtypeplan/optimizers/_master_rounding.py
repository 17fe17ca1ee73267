"""Rounding an fp32 update into bf16 master weights: to nearest, stochastically, or with Kahan.

With bf16 master weights the update is computed in fp32 (see ``_low_precision_update.py``) and
written back into the bf16 parameters, which are the masters. How it is written decides what
survives of an update smaller than half a bf16 ulp (2**-9 relative):

* ``nearest``: ``.to(bfloat16)`` (round to nearest even, DeepSpeed's
  ``bf16_master_weights_and_grads``). Such an update is lost every time: training with small
  learning rates stalls.
* ``stochastic``: round up with probability equal to the distance from the lower bf16 value
  (in ulps), so the expected stored value is the fp32 value. A small update moves the weight
  by one ulp now and then, at the right average rate. The bits come from a seeded
  ``torch.Generator``: the same seed and the same sequence of calls give the same bits (torchao's
  ``_fp32_to_bf16_sr`` is the same arithmetic).
* ``kahan``: round to nearest and keep the error in a bf16 compensation buffer that is added
  back before the next update; master + compensation hold about 16 mantissa bits.
"""

from __future__ import annotations

import torch

__all__ = ["ROUNDINGS", "kahan_load", "kahan_store", "round_nearest", "round_stochastic"]

ROUNDINGS = ("nearest", "stochastic", "kahan")
"""The values of ``master_weights.rounding`` (``plan.master_rounding``)."""

_HIGH_BITS = -0x10000  # 0xFFFF0000 as an int32: sign, exponent and bf16's 7 mantissa bits


def round_nearest(source: torch.Tensor, out: torch.Tensor) -> None:
    """Write fp32 ``source`` into bf16 ``out``, rounded to nearest even."""
    out.copy_(source)


def round_stochastic(
    source: torch.Tensor,
    out: torch.Tensor,
    generator: torch.Generator,
    noise: torch.Tensor | None = None,
) -> None:
    """Write fp32 ``source`` into bf16 ``out``, rounded stochastically (unbiased).

    Adds 16 uniform random bits to the bits that bf16 drops and truncates: the value rounds
    away from zero with probability (dropped bits) / 2**16, so ``E[out] == source``.
    ``source`` is overwritten (it is the caller's scratch). ``noise``, an int32 scratch of at
    least ``source``'s size, avoids an allocation. Infinities and NaNs stay what they are; a
    finite value within one bf16 ulp of the largest finite bf16 may round up to infinity, as
    it may in torchao.
    """
    bits = source.view(torch.int32)
    if noise is None:
        noise = torch.empty_like(bits)
    noise = noise[: bits.numel()].view_as(bits)
    noise.random_(0, 1 << 16, generator=generator)
    finite = torch.isfinite(source)
    # The carry out of the low 16 bits bumps the bf16 mantissa (and exponent) by one ulp.
    noise.add_(bits)
    noise.bitwise_and_(_HIGH_BITS)
    # Non-finite values keep their bits: the conversion below keeps a NaN a NaN.
    bits.copy_(torch.where(finite, noise, bits))
    out.copy_(source)  # exact for finite values: their low 16 bits are zero


def kahan_load(master: torch.Tensor, compensation: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (fp32) = the value the bf16 pair ``master + compensation`` stands for."""
    out.copy_(master)
    out.add_(compensation)


def kahan_store(source: torch.Tensor, master: torch.Tensor, compensation: torch.Tensor) -> None:
    """Round fp32 ``source`` to nearest into ``master``; keep the error in ``compensation``.

    ``source`` is overwritten with the error (it is the caller's scratch).
    """
    master.copy_(source)
    source.sub_(master)
    compensation.copy_(source)
