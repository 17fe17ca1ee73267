"""The tensors of one param group in the flat engine: buffer, accumulator and master chunks.

Built once per param group from its :class:`FlatGroup` (see ``buffers/layout.py`` for the layout)::

    flat.buffer        the parameters, in the parameter dtype (they are views of it)
    accumulator        whole:   laid out like the buffer, with one view per parameter
                       sharded: this rank's chunk of every bucket, concatenated
    masters            one per bucket: this rank's chunk, fp32; views of the buffer itself
                       when the parameters are fp32, or bf16 with bf16 master weights; in
                       host memory with optimizer offload (``buffers/host_offload.py``), never views
"""

from __future__ import annotations

import torch

from dtypeplan.optimizers.buffers.host_offload import HostOffload
from dtypeplan.optimizers.buffers.layout import FlatGroup
from dtypeplan.optimizers.state.values import ShardPiece

__all__ = ["GroupState"]


class GroupState:
    """One param group's flat buffer, accumulator and master chunks on this rank."""

    def __init__(
        self,
        flat: FlatGroup,
        *,
        shard_rank: int,
        accum_dtype: torch.dtype,
        sharded_accumulator: bool,
        master_dtype: torch.dtype = torch.float32,
        offload: HostOffload | None = None,
    ) -> None:
        self.flat = flat
        self.shard_rank = shard_rank
        shards = flat.shards
        device = flat.buffer.device
        self.masters: list[torch.Tensor] = []
        # fp32 parameters, and bf16 ones with bf16 master weights, are their own masters.
        alias_master = flat.dtype == master_dtype and offload is None
        if not alias_master:
            # Master chunks take the parameters' values before they are cast down.
            self.masters = [
                torch.zeros(b.chunk_numel(shards), dtype=torch.float32, device=device)
                if offload is None
                else offload.host_zeros(b.chunk_numel(shards))
                for b in flat.buckets
            ]
            for index, begin, end, bucket, offset in self._pieces():
                source = flat.params[index].detach().reshape(-1)[begin:end]
                self.masters[bucket][offset : offset + end - begin].copy_(source)
        flat.adopt_parameters()
        if alias_master:
            self.masters = [flat.chunk_view(flat.buffer, b, shard_rank) for b in flat.buckets]
        self.acc_param_views: list[torch.Tensor] = []
        self.acc_chunks: list[torch.Tensor] = []
        if sharded_accumulator:
            self.accumulator = torch.zeros(flat.shard_numel, dtype=accum_dtype, device=device)
            self.acc_chunks = [
                self.accumulator[off : off + b.chunk_numel(shards)]
                for off, b in zip(flat.shard_offsets(), flat.buckets, strict=True)
            ]
        else:
            self.accumulator = torch.zeros(flat.numel, dtype=accum_dtype, device=device)
            self.acc_param_views = flat.param_views(self.accumulator)

    def _pieces(self) -> list[tuple[int, int, int, int, int]]:
        """``(param index, begin, end, bucket, offset in the bucket's chunk)`` per held piece."""
        flat = self.flat
        shard_offsets = flat.shard_offsets()
        out = []
        for index in range(len(flat.params)):
            where = flat.param_chunk_ranges(index, self.shard_rank)
            if where is not None:
                begin, end, shard_offset = where
                bucket = flat.bucket_of[index]
                out.append((index, begin, end, bucket, shard_offset - shard_offsets[bucket]))
        return out

    def master_segments(self) -> list[list[int]]:
        """Per master chunk, the lengths of its segments in order: each parameter piece it
        holds, and each stretch of bucket padding between or after them (block layout of
        quantized states, ``storage.BlockLayout``)."""
        held: list[list[tuple[int, int]]] = [[] for _ in self.flat.buckets]
        for _, begin, end, number, offset in self._pieces():
            held[number].append((offset, end - begin))
        segments = []
        for pieces, bucket in zip(held, self.flat.buckets, strict=True):
            lengths, at = [], 0
            for offset, length in sorted(pieces):
                if offset > at:
                    lengths.append(offset - at)  # padding
                lengths.append(length)
                at = offset + length
            numel = bucket.chunk_numel(self.flat.shards)
            if numel > at:
                lengths.append(numel - at)
            segments.append(lengths)
        return segments

    def shard_pieces(self, first: int) -> list[ShardPiece]:
        """The pieces of this group's parameters held here; ``first`` numbers its first one."""
        return [
            ShardPiece(first + index, begin, end, self.masters[bucket], offset)
            for index, begin, end, bucket, offset in self._pieces()
        ]
