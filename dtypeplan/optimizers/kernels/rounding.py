"""Rounding an fp32 update into bf16 master weights: to nearest, stochastically, or with Kahan.

With bf16 master weights the update is computed in fp32 (see ``update/pieces.py``) and
written back into the bf16 parameters, which are the masters. How it is written decides what
survives of an update smaller than half a bf16 ulp (2**-9 relative):

* ``nearest``: ``.to(bfloat16)`` (round to nearest even, DeepSpeed's
  ``bf16_master_weights_and_grads``). Such an update is lost every time: training with small
  learning rates stalls.
* ``stochastic``: round up with probability equal to the distance from the lower bf16 value
  (in ulps), so the expected stored value is the fp32 value. A small update moves the weight
  by one ulp now and then, at the right average rate. The bits are a hash of a counter under a
  key (torchao's ``_fp32_to_bf16_sr`` is the same arithmetic, with a generator's bits).
* ``kahan``: round to nearest and keep the error in a bf16 compensation buffer that is added
  back before the next update; master + compensation hold about 16 mantissa bits.

Stochastic rounding's noise is :func:`round_stochastic_hashed`'s: a hash of the element's
counter under a key (:func:`noise_key`, :func:`step_noise_key`) made of the seed, the master's
number and a step count the checkpoint saves (torch's ``step``, or ``keys.ROUNDING_STEP`` for a
class without one), on every path (the fp32 pieces, the one-pass update of
``kernels/one_pass.py`` and its Triton kernel). No ``torch.Generator`` is involved: its state is
no part of a checkpoint, so a resumed run would draw other bits than the uninterrupted one.
"""

from __future__ import annotations

import torch

__all__ = [
    "ROUNDINGS",
    "kahan_load",
    "kahan_store",
    "noise_key",
    "round_nearest",
    "round_stochastic_hashed",
    "round_stochastic_keyed",
    "step_noise_key",
]

ROUNDINGS = ("nearest", "stochastic", "kahan")
"""The values of ``master_weights.rounding`` (``plan.master_rounding``)."""

_HIGH_BITS = -0x10000  # 0xFFFF0000 as an int32: sign, exponent and bf16's 7 mantissa bits
_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27: a 32-bit value times it stays below 2**59 in int64
_EXPONENT = 0x7F800000


def round_nearest(source: torch.Tensor, out: torch.Tensor) -> None:
    """Write fp32 ``source`` into bf16 ``out``, rounded to nearest even."""
    out.copy_(source)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 ``x`` in [0, 2**32)."""
    x = torch.bitwise_and(torch.bitwise_xor(x, x >> 16) * _MIX, _MASK32)
    x = torch.bitwise_and(torch.bitwise_xor(x, x >> 16) * _MIX, _MASK32)
    return torch.bitwise_xor(x, x >> 16)


def _mix32_int(x: int) -> int:
    x &= _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    return (x >> 16) ^ x


def noise_key(seed: int, master_number: int, step: int) -> int:
    """The 32-bit key of the stochastic-rounding noise of one master at one step."""
    return _mix32_int(_mix32_int(_mix32_int(seed) ^ master_number) + step)


def step_noise_key(seed: int, master_number: int, step: torch.Tensor) -> torch.Tensor:
    """:func:`noise_key` with the step a tensor (int64, on ``step``'s device: no sync), the
    step count a checkpoint saves with the master's state."""
    base = _mix32_int(_mix32_int(seed) ^ master_number)
    return _mix32(torch.bitwise_and(step.to(torch.int64) + base, _MASK32))


def _mix32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """:func:`_mix32` in place on int64 ``x`` (``scratch``: an int64 tensor like it)."""
    for _ in range(2):
        x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=scratch))
        x.mul_(_MIX).bitwise_and_(_MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=scratch))


def round_stochastic_keyed(
    source: torch.Tensor, out: torch.Tensor, key: torch.Tensor, offset: int
) -> None:
    """Write fp32 ``source`` (contiguous) into bf16 ``out``, rounded stochastically with the
    hashed noise of counters ``offset + i`` under ``key``: :func:`round_stochastic_hashed`'s
    bits, so a resumed run draws the uninterrupted run's. ``source`` is overwritten (the
    caller's scratch). Eager, in place: two int64 temporaries where the functional form (which
    Inductor compiles) makes a dozen, 3x faster on the host (200k values: 3.6 ms against
    12 ms, one thread)."""
    bits = source.view(torch.int32)
    counters = torch.arange(
        offset, offset + source.numel(), dtype=torch.int64, device=source.device
    ).view(bits.shape)
    counters.bitwise_xor_(key.to(source.device))
    noise = _mix32_(counters, torch.empty_like(counters)).bitwise_and_(0xFFFF).to(torch.int32)
    finite = torch.bitwise_and(bits, _EXPONENT) != _EXPONENT
    # The carry out of the low 16 bits bumps the bf16 mantissa (and exponent) by one ulp;
    # non-finite values keep their bits (a NaN stays a NaN).
    noise.add_(bits).bitwise_and_(_HIGH_BITS)
    bits.copy_(torch.where(finite, noise, bits))
    out.copy_(source)  # exact for finite values: their low 16 bits are zero


def round_stochastic_hashed(
    values: torch.Tensor, key: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """fp32 ``values`` rounded stochastically to bf16 precision (still fp32, low 16 bits zero;
    unbiased: ``E[result] == values``), with the noise of counter ``offset + i`` under ``key``.

    Adds 16 bits of noise to the bits bf16 drops and truncates: the value rounds away from
    zero with probability (dropped bits) / 2**16, so ``E[result] == values`` (the noise of
    :func:`adam_one_pass <dtypeplan.optimizers.kernels.one_pass.adam_one_pass>` too).
    Infinities and NaNs keep their bits; a finite value within one bf16 ulp of the largest
    finite bf16 may round up to infinity, as it may in torchao."""
    bits = values.view(torch.int32)
    index = torch.arange(values.numel(), dtype=torch.int64, device=values.device) + offset
    noise = torch.bitwise_and(_mix32(torch.bitwise_xor(index, key)), 0xFFFF).to(torch.int32)
    # The carry out of the low 16 bits bumps the bf16 mantissa (and exponent) by one ulp.
    rounded = torch.bitwise_and(bits + noise, _HIGH_BITS)
    finite = torch.bitwise_and(bits, _EXPONENT) != _EXPONENT
    # Non-finite values keep their bits (a NaN stays a NaN); finite ones have zero low bits,
    # so converting them to bf16 is exact.
    return torch.where(finite, rounded, bits).view(torch.float32)


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
