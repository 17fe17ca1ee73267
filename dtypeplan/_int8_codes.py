"""int8 block codes in two table reads: torchao's codes, bit for bit, without its search.

torchao's ``quantize_8bit_with_qmap`` finds each value's code with an 8-step branchless
binary search over the 256-entry code table and rounds to the nearer neighbour: on a CPU that
is about 20 passes over int64 temporaries (1.3 s for 4.2 M values, most of an int8 step).

The code as a function of the value, ``F(x)``, is a monotone step function (the floor code is
monotone, and so is the round-up test ``x - q[c] >= (q[c+1] - q[c]) / 2`` for a fixed ``c``).
Its steps lie between neighbouring code values, and neighbouring entries of the dynamic-tree
maps are at least 1.4% apart, wider than a bucket of the fp32 values that share their top 16
bits (sign, exponent, 7 mantissa bits: 0.8% wide at most). So within a bucket ``F`` takes at
most two values, and

    F(x) = first[bucket(x)] + (x >= threshold[bucket(x)])

with ``first`` the code at the bucket's low end and ``threshold`` the smallest value of the
bucket with the next code (NaN where the bucket has one code). Both tables (65,536 entries
each) are computed from torchao's own function -- its code at each bucket's ends, and the step
found by bisection over the bucket's low 16 bits -- so they reproduce it exactly on every
value a block scaling produces (``[-1, 1]`` and NaN); building them checks the at-most-one-step
property and refuses a code table without it. Values above 1 in magnitude never reach the
quantizer (they are divided by their block's absmax first); the bucket of +inf also holds NaNs,
and gets NaN's code 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["CodeTables", "build_tables", "quantize"]

_BUCKETS = 1 << 16
_INF_NAN_BUCKETS = (0x7F80, 0xFF80)
"""Buckets that hold +-inf and NaNs together: only NaN (code 0) reaches the quantizer there."""


class CodeTables(NamedTuple):
    """``first`` (uint8) and ``threshold`` (fp32) per bucket of 16 high bits."""

    first: torch.Tensor
    threshold: torch.Tensor

    def to(self, device: torch.device) -> CodeTables:
        return CodeTables(self.first.to(device), self.threshold.to(device))


def build_tables(reference: Callable[[torch.Tensor], torch.Tensor]) -> CodeTables:
    """The tables of the code function ``reference`` (fp32 values -> codes), on the CPU."""
    keys = torch.arange(_BUCKETS, dtype=torch.int32)
    high = keys << 16
    negative = keys >= 0x8000

    def value_at(low: torch.Tensor) -> torch.Tensor:
        # In a negative bucket larger low bits are more negative: count them down so that
        # the value grows with ``low`` in every bucket.
        bits = high | torch.where(negative, 0xFFFF - low, low)
        return bits.view(torch.float32)

    def code(values: torch.Tensor) -> torch.Tensor:
        return reference(values).to(torch.int32)

    low_end = torch.zeros_like(keys)
    first, last = code(value_at(low_end)), code(value_at(low_end + 0xFFFF))
    special = torch.zeros_like(negative)
    for bucket in _INF_NAN_BUCKETS:
        special |= keys == bucket
    rise = torch.where(special, 0, last - first)
    if bool((rise < 0).any()) or bool((rise > 1).any()):
        bad = [hex(int(k)) for k in keys[(rise < 0) | (rise > 1)][:4]]
        raise ValueError(
            f"the int8 code table has more than one code step in a 16-bit bucket ({bad}): the "
            "two-table quantizer cannot reproduce it"
        )
    # Bisection for the smallest low bits whose code is above the bucket's first code.
    below, above = low_end.clone(), low_end + 0xFFFF
    for _ in range(17):
        middle = (below + above) >> 1
        stepped = code(value_at(middle)) > first
        above = torch.where(stepped, middle, above)
        below = torch.where(stepped, below, middle + 1)
    nan = torch.full((_BUCKETS,), float("nan"))
    threshold = torch.where(rise == 1, value_at(above), nan)
    first = torch.where(special, 0, first)
    return CodeTables(first.to(torch.uint8), threshold)


def quantize(scaled: torch.Tensor, tables: CodeTables) -> torch.Tensor:
    """uint8 codes of ``scaled`` (fp32 values in ``[-1, 1]`` or NaN), equal to torchao's."""
    # index_select takes int32 indices and is several times faster than tensor[index] on CPU.
    bucket = scaled.view(torch.int32).bitwise_right_shift(16).bitwise_and_(0xFFFF).view(-1)
    first = torch.index_select(tables.first, 0, bucket)
    stepped = torch.index_select(tables.threshold, 0, bucket) <= scaled.view(-1)
    return first.add_(stepped).view(scaled.shape)
