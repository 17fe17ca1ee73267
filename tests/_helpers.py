"""Builders and checks shared by the test modules and the workers they spawn.

No test module imports another; what two of them need lives here (parent-side checks and the
seeded model/batch builders) or in ``tests/workers/`` (code that runs inside spawned ranks).
"""

from __future__ import annotations

from typing import Any

import torch

from dtypeplan.resolver import PARAMS, load_rules
from dtypeplan.resolver._dimensions import MASTER, STATES

IN, HIDDEN, OUT = 12, 24, 6


def make_model(
    seed: int, in_features: int = IN, hidden: int = HIDDEN, out_features: int = OUT
) -> torch.nn.Module:
    """A 3-layer tanh MLP with seeded N(0, 0.3^2) weights, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(in_features, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, out_features),
    )
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def make_batch(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(size, IN, generator=generator), torch.randn(size, OUT, generator=generator)


def mse(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


PARAMS_KEYS = {dtype: PARAMS.config_for(dtype) for dtype in PARAMS.choices}
"""The config keys that select each parameter dtype (from the table's dimension record)."""


def ok_cells(
    stages: tuple[int, ...] = (0, 1, 2, 3), pipeline: bool = False
) -> list[dict[str, Any]]:
    """The OK cells of the shipped table; ``reductions`` lists the OK reduction methods."""
    table = load_rules()
    cells: dict[tuple, dict[str, Any]] = {}
    for point in table.points():
        if (
            point["params"] not in PARAMS.choices
            or point["stage"] not in stages
            or point["pipeline"] != pipeline
        ):
            continue
        if table.lookup(point).status != "OK":
            continue
        key = tuple(v for k, v in point.items() if k != "reduction")
        cell = cells.setdefault(key, {**point, "reductions": []})
        cell["reductions"].append(point["reduction"])
    return list(cells.values())


def master_cells(
    stages: tuple[int, ...] = (0, 1, 2), states_values: tuple[str, ...] = ("fp32", "bf16")
) -> list[dict[str, Any]]:
    """The OK cells with 16-bit master weights (every master value but fp32, x
    ``states_values``), without pipeline parallelism; ``reductions`` lists the OK reduction
    methods. The int8 / fp8 / mixed states values take the same update path and are proven
    with bf16 masters in test_optimizer_states.py."""
    table = load_rules()
    cells: dict[tuple, dict[str, Any]] = {}
    for core in table.points():
        if core["params"] not in PARAMS.choices or core["stage"] not in stages:
            continue
        if core["pipeline"]:
            continue
        for master in MASTER.values[1:]:
            for states in states_values:
                assert states in STATES.values, states
                point = {**core, "master": master, "states": states}
                if table.lookup(point).status != "OK":
                    continue
                key = tuple(v for k, v in point.items() if k != "reduction")
                cell = cells.setdefault(key, {**point, "reductions": []})
                cell["reductions"].append(point["reduction"])
    return list(cells.values())


def feature_config(point: dict[str, Any]) -> dict[str, Any]:
    """The config keys of the master / states values of ``point`` (merged per block)."""
    config: dict[str, Any] = {}
    for dim in (MASTER, STATES):
        if point.get(dim.name, dim.default_value) == dim.default_value:
            continue
        for key, value in dim.config_for(point[dim.name]).items():
            config[key] = {**config.get(key, {}), **value}
    return config


MEMORY_KEYS = ("params", "accumulator", "master", "optimizer_states", "total")
"""The device keys of plan.memory() that the memory tests compare with what is held."""


def assert_memory_close(
    measured: dict[str, int],
    predicted: dict[str, int],
    context: object,
    keys: tuple[str, ...] = MEMORY_KEYS,
) -> None:
    """``plan.memory()`` within 10% (plus 1 KiB: step counters, code tables) of the bytes held,
    for each of ``keys``."""
    for key in keys:
        assert abs(measured[key] - predicted[key]) <= 0.1 * predicted[key] + 1024, (
            key,
            measured,
            predicted,
            context,
        )


def assert_parity(result: dict[str, Any], loss_rtol: float, master_rtol: float) -> None:
    assert "error" not in result, result["error"]
    assert result["param_dtype_ok"], result["name"]
    for step, (mine, ref) in enumerate(zip(result["losses"], result["ref_losses"], strict=True)):
        assert abs(mine - ref) <= loss_rtol * abs(ref) + 1e-7, (
            f"{result['name']}: step {step} loss {mine} vs reference {ref}"
        )
    error = result["master_rel_error"]
    assert error <= master_rtol, f"{result['name']}: master weights rel error {error:.2e}"


def assert_replicas_equal(per_rank: list[list[dict[str, Any]]]) -> None:
    """Every rank ended each case with the same parameters, bit for bit (``params_digest``)."""
    for index, first in enumerate(per_rank[0]):
        if "error" in first:
            continue
        digests = {rank_results[index]["params_digest"] for rank_results in per_rank}
        assert len(digests) == 1, f"{first['name']}: the replicas differ after training"


# Every elementwise torch optimizer with the options that add states (momentum, centered,
# amsgrad, decoupled decay): what the client-optimizer and checkpoint tests build.
CLIENT_HYPERPARAMETERS: dict[str, dict[str, Any]] = {
    "SGD": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    "Adam": {"lr": 1e-2, "amsgrad": True},
    "AdamW": {"lr": 1e-2, "weight_decay": 0.1},
    "Adamax": {"lr": 1e-2},
    "Adagrad": {"lr": 0.05, "lr_decay": 0.01},
    "Adadelta": {"lr": 0.5},
    "RMSprop": {"lr": 1e-3, "momentum": 0.5, "centered": True},
    "NAdam": {"lr": 1e-2},
    "RAdam": {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.1},
    "Rprop": {"lr": 1e-3},
    "ASGD": {"lr": 1e-2, "t0": 1.0},
}
