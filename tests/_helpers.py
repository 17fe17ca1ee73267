"""Builders and checks shared by the test modules and the workers they spawn.

No test module imports another; what two of them need lives here (parent-side checks and the
seeded model/batch builders) or in ``tests/workers/`` (code that runs inside spawned ranks).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import strategies as st

from dtypeplan.resolver import PARAMS, load_rules
from dtypeplan.resolver._dimensions import FEATURE_DIMENSIONS, MASTER, STATES

IN, HIDDEN, OUT = 12, 24, 6


FULL_MATRICES_ENV = "DTYPEPLAN_FULL_MATRICES"
"""``DTYPEPLAN_FULL_MATRICES=1 pytest -m slow``: every case of the slow run's largest products
(run by hand; the figures are in the closing notes). CI runs a spread sample of each, so that
its whole run stays under an hour on 2 cores."""


def full_matrices() -> bool:
    """Whether this run takes the slow run's largest products whole (:data:`FULL_MATRICES_ENV`)."""
    return os.environ.get(FULL_MATRICES_ENV) == "1"


def full_only(covered_by: str) -> pytest.MarkDecorator:
    """Skip the case in CI's sample; ``covered_by``: the case CI runs instead, which takes the
    same path (:data:`FULL_MATRICES_ENV` runs both)."""
    return pytest.mark.skipif(
        not full_matrices(),
        reason=f"CI samples this product (it runs {covered_by}); {FULL_MATRICES_ENV}=1 runs it",
    )


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
    """The config keys of ``point``'s feature values (master weights, optimizer states,
    offload...) that are not "not used", merged per block."""
    config: dict[str, Any] = {}
    for dim in FEATURE_DIMENSIONS.values():
        if point.get(dim.name, dim.default_value) == dim.default_value:
            continue
        for key, value in dim.config_for(point[dim.name]).items():
            # A top-level key (communication_data_type_across_groups) is a value, not a block.
            config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


MEMORY_KEYS = ("params", "accumulator", "master", "optimizer_states", "total")
"""The device keys of plan.memory() that the memory tests compare with what is held."""


def memory_mlp(width: int) -> torch.nn.Sequential:
    """The memory tests' model: Linear, ReLU, Linear of ``width`` (seeded)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
    )


def master_rel_error(state: dict[str, Any], reference: list[torch.Tensor]) -> float:
    """``||master - reference|| / ||reference||`` over every parameter: ``state`` is an
    optimizer's ``full_state()``, ``reference`` the reference's parameters in torch order."""
    diff = size = 0.0
    for i, param in enumerate(reference):
        diff += float((state[f"param.{i}.master"] - param.detach()).square().sum())
        size += float(param.detach().square().sum())
    return (diff / size) ** 0.5


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


# --- parity cases: a table cell, what hypothesis draws for it, and the check ------------------

FP32_RTOL = 1e-5
# bf16 keeps 8 mantissa bits: a forward pass in bf16 moves the loss by ~1e-3 relative, and the
# first Adam steps amplify that noise in the master weights; measured worst cases were 1.7e-3
# (loss) and 2.1e-3 (master weights) over 4 steps.
LOW_PRECISION_LOSS_RTOL = 1e-2
LOW_PRECISION_MASTER_RTOL = 2e-2


def parity_config(point: dict[str, Any], extras: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        **PARAMS_KEYS[point["params"]],
        "gradient_accumulation_dtype": {"dtype": point["accum"], "sharded": point["sharded"]},
        "communication_data_type": point["comm"],
        # Small buckets so that every model spans several of them.
        "zero_optimization": {"stage": point["stage"], "reduce_bucket_size": extras["bucket"]},
        "optimizer": extras["optimizer"],
    }
    if extras["clip"]:
        config["gradient_clipping"] = extras["clip"]
    if extras["reduction"] != "collective":
        config["communication_reduction"] = extras["reduction"]
    if extras.get("loss_scale_power") is not None and point["params"] == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": extras["loss_scale_power"]}
    for key, value in feature_config(point).items():
        config[key] = {**config.get(key, {}), **value}
    return config


optimizers = st.sampled_from(
    [
        {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.8, 0.99]}},
        {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        {"type": "SGD", "params": {"lr": 0.05}},
    ]
)


def draw_parity_case(data: st.DataObject, point: dict[str, Any]) -> dict[str, Any]:
    extras = {
        # 16-bit masters too: Adam/AdamW on torch's fused kernel, SGD by its own torch step
        # on fp32 copies (update/pieces.py).
        "optimizer": data.draw(optimizers),
        "clip": data.draw(st.sampled_from([0.0, 0.0, 0.3])),
        "reduction": data.draw(st.sampled_from(point["reductions"])),
        # 2**16-scaled fp16 gradients can overflow on an fp16 wire: a skipped step is correct
        # behaviour but makes the trajectory differ from the reference.
        "loss_scale_power": data.draw(st.sampled_from([4, 8])),
        "bucket": data.draw(st.sampled_from([200, 700, 100_000])),
    }
    name = "-".join(f"{k}={v}" for k, v in point.items() if k != "reductions") + f" {extras}"
    return {
        "name": name,
        "point": point,
        "config": parity_config(point, extras),
        "steps": 3,
        "micro_batches": data.draw(st.integers(1, 3)),
        "param_groups": data.draw(st.sampled_from([1, 2])),
        # fp16 needs opt.backward(loss) to scale the loss.
        "loss_backward": point["params"] != "fp16" and data.draw(st.booleans()),
        # opt.backward(loss, last_micro_batch=True) starts the reduction inside backward.
        "boundary": data.draw(st.booleans()),
        "seed": data.draw(st.integers(0, 1000)),
    }


def check_parity_cases(results: list[dict[str, Any]], cases: list[dict[str, Any]]) -> None:
    for result, case in zip(results, cases, strict=True):
        point = case["point"]
        exact = point["params"] == point["accum"] == point["comm"] == "fp32"
        if exact:
            assert_parity(result, FP32_RTOL, FP32_RTOL)
        else:
            assert_parity(result, LOW_PRECISION_LOSS_RTOL, LOW_PRECISION_MASTER_RTOL)
        for norm, ref in zip(result["grad_norms"], result["ref_grad_norms"], strict=True):
            tolerance = FP32_RTOL if exact else 5e-2
            assert abs(norm - ref) <= tolerance * ref + 1e-6, (
                f"{case['name']}: norm {norm} vs {ref}"
            )


# Integrations (issue 20): a framework's dtypeplan run against its plain torch AdamW fp32 run.
# fp32: the same math in another reduction order (DDP's bucketed all-reduce against
# dtypeplan's), measured 1e-7 on the loss and 5e-7 on masters and exp_avg. bf16: 8 mantissa
# bits give 2**-9 relative per rounding; the loss of a 2-layer GPT-2 moves by less than 1%
# (measured 6e-5), the masters by 2% (1.5e-3) and Adam's first moment, the mean of bf16
# gradients, by 5% (6e-3). A clip factor applied on one side only (about 0.5 here) moves
# exp_avg by ~100%.
FRAMEWORK_RTOL: dict[str, dict[str, float]] = {
    "fp32": {"loss": 1e-6, "master": 1e-5, "exp_avg": 1e-5, "norm": 1e-5},
    "bf16": {"loss": 1e-2, "master": 2e-2, "exp_avg": 5e-2, "norm": 1e-2},
}


def assert_framework_case(per_rank: list[dict[str, Any]], case: str, max_grad_norm: float) -> None:
    """Trains (loss, masters and exp_avg within the dtype's bound of the plain run), clips
    (every step's norm above ``max_grad_norm``, the logged norm the optimizer's own, in float32
    as the frameworks log it), resumes bitwise, writes every weight (fp32 masters by name)."""
    dtype = case.rsplit("-", 1)[1]
    rtol = FRAMEWORK_RTOL[dtype]
    for rank, got in enumerate(per_rank):
        assert isinstance(got, dict), f"rank {rank}: {got}"
        where = f"{case} rank {rank}"
        assert len(got["losses"]) == len(got["ref_losses"]) > 0, where
        for step, (mine, ref) in enumerate(zip(got["losses"], got["ref_losses"], strict=True)):
            assert abs(mine - ref) <= rtol["loss"] * abs(ref), f"{where} micro-batch {step}"
        assert got["master_rel"] <= rtol["master"], (where, got["master_rel"])
        assert got["exp_avg_rel"] <= rtol["exp_avg"], (where, got["exp_avg_rel"])
        norms, optimizer_norms = got["logged_norms"], got["optimizer_norms"]
        assert len(norms) == len(optimizer_norms) == len(got["ref_logged_norms"]) > 0, where
        assert all(norm > max_grad_norm for norm in norms), f"{where}: no step clipped {norms}"
        for logged, own, ref in zip(norms, optimizer_norms, got["ref_logged_norms"], strict=True):
            assert own is not None and logged == float(torch.tensor(own, dtype=torch.float32))
            assert abs(logged - ref) <= rtol["norm"] * ref, (where, norms, got["ref_logged_norms"])
        resumed = got["resumed_losses"]
        assert 0 < len(resumed) < len(got["losses"]), where
        assert resumed == got["losses"][-len(resumed) :], f"{where}: resume is not bitwise"
        assert got["resumed_masters"] == got["final_masters"], f"{where}: masters after resume"
        weights = got["saved_weights"]
        assert weights["names"] == got["expected_names"], where
        assert not weights["missing"] and weights["equal"], (where, weights)
        assert weights["stored_dtypes"] == ["torch.float32"], (where, weights)


README_FRAMEWORK_HEADINGS = {
    "trainer": "## HF Trainer",
    "accelerate": "## Accelerate",
    "lightning": "## Lightning",
}
"""The headings of docs/frameworks.md whose first ```python block is each framework's recipe."""


def readme_recipe_blocks() -> dict[str, str]:
    """The first ```python block under each framework's heading of docs/frameworks.md, by
    framework."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "frameworks.md"), encoding="utf-8") as handle:
        text = handle.read()
    blocks: dict[str, str] = {}
    for framework, heading in README_FRAMEWORK_HEADINGS.items():
        part = text.split("\n" + heading + "\n", 1)[1].split("\n## ", 1)[0]
        found = re.search(r"```python\n(.*?)```", part, re.DOTALL)
        assert found, f"docs/frameworks.md: no python block under {heading}"
        blocks[framework] = found.group(1)
    return blocks
