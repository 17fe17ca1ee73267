"""How one optimizer state (an Adam moment) is stored between steps, in the format its
record says (``dtypeplan/_formats.py``: fp32, bf16, torchao's int8 or fp8 blocks).

The update never computes in the storage format: each step loads a piece of a state into fp32
scratch, runs torch's fused Adam/AdamW on it, and stores it back (``update/pieces.py``).
This module says what "load" and "store" mean for a state, whatever its format: a plain one
(fp32, bf16) is read and rounded in place; a quantized one is decoded and encoded a block at a
time by its format's record.

torchao blocks each tensor separately, and its own optimizers keep any tensor with fewer than
4096 values, or a count that is not a multiple of the block, in fp32 without a word. Here a
state covers a whole master (a flat chunk of several parameters, or a ZeRO-3 local shard), laid
out as a :class:`BlockLayout`: each segment of the master (a parameter's piece, or bucket
padding) starts on a block boundary and is padded up to whole blocks, so no block holds values
of two parameters (a block's absmax taken from a neighbour with 1000x larger gradients would
flush a small parameter's second moment toward 0 and make its steps 5x-50x too large), and
every parameter is quantized whatever its size. The padding values are zero and never updated
(a zero adds nothing to its block's absmax). A state of no values (a ZeRO-3 rank whose local
shard of a parameter is empty) holds no codes: it is an empty fp32 tensor, whatever its format
(torchao cannot hold zero blocks).

torchao is imported only when an int8 or fp8 state is made (importing it costs seconds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from dtypeplan._formats import FORMATS, QuantizedFormat, format_of, state_format

__all__ = [
    "BlockLayout",
    "LayoutPiece",
    "is_quantized",
    "layout_block",
    "load_piece",
    "new_state",
    "state_tensors",
    "state_values",
    "scratch_numel",
    "store_piece",
    "to_storage",
]


def layout_block(names: Sequence[str]) -> int:
    """The block a layout shared by states of the formats ``names`` pads to: a multiple of
    each quantized format's block (their least common multiple; 1 without one)."""
    blocks = [f.block for f in map(state_format, names) if f.quantized]
    return math.lcm(*blocks) if blocks else 1


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
    local shard. ``block``: the values each segment is padded to a multiple of
    (:func:`layout_block` of the formats stored in it); fp32 and bf16 states keep the master's
    own layout (a layout of block 1 reads them).
    """

    def __init__(self, lengths: Sequence[int], *, block: int) -> None:
        self.block = block
        self.lengths = tuple(int(n) for n in lengths if n > 0)
        self.starts: list[int] = []
        self.stored_starts: list[int] = []
        begin = stored = 0
        for n in self.lengths:
            self.starts.append(begin)
            self.stored_starts.append(stored)
            begin += n
            stored += self.padded(n)
        self.numel, self.stored_numel = begin, stored
        self._pieces: dict[int, list[LayoutPiece]] = {}

    @classmethod
    def whole(cls, numel: int, *, block: int) -> BlockLayout:
        """One segment: a master that holds one parameter (a ZeRO-3 local shard)."""
        return cls([numel], block=block)

    def padded(self, numel: int) -> int:
        """``numel`` rounded up to whole blocks."""
        return -(-numel // self.block) * self.block

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
            stored_end = self.stored_starts[last] + self.padded(self.lengths[last])
            if len(group) == 1:
                out.append(LayoutPiece(begin, end, stored_begin, stored_end, None))
            else:
                splits = tuple(
                    size
                    for j in group
                    for size in (self.lengths[j], self.padded(self.lengths[j]) - self.lengths[j])
                )
                out.append(LayoutPiece(begin, end, stored_begin, stored_end, splits))
            group.clear()

        stored_in_group = 0
        for j, n in enumerate(self.lengths):
            if self.padded(n) > limit // 4:
                # Alone: read and written in place, where gathering it would cost more than
                # the extra fused call.
                flush()
                stored_in_group = 0
                for part in range(0, n, limit):
                    m = min(limit, n - part)
                    begin, stored = self.starts[j] + part, self.stored_starts[j] + part
                    out.append(LayoutPiece(begin, begin + m, stored, stored + self.padded(m), None))
                continue
            if stored_in_group + self.padded(n) > limit:
                flush()
                stored_in_group = 0
            group.append(j)
            stored_in_group += self.padded(n)
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
    """Whether ``value`` is a quantized state: held in a quantized format's container (codes
    and block scales in a torchao tensor), whatever its code table."""
    if not torch.is_tensor(value) or type(value) is torch.Tensor:
        return False
    for fmt in FORMATS.values():
        if isinstance(fmt, QuantizedFormat) and isinstance(value, fmt.container()):
            return True
    return False


def _quantized_format(value: Any) -> QuantizedFormat:
    """The format of the quantized state ``value``; ValueError for codes of no known format."""
    fmt = format_of(value)
    if not isinstance(fmt, QuantizedFormat):
        raise ValueError(
            f"a quantized state of {type(value).__name__} in no known state format (its code "
            "table is none of dtypeplan/_formats.py's)"
        )
    return fmt


def new_state(
    dtype: str,
    numel: int,
    device: torch.device,
    *,
    signed: bool,
    layout: BlockLayout | None = None,
) -> torch.Tensor:
    """A zero state of ``numel`` values stored in the format ``dtype``; ``signed``: whether it
    can be negative (Adam's first moment), which picks the code table of a format with one per
    sign. A quantized state holds ``layout``'s stored values (default: one segment of
    ``numel``); a state of no values holds none (an empty fp32 tensor)."""
    fmt = state_format(dtype)
    if not isinstance(fmt, QuantizedFormat):
        return torch.zeros(numel, dtype=fmt.storage_dtype, device=device)
    layout = layout or BlockLayout.whole(numel, block=fmt.block)
    if layout.numel != numel:
        raise ValueError(f"a block layout of {layout.numel} values for a state of {numel}")
    if layout.block % fmt.block:
        raise ValueError(
            f"a layout padded to {layout.block} values for {fmt.name} blocks of {fmt.block}"
        )
    if layout.stored_numel == 0:
        # No values, no codes: torchao cannot hold zero blocks (its block size is codes per
        # scale), and a state of nothing has nothing to quantize.
        return torch.zeros(0, dtype=torch.float32, device=device)
    return fmt.new(layout.stored_numel, torch.device(device), signed=signed)


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
        fmt = _quantized_format(value)
        layout = layout or BlockLayout.whole(numel, block=fmt.block)
        whole = torch.empty(layout.stored_numel, dtype=torch.float32, device=value.device)
        _decode(fmt, value, 0, layout.stored_numel, whole)
        return layout.gather(whole)
    return value.to(torch.float32, copy=True)


def to_storage(
    values: torch.Tensor, dtype: str, *, signed: bool, layout: BlockLayout | None = None
) -> torch.Tensor:
    """``values`` (1-D, any float dtype, master order) stored as ``dtype``; quantized in
    ``layout``'s blocks (default: one segment)."""
    fmt = state_format(dtype)
    layout = layout or BlockLayout.whole(values.numel(), block=fmt.block)
    stored = new_state(dtype, values.numel(), values.device, signed=signed, layout=layout)
    if not is_quantized(stored):
        return stored.copy_(values)
    fmt = _quantized_format(stored)
    _encode(fmt, layout.scatter(values.to(torch.float32)), stored, 0, layout.stored_numel)
    return stored


def scratch_numel(piece: LayoutPiece) -> int:
    """The fp32 scratch :func:`load_piece` needs for ``piece``: its stored span (whole
    blocks, since a quantized state is read and written a block at a time), and the piece's
    values besides when it spans several segments."""
    span = piece.stored_end - piece.stored_begin
    return span if piece.splits is None else span + piece.end - piece.begin


def _decode(
    fmt: QuantizedFormat, stored: torch.Tensor, begin: int, end: int, out: torch.Tensor
) -> None:
    """Stored values ``[begin, end)`` (whole blocks) of a quantized state of format ``fmt``
    into ``out``, by the format's decoding of the codes and scales directly (the torchao
    subclass's dispatch costs more than the arithmetic on small chunks)."""
    codes, scales, signed = fmt.parts(stored)
    at_codes, at_scales = fmt.spans(begin, end)
    fmt.decode(codes[at_codes], scales[at_scales], out, signed=signed)


def _encode(
    fmt: QuantizedFormat, values: torch.Tensor, stored: torch.Tensor, begin: int, end: int
) -> None:
    """Encode fp32 ``values`` (whole blocks) into stored values ``[begin, end)`` of a quantized
    state of format ``fmt`` (torchao's codes, bit for bit)."""
    codes, scales, signed = fmt.parts(stored)
    at_codes, at_scales = fmt.spans(begin, end)
    new_codes, new_scales = fmt.encode(values, signed=signed)
    codes[at_codes].copy_(new_codes)
    scales[at_scales].copy_(new_scales)


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
    fmt = _quantized_format(stored)
    span = piece.stored_end - piece.stored_begin
    if piece.splits is None:
        _decode(fmt, stored, piece.stored_begin, piece.stored_end, scratch[:span])
        return scratch[:n]
    staging = scratch[n : n + span]
    _decode(fmt, stored, piece.stored_begin, piece.stored_end, staging)
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
    fmt = _quantized_format(stored)
    n, span = end - begin, piece.stored_end - piece.stored_begin
    if piece.splits is None:
        # The padding beyond the segment joins its last block's absmax: it must stay zero.
        scratch[n:span].zero_()
        _encode(fmt, scratch[:span], stored, piece.stored_begin, piece.stored_end)
        return
    parts = scratch[n : n + span].split(piece.splits)  # segment, padding, segment, ...
    # The padding after each segment joins its last block's absmax: it must stay zero.
    torch._foreach_zero_(list(parts[1::2]))
    torch._foreach_copy_(list(parts[::2]), list(values.split(piece.splits[::2])))
    _encode(fmt, scratch[n : n + span], stored, piece.stored_begin, piece.stored_end)
