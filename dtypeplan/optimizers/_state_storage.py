"""How one optimizer state (an Adam moment) is stored between steps: fp32, bf16, int8 or fp8.

The update never computes in the storage dtype: each step loads a piece of a state into fp32
scratch, runs torch's fused Adam/AdamW on it, and stores it back (``_low_precision_update.py``).
This module says what "load" and "store" mean for each dtype of the ``states`` dimension:

* ``fp32``: the state itself (no copy);
* ``bf16``: rounded to nearest (DeepSpeed's ``bf16_optimizer_states``);
* ``int8``: torchao's ``OptimState8bit`` -- 8-bit codes of a dynamic-tree map (signed for the
  first moment, unsigned for the second; arXiv 2110.02861) and one fp32 absmax scale per block
  of 256 values;
* ``fp8``: torchao's ``OptimStateFp8`` -- e4m3 codes and one fp32 absmax scale per block of 256.

torchao's own optimizers keep any tensor with fewer than 4096 values, or a count that is not a
multiple of the block, in fp32 without a word. Here a state covers a whole master chunk and is
padded up to whole blocks instead, so every chunk is quantized whatever its size, and
``plan.memory()`` is what is held. The padding values are zero and never updated (a zero adds
nothing to its block's absmax). The int8 code tables are shared: one per device and sign.

torchao is imported only when an int8 or fp8 state is made (importing it costs seconds).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dtypeplan.resolver._memory import QUANTIZED_BLOCK

__all__ = [
    "QUANTIZED",
    "is_quantized",
    "load_piece",
    "new_state",
    "padded",
    "state_dtype_name",
    "state_tensors",
    "state_values",
    "scratch_numel",
    "store_piece",
    "to_storage",
]

QUANTIZED = ("int8", "fp8")
"""The state dtypes stored as torchao's blockwise codes."""

_PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16}


@functools.cache
def _torchao() -> Any:
    try:
        from torchao.optim import quant_utils, subclass_8bit, subclass_fp8
    except ImportError as error:  # pragma: no cover - torchao is a dependency
        raise ImportError(
            "int8 and fp8 optimizer states are torchao's quantized states: pip install torchao"
        ) from error
    return subclass_8bit, subclass_fp8, quant_utils


@functools.cache
def _code_table(device: torch.device, signed: bool) -> torch.Tensor:
    subclass_8bit, _, quant_utils = _torchao()
    table = subclass_8bit.get_qmap_signed() if signed else subclass_8bit.get_qmap_unsigned()
    return torch.tensor(table, dtype=torch.float32, device=device)


def padded(numel: int) -> int:
    """``numel`` rounded up to whole quantization blocks."""
    return -(-numel // QUANTIZED_BLOCK) * QUANTIZED_BLOCK


def is_quantized(value: Any) -> bool:
    """Whether ``value`` is one of torchao's quantized states (int8 or fp8 codes)."""
    if not torch.is_tensor(value) or type(value) is torch.Tensor:
        return False
    subclass_8bit, subclass_fp8, _ = _torchao()
    return isinstance(value, (subclass_8bit.OptimState8bit, subclass_fp8.OptimStateFp8))


def state_dtype_name(value: torch.Tensor) -> str:
    """The ``states`` dtype name ``value`` is stored in."""
    if is_quantized(value):
        _, subclass_fp8, _ = _torchao()
        return "fp8" if isinstance(value, subclass_fp8.OptimStateFp8) else "int8"
    return "bf16" if value.dtype == torch.bfloat16 else "fp32"


def new_state(dtype: str, numel: int, device: torch.device, *, signed: bool) -> torch.Tensor:
    """A zero state of ``numel`` values stored as ``dtype``; ``signed``: whether it can be
    negative (Adam's first moment), which picks the int8 code table."""
    if dtype in _PLAIN:
        return torch.zeros(numel, dtype=_PLAIN[dtype], device=device)
    subclass_8bit, subclass_fp8, _ = _torchao()
    length = padded(numel)
    scale = torch.zeros(length // QUANTIZED_BLOCK, dtype=torch.float32, device=device)
    if dtype == "int8":
        codes = torch.zeros(length, dtype=torch.uint8, device=device)
        return subclass_8bit.OptimState8bit(
            codes, scale, _code_table(torch.device(device), signed), signed
        )
    if dtype == "fp8":
        codes = torch.zeros(length, dtype=torch.float8_e4m3fn, device=device)
        return subclass_fp8.OptimStateFp8(codes, scale)
    raise ValueError(f"unknown optimizer-state dtype {dtype!r}")


def state_tensors(value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The plain tensors that hold ``value``: itself, or the codes, scales (and code table)
    of a quantized state, so that memory is counted in real bytes."""
    if not is_quantized(value):
        return (value,)
    names, _ = value.__tensor_flatten__()  # type: ignore[attr-defined]
    return tuple(getattr(value, name) for name in names)


def state_values(value: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` values of ``value`` as a new fp32 tensor (what a checkpoint keeps)."""
    if is_quantized(value):
        whole = torch.empty(value.numel(), dtype=torch.float32, device=value.device)
        _dequantize(value, 0, value.numel(), whole)
        return whole[:numel].clone() if numel < value.numel() else whole
    return value.to(torch.float32, copy=True)


def to_storage(values: torch.Tensor, dtype: str, *, signed: bool) -> torch.Tensor:
    """``values`` (1-D, any float dtype) stored as ``dtype``."""
    stored = new_state(dtype, values.numel(), values.device, signed=signed)
    if not is_quantized(stored):
        return stored.copy_(values)
    whole = torch.zeros(stored.numel(), dtype=torch.float32, device=values.device)
    whole[: values.numel()].copy_(values)
    _quantize(whole, stored, 0, stored.numel())
    return stored


def scratch_numel(numel: int) -> int:
    """The fp32 scratch :func:`load_piece` needs for a piece of ``numel`` values: whole
    blocks, since a quantized state is read and written a block at a time."""
    return padded(numel)


def _dequantize(stored: torch.Tensor, begin: int, end: int, out: torch.Tensor) -> None:
    """Values ``[begin, end)`` (whole blocks) of a quantized state into ``out``, with
    torchao's own dequantization applied to the codes and scales directly (the subclass's
    dispatch costs more than the arithmetic on small chunks)."""
    subclass_8bit, _, quant_utils = _torchao()
    first, last = begin // QUANTIZED_BLOCK, end // QUANTIZED_BLOCK
    quantized: Any = stored  # a torchao subclass: codes, scale (and qmap for int8)
    codes, scale = quantized.codes[begin:end], quantized.scale[first:last]
    if isinstance(stored, subclass_8bit.OptimState8bit):
        out.copy_(quant_utils.dequant_with_qmap(codes, quantized.qmap, scale))
    else:
        torch.mul(
            codes.float().view(-1, QUANTIZED_BLOCK),
            scale.view(-1, 1),
            out=out.view(-1, QUANTIZED_BLOCK),
        )


def _quantize(values: torch.Tensor, stored: torch.Tensor, begin: int, end: int) -> None:
    """Quantize fp32 ``values`` (whole blocks) into ``[begin, end)`` of a quantized state with
    torchao's quantizers (what the subclass's ``copy_`` runs)."""
    subclass_8bit, subclass_fp8, quant_utils = _torchao()
    first, last = begin // QUANTIZED_BLOCK, end // QUANTIZED_BLOCK
    quantized: Any = stored  # a torchao subclass: codes, scale (and qmap for int8)
    if isinstance(stored, subclass_8bit.OptimState8bit):
        scaled, scale = quant_utils.scale_tensor(values, QUANTIZED_BLOCK)
        quantized.codes[begin:end].copy_(
            quant_utils.quantize_8bit_with_qmap(scaled, quantized.qmap)
        )
    else:
        codes, scale = subclass_fp8.quantize_fp8(values, QUANTIZED_BLOCK)
        quantized.codes[begin:end].copy_(codes)
    quantized.scale[first:last].copy_(scale)


def load_piece(stored: torch.Tensor, begin: int, end: int, scratch: torch.Tensor) -> torch.Tensor:
    """Values ``[begin, end)`` of ``stored`` in fp32: the state's own view when it is fp32,
    else written into ``scratch`` (fp32, :func:`scratch_numel` long at least) and returned.
    ``begin`` is a multiple of the block (every piece starts on one)."""
    n = end - begin
    if not is_quantized(stored):
        if stored.dtype == torch.float32:
            return stored[begin:end]
        scratch[:n].copy_(stored[begin:end])
        return scratch[:n]
    last = min(padded(end), stored.numel())
    _dequantize(stored, begin, last, scratch[: last - begin])
    return scratch[:n]


def store_piece(
    values: torch.Tensor, stored: torch.Tensor, begin: int, end: int, scratch: torch.Tensor
) -> None:
    """Write back what :func:`load_piece` returned (``values``, updated), rounding or
    quantizing it into ``[begin, end)`` of ``stored``."""
    if not is_quantized(stored):
        if stored.dtype != torch.float32:
            stored[begin:end].copy_(values)
        return  # fp32: updated in place
    last = min(padded(end), stored.numel())
    # The padding beyond ``end`` joins the last block's absmax: it must stay zero.
    scratch[end - begin : last - begin].zero_()
    _quantize(scratch[: last - begin], stored, begin, last)
