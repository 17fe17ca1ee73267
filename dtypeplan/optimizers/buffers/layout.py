"""Flat parameter buffers and the shard map.

One param group becomes one contiguous buffer in the parameter dtype, and every parameter
becomes a view into it, so the model keeps working on ordinary tensors while the optimizer
moves whole buckets.

Layout of one group, for ``shards`` ranks (``shards`` is 1 at ZeRO stage 0)::

    buffer = [ bucket 0 | bucket 1 | ... ]            buckets in reverse parameter order,
    bucket = [ p_k | p_k-1 | ... | padding ]          so that backward fills bucket 0 first
    bucket = [ chunk 0 | chunk 1 | ... | chunk S-1 ]  rank r owns chunk r of every bucket

Each bucket holds whole parameters (a parameter larger than the bucket size gets a bucket of
its own) and is padded to a multiple of ``world_size * ALIGN`` elements, so every chunk has the
same size and starts on an aligned address. Padding is zero and stays zero: its gradient is
zero, so the optimizer never moves it. Rank r's shard is the list of its chunks, one per
bucket; the optimizer updates that list with one fused multi-tensor call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "Bucket", "FlatGroup"]

ALIGN = 64
"""Chunk sizes are multiples of this many elements (128-byte alignment for 16-bit data)."""


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int
    """Offset of the bucket in the group's buffer, in elements."""
    numel: int
    """Padded size; a multiple of ``world_size * ALIGN``."""
    params: tuple[int, ...]
    """Indices (into ``FlatGroup.params``) of the parameters in the bucket."""

    def chunk_numel(self, shards: int) -> int:
        return self.numel // shards


class FlatGroup:
    """The flat buffer of one param group and its buckets."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        dtype: torch.dtype,
        shards: int,
        bucket_numel: int,
        world_size: int,
    ) -> None:
        # A group without trainable parameters (all frozen) is valid and simply has no buckets.
        self.params = params
        self.dtype = dtype
        self.shards = shards
        self.offsets: list[int] = [0] * len(params)
        buckets: list[Bucket] = []
        # Padding to the world size even when unsharded lets any bucket be reduce-scattered.
        unit = max(shards, world_size) * ALIGN
        start = 0
        current: list[int] = []
        used = 0

        def close() -> None:
            nonlocal start, current, used
            if current:
                padded = -(-used // unit) * unit
                buckets.append(Bucket(len(buckets), start, padded, tuple(current)))
                start += padded
                current, used = [], 0

        for index in reversed(range(len(params))):
            numel = params[index].numel()
            if current and used + numel > bucket_numel:
                close()
            self.offsets[index] = start + used
            current.append(index)
            used += numel
        close()
        self.buckets = tuple(buckets)
        self.numel = start
        self.bucket_of = [0] * len(params)
        for bucket in self.buckets:
            for index in bucket.params:
                self.bucket_of[index] = bucket.index
        device = params[0].device if params else torch.device("cpu")
        self.buffer = torch.zeros(self.numel, dtype=dtype, device=device)

    def adopt_parameters(self) -> None:
        """Copy the parameters into the buffer (casting) and make them views of it."""
        with torch.no_grad():
            for param, view in zip(self.params, self.param_views(self.buffer), strict=True):
                view.copy_(param.detach())
                param.data = view

    def param_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` (any tensor laid out like the buffer) shaped like each parameter."""
        return [
            flat[offset : offset + param.numel()].view(param.shape)
            for param, offset in zip(self.params, self.offsets, strict=True)
        ]

    def bucket_view(self, flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return flat[bucket.start : bucket.start + bucket.numel]

    def chunk_view(self, flat: torch.Tensor, bucket: Bucket, rank: int) -> torch.Tensor:
        size = bucket.chunk_numel(self.shards)
        begin = bucket.start + rank * size
        return flat[begin : begin + size]

    @property
    def shard_numel(self) -> int:
        return self.numel // self.shards

    def shard_offsets(self) -> list[int]:
        """Offset of each bucket's chunk inside a rank's concatenated shard."""
        offsets, total = [], 0
        for bucket in self.buckets:
            offsets.append(total)
            total += bucket.chunk_numel(self.shards)
        return offsets

    def param_chunk_ranges(self, index: int, rank: int) -> tuple[int, int, int] | None:
        """Where parameter ``index`` meets rank ``rank``'s chunk of its bucket.

        Returns ``(param_begin, param_end, shard_offset)`` in flattened-parameter and
        concatenated-shard coordinates, or None if the rank holds none of it.
        """
        bucket = self.buckets[self.bucket_of[index]]
        size = bucket.chunk_numel(self.shards)
        chunk_begin = bucket.start + rank * size
        begin = max(self.offsets[index], chunk_begin)
        end = min(self.offsets[index] + self.params[index].numel(), chunk_begin + size)
        if begin >= end:
            return None
        shard_offset = self.shard_offsets()[bucket.index] + (begin - chunk_begin)
        return begin - self.offsets[index], end - self.offsets[index], shard_offset
