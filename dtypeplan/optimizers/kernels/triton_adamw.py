"""One-pass mixed-precision AdamW/Adam step over a flat shard (Triton on CUDA).

Design note
===========

What the step does, per element of a flat 1-D shard::

    g  = float(grad) * grad_factor          # grad_factor = clip_coef / (loss_scale * world_size)
    if weight_decay:                        # AdamW (decoupled) or Adam (L2)
        adam_w_mode: p = p * (1 - lr * wd)
        else:        g = g + wd * p
    m  = lerp(m, g, 1 - beta1)
    v  = v * beta2 + (1 - beta2) * g * g
    p  = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)    # bc_i = 1 - beta_i ** step
    param_out = p  (rounded to the 16-bit type)
    grad = 0       (optional)

``p`` is the fp32 master copy, ``m`` and ``v`` the fp32 moments. The semantics are exactly those
of ``torch.optim.AdamW`` / ``torch.optim.Adam`` (single-tensor path, same operation order);
:func:`mixed_adamw_reference_` is that math written with torch operations and
:func:`fused_mixed_adamw_` is the same math as one Triton kernel.

Bytes moved per parameter (one pass; each byte read or written exactly once)::

    reads : grad G + master 4 + m 4 + v 4
    writes: master 4 + m 4 + v 4 + param_out P + (G if zero_grad)
    total : 24 + G + P + (G if zero_grad)

with G = 4 for an fp32 accumulator, 2 for a bf16/fp16 gradient, and P = 2 for bf16/fp16
parameters, 4 for fp32 ones, 0 when there is no separate ``param_out``:

    =====================  ==========  ==========  =========
    grad                   param_out   zero_grad   bytes/param
    =====================  ==========  ==========  =========
    bf16/fp16              bf16/fp16   no          28
    bf16/fp16              bf16/fp16   yes         30
    fp32 accumulator       bf16/fp16   no          30
    fp32 accumulator       bf16/fp16   yes         34
    fp32                   none        no          28
    =====================  ==========  ==========  =========

The floor. The step does ~20 fp32 flops per element against 28-34 bytes, far below the ridge
point of current GPUs (their fp32 flop rate over their memory bandwidth is well above 2
flop/byte), so it is bound by memory. No implementation can beat
``t_floor = numel * bytes_per_param / B_copy``, where ``B_copy`` is the measured bandwidth of a
device-to-device copy (bytes read + bytes written per second), the best a streaming kernel
achieves in practice. Measured timings against that floor are not quoted here: they will come
from a dated result file under ``benchmarks/results/`` once the GPU benchmark has been run.

Why one pass. Composed of torch operations the same step is several kernels, each of which
streams its operands through HBM again: scaling the accumulator (read + write, 8 B), the fused
AdamW step (28 B), copying the master to bf16 (6 B), zeroing the accumulator (4 B) -- 46 B/param
instead of 34, plus, when the gradient arrives in bf16, accumulating it into an fp32 buffer first
(10 B more) which the kernel avoids by reading the bf16 gradient directly (56 B against 28).
Fusing removes every intermediate round trip,
and the clip factor is a 0-dim device tensor read inside the kernel, so no host sync is needed.

Kernel choices: one program per BLOCK contiguous elements (BLOCK=4096, 8 warps: 16 elements per
thread, i.e. four 128-bit loads per fp32 stream, enough loads in flight to saturate HBM3e);
int64 offsets so shards beyond 2**31 elements are fine; all math in fp32 with IEEE-rounded sqrt
and division (``sqrt_rn``/``div_rn``), which cost nothing in a memory-bound kernel and keep the
result within an ulp or so of torch; step-dependent bias corrections are computed on the host as
Python floats and passed as scalars (no recompilation per step); loads/stores use an
evict-first policy since every byte is touched once.

Many chunks, one launch. :func:`fused_mixed_adamw_multi_` updates a list of flat chunks (a
param group's per-bucket master chunks, which are separate tensors, and its parameter chunks,
which are strided over the flat buffer) in one launch: a pointer table holds each chunk's five
addresses, a tile table splits every chunk into BLOCK-sized tiles (a tile never straddles two
chunks), and program ``i`` runs tile ``i``. The host cost is one launch per param group
instead of one per bucket (a 14 us wrapper each, and at 64 ranks a bucket's chunk is under one
wave of the GPU); ``launch_tables`` builds and caches both: the pointer table again when an
address changes, the tile table once per chunk sizes, with a host-to-device copy, never a sync.

Triton is imported guarded: this module imports without it. :func:`fused_mixed_adamw_` raises
``RuntimeError`` when Triton or CUDA is missing (under ``TRITON_INTERPRET=1`` it also accepts CPU
tensors, which is how the kernel is tested on machines without a GPU).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dtypeplan.optimizers.kernels import launch_tables

__all__ = [
    "bytes_per_param",
    "fused_kernel_available",
    "fused_mixed_adamw_",
    "fused_mixed_adamw_multi_",
    "mixed_adamw_reference_",
    "triton_available",
]

DEFAULT_BLOCK = 4096
DEFAULT_NUM_WARPS = 8

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

try:  # guarded: the module must import on machines without triton
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: str | None = None
except Exception as exc:  # any failure to import means "no triton"
    triton = None
    tl = None
    # Only the message: the exception's traceback links (through f_back) to the frames of
    # whoever first imported this module lazily, e.g. an optimizer's step(), keeping it alive.
    _TRITON_IMPORT_ERROR = repr(exc)


def triton_available() -> bool:
    """True when ``triton`` imported successfully."""
    return triton is not None


def _interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fused_kernel_available(device: torch.device | str | None = None) -> bool:
    """True when :func:`fused_mixed_adamw_` can run on ``device`` (default: a CUDA device)."""
    if not triton_available():
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type == "cuda":
        return torch.cuda.is_available()
    return _interpret_mode()


def bytes_per_param(
    grad_dtype: torch.dtype, param_dtype: torch.dtype | None, zero_grad: bool
) -> int:
    """Bytes one step moves per parameter (see the design note): 24 + G + P (+ G if zeroing)."""
    g = torch.empty((), dtype=grad_dtype).element_size()
    p = 0 if param_dtype is None else torch.empty((), dtype=param_dtype).element_size()
    return 24 + g + p + (g if zero_grad else 0)


def _check_args(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor | None,
    step: int,
    grad_factor: float | torch.Tensor,
) -> None:
    n = master.numel()
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    if grad.dtype not in _GRAD_DTYPES:
        raise ValueError(f"grad must be float32, bfloat16 or float16, got {grad.dtype}")
    if param_out is not None and param_out.dtype not in _PARAM_DTYPES:
        raise ValueError(f"param_out must be float32, bfloat16 or float16, got {param_out.dtype}")
    named = [("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("grad", grad)]
    if param_out is not None:
        named.append(("param_out", param_out))
    for name, t in named:
        if t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D flat tensor, got shape {tuple(t.shape)}")
        if t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements, master has {n}")
        if t.device != master.device:
            raise ValueError(f"{name} is on {t.device}, master on {master.device}")
    if int(step) < 1:
        raise ValueError(f"step is the 1-based number of this update, got {step}")
    if isinstance(grad_factor, torch.Tensor):
        if grad_factor.numel() != 1 or grad_factor.dtype != torch.float32:
            raise ValueError("a tensor grad_factor must be a single float32 element")
        if grad_factor.device != master.device:
            raise ValueError(f"grad_factor is on {grad_factor.device}, master on {master.device}")


@torch.no_grad()
def mixed_adamw_reference_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_factor: float | torch.Tensor,
    adam_w_mode: bool = True,
    zero_grad: bool = False,
) -> None:
    """Reference of the mixed-precision step in torch operations; updates the tensors in place.

    ``step`` is the 1-based number of this update (torch's ``state["step"]`` after its
    increment). ``grad`` is read as ``grad.float() * grad_factor``; ``grad_factor`` is a Python
    float or a 0-dim float32 tensor on the device. The operation order is that of
    ``torch.optim.AdamW`` / ``torch.optim.Adam`` (single-tensor implementation).
    """
    _check_args(master, exp_avg, exp_avg_sq, grad, param_out, step, grad_factor)
    g = grad.float() * grad_factor
    if weight_decay != 0:
        if adam_w_mode:
            master.mul_(1 - lr * weight_decay)
        else:
            g = g.add(master, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-step_size)
    if param_out is not None and param_out.data_ptr() != master.data_ptr():
        param_out.copy_(master)
    if zero_grad:
        grad.zero_()


if triton is not None:

    @triton.jit
    def _mixed_adamw_kernel(
        master_ptr,
        m_ptr,
        v_ptr,
        grad_ptr,
        out_ptr,
        factor_ptr,
        n_elements,
        grad_factor,
        decay,
        l2_wd,
        w1,
        beta2,
        w2,
        neg_step_size,
        bc2_sqrt,
        eps,
        FACTOR_FROM_PTR: tl.constexpr,
        ADAM_W_MODE: tl.constexpr,
        HAS_WD: tl.constexpr,
        LERP_LOW: tl.constexpr,
        HAS_OUT: tl.constexpr,
        ZERO_GRAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements

        g_raw = tl.load(grad_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        p = tl.load(master_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        m = tl.load(m_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        v = tl.load(v_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")

        if FACTOR_FROM_PTR:
            factor = tl.load(factor_ptr).to(tl.float32)
        else:
            factor = grad_factor
        g = g_raw.to(tl.float32) * factor

        if HAS_WD:
            if ADAM_W_MODE:
                p = p * decay
            else:
                g = g + p * l2_wd

        # torch.lerp with a scalar weight: two formulas depending on |weight| < 0.5
        if LERP_LOW:
            m = m + w1 * (g - m)
        else:
            m = g - (g - m) * (1.0 - w1)
        # exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        v = v * beta2 + (w2 * g) * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p + neg_step_size * tl.div_rn(m, denom)

        tl.store(master_ptr + offs, p, mask=mask, eviction_policy="evict_first")
        tl.store(m_ptr + offs, m, mask=mask, eviction_policy="evict_first")
        tl.store(v_ptr + offs, v, mask=mask, eviction_policy="evict_first")
        if HAS_OUT:
            tl.store(
                out_ptr + offs,
                p.to(out_ptr.dtype.element_ty),  # fp downcast: round-to-nearest-even
                mask=mask,
                eviction_policy="evict_first",
            )
        if ZERO_GRAD:
            tl.store(
                grad_ptr + offs,
                tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty),
                mask=mask,
                eviction_policy="evict_first",
            )


if triton is not None:

    @triton.jit
    def _mixed_adamw_multi_kernel(
        pointers,
        tiles,
        grad_example,
        out_example,
        factor_ptr,
        grad_factor,
        decay,
        l2_wd,
        w1,
        beta2,
        w2,
        neg_step_size,
        bc2_sqrt,
        eps,
        FACTOR_FROM_PTR: tl.constexpr,
        ADAM_W_MODE: tl.constexpr,
        HAS_WD: tl.constexpr,
        LERP_LOW: tl.constexpr,
        HAS_OUT: tl.constexpr,
        ZERO_GRAD: tl.constexpr,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        # Tile -> (chunk, first element, elements); chunk -> its five addresses.
        pid = tl.program_id(0).to(tl.int64)
        chunk = tl.load(tiles + pid * 3)
        begin = tl.load(tiles + pid * 3 + 1)
        count = tl.load(tiles + pid * 3 + 2)
        row = pointers + chunk * 5
        master_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        grad_ptr = tl.load(row + 3).to(tl.pointer_type(grad_example.dtype.element_ty))
        out_ptr = tl.load(row + 4).to(tl.pointer_type(out_example.dtype.element_ty))
        if ALIGNED:
            # What the launcher checked (see _aligned); without it the compiler knows nothing
            # of addresses read from a table and loads one element at a time.
            master_ptr = tl.multiple_of(master_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
            grad_ptr = tl.multiple_of(grad_ptr, 16)
            out_ptr = tl.multiple_of(out_ptr, 16)
            begin = tl.multiple_of(begin, 16)
            count = tl.multiple_of(count, 16)
        lane = tl.arange(0, BLOCK)
        offs = begin + lane
        mask = lane < count

        g_raw = tl.load(grad_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        p = tl.load(master_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        m = tl.load(m_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
        v = tl.load(v_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")

        if FACTOR_FROM_PTR:
            factor = tl.load(factor_ptr).to(tl.float32)
        else:
            factor = grad_factor
        g = g_raw.to(tl.float32) * factor

        if HAS_WD:
            if ADAM_W_MODE:
                p = p * decay
            else:
                g = g + p * l2_wd

        if LERP_LOW:
            m = m + w1 * (g - m)
        else:
            m = g - (g - m) * (1.0 - w1)
        v = v * beta2 + (w2 * g) * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p + neg_step_size * tl.div_rn(m, denom)

        tl.store(master_ptr + offs, p, mask=mask, eviction_policy="evict_first")
        tl.store(m_ptr + offs, m, mask=mask, eviction_policy="evict_first")
        tl.store(v_ptr + offs, v, mask=mask, eviction_policy="evict_first")
        if HAS_OUT:
            tl.store(
                out_ptr + offs,
                p.to(out_example.dtype.element_ty),
                mask=mask,
                eviction_policy="evict_first",
            )
        if ZERO_GRAD:
            tl.store(
                grad_ptr + offs,
                tl.zeros([BLOCK], dtype=grad_example.dtype.element_ty),
                mask=mask,
                eviction_policy="evict_first",
            )


def aligned(addresses: tuple[tuple[int, ...], ...], sizes: tuple[int, ...]) -> bool:
    """Whether a multi-chunk launch may use 128-bit accesses: every address 16-byte aligned
    and every chunk a multiple of 16 elements (so a tile's start and length are; the flat
    layout's chunks are, ``buffers/layout.ALIGN``)."""
    return all(a % 16 == 0 for row in addresses for a in row) and all(
        size % 16 == 0 for size in sizes
    )


def check_block_size(block_size: int) -> int:
    """``block_size`` as an int, refused unless a power of two (a tile's lane count)."""
    block = int(block_size)
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block_size must be a power of two, got {block}")
    return block


def fused_mixed_adamw_multi_(
    masters: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    grads: list[torch.Tensor],
    params_out: list[torch.Tensor] | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_factor: float | torch.Tensor,
    adam_w_mode: bool = True,
    zero_grad: bool = False,
    block_size: int | None = None,
    num_warps: int | None = None,
) -> None:
    """:func:`fused_mixed_adamw_` over many chunks with shared hyperparameters, one launch.

    Every chunk is checked as :func:`fused_mixed_adamw_` checks its tensors; the gradients
    share one dtype, and so do the ``params_out`` (None: no separate parameters anywhere).
    """
    if triton is None:
        raise RuntimeError(
            "fused_mixed_adamw_multi_ needs Triton, which failed to import: "
            f"{_TRITON_IMPORT_ERROR!r}; use the torch optimizer path instead"
        )
    count = len(masters)
    outs: list[torch.Tensor | None] = list(params_out) if params_out is not None else [None] * count
    if not (len(exp_avgs) == len(exp_avg_sqs) == len(grads) == len(outs) == count):
        raise ValueError("fused_mixed_adamw_multi_ needs lists of one length")
    if count == 0:
        return
    for master, m, v, g, out in zip(masters, exp_avgs, exp_avg_sqs, grads, outs, strict=True):
        _check_args(master, m, v, g, out, step, grad_factor)
        for t in (master, m, v, g) + ((out,) if out is not None else ()):
            if not t.is_contiguous():
                raise ValueError("fused_mixed_adamw_multi_ needs contiguous tensors")
    device = masters[0].device
    if device.type != "cuda" and not _interpret_mode():
        raise RuntimeError(
            f"fused_mixed_adamw_multi_ runs on CUDA tensors, got {device} "
            "(set TRITON_INTERPRET=1 to run the kernel in Triton's CPU interpreter)"
        )
    if any(t.device != device for t in masters):
        raise ValueError("fused_mixed_adamw_multi_ needs every chunk on one device")
    if len({g.dtype for g in grads}) != 1:
        raise ValueError("fused_mixed_adamw_multi_ needs one gradient dtype")
    has_out = [
        o is not None and o.data_ptr() != mst.data_ptr()
        for o, mst in zip(outs, masters, strict=True)
    ]
    if any(has_out) and not all(has_out):
        raise ValueError("params_out must be given for every chunk or for none")
    if any(has_out) and len({o.dtype for o in outs if o is not None}) != 1:
        raise ValueError("fused_mixed_adamw_multi_ needs one params_out dtype")
    block = check_block_size(block_size or DEFAULT_BLOCK)

    with_out = all(has_out)
    addresses = tuple(
        (
            mst.data_ptr(),
            m.data_ptr(),
            v.data_ptr(),
            g.data_ptr(),
            o.data_ptr() if with_out and o is not None else mst.data_ptr(),
        )
        for mst, m, v, g, o in zip(masters, exp_avgs, exp_avg_sqs, grads, outs, strict=True)
    )
    sizes = tuple(mst.numel() for mst in masters)
    num_tiles = sum(triton.cdiv(size, block) for size in sizes)
    if num_tiles == 0:
        return
    pointers = launch_tables.pointer_table("pointers", addresses, device)
    tiles = launch_tables.tile_table(sizes, block, device)

    factor_is_tensor = isinstance(grad_factor, torch.Tensor)
    w1 = 1.0 - beta1
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    out_example = next((o for o in outs if o is not None), masters[0]) if with_out else masters[0]
    _mixed_adamw_multi_kernel[(num_tiles,)](
        pointers,
        tiles,
        grads[0],
        out_example,
        grad_factor if factor_is_tensor else grads[0],
        1.0 if factor_is_tensor else float(grad_factor),
        1.0 - lr * weight_decay,
        float(weight_decay),
        w1,
        float(beta2),
        1.0 - beta2,
        -lr / bias_correction1,
        bias_correction2**0.5,
        float(eps),
        FACTOR_FROM_PTR=factor_is_tensor,
        ADAM_W_MODE=bool(adam_w_mode),
        HAS_WD=weight_decay != 0,
        LERP_LOW=abs(w1) < 0.5,
        HAS_OUT=with_out,
        ZERO_GRAD=bool(zero_grad),
        BLOCK=block,
        ALIGNED=aligned(addresses, sizes),
        num_warps=int(num_warps or DEFAULT_NUM_WARPS),
    )


def fused_mixed_adamw_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_factor: float | torch.Tensor,
    adam_w_mode: bool = True,
    zero_grad: bool = False,
    block_size: int | None = None,
    num_warps: int | None = None,
) -> None:
    """The step of :func:`mixed_adamw_reference_` as one Triton kernel (one pass over memory).

    Same arguments and semantics; the tensors must be contiguous and on a CUDA device.
    ``block_size`` / ``num_warps`` override the launch configuration (for tuning).
    """
    if triton is None:
        raise RuntimeError(
            "fused_mixed_adamw_ needs Triton, which failed to import: "
            f"{_TRITON_IMPORT_ERROR}; use the torch optimizer path instead"
        )
    _check_args(master, exp_avg, exp_avg_sq, grad, param_out, step, grad_factor)
    if master.device.type != "cuda" and not _interpret_mode():
        raise RuntimeError(
            f"fused_mixed_adamw_ runs on CUDA tensors, got {master.device} "
            "(set TRITON_INTERPRET=1 to run the kernel in Triton's CPU interpreter)"
        )
    if master.device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("fused_mixed_adamw_ needs CUDA, which is not available")
    tensors = [master, exp_avg, exp_avg_sq, grad] + ([param_out] if param_out is not None else [])
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("fused_mixed_adamw_ needs contiguous tensors")
    n = master.numel()
    if n == 0:
        return
    if param_out is not None and param_out.data_ptr() == master.data_ptr():
        param_out = None  # writing the master onto itself

    block = check_block_size(block_size or DEFAULT_BLOCK)
    warps = int(num_warps or DEFAULT_NUM_WARPS)

    factor_is_tensor = isinstance(grad_factor, torch.Tensor)
    factor_ptr = grad_factor if factor_is_tensor else grad
    factor_value = 1.0 if factor_is_tensor else float(grad_factor)
    w1 = 1.0 - beta1
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    step_size = lr / bias_correction1
    launch_kwargs: dict[str, Any] = {"num_warps": warps}

    grid = (triton.cdiv(n, block),)
    _mixed_adamw_kernel[grid](
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        param_out if param_out is not None else master,
        factor_ptr,
        n,
        factor_value,
        1.0 - lr * weight_decay,
        float(weight_decay),
        w1,
        float(beta2),
        1.0 - beta2,
        -step_size,
        bias_correction2**0.5,
        float(eps),
        FACTOR_FROM_PTR=factor_is_tensor,
        ADAM_W_MODE=bool(adam_w_mode),
        HAS_WD=weight_decay != 0,
        LERP_LOW=abs(w1) < 0.5,
        HAS_OUT=param_out is not None,
        ZERO_GRAD=bool(zero_grad),
        BLOCK=block,
        **launch_kwargs,
    )
