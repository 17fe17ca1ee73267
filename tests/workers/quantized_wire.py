"""Spawn-able worker for tests/test_quantized_wire.py: block-quantized all-reduces of inputs
that the parent can rebuild (:func:`wire_input`) to bound the error."""

from __future__ import annotations

from typing import Any

import torch

from dtypeplan.comm import Communicator
from tests.workers.optimizer import record_wire


def wire_input(case: dict[str, Any], rank: int) -> torch.Tensor:
    """Rank ``rank``'s contribution: N(0, 1) times the rank's magnitude, with every 97th
    element 50 times larger (blocks whose absmax dwarfs most of their elements), and the
    case's non-finite values placed at their (rank, index)."""
    generator = torch.Generator().manual_seed(case["seed"] * 1009 + rank)
    values = torch.randn(case["numel"], generator=generator, dtype=torch.float32)
    values[::97] *= 50.0
    values *= case["magnitudes"][rank % len(case["magnitudes"])]
    for where, index, value in case.get("specials", []):
        if where == rank:
            values[index] = value
    return values.to(getattr(torch, case["dtype"]))


def quantized_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for case in cases:
        comm = Communicator()
        tensor = wire_input(case, rank)
        with record_wire() as log:
            finish = comm.start_all_reduce_quantized(tensor, case["fmt"])
            finish()
        results.append(
            {
                "result": tensor.float(),
                "dtype": str(tensor.dtype),
                "bytes": dict(comm.stats.bytes_sent),
                "calls": dict(comm.stats.calls),
                "log": [(op, str(dtype), numel) for op, dtype, numel in log],
            }
        )
    return results
