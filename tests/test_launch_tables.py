"""The multi-chunk launches' tables (``kernels/launch_tables.py``): the tile table built with
whole-tensor operations holds exactly the rows the per-element Python formulation did, and a
launch whose addresses change every step (a reduce-scatter's fresh chunk) keeps its tile table.
"""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest
import torch

from dtypeplan.optimizers.kernels import launch_tables


def _rows_as_lists(sizes: tuple[int, ...], block: int) -> list[list[int]]:
    """The formulation the kernels' tile tables were first built with (row by row)."""
    return [
        [index, begin, min(block, size - begin)]
        for index, size in enumerate(sizes)
        for begin in range(0, size, block)
    ]


EDGE_CASES = [
    ((), 16),
    ((0,), 16),
    ((0, 0, 0), 1024),
    ((1,), 1),
    ((5,), 1),
    ((16,), 16),
    ((17,), 16),
    ((15, 0, 16, 33, 0), 16),
    ((0, 4096, 4095, 4097, 1), 4096),
    ((3 * 1024 + 7,), 1024),
    ((2**31 + 5, 7), 2**30),  # first elements past int32
]


@pytest.mark.parametrize(("sizes", "block"), EDGE_CASES)
def test_tile_rows_are_the_row_by_row_tables(sizes: tuple[int, ...], block: int) -> None:
    table = launch_tables.tile_rows(sizes, block)
    assert table.dtype == torch.int64 and table.shape == (len(_rows_as_lists(sizes, block)), 3)
    assert table.tolist() == _rows_as_lists(sizes, block)


def test_tile_rows_on_random_sizes() -> None:
    draw = random.Random(32)
    for _ in range(200):
        block = 2 ** draw.randrange(0, 13)
        sizes = tuple(
            draw.choice([0, draw.randrange(1, 4 * block + 3), block * draw.randrange(1, 5)])
            for _ in range(draw.randrange(0, 12))
        )
        assert launch_tables.tile_rows(sizes, block).tolist() == _rows_as_lists(sizes, block)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_address_churn_never_rebuilds_the_tile_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh gradient chunks each step, as a reduce-scatter makes them: a new pointer table
    each time, but the tile table (which depends on the sizes alone) is the one tensor every
    launch reads. Before, 64 pointer tables cleared every cache, the tile table with them (at
    7B on one rank, 11-19 s to build again)."""
    from dtypeplan.optimizers.kernels import triton_adamw
    from tests._triton_compile import Recorder

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the launcher's device check only
    launches: list[Any] = []
    monkeypatch.setattr(
        triton_adamw,
        "_mixed_adamw_multi_kernel",
        Recorder(triton_adamw._mixed_adamw_multi_kernel, launches),
    )
    sizes = [4096 + 64, 128, 0]
    state = [[torch.zeros(n) for n in sizes] for _ in range(3)]
    keep = []  # the chunks stay alive, so every step's addresses are new
    for step in range(1, 3 * launch_tables.MAX_POINTER_TABLES):
        grads = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
        keep.append(grads)
        triton_adamw.fused_mixed_adamw_multi_(
            *state, grads, None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.0, step=step, grad_factor=1.0,
        )  # fmt: skip
    pointers = {id(launch.args[0]) for launch in launches}
    tiles = {id(launch.args[1]) for launch in launches}
    assert len(pointers) > launch_tables.MAX_POINTER_TABLES  # the churn happened
    assert len(tiles) == 1
    assert launches[0].args[1].tolist() == _rows_as_lists(tuple(sizes), triton_adamw.DEFAULT_BLOCK)


def test_the_caches_evict_the_least_recently_used() -> None:
    cache = launch_tables._UploadedTables(limit=2)
    device = torch.device("cpu")
    first = cache.get("a", lambda: torch.zeros(1), device)
    cache.get("b", lambda: torch.zeros(1), device)
    assert cache.get("a", lambda: torch.ones(1), device) is first  # now the most recent
    cache.get("c", lambda: torch.zeros(1), device)  # evicts "b"
    assert set(cache.tables) == {"a", "c"} and cache.builds == 3
