"""An all-reduce whose contributions travel block-quantized (int8 or fp8) and are summed in fp32.

What DeepSpeed's ZeRO++ qgZ does for gradients across nodes, for one flat tensor of ``n``
elements over a group of ``W`` ranks:

1. Pad to ``P``, a multiple of ``W * BLOCK``, and split into ``W`` slices of ``P / W``.
2. Quantize every block of ``BLOCK`` (256) elements with its own fp32 scale: int8 is
   symmetric, ``scale = absmax / 127``, codes rounded to nearest; fp8 is e4m3 with
   ``scale = absmax / 448``.
3. All-to-all: rank ``r`` receives every rank's codes and scales of slice ``r``, dequantizes the
   ``W`` pieces and sums them in fp32, in rank order.
4. Each rank quantizes its summed slice again (same blocks) and an all-gather of those codes and
   scales gives every rank every slice; all dequantize the same bytes, so every rank ends with
   the same bits.

Codes and scales of one slice travel in one byte buffer, so each step is one collective. The
error per element (int8), with ``a_r`` the absmax of the element's block in rank ``r``'s input
and ``a_s`` the absmax of its block of the fp32 sum that is quantized the second time, is at
most ``sum_r a_r / 254 + a_s / 254`` (half a code step per rounding) plus fp32 rounding. For
fp8 e4m3 (3 mantissa bits) a code ``c`` rounds by at most ``|c| / 16 + 2**-10`` code units,
so an element ``x`` of a block with absmax ``a`` moves by at most ``|x| / 16 + a / 458752``,
once per rank's input and once for the sum.

A block holding an inf or a nan gets a non-finite scale and dequantizes to nan throughout
(``0 * inf``), and the sum and the second quantization keep it so: an overflow stays visible to
the overflow check, though as nan rather than inf. On one rank nothing is sent or quantized.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

__all__ = [
    "BLOCK",
    "WIRE_FORMATS",
    "WireFormat",
    "dequantize_blocks",
    "padded_numel",
    "quantize_blocks",
    "quantized_wire_bytes",
    "start_all_reduce_quantized",
]

BLOCK = 256
"""Elements per block; each block has one fp32 scale. The wire's own: not the state formats'
block (``dtypeplan/_formats.py``), which is the same number by coincidence of defaults."""

_SCALE_BYTES = 4


@dataclass(frozen=True)
class WireFormat:
    """One block-quantized wire format: a symmetric linear code, ``absmax / max_code`` a step.

    Not a state format (``dtypeplan/_formats.py``), though ``int8`` names one of each: the
    wire's is signed int8 codes on a linear grid of 255 steps, rounded to nearest, for one
    collective's contributions; the state's is torchao's dynamic-tree map in uint8, a
    nonlinear code for values that span decades (Adam's moments), kept between steps and
    saved by checkpoints under its record's tag. They share the config's spelling only, never
    a record, a block constant or a tag: wire codes are never stored.
    """

    name: str
    code_dtype: torch.dtype
    """The dtype of a code (one byte)."""
    max_code: float
    """The largest code magnitude: a block's absmax maps onto it."""


WIRE_FORMATS: dict[str, WireFormat] = {
    "int8": WireFormat("int8", torch.int8, 127.0),
    "fp8": WireFormat("fp8", torch.float8_e4m3fn, 448.0),
}


class _Stats(Protocol):
    def add(self, op: str, nbytes: int) -> None: ...


class Communicator(Protocol):
    """What this module uses of :class:`dtypeplan.comm.Communicator` (which imports this
    module: a Protocol keeps the import graph one way)."""

    world_size: int

    @property
    def group(self) -> dist.ProcessGroup | None: ...

    @property
    def stats(self) -> _Stats: ...

    def _guard(
        self, op: str, numel: int | None = None, dtype: torch.dtype | None = None
    ) -> AbstractContextManager[None]: ...


def _format(fmt: str) -> WireFormat:
    try:
        return WIRE_FORMATS[fmt]
    except KeyError:
        raise ValueError(
            f"unknown block-quantized wire format {fmt!r}; the valid ones are "
            f"{sorted(WIRE_FORMATS)}"
        ) from None


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size * BLOCK`` (whole blocks per slice)."""
    unit = world_size * BLOCK
    return -(-numel // unit) * unit


def quantized_wire_bytes(numel: int, world_size: int) -> dict[str, int]:
    """The bytes one rank sends for a quantized all-reduce of ``numel`` elements, per collective
    (ring count, as :class:`~dtypeplan.comm.CommStats` records): codes and scales of the padded
    tensor, ``(W - 1) / W`` of them, once in the all-to-all and once in the all-gather."""
    if world_size <= 1:
        return {}
    padded = padded_numel(numel, world_size)
    packed = padded + padded // BLOCK * _SCALE_BYTES
    sent = packed * (world_size - 1) // world_size
    return {"all_to_all": sent, "all_gather": sent}


def quantize_blocks(values: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of an fp32 tensor whose length is a multiple of :data:`BLOCK`.

    A block of zeros gets scale 0 and codes 0; a block holding a non-finite value gets a
    non-finite scale (and codes 0), so that it dequantizes to nan.
    """
    wire = _format(fmt)
    blocks = values.view(-1, BLOCK)
    # amax propagates nan; an inf gives scale inf.
    scales = blocks.abs().amax(dim=1) / wire.max_code
    # A zero scale divides by 1 instead (its codes are 0 either way); x / inf and inf / inf
    # give 0 and nan, which nan_to_num makes code 0: the scale alone carries the non-finite.
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    scaled = torch.nan_to_num(blocks / safe[:, None], nan=0.0, posinf=0.0, neginf=0.0)
    scaled.clamp_(-wire.max_code, wire.max_code)
    if wire.code_dtype == torch.int8:
        codes = scaled.round_().to(torch.int8)
    else:
        codes = scaled.to(wire.code_dtype)  # round to nearest even
    return codes.view(-1), scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values of ``codes`` (any code dtype) with one scale per :data:`BLOCK` codes."""
    return (codes.view(-1, BLOCK).float() * scales[:, None]).view(-1)


def _pack(codes: torch.Tensor, scales: torch.Tensor, pieces: int) -> torch.Tensor:
    """``pieces`` rows of bytes, each one slice's codes followed by its scales."""
    code_bytes = codes.view(torch.uint8).view(pieces, -1)
    scale_bytes = scales.view(torch.uint8).view(pieces, -1)
    return torch.cat([code_bytes, scale_bytes], dim=1).contiguous()


def _unpack(packed: torch.Tensor, wire: WireFormat) -> torch.Tensor:
    """The fp32 values of rows packed by :func:`_pack`, concatenated row after row."""
    rows = packed.shape[0]
    width = packed.shape[1]
    numel = width * BLOCK // (BLOCK + _SCALE_BYTES)
    codes = packed[:, :numel].contiguous().view(wire.code_dtype)
    scales = packed[:, numel:].contiguous().view(torch.float32)
    return dequantize_blocks(codes.view(-1), scales.view(-1)).view(rows, numel)


def start_all_reduce_quantized(
    comm: Communicator, tensor: torch.Tensor, fmt: str
) -> Callable[[], None]:
    """Sum ``tensor`` (fp32 or 16-bit, contiguous) over ``comm``'s group in place, each rank's
    contribution block-quantized in ``fmt`` on the wire and summed in fp32 (no mean).

    The all-to-all is launched now; the returned function waits for it, sums, and runs the
    all-gather of the quantized sums synchronously. Ranks must finish their launches in the same
    order. Adds the bytes sent to ``comm.stats``.
    """
    wire = _format(fmt)
    if not tensor.is_floating_point():
        raise TypeError(
            f"a quantized all-reduce sums floating-point tensors, got {tensor.dtype}; "
            "send integer data with an exact wire dtype instead"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            "a quantized all-reduce works in place on a contiguous tensor (a flat bucket); "
            "pass tensor.contiguous() and copy the result back"
        )
    world = comm.world_size
    if world <= 1 or tensor.numel() == 0:
        return _nothing
    flat = tensor.view(-1)
    numel = flat.numel()
    padded = torch.zeros(padded_numel(numel, world), dtype=torch.float32, device=tensor.device)
    padded[:numel].copy_(flat)
    codes, scales = quantize_blocks(padded, fmt)
    send = _pack(codes, scales, world)
    received = torch.empty_like(send)
    bytes_sent = quantized_wire_bytes(numel, world)
    comm.stats.add("all_to_all", bytes_sent["all_to_all"])
    with comm._guard("all_to_all", send.numel(), torch.uint8):
        work = dist.all_to_all_single(received, send, group=comm.group, async_op=True)

    def finish(send: torch.Tensor = send) -> None:  # keeps `send` alive until done
        with comm._guard("all_to_all", send.numel(), torch.uint8):
            work.wait()
        pieces = _unpack(received, wire)
        total = pieces[0].clone()
        for piece in pieces[1:]:  # rank order, rounded once per addition in fp32
            total += piece
        sum_codes, sum_scales = quantize_blocks(total, fmt)
        mine = _pack(sum_codes, sum_scales, 1).view(-1)
        gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=mine.device)
        comm.stats.add("all_gather", bytes_sent["all_gather"])
        with comm._guard("all_gather", gathered.numel(), torch.uint8):
            _all_gather_flat()(gathered, mine, group=comm.group)
        result = _unpack(gathered.view(world, -1), wire).view(-1)
        flat.copy_(result[:numel])

    return finish


def _all_gather_flat() -> Callable[..., object]:
    # Looked up at call time, as FSDP2 does, so that a wrapper around torch.distributed's
    # collective (the tests' wire log) sees this one too. torch >= 2.13 renamed it.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _nothing() -> None:
    """The finisher of a collective that had nothing to send."""
