"""The one spawned group of tests/test_optimizer_states.py: parity, memory and a checkpoint."""

from __future__ import annotations

from typing import Any

import dtypeplan
from dtypeplan import checkpoint
from tests._helpers import make_model
from tests.workers import checkpoint as checkpoint_cases
from tests.workers.optimizer import memory_cases
from tests.workers.parity import run_cases

CHECKPOINT_CONFIG: dict[str, Any] = {
    "optimizer_states": {"exp_avg": "int8", "exp_avg_sq": "fp8"},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 300},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
}
"""Saved on two ranks at ZeRO-2 (several chunks per rank, none a whole number of blocks)."""


def save_quantized_checkpoint(directory: str) -> dict[str, Any]:
    """Train CHECKPOINT_CONFIG 3 steps, save it; return what it must preserve."""
    plan = dtypeplan.resolve(CHECKPOINT_CONFIG)
    model = plan.prepare_model(make_model(0))
    optimizer = plan.build(model.parameters())
    checkpoint_cases.train(model, optimizer, range(3))
    checkpoint.save(optimizer, directory)
    return checkpoint_cases.snapshot(optimizer)


def states_group(
    rank: int,
    world_size: int,
    parity_cases: list[dict[str, Any]],
    memory_configs: list[dict[str, Any]],
    width: int,
    directory: str,
) -> dict[str, Any]:
    return {
        "parity": run_cases(rank, world_size, parity_cases),
        "memory": memory_cases(rank, world_size, memory_configs, width),
        "checkpoint": save_quantized_checkpoint(directory),
    }
