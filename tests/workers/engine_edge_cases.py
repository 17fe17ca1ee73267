"""Spawn-able workers for tests/test_engine_edge_cases.py."""

from __future__ import annotations

import torch

import dtypeplan
from tests._helpers import make_batch, make_model, mse


def empty_micro_batch_on_one_rank(
    rank: int, world_size: int, stages: list[int]
) -> list[list[float]]:
    return [_empty_micro_batch(rank, stage) for stage in stages]


def _empty_micro_batch(rank: int, stage: int) -> list[float]:
    """Rank 1's second micro-batch reaches no parameter; the ranks must still pair up."""
    config = {
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    model = make_model(0)
    optimizer = dtypeplan.resolve(config).build(model.parameters())
    x, y = make_batch(0, 8)
    optimizer.backward(mse(model, x, y))
    if rank == 1:
        optimizer.backward(torch.zeros((), requires_grad=True).sum())
    else:
        optimizer.backward(mse(model, x, y) * 0)
    optimizer.step()
    return [float(p.detach().sum()) for p in model.parameters()]
