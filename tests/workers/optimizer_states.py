"""The one spawned group of tests/test_optimizer_states.py: parity, memory and a checkpoint."""

from __future__ import annotations

from typing import Any

import torch

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


ZERO3_CONFIG: dict[str, Any] = {
    "optimizer_states": "int8",
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
}
"""The ZeRO-3 side of the round trip with ZeRO-2 fp32 states on one process."""


def zero3_round_trip(fp32_directory: str, zero3_directory: str) -> dict[str, Any]:
    """On the group, at ZeRO-3 with int8 states: load the one-process ZeRO-2 fp32 checkpoint
    in ``fp32_directory`` (what it holds then) and train 2 more steps; then train a fresh
    model 3 steps and save it into ``zero3_directory`` (what it must preserve)."""
    plan = dtypeplan.resolve(ZERO3_CONFIG)
    model = plan.prepare_model(make_model(1))
    optimizer = plan.build(model.parameters())
    checkpoint.load(optimizer, fp32_directory)
    loaded = checkpoint_cases.snapshot(optimizer)
    losses = checkpoint_cases.train(model, optimizer, range(3, 5))
    model = plan.prepare_model(make_model(0))
    optimizer = plan.build(model.parameters())
    checkpoint_cases.train(model, optimizer, range(3))
    checkpoint.save(optimizer, zero3_directory)
    # state_dict on the same layout, into a fresh optimizer.
    fresh_model = plan.prepare_model(make_model(2))
    fresh = plan.build(fresh_model.parameters())
    fresh.load_state_dict(optimizer.state_dict())
    return {
        "loaded": loaded,
        "losses_after_load": losses,
        "saved": checkpoint_cases.snapshot(optimizer),
        "state_dict_loaded": checkpoint_cases.snapshot(fresh),
        "holds_int8_codes": any(
            t.dtype == torch.uint8 for t in fresh.held_tensors().optimizer_states
        ),
    }


def states_group(
    rank: int,
    world_size: int,
    parity_cases: list[dict[str, Any]],
    memory_configs: list[dict[str, Any]],
    width: int,
    directory: str,
    fp32_directory: str,
    zero3_directory: str,
) -> dict[str, Any]:
    return {
        "parity": run_cases(rank, world_size, parity_cases),
        "memory": memory_cases(rank, world_size, memory_configs, width),
        "checkpoint": save_quantized_checkpoint(directory),
        "zero3": zero3_round_trip(fp32_directory, zero3_directory),
    }
