"""How one optimizer state (an Adam moment) is stored between steps: fp32, bf16, int8 or fp8.

The update never computes in the storage dtype: each step loads a piece of a state into fp32
scratch, runs torch's fused Adam/AdamW on it, and stores it back (``update/pieces.py``).
This module says what "load" and "store" mean for each dtype of the ``states`` dimension:

* ``fp32``: the state itself (no copy);
* ``bf16``: rounded to nearest (DeepSpeed's ``bf16_optimizer_states``);
* ``int8``: torchao's ``OptimState8bit`` -- 8-bit codes of a dynamic-tree map (signed for the
  first moment, unsigned for the second; arXiv 2110.02861) and one fp32 absmax scale per block
  of 256 values;
* ``fp8``: torchao's ``OptimStateFp8`` -- e4m3 codes and one fp32 absmax scale per block of 256.

torchao blocks each tensor separately, and its own optimizers keep any tensor with fewer than
4096 values, or a count that is not a multiple of the block, in fp32 without a word. Here a
state covers a whole master (a flat chunk of several parameters, or a ZeRO-3 local shard), laid
out as a :class:`BlockLayout`: each segment of the master (a parameter's piece, or bucket
padding) starts on a block boundary and is padded up to whole blocks, so no block holds values
of two parameters (a block's absmax taken from a neighbour with 1000x larger gradients would
flush a small parameter's second moment toward 0 and make its steps 5x-50x too large), and
every parameter is quantized whatever its size. The padding values are zero and never updated
(a zero adds nothing to its block's absmax). The int8 code tables are shared: one per device
and sign.

torchao is imported only when an int8 or fp8 state is made (importing it costs seconds).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from dtypeplan._quiet_imports import torchao_import_quiet
from dtypeplan.optimizers.kernels import int8_codes
from dtypeplan.resolver._memory import QUANTIZED, QUANTIZED_BLOCK

__all__ = [
    "QUANTIZED",
    "BlockLayout",
    "LayoutPiece",
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

_PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16}


@functools.cache
def _torchao() -> Any:
    try:
        with torchao_import_quiet():
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


@functools.cache
def _fp8_values(device: torch.device) -> torch.Tensor:
    """The fp32 value of each of the 256 e4m3 codes, by their bits."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    return codes.float().to(device)


@functools.cache
def _int8_tables(device: torch.device, signed: bool) -> int8_codes.CodeTables:
    """The two-table form of torchao's quantizer for the shared code table (``int8_codes``)."""
    _, _, quant_utils = _torchao()
    qmap = _code_table(torch.device("cpu"), signed)
    tables = int8_codes.build_tables(lambda v: quant_utils.quantize_8bit_with_qmap(v, qmap))
    return tables.to(device)


def padded(numel: int) -> int:
    """``numel`` rounded up to whole quantization blocks."""
    return -(-numel // QUANTIZED_BLOCK) * QUANTIZED_BLOCK


class LayoutPiece(NamedTuple):
    """Values ``[begin, end)`` of a master, stored at ``[stored_begin, stored_end)`` (whole
    blocks) of its quantized states. ``splits``: for a piece of several segments, the stored
    span cut into segment, padding, segment, padding, ... (the even parts are the values, in
    master order); None when the piece lies in one segment (stored contiguously)."""

    begin: int
    end: int
    stored_begin: int
    stored_end: int
    splits: tuple[int, ...] | None


class BlockLayout:
    """Where the values of one master sit in its quantized states: segment after segment, each
    starting on a block boundary (stored offset: the padded lengths of the segments before it).

    ``lengths`` are the master's segments in order (they sum to its numel): the parameter
    pieces of a flat chunk and any bucket padding between them, or one segment for a ZeRO-3
    local shard. fp32 and bf16 states keep the master's own layout.
    """

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = tuple(int(n) for n in lengths if n > 0)
        self.starts: list[int] = []
        self.stored_starts: list[int] = []
        begin = stored = 0
        for n in self.lengths:
            self.starts.append(begin)
            self.stored_starts.append(stored)
            begin += n
            stored += padded(n)
        self.numel, self.stored_numel = begin, stored
        self._pieces: dict[int, list[LayoutPiece]] = {}

    @classmethod
    def whole(cls, numel: int) -> BlockLayout:
        """One segment: a master that holds one parameter (a ZeRO-3 local shard)."""
        return cls([numel])

    def pieces(self, limit: int) -> list[LayoutPiece]:
        """The master in pieces of at most ``limit`` stored values (a multiple of the block):
        short segments together, one over ``limit / 4`` alone (in block-aligned parts of at
        most ``limit``)."""
        cached = self._pieces.get(limit)
        if cached is None:
            cached = self._pieces[limit] = self._make_pieces(limit)
        return cached

    def _make_pieces(self, limit: int) -> list[LayoutPiece]:
        out: list[LayoutPiece] = []
        group: list[int] = []  # segment numbers of the piece being gathered

        def flush() -> None:
            if not group:
                return
            first, last = group[0], group[-1]
            begin, stored_begin = self.starts[first], self.stored_starts[first]
            end = self.starts[last] + self.lengths[last]
            stored_end = self.stored_starts[last] + padded(self.lengths[last])
            if len(group) == 1:
                out.append(LayoutPiece(begin, end, stored_begin, stored_end, None))
            else:
                splits = tuple(
                    size
                    for j in group
                    for size in (self.lengths[j], padded(self.lengths[j]) - self.lengths[j])
                )
                out.append(LayoutPiece(begin, end, stored_begin, stored_end, splits))
            group.clear()

        stored_in_group = 0
        for j, n in enumerate(self.lengths):
            if padded(n) > limit // 4:
                # Alone: read and written in place, where gathering it would cost more than
                # the extra fused call.
                flush()
                stored_in_group = 0
                for part in range(0, n, limit):
                    m = min(limit, n - part)
                    begin, stored = self.starts[j] + part, self.stored_starts[j] + part
                    out.append(LayoutPiece(begin, begin + m, stored, stored + padded(m), None))
                continue
            if stored_in_group + padded(n) > limit:
                flush()
                stored_in_group = 0
            group.append(j)
            stored_in_group += padded(n)
        flush()
        return out

    def gather(self, stored: torch.Tensor) -> torch.Tensor:
        """fp32 values in this layout's stored order (``stored_numel``) in master order, as a
        new tensor (or ``stored`` itself when the two orders are the same)."""
        if len(self.lengths) <= 1:
            return stored if self.numel == stored.numel() else stored[: self.numel].clone()
        out = torch.empty(self.numel, dtype=stored.dtype, device=stored.device)
        for begin, at, n in zip(self.starts, self.stored_starts, self.lengths, strict=True):
            out[begin : begin + n].copy_(stored[at : at + n])
        return out

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """fp32 values in master order laid out for storage, zero padding after each segment."""
        out = torch.zeros(self.stored_numel, dtype=torch.float32, device=values.device)
        for begin, at, n in zip(self.starts, self.stored_starts, self.lengths, strict=True):
            out[at : at + n].copy_(values[begin : begin + n])
        return out


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


def new_state(
    dtype: str,
    numel: int,
    device: torch.device,
    *,
    signed: bool,
    layout: BlockLayout | None = None,
) -> torch.Tensor:
    """A zero state of ``numel`` values stored as ``dtype``; ``signed``: whether it can be
    negative (Adam's first moment), which picks the int8 code table. A quantized state holds
    ``layout``'s stored values (default: one segment of ``numel``)."""
    if dtype in _PLAIN:
        return torch.zeros(numel, dtype=_PLAIN[dtype], device=device)
    subclass_8bit, subclass_fp8, _ = _torchao()
    layout = layout or BlockLayout.whole(numel)
    if layout.numel != numel:
        raise ValueError(f"a block layout of {layout.numel} values for a state of {numel}")
    length = layout.stored_numel
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


def state_values(
    value: torch.Tensor, numel: int, layout: BlockLayout | None = None
) -> torch.Tensor:
    """The ``numel`` values ``value`` stands for, in master order, as a new fp32 tensor (what
    a checkpoint keeps); a quantized ``value`` is laid out as ``layout`` says (default: one
    segment)."""
    if is_quantized(value):
        layout = layout or BlockLayout.whole(numel)
        whole = torch.empty(value.numel(), dtype=torch.float32, device=value.device)
        _dequantize(value, 0, value.numel(), whole)
        return layout.gather(whole)
    return value.to(torch.float32, copy=True)


def to_storage(
    values: torch.Tensor, dtype: str, *, signed: bool, layout: BlockLayout | None = None
) -> torch.Tensor:
    """``values`` (1-D, any float dtype, master order) stored as ``dtype``; quantized in
    ``layout``'s blocks (default: one segment)."""
    layout = layout or BlockLayout.whole(values.numel())
    stored = new_state(dtype, values.numel(), values.device, signed=signed, layout=layout)
    if not is_quantized(stored):
        return stored.copy_(values)
    _quantize(layout.scatter(values.to(torch.float32)), stored, 0, stored.numel())
    return stored


def scratch_numel(piece: LayoutPiece) -> int:
    """The fp32 scratch :func:`load_piece` needs for ``piece``: its stored span (whole
    blocks, since a quantized state is read and written a block at a time), and the piece's
    values besides when it spans several segments."""
    span = piece.stored_end - piece.stored_begin
    return span if piece.splits is None else span + piece.end - piece.begin


def _dequantize(stored: torch.Tensor, begin: int, end: int, out: torch.Tensor) -> None:
    """Values ``[begin, end)`` (whole blocks) of a quantized state into ``out``, with
    torchao's own dequantization applied to the codes and scales directly (the subclass's
    dispatch costs more than the arithmetic on small chunks)."""
    subclass_8bit, _, _ = _torchao()
    first, last = begin // QUANTIZED_BLOCK, end // QUANTIZED_BLOCK
    quantized: Any = stored  # a torchao subclass: codes, scale (and qmap for int8)
    codes, scale = quantized.codes[begin:end], quantized.scale[first:last]
    if isinstance(stored, subclass_8bit.OptimState8bit):
        # torchao's dequant_with_qmap (qmap[codes] * scale), with index_select for the lookup:
        # the same values, several times faster than tensor[index] on CPU.
        values = torch.index_select(quantized.qmap, 0, codes.int())
    else:
        # Every e4m3 code's fp32 value by lookup: exactly what codes.float() gives, which CPU
        # torch converts element by element at several times the cost.
        values = torch.index_select(_fp8_values(codes.device), 0, codes.view(torch.uint8).int())
    blocks = out.view(-1, QUANTIZED_BLOCK)
    torch.mul(values.view(-1, QUANTIZED_BLOCK), scale.view(-1, 1), out=blocks)


def _quantize(values: torch.Tensor, stored: torch.Tensor, begin: int, end: int) -> None:
    """Quantize fp32 ``values`` (whole blocks) into ``[begin, end)`` of a quantized state: the
    codes of torchao's quantizers (what the subclass's ``copy_`` runs), int8 ones computed
    without its search (``int8_codes``)."""
    subclass_8bit, subclass_fp8, quant_utils = _torchao()
    first, last = begin // QUANTIZED_BLOCK, end // QUANTIZED_BLOCK
    quantized: Any = stored  # a torchao subclass: codes, scale (and qmap for int8)
    if isinstance(stored, subclass_8bit.OptimState8bit):
        scaled, scale = quant_utils.scale_tensor(values, QUANTIZED_BLOCK)
        if quantized.qmap is _code_table(quantized.qmap.device, quantized.signed):
            codes = int8_codes.quantize(scaled, _int8_tables(scaled.device, quantized.signed))
        else:  # a state made elsewhere with its own code table: torchao's search
            codes = quant_utils.quantize_8bit_with_qmap(scaled, quantized.qmap)
        quantized.codes[begin:end].copy_(codes)
    else:
        codes, scale = subclass_fp8.quantize_fp8(values, QUANTIZED_BLOCK)
        quantized.codes[begin:end].copy_(codes)
    quantized.scale[first:last].copy_(scale)


def load_piece(stored: torch.Tensor, piece: LayoutPiece, scratch: torch.Tensor) -> torch.Tensor:
    """Values ``[piece.begin, piece.end)`` of ``stored`` in fp32, in master order: the state's
    own view when it is fp32, else written into ``scratch`` (fp32, :func:`scratch_numel` long
    at least) and returned. A quantized state is read from ``piece``'s stored span."""
    begin, end = piece.begin, piece.end
    n = end - begin
    if not is_quantized(stored):
        if stored.dtype == torch.float32:
            return stored[begin:end]
        scratch[:n].copy_(stored[begin:end])
        return scratch[:n]
    span = piece.stored_end - piece.stored_begin
    if piece.splits is None:
        _dequantize(stored, piece.stored_begin, piece.stored_end, scratch[:span])
        return scratch[:n]
    staging = scratch[n : n + span]
    _dequantize(stored, piece.stored_begin, piece.stored_end, staging)
    torch.cat(staging.split(piece.splits)[::2], out=scratch[:n])  # one call, no index
    return scratch[:n]


def store_piece(
    values: torch.Tensor, stored: torch.Tensor, piece: LayoutPiece, scratch: torch.Tensor
) -> None:
    """Write back what :func:`load_piece` returned (``values``, updated), rounding or
    quantizing it into ``piece`` of ``stored``."""
    begin, end = piece.begin, piece.end
    if not is_quantized(stored):
        if stored.dtype != torch.float32:
            stored[begin:end].copy_(values)
        return  # fp32: updated in place
    n, span = end - begin, piece.stored_end - piece.stored_begin
    if piece.splits is None:
        # The padding beyond the segment joins its last block's absmax: it must stay zero.
        scratch[n:span].zero_()
        _quantize(scratch[:span], stored, piece.stored_begin, piece.stored_end)
        return
    parts = scratch[n : n + span].split(piece.splits)  # segment, padding, segment, ...
    # The padding after each segment joins its last block's absmax: it must stay zero.
    torch._foreach_zero_(list(parts[1::2]))
    torch._foreach_copy_(list(parts[::2]), list(values.split(piece.splits[::2])))
    _quantize(scratch[n : n + span], stored, piece.stored_begin, piece.stored_end)
