"""The one-pass update of ``one_pass.adam_one_pass`` as one Triton kernel (CUDA).

:func:`adam_one_pass_triton_` takes :func:`~dtypeplan.optimizers.kernels.one_pass.adam_one_pass`'s
arguments and gives its bits: read the gradient (fp32, bf16 or fp16) over ``grad_scale``, the
master (bf16 or fp32; bf16 plus its Kahan compensation), both moments (fp32 or bf16); do the
Adam/AdamW math in fp32, operation for operation as that function writes it; round the master
(nearest, stochastic with the same hashed noise, Kahan); store the moments; write the
parameter (bf16 or fp32) where it is not the master. Each element is read once and written
once: per parameter ``G + 2 * (W + C + M + V) + P`` bytes (see :func:`bytes_per_param`).

"Its bits" for every root too: torch's CPU ``sqrt`` on fp32 is not correctly rounded (about
one value in five one ulp off on this machine's AMD EPYC), so the host's eager update takes the
root in double (``one_pass._correctly_rounded_sqrt``), which rounds correctly as ``sqrt_rn``,
CUDA's ``sqrt`` and the host's compiled update (Inductor) do.

How it keeps the host update's bits:

* the scalars come from the same fp32 tensor (``hyperparameters``) and ``grad_scale`` from
  device memory, read in the kernel (no rounding of its own; the registry uploads the
  scalars from pinned memory, so nothing waits);
* every operation is one IEEE-rounded fp32 operation: ``div_rn`` and ``sqrt_rn`` for the
  division and root, and the launch turns Triton's FMA contraction off
  (``enable_fp_fusion=False``), so a mul and an add round on their own as in eager;
* bf16 is handled as its 16 bits (the tensors are passed as int16 views): widening is a shift;
  narrowing rounds to nearest even with integer operations, ``(b + 0x7FFF + ((b >> 16) & 1))
  >> 16``, which is exact on CUDA and in Triton's interpreter alike (the interpreter's own
  fp32 -> bf16 cast truncates). A NaN becomes bf16's quiet NaN 0x7FC0 (torch's scalar
  conversion gives that; its vectorized one gives 0xFFFF: either is a NaN, and the tests
  compare NaNs as NaNs);
* the stochastic-rounding noise is ``kernels/rounding.py``'s hash: element ``i`` draws
  ``mix32((offset + i) ^ key) & 0xFFFF``. Its first xorshift runs on int64 (the counter may
  pass 2**32), after which only the low 32 bits matter: the multiplies run on uint32, which
  wrap in CUDA and in the interpreter as eager's int64 product masked to 32 bits does.

:func:`adam_one_pass_triton_` updates one chunk; :func:`adam_one_pass_triton_multi_` a param
group's bucket chunks in one launch, through a pointer table and a tile table as
``triton_adamw.fused_mixed_adamw_multi_`` does (uploaded once per layout), each chunk's
noise key computed in the kernel from a per-master base and the step (the table stays the
same from step to step). ``BLOCK`` elements per program; offsets are int64. Triton is imported
guarded (``triton_adamw.triton``): this module imports without it and the call raises.
"""

from __future__ import annotations

from typing import Any

import torch

from dtypeplan.optimizers.kernels import launch_tables, rounding
from dtypeplan.optimizers.kernels import triton_adamw as fp32_kernel

__all__ = [
    "ROUNDINGS",
    "adam_one_pass_triton_",
    "adam_one_pass_triton_multi_",
    "bytes_per_param",
    "noise_key_base",
    "supports",
]

ROUNDINGS = {"nearest": 0, "stochastic": 1, "kahan": 2}
"""The master roundings and their codes in the kernel."""

BLOCK = 1024
NUM_WARPS = 4

_MASTER_DTYPES = (torch.float32, torch.bfloat16)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PARAM_DTYPES = (torch.float32, torch.bfloat16)

try:  # guarded: the module must import on machines without triton
    import triton
    import triton.language as tl
except Exception:  # any failure to import means "no triton" (triton_adamw says why)
    triton = None
    tl = None


def supports(
    master: torch.dtype,
    exp_avg: torch.dtype,
    exp_avg_sq: torch.dtype,
    grad: torch.dtype,
    param: torch.dtype | None,
) -> bool:
    """Whether the kernel serves these dtypes (``param``: None where the master is it)."""
    return (
        master in _MASTER_DTYPES
        and exp_avg in _MOMENT_DTYPES
        and exp_avg_sq in _MOMENT_DTYPES
        and grad in _GRAD_DTYPES
        and (param is None or param in _PARAM_DTYPES)
    )


def noise_key_base(seed: int, master_number: int) -> int:
    """What :func:`~dtypeplan.optimizers.kernels.rounding.noise_key` hashes the step with:
    ``noise_key(seed, number, step) == mix32((base + step) mod 2**32)``."""
    return rounding._mix32_int(rounding._mix32_int(seed) ^ master_number)


def bytes_per_param(
    master: torch.dtype,
    exp_avg: torch.dtype,
    exp_avg_sq: torch.dtype,
    grad: torch.dtype,
    param: torch.dtype | None,
    kahan: bool,
) -> int:
    """Bytes one step moves per parameter: the gradient read; master, Kahan compensation
    (bf16) and moments read and written; the parameter written."""

    def size(dtype: torch.dtype) -> int:
        return torch.empty((), dtype=dtype).element_size()

    state = size(master) + size(exp_avg) + size(exp_avg_sq) + (2 if kahan else 0)
    return size(grad) + 2 * state + (0 if param is None else size(param))


if triton is not None:

    @triton.jit
    def _widen_bf16(bits):
        """int16 bf16 bits -> the fp32 value (exact)."""
        wide = bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return wide.to(tl.float32, bitcast=True)

    @triton.jit
    def _narrow_bf16(x):
        """fp32 -> int16 bf16 bits, rounded to nearest even; a NaN -> 0x7FC0."""
        b = x.to(tl.uint32, bitcast=True)
        rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.int16, bitcast=True)

    @triton.jit
    def _load(ptr, offs, mask, IS_BF16: tl.constexpr):
        raw = tl.load(ptr + offs, mask=mask, other=0, eviction_policy="evict_first")
        if IS_BF16:
            value = _widen_bf16(raw)
        else:
            value = raw.to(tl.float32)
        return value

    @triton.jit
    def _store(ptr, offs, mask, value, IS_BF16: tl.constexpr):
        if IS_BF16:
            tl.store(ptr + offs, _narrow_bf16(value), mask=mask, eviction_policy="evict_first")
        else:
            tl.store(ptr + offs, value, mask=mask, eviction_policy="evict_first")

    @triton.jit
    def _update(
        master_ptr,
        grad_ptr,
        m_ptr,
        v_ptr,
        comp_ptr,
        param_ptr,
        hyper_ptr,
        scale_ptr,
        offs,
        mask,
        key,
        offset,
        MASTER_BF16: tl.constexpr,
        GRAD_BF16: tl.constexpr,
        M_BF16: tl.constexpr,
        V_BF16: tl.constexpr,
        PARAM_BF16: tl.constexpr,
        HAS_PARAM: tl.constexpr,
        DECOUPLED: tl.constexpr,
        WEIGHT_DECAY: tl.constexpr,
        ROUNDING: tl.constexpr,
    ):
        """The update of elements ``offs`` (int64) of one chunk; the noise counter of
        element ``offs`` is ``offset + offs`` under ``key``."""
        # The scalars, in one_pass's order: beta1, 1 - beta1, beta2, 1 - beta2, eps,
        # decay, step size, sqrt(bias correction 2).
        beta1 = tl.load(hyper_ptr + 0)
        one_minus_beta1 = tl.load(hyper_ptr + 1)
        beta2 = tl.load(hyper_ptr + 2)
        one_minus_beta2 = tl.load(hyper_ptr + 3)
        eps = tl.load(hyper_ptr + 4)
        decay = tl.load(hyper_ptr + 5)
        step_size = tl.load(hyper_ptr + 6)
        bc2_sqrt = tl.load(hyper_ptr + 7)
        scale = tl.load(scale_ptr)

        g = tl.div_rn(_load(grad_ptr, offs, mask, GRAD_BF16), scale)
        w = _load(master_ptr, offs, mask, MASTER_BF16)
        if ROUNDING == 2:
            w = w + _load(comp_ptr, offs, mask, True)
        if WEIGHT_DECAY:
            if DECOUPLED:
                w = w - w * decay
            else:
                g = g + w * decay
        m = _load(m_ptr, offs, mask, M_BF16) * beta1 + g * one_minus_beta1
        v = _load(v_ptr, offs, mask, V_BF16) * beta2 + (g * g) * one_minus_beta2
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        w = w - tl.div_rn(m, denom) * step_size
        _store(m_ptr, offs, mask, m, M_BF16)
        _store(v_ptr, offs, mask, v, V_BF16)

        if MASTER_BF16:
            if ROUNDING == 1:
                # The noise of counter offset + i under key: rounding._mix32. Past the
                # first xorshift only the low 32 bits reach the result.
                x = (offs + offset) ^ key
                h = ((x ^ (x >> 16)) & 0xFFFFFFFF).to(tl.uint32)
                h = h * 0x45D9F3B
                h = (h ^ (h >> 16)) * 0x45D9F3B
                noise = (h ^ (h >> 16)) & 0xFFFF
                bits = w.to(tl.uint32, bitcast=True)
                finite = (bits & 0x7F800000) != 0x7F800000
                # The carry out of the low 16 bits bumps the bf16 mantissa by one ulp; the
                # result's low bits are zero, so taking the high half is exact.
                rounded = tl.where(finite, (bits + noise) >> 16, bits >> 16)
                rounded = tl.where(w != w, 0x7FC0, rounded)
                stored = rounded.to(tl.uint16).to(tl.int16, bitcast=True)
            else:
                stored = _narrow_bf16(w)
            tl.store(master_ptr + offs, stored, mask=mask, eviction_policy="evict_first")
            if ROUNDING == 2:
                error = w - _widen_bf16(stored)
                _store(comp_ptr, offs, mask, error, True)
            if HAS_PARAM:
                if PARAM_BF16:
                    tl.store(param_ptr + offs, stored, mask=mask, eviction_policy="evict_first")
                else:
                    param = _widen_bf16(stored)
                    tl.store(param_ptr + offs, param, mask=mask, eviction_policy="evict_first")
        else:
            tl.store(master_ptr + offs, w, mask=mask, eviction_policy="evict_first")
            if HAS_PARAM:
                _store(param_ptr, offs, mask, w, PARAM_BF16)

    # An int argument equal to 1 would be specialized into a constexpr Python int (no
    # ``.to``: every step-1 launch failed to compile) and one divisible by 16 into another
    # variant: the per-step values are plain runtime arguments, so steps never recompile.
    @triton.jit(do_not_specialize=["key", "offset"])
    def _adam_one_pass_kernel(
        master_ptr,
        grad_ptr,
        m_ptr,
        v_ptr,
        comp_ptr,
        param_ptr,
        hyper_ptr,
        scale_ptr,
        n_elements,
        key,
        offset,
        MASTER_BF16: tl.constexpr,
        GRAD_BF16: tl.constexpr,
        M_BF16: tl.constexpr,
        V_BF16: tl.constexpr,
        PARAM_BF16: tl.constexpr,
        HAS_PARAM: tl.constexpr,
        DECOUPLED: tl.constexpr,
        WEIGHT_DECAY: tl.constexpr,
        ROUNDING: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < n_elements
        _update(
            master_ptr, grad_ptr, m_ptr, v_ptr, comp_ptr, param_ptr, hyper_ptr, scale_ptr,
            offs, mask, key.to(tl.int64) & 0xFFFFFFFF, offset.to(tl.int64),
            MASTER_BF16, GRAD_BF16, M_BF16, V_BF16, PARAM_BF16, HAS_PARAM, DECOUPLED,
            WEIGHT_DECAY, ROUNDING,
        )  # fmt: skip

    @triton.jit
    def _mix32(x):
        """rounding._mix32 on an int64 value in [0, 2**32)."""
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit(do_not_specialize=["step"])
    def _adam_one_pass_multi_kernel(
        pointers,
        tiles,
        master_example,
        grad_example,
        m_example,
        v_example,
        comp_example,
        param_example,
        hyper_ptr,
        scale_ptr,
        step,
        MASTER_BF16: tl.constexpr,
        GRAD_BF16: tl.constexpr,
        M_BF16: tl.constexpr,
        V_BF16: tl.constexpr,
        PARAM_BF16: tl.constexpr,
        HAS_PARAM: tl.constexpr,
        DECOUPLED: tl.constexpr,
        WEIGHT_DECAY: tl.constexpr,
        ROUNDING: tl.constexpr,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        # Tile -> (chunk, first element, elements); chunk -> its six addresses and the base
        # of its noise key (noise_key(seed, number, step) == mix32(base + step)).
        pid = tl.program_id(0).to(tl.int64)
        chunk = tl.load(tiles + pid * 3)
        begin = tl.load(tiles + pid * 3 + 1)
        count = tl.load(tiles + pid * 3 + 2)
        row = pointers + chunk * 7
        master_ptr = tl.load(row).to(tl.pointer_type(master_example.dtype.element_ty))
        grad_ptr = tl.load(row + 1).to(tl.pointer_type(grad_example.dtype.element_ty))
        m_ptr = tl.load(row + 2).to(tl.pointer_type(m_example.dtype.element_ty))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(v_example.dtype.element_ty))
        comp_ptr = tl.load(row + 4).to(tl.pointer_type(comp_example.dtype.element_ty))
        param_ptr = tl.load(row + 5).to(tl.pointer_type(param_example.dtype.element_ty))
        key = _mix32((tl.load(row + 6) + step.to(tl.int64)) & 0xFFFFFFFF)
        if ALIGNED:  # what the launcher checked (triton_adamw.aligned): 128-bit accesses
            master_ptr = tl.multiple_of(master_ptr, 16)
            grad_ptr = tl.multiple_of(grad_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
            comp_ptr = tl.multiple_of(comp_ptr, 16)
            param_ptr = tl.multiple_of(param_ptr, 16)
            begin = tl.multiple_of(begin, 16)
            count = tl.multiple_of(count, 16)
        lane = tl.arange(0, BLOCK).to(tl.int64)
        _update(
            master_ptr, grad_ptr, m_ptr, v_ptr, comp_ptr, param_ptr, hyper_ptr, scale_ptr,
            begin + lane, lane < count, key, 0,
            MASTER_BF16, GRAD_BF16, M_BF16, V_BF16, PARAM_BF16, HAS_PARAM, DECOUPLED,
            WEIGHT_DECAY, ROUNDING,
        )  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 tensors as their int16 bits (the kernel rounds them itself); others as they are."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _as_int32(key: int) -> int:
    """A 32-bit noise key as the signed int32 of its bits: Triton types an int argument by
    its value (int32 below 2**31, int64 above), so half the keys would compile a second
    variant; the kernel masks it back to 32 bits."""
    key = int(key)
    if not 0 <= key < 1 << 32:
        raise ValueError(f"key is a 32-bit noise key (rounding.noise_key), got {key}")
    return key - (1 << 32) if key >= 1 << 31 else key


def _check(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    compensation: torch.Tensor | None,
    param: torch.Tensor | None,
    rounding: str,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Refuse what the kernel cannot do; the compensation it reads (None unless a bf16 master
    rounds with Kahan) and the parameter it writes (None where the master is it)."""
    if triton is None:
        raise RuntimeError(
            "the one-pass Triton update needs Triton, which failed to import "
            f"({fp32_kernel._TRITON_IMPORT_ERROR}); the update falls back to torch ops "
            "(update/low_precision.py)"
        )
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {sorted(ROUNDINGS)}, got {rounding!r}")
    n = master.numel()
    named: list[tuple[str, torch.Tensor]] = [
        ("grad", grad),
        ("exp_avg", exp_avg),
        ("exp_avg_sq", exp_avg_sq),
    ]
    if param is not None:
        named.append(("param", param))
    kahan = master.dtype == torch.bfloat16 and rounding == "kahan"
    if kahan:
        if compensation is None or compensation.dtype != torch.bfloat16:
            raise ValueError("Kahan rounding needs a bf16 compensation laid out like the master")
        named.append(("compensation", compensation))
    if not supports(
        master.dtype,
        exp_avg.dtype,
        exp_avg_sq.dtype,
        grad.dtype,
        None if param is None else param.dtype,
    ):
        raise ValueError(
            "the one-pass Triton update serves bf16 or fp32 masters, fp32 or bf16 moments, "
            "fp32, bf16 or fp16 gradients and bf16 or fp32 parameters; got master "
            f"{master.dtype}, exp_avg {exp_avg.dtype}, exp_avg_sq {exp_avg_sq.dtype}, grad "
            f"{grad.dtype}, param {None if param is None else param.dtype}"
        )
    for name, t in [("master", master), *named]:
        if t.numel() != n or not t.is_contiguous() or t.device != master.device:
            raise ValueError(
                f"{name} must be contiguous with master's {n} elements on {master.device}; "
                f"got {t.numel()} on {t.device} (contiguous: {t.is_contiguous()})"
            )
    if master.device.type != "cuda" and not fp32_kernel._interpret_mode():
        raise RuntimeError(
            f"the one-pass Triton update runs on CUDA tensors, got {master.device} "
            "(set TRITON_INTERPRET=1 to run it in Triton's CPU interpreter)"
        )
    if param is not None and param.data_ptr() == master.data_ptr():
        param = None  # the master is the parameter
    return (compensation if kahan else None), param


def _flags(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param: torch.Tensor | None,
    *,
    decoupled: bool,
    weight_decay: bool,
    rounding: str,
) -> dict[str, Any]:
    """The kernels' compile-time switches, and the launch options: no FMA contraction (each
    mul and add rounds on its own, as eagerly)."""
    return {
        "MASTER_BF16": master.dtype == torch.bfloat16,
        "GRAD_BF16": grad.dtype == torch.bfloat16,
        "M_BF16": exp_avg.dtype == torch.bfloat16,
        "V_BF16": exp_avg_sq.dtype == torch.bfloat16,
        "PARAM_BF16": param is not None and param.dtype == torch.bfloat16,
        "HAS_PARAM": param is not None,
        "DECOUPLED": bool(decoupled),
        "WEIGHT_DECAY": bool(weight_decay),
        "ROUNDING": ROUNDINGS[rounding] if master.dtype == torch.bfloat16 else 0,
        "enable_fp_fusion": False,
    }


def _scalars(
    hyper: torch.Tensor, grad_scale: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    if hyper.dtype != torch.float32 or hyper.numel() != 8 or grad_scale.numel() != 1:
        raise ValueError("hyper must be one_pass.hyperparameters(); grad_scale one value")
    return hyper.to(device), grad_scale.reshape(()).to(device=device, dtype=torch.float32)


def adam_one_pass_triton_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    compensation: torch.Tensor | None,
    param: torch.Tensor | None,
    hyper: torch.Tensor,
    grad_scale: torch.Tensor,
    key: int,
    offset: int,
    *,
    decoupled: bool,
    weight_decay: bool,
    rounding: str,
    block_size: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> None:
    """:func:`~dtypeplan.optimizers.kernels.one_pass.adam_one_pass` as one Triton launch, on
    flat contiguous tensors of one CUDA device (or CPU under ``TRITON_INTERPRET=1``).

    ``key`` and ``offset`` are host integers here (``noise_key``; the index of ``master[0]``
    in its whole master). ``param``: the parameters' chunk, written with the new master's
    value; None where the master is it. With a bf16 master ``param`` is written from the
    rounded master (``adam_one_pass`` leaves it alone: there the master is the parameter)."""
    compensation, param = _check(master, grad, exp_avg, exp_avg_sq, compensation, param, rounding)
    block_size = fp32_kernel.check_block_size(block_size)
    hyper, scale = _scalars(hyper, grad_scale, master.device)
    n = master.numel()
    if n == 0:
        return
    _adam_one_pass_kernel[(triton.cdiv(n, block_size),)](
        _bits(master),
        _bits(grad),
        _bits(exp_avg),
        _bits(exp_avg_sq),
        _bits(compensation) if compensation is not None else _bits(master),
        _bits(param) if param is not None else _bits(master),
        hyper,
        scale,
        n,
        _as_int32(key),
        int(offset),
        BLOCK=block_size,
        num_warps=num_warps,
        **_flags(
            master, grad, exp_avg, exp_avg_sq, param,
            decoupled=decoupled, weight_decay=weight_decay, rounding=rounding,
        ),
    )  # fmt: skip


def adam_one_pass_triton_multi_(
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    compensations: list[torch.Tensor | None],
    params: list[torch.Tensor | None],
    hyper: torch.Tensor,
    grad_scale: torch.Tensor,
    key_bases: list[int],
    step: int,
    *,
    decoupled: bool,
    weight_decay: bool,
    rounding: str,
    block_size: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> None:
    """:func:`adam_one_pass_triton_` over many chunks (a param group's bucket chunks) with
    shared scalars, in one launch: each chunk's noise key is ``noise_key(seed, number, step)``
    with ``key_bases[i] = noise_key_base(seed, number)``, its counter starts at 0. The chunks
    share their dtypes; a pointer table and a tile table (``triton_adamw``'s design:
    a tile never straddles two chunks) are uploaded once per layout."""
    count = len(masters)
    lists = (grads, exp_avgs, exp_avg_sqs, compensations, params, key_bases)
    if any(len(items) != count for items in lists):
        raise ValueError("adam_one_pass_triton_multi_ needs lists of one length")
    if count == 0:
        return
    block_size = fp32_kernel.check_block_size(block_size)
    rows: list[tuple[torch.Tensor, ...]] = []
    kinds: set[tuple[Any, ...]] = set()
    for master, grad, m, v, comp, param in zip(
        masters, grads, exp_avgs, exp_avg_sqs, compensations, params, strict=True
    ):
        comp, param = _check(master, grad, m, v, comp, param, rounding)
        kinds.add(
            (master.device, master.dtype, grad.dtype, m.dtype, v.dtype, comp is None)
            + (None if param is None else param.dtype,)
        )
        rows.append((master, grad, m, v, comp if comp is not None else master,
                     param if param is not None else master))  # fmt: skip
    if len(kinds) != 1:
        raise ValueError(
            "adam_one_pass_triton_multi_ needs chunks of one device and one dtype per tensor "
            f"(and a parameter for all or none); got {sorted(map(str, kinds))}"
        )
    device = masters[0].device
    hyper, scale = _scalars(hyper, grad_scale, device)
    sizes = tuple(master.numel() for master in masters)
    num_tiles = sum(triton.cdiv(size, block_size) for size in sizes)
    if num_tiles == 0:
        return
    table = tuple(
        tuple(t.data_ptr() for t in row) + (int(base),)
        for row, base in zip(rows, key_bases, strict=True)
    )
    pointers = launch_tables.pointer_table("low-precision pointers", table, device)
    tiles = launch_tables.tile_table(sizes, block_size, device)
    first = rows[0]
    has_param = first[5].data_ptr() != first[0].data_ptr()
    _adam_one_pass_multi_kernel[(num_tiles,)](
        pointers,
        tiles,
        *(_bits(t) for t in first),
        hyper,
        scale,
        int(step),
        BLOCK=block_size,
        ALIGNED=fp32_kernel.aligned(tuple(row[:6] for row in table), sizes),
        num_warps=num_warps,
        **_flags(
            masters[0], grads[0], exp_avgs[0], exp_avg_sqs[0], first[5] if has_param else None,
            decoupled=decoupled, weight_decay=weight_decay, rounding=rounding,
        ),
    )  # fmt: skip
