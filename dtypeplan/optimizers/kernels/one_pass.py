"""One description of the Adam/AdamW update for bf16 masters and 16-bit moments, one pass a step.

:func:`adam_one_pass` is plain torch: load the master (bf16 upcast, plus its Kahan
compensation), the gradient and both moments, do the Adam/AdamW math in fp32, round the master
(nearest, stochastic, Kahan), round the moments into their storage dtype, write the 16-bit
parameter. On the host it runs compiled (``torch.compile``, Inductor's C++ code generation):
every element is read once and written once, no fp32 scratch. Where no compiler is present
(compiling fails: one warning) or ``DTYPEPLAN_EAGER_UPDATE=1`` is set, the same function runs
eagerly, op by op (about 10x slower than compiled). torch 2.13's Inductor also fails to compile
under ``ATEN_CPU_CAPABILITY=default`` (its vectorized code names ``at::vec``, which that build
does not declare): the same fallback.

Compiled and eager give the same bits (``tests/test_update_kernel.py``): every operation is one
IEEE-rounded fp32 operation in both (mul, add, div, sqrt; no ``lerp``, whose eager kernel uses
an FMA), and the compile pins ``-ffp-contract=off`` and no unsafe math, so the C++ compiler
neither contracts a mul and an add into an FMA nor reorders. The scalars (learning rate, bias
corrections, ...) are computed on the host in double and passed rounded to fp32 in one tensor,
so a scheduler changing them recompiles nothing; the length is dynamic, so pieces of any size
share one compiled kernel per combination of dtypes and roundings.

The math is torch's fused AdamW's, written out: with ``g = grad / grad_scale``,
``w -= w * (lr * wd)`` (AdamW; Adam adds ``w * wd`` to ``g``), ``m = m * b1 + g * (1 - b1)``,
``v = v * b2 + g * g * (1 - b2)``, ``w -= (m / (sqrt(v) / sqrt(1 - b2**t) + eps)) * (lr / (1 -
b1**t))``. torch's kernel forms ``m`` with ``lerp`` (an FMA) and orders some products
differently, so the fp32 results differ from it by a few fp32 ulps a step, which rounding to
bf16 mostly hides. Measured against the fp32 pieces around torch's fused AdamW (the path before
this kernel), 100 steps on 65,536 values (lr 1e-3, weight decay 0.01): rounded to nearest, with
bf16 or fp32 moments, 3 values differ, by at most 2 bf16 ulps or lr / 4 (3 of 16,384 too,
0.0112 against 0.0110 at most: the test allows one value in 2,000); with Kahan
rounding 12% of the pairs differ, each by less than one bf16 ulp of its value (2.5e-3
relative at most). ``tests/test_update_kernel.py`` holds that bound; the parity tests against
torch keep their tolerances. This path serves bf16 masters only (``LowPrecisionAdamUpdate``):
for fp32 masters with bf16 moments Inductor's bf16 conversions made it slower than the pieces.

Stochastic rounding adds 16 bits of noise to the bits bf16 drops and truncates (unbiased,
``kernels/rounding.py``'s ``round_stochastic_hashed``), from a counter-based hash, not a
``torch.Generator``: the noise of element ``i`` of master number ``k`` at step ``t`` is a hash
of ``(seed + shard rank, k, t, i)``. The same run gives the same bits, the compiled and eager
paths give the same bits, and since the step count is checkpointed, a resumed run draws the
same bits as the uninterrupted one.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from dtypeplan import _update_path as update_path
from dtypeplan.optimizers.kernels.rounding import round_stochastic_hashed

__all__ = [
    "OnePassUpdate",
    "adam_one_pass",
    "compile_options",
    "hyperparameters",
]


# Indices of the scalars in the fp32 tensor ``hyper`` (see :func:`hyperparameters`).
_BETA1, _ONE_MINUS_BETA1, _BETA2, _ONE_MINUS_BETA2, _EPS, _DECAY, _STEP_SIZE, _BC2_SQRT = range(8)


def hyperparameters(
    group: dict[str, Any], step: int, decoupled: bool, device: torch.device
) -> torch.Tensor:
    """The update's scalars for ``group`` at ``step`` (1-based), computed in double and held
    as one fp32 tensor."""
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    beta1, beta2 = (float(b) for b in group["betas"])
    values = [0.0] * 8
    values[_BETA1], values[_ONE_MINUS_BETA1] = beta1, 1.0 - beta1
    values[_BETA2], values[_ONE_MINUS_BETA2] = beta2, 1.0 - beta2
    values[_EPS] = float(group["eps"])
    values[_DECAY] = lr * wd if decoupled else wd
    values[_STEP_SIZE] = lr / (1.0 - beta1**step)
    values[_BC2_SQRT] = math.sqrt(1.0 - beta2**step)
    return torch.tensor(values, dtype=torch.float32, device=device)


def adam_one_pass(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    compensation: torch.Tensor | None,
    param: torch.Tensor | None,
    hyper: torch.Tensor,
    grad_scale: torch.Tensor,
    key: torch.Tensor,
    offset: torch.Tensor,
    *,
    decoupled: bool,
    weight_decay: bool,
    rounding: str,
) -> None:
    """One Adam/AdamW step of flat ``master`` (fp32 or bf16) from ``grad / grad_scale``, in
    place: the moments (fp32 or bf16) and, for ``rounding == "kahan"``, ``compensation``;
    ``param`` (or None) gets the new fp32 master's value in its dtype. ``hyper``: from
    :func:`hyperparameters`; ``key`` (int64, 0-d): ``kernels/rounding.py``'s :func:`noise_key
    <dtypeplan.optimizers.kernels.rounding.noise_key>`; ``offset`` (int64, 0-d): the index of
    ``master[0]`` in its whole master (the noise counter)."""
    g = grad.float() / grad_scale
    w = master.float()
    if compensation is not None:
        w = w + compensation.float()
    if weight_decay:
        if decoupled:
            w = w - w * hyper[_DECAY]
        else:
            g = g + w * hyper[_DECAY]
    m = exp_avg.float() * hyper[_BETA1] + g * hyper[_ONE_MINUS_BETA1]
    v = exp_avg_sq.float() * hyper[_BETA2] + (g * g) * hyper[_ONE_MINUS_BETA2]
    denom = torch.sqrt(v) / hyper[_BC2_SQRT] + hyper[_EPS]
    w = w - (m / denom) * hyper[_STEP_SIZE]
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if master.dtype == torch.float32:
        master.copy_(w)
        if param is not None:
            param.copy_(w)
        return
    if rounding == "stochastic":
        master.copy_(round_stochastic_hashed(w, key, offset))
    elif rounding == "kahan":
        rounded = w.to(master.dtype)
        assert compensation is not None
        compensation.copy_(w - rounded.float())
        master.copy_(rounded)
    else:
        master.copy_(w)


_COMPILE_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {
    # Each mul and add rounds on its own, as eagerly: no FMA contraction, no reassociation.
    "cpp.enable_floating_point_contract_flag": "off",
    "cpp.enable_unsafe_math_opt_flag": False,
}


def compile_options(rounding: str) -> dict[str, str | int | bool | Callable[..., Any]]:
    """Inductor's options for the kernel of ``rounding``.

    Only Kahan rounding reads a rounded bf16 value back as fp32 (its error term): there
    ``emulate_precision_casts`` must make Inductor round it (else it keeps the fp32 value and
    the compensation comes out zero). The other roundings read nothing back (every stored
    value is rounded once, on its store), so they go without the emulation's extra casts.
    With bf16 masters and moments rounded to nearest (16.8 M values, one thread, four
    interleaved runs, 2026-12-01) the step went from 3% slower to 9% faster (noise on a shared
    machine: 62.9 -> 57.5, 28.7 -> 29.7, 31.5 -> 29.9, 32.9 -> 30.1 ms); with an fp32 master and
    bf16 moments, 84.8 -> 48.8 ms. Compiled still gives eager's bits
    (``tests/test_update_kernel.py``)."""
    return {**_COMPILE_OPTIONS, "emulate_precision_casts": rounding == "kahan"}


@functools.cache
def _compiled(decoupled: bool, weight_decay: bool, rounding: str) -> Callable[..., None]:
    kernel = functools.partial(
        adam_one_pass, decoupled=decoupled, weight_decay=weight_decay, rounding=rounding
    )
    compiled: Callable[..., None] = torch.compile(
        kernel, dynamic=True, fullgraph=True, options=compile_options(rounding)
    )
    return compiled


class OnePassUpdate:
    """Calls :func:`adam_one_pass` compiled, or eagerly (forced, or after a failed compile)."""

    def __call__(self, *args: Any, decoupled: bool, weight_decay: bool, rounding: str) -> None:
        if update_path.path() == "compiled":
            try:
                _compiled(decoupled, weight_decay, rounding)(*args)
                return
            except Exception as error:  # noqa: BLE001 - any compile failure falls back
                update_path.compile_failed(repr(error))
                warnings.warn(
                    "dtypeplan: compiling the one-pass optimizer update failed "
                    f"({type(error).__name__}: {str(error)[:200]}); running it eagerly (the "
                    f"same numbers, slower). Set {update_path.EAGER_ENV}=1 to skip the attempt.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        adam_one_pass(*args, decoupled=decoupled, weight_decay=weight_decay, rounding=rounding)
