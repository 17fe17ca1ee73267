"""The tables a multi-chunk Triton launch reads: pointer tables and tile tables, uploaded once.

A multi-chunk kernel (``triton_adamw._mixed_adamw_multi_kernel``,
``triton_one_pass._adam_one_pass_multi_kernel``) runs one program per tile. Program ``i`` reads
row ``i`` of the tile table, ``[chunk, first element, elements]`` (int64; a tile never
straddles two chunks), then row ``chunk`` of the pointer table, that chunk's addresses.

Two caches, because the two tables change for different reasons:

* a pointer table is keyed by its addresses, which change whenever a tensor is reallocated (a
  reduce-scatter's fresh output chunk each step, a checkpoint load). It is a few hundred
  integers, cheap to build and upload again; the cache keeps the most recently used ones.
* a tile table depends on the chunk sizes and the block only, so it is keyed by those: an
  address that changes never rebuilds it. At 7B on one rank (6.7e9 elements, 1024 a tile) it
  is 6.6 million rows, 158 MB; :func:`tile_rows` builds it with a few whole-tensor operations
  (the rows as Python lists took 11-19 s and 1.0-1.4 GB of host memory, and a full cache of
  pointer tables used to evict it with them).

Uploads are host-to-device copies with ``non_blocking=True``: nothing waits for the device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

__all__ = ["MAX_POINTER_TABLES", "MAX_TILE_TABLES", "pointer_table", "tile_rows", "tile_table"]

MAX_POINTER_TABLES = 64
"""Pointer tables kept: the least recently used one goes when a new one comes."""
MAX_TILE_TABLES = 8
"""Tile tables kept (one per layout and block: a few a process; each may be 100s of MB)."""


class _UploadedTables:
    """Tables on their devices by key, the least recently used evicted past ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.tables: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.builds = 0
        """How many tables were built (a measure for tests and benchmarks)."""

    def get(
        self, key: Hashable, build: Callable[[], torch.Tensor], device: torch.device
    ) -> torch.Tensor:
        table = self.tables.get(key)
        if table is not None:
            self.tables.move_to_end(key)
            return table
        table = build().to(device, non_blocking=True)
        self.builds += 1
        self.tables[key] = table
        while len(self.tables) > self.limit:
            self.tables.popitem(last=False)
        return table

    def clear(self) -> None:
        self.tables.clear()


_POINTER_TABLES = _UploadedTables(MAX_POINTER_TABLES)
_TILE_TABLES = _UploadedTables(MAX_TILE_TABLES)


def pointer_table(
    kind: str, rows: tuple[tuple[int, ...], ...], device: torch.device
) -> torch.Tensor:
    """The uploaded int64 table of ``rows`` (one row per chunk: its addresses and whatever
    else the ``kind`` of kernel reads per chunk)."""
    return _POINTER_TABLES.get(
        (kind, device, rows), lambda: torch.tensor(rows, dtype=torch.int64), device
    )


def tile_rows(sizes: tuple[int, ...], block: int) -> torch.Tensor:
    """The ``[chunk, first element, elements]`` rows (int64, on the host) of a launch over
    chunks of ``sizes``, ``block`` elements a tile: every chunk in order, cut into tiles of
    ``block`` from its start, the last one shorter where ``block`` does not divide the chunk;
    a chunk of no elements has no tile."""
    counts = torch.tensor(sizes, dtype=torch.int64).reshape(-1)
    if bool((counts < 0).any()) or block <= 0:
        raise ValueError(f"tile_rows needs sizes >= 0 and block > 0, got {block}")
    tiles = (counts + (block - 1)).div_(block, rounding_mode="floor")
    total = int(tiles.sum())
    table = torch.empty((total, 3), dtype=torch.int64)
    if total == 0:
        return table
    chunk = torch.repeat_interleave(torch.arange(len(sizes)), tiles, output_size=total)
    table[:, 0] = chunk
    # A tile's first element: block * (its index in the launch - its chunk's first tile's).
    first_element = (tiles.cumsum(0) - tiles).mul_(block)[chunk]
    begin = table[:, 1]
    begin.copy_(torch.arange(0, total * block, block, dtype=torch.int64))
    begin.sub_(first_element)
    del first_element
    elements = table[:, 2]
    elements.copy_(counts[chunk])
    elements.sub_(begin).clamp_(max=block)
    return table


def tile_table(sizes: tuple[int, ...], block: int, device: torch.device) -> torch.Tensor:
    """:func:`tile_rows` uploaded to ``device``, built once per ``(sizes, block)``."""
    key = ("tiles", device, block, sizes)
    return _TILE_TABLES.get(key, lambda: tile_rows(sizes, block), device)
