"""One description of the Adam/AdamW update for 16-bit masters or moments, one pass a step.

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
an FMA; eager takes the root in double, as torch's fp32 ``sqrt`` is not correctly rounded:
:func:`_correctly_rounded_sqrt`), and the compile pins ``-ffp-contract=off`` and no unsafe
math, so the C++ compiler neither contracts a mul and an add into an FMA nor reorders. The
scalars (learning rate, bias corrections, ...) are computed on the host in double and passed
rounded to fp32 in one tensor, so a scheduler changing them recompiles nothing; the length is
dynamic, so pieces of any size share one compiled kernel per combination of dtypes and
roundings.

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
torch keep their tolerances. This path serves bf16 masters, and fp32 masters with a bf16 moment
(``LowPrecisionAdamUpdate``); with fp32 masters nothing hides those ulps, and the parity tests
of those cells hold them to their tolerances.

Stochastic rounding adds 16 bits of noise to the bits bf16 drops and truncates (unbiased,
``kernels/rounding.py``'s ``round_stochastic_hashed``), from a counter-based hash, not a
``torch.Generator``: the noise of element ``i`` of master number ``k`` at step ``t`` is a hash
of ``(seed + shard rank, k, t, i)``. The same run gives the same bits, the compiled and eager
paths give the same bits, and since the step count is checkpointed, a resumed run draws the
same bits as the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import warnings
from collections.abc import Callable, Iterator
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
    denom = _correctly_rounded_sqrt(v) / hyper[_BC2_SQRT] + hyper[_EPS]
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


def _correctly_rounded_sqrt(values: torch.Tensor) -> torch.Tensor:
    """The fp32 square root rounded correctly, compiled and eager alike.

    Inductor's root (``_mm512_sqrt_ps``, ``std::sqrt``) is IEEE's; torch's eager fp32
    ``sqrt`` (Sleef/MKL) is not: about one value in five is one ulp off on this machine's
    AMD EPYC (ATen's AVX-512, AVX2 and default kernels alike), which an fp32 master keeps. The
    eager path takes the root in double and rounds it to fp32, which is the correctly rounded
    fp32 root: the double root's error (an ulp of double) is far below the distance of any fp32
    root from a rounding midpoint."""
    if torch.compiler.is_compiling():
        return torch.sqrt(values)
    return torch.sqrt(values.double()).float()


_COMPILE_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {
    # Each mul and add rounds on its own, as eagerly: no FMA contraction, no reassociation.
    "cpp.enable_floating_point_contract_flag": "off",
    "cpp.enable_unsafe_math_opt_flag": False,
}


def compile_options(
    rounding: str, *, tiled_by_16_bit: bool = False
) -> dict[str, str | int | bool | Callable[..., Any]]:
    """Inductor's options for the kernel of ``rounding``.

    Only Kahan rounding reads a rounded bf16 value back as fp32 (its error term): there
    ``emulate_precision_casts`` must make Inductor round it (else it keeps the fp32 value and
    the compensation comes out zero). The other roundings read nothing back (every stored
    value is rounded once, on its store), so they go without the emulation's extra casts.
    With bf16 masters and moments rounded to nearest (16.8 M values, one thread, four
    interleaved runs, 2026-12-01) the step went from 3% slower to 9% faster (noise on a shared
    machine: 62.9 -> 57.5, 28.7 -> 29.7, 31.5 -> 29.9, 32.9 -> 30.1 ms); with an fp32 master and
    bf16 moments, 84.8 -> 48.8 ms. Compiled still gives eager's bits
    (``tests/test_update_kernel.py``).

    ``tiled_by_16_bit``: the kernel of an fp32 master beside 16-bit moments, compiled with
    :func:`_tiled_by`'s hint, which Inductor's FX graph cache does not know of (its key would
    be the unhinted kernel's, and a cached unhinted kernel would be taken): that kernel skips
    the cache (the C++ build of its code is still cached, by the code's text)."""
    options = {**_COMPILE_OPTIONS, "emulate_precision_casts": rounding == "kahan"}
    if tiled_by_16_bit:
        options["fx_graph_cache"] = False
    return options


RECOMPILE_LIMIT = 64
"""Dynamo's limit of compiled variants of :func:`adam_one_pass` while it runs here (torch's
default is 8). Every variant shares that one function's code object, and with it the limit:
each combination of roundings, weight decay and dtypes (master, gradient, each moment, the
parameter written or not) is one, so a process that builds several cells (a test run, a
sweep) passed 8, failed to compile with ``fullgraph=True``, and ran eagerly from then on."""


@functools.cache
def _compiled(
    decoupled: bool, weight_decay: bool, rounding: str, tiled_by_16_bit: bool = False
) -> Callable[..., None]:
    kernel = functools.partial(
        adam_one_pass, decoupled=decoupled, weight_decay=weight_decay, rounding=rounding
    )
    options = compile_options(rounding, tiled_by_16_bit=tiled_by_16_bit)
    compiled: Callable[..., None] = torch.compile(
        kernel, dynamic=True, fullgraph=True, options=options
    )
    return compiled


@contextlib.contextmanager
def _tiled_by(narrow: torch.dtype | None) -> Iterator[None]:
    """Inductor's C++ loops of the kernel compiled inside step ``narrow``'s vector width.

    Inductor (torch 2.13, ``TilingSelect.select_tiling``) tiles a kernel by a 16-bit dtype
    only if every one of its loop bodies holds a 16-bit value. An fp32 master's body reads
    only fp32 (the new moments, from fp32 intermediates), so the whole kernel is tiled by
    fp32's 16 lanes and every bf16 moment is loaded and stored as half of a 32-lane bf16
    vector, through a copy: the step took 28.6 ms for 16.8 M values against 14.0 ms tiled by
    bf16, and 14.8 for torch's fused fp32 AdamW (one AMD EPYC core). The bodies without a
    16-bit value are reported as ``narrow``'s while compiling (still computed in fp32: the
    same operations, the same bits, ``tests/test_update_kernel.py``). Where the hook is not
    there (another torch), nothing changes but the speed."""
    if narrow is None:
        yield
        return
    try:
        module: Any = importlib.import_module("torch._inductor.codegen.cpp")
    except ImportError:
        module = None
    original = getattr(module, "get_loop_body_lowp_fp", None)
    if original is None:
        yield
        return

    def narrowest(body: Any) -> tuple[torch.dtype | None, bool]:
        found, needs_fp32 = original(body)
        return (narrow, True) if found is None else (found, needs_fp32)

    module.get_loop_body_lowp_fp = narrowest
    try:
        yield
    finally:
        module.get_loop_body_lowp_fp = original


def _narrow_beside_fp32_master(master: torch.Tensor, *others: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype of a moment or gradient stepped with an fp32 master (None: none)."""
    if master.dtype != torch.float32:
        return None
    return next((t.dtype for t in others if t.dtype in (torch.bfloat16, torch.float16)), None)


class OnePassUpdate:
    """Calls :func:`adam_one_pass` compiled, or eagerly (forced, or after a failed compile)."""

    def __call__(self, *args: Any, decoupled: bool, weight_decay: bool, rounding: str) -> None:
        if update_path.path() == "compiled":
            try:
                narrow = _narrow_beside_fp32_master(args[0], args[2], args[3])
                compiled = _compiled(decoupled, weight_decay, rounding, narrow is not None)
                with _tiled_by(narrow), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                    compiled(*args)
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
