"""The flat engine's update-kernel registry (``dtypeplan/optimizers/update_kernels/``).

Each precision cell is served by the kernel the registry names for it (on one CPU process:
no Triton), a param group that turns amsgrad on after build moves the engine off torch's
fused path at the next step (as before the registry: the choice follows the switches), and
the kernel's host copies are dropped when the states are loaded.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan.optimizers.update_kernels import KERNELS

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}
BF16 = {"bf16": {"enabled": True}}

CELLS: list[tuple[str, dict[str, Any]]] = [
    ("torch-fused", {"optimizer": ADAMW}),
    ("torch-fused", {**BF16, "optimizer": ADAMW}),
    (
        "torch-fused-16bit",
        {
            **BF16,
            "gradient_accumulation_dtype": "bf16",
            "master_weights": {"dtype": "bf16"},
            "optimizer_states": "bf16",
            "optimizer": ADAMW,
        },
    ),
    (
        "low-precision",
        {
            **BF16,
            "master_weights": {"dtype": "bf16", "rounding": "stochastic"},
            "optimizer_states": "bf16",
            "optimizer": ADAMW,
        },
    ),
    ("low-precision", {"optimizer_states": "bf16", "optimizer": ADAMW}),
    ("quantized", {"optimizer_states": "int8", "optimizer": ADAMW}),
    (
        "quantized",
        {
            **BF16,
            "master_weights": {"dtype": "bf16"},
            "optimizer_states": "fp8",
            "optimizer": ADAMW,
        },
    ),
    ("host-offload", {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}),
    ("generic", {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}),
    (
        "generic",
        {
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        },
    ),
]


def _train(opt: Any, model: torch.nn.Module, steps: int, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        opt.backward(model(torch.randn(4, 8, dtype=dtype)).square().sum())
        opt.step()


@pytest.mark.parametrize(
    ("name", "config"), CELLS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CELLS)]
)
def test_each_cell_runs_the_kernel_the_registry_names(name: str, config: dict[str, Any]) -> None:
    plan = dtypeplan.resolve(config)
    torch.manual_seed(0)
    model = plan.prepare_model(torch.nn.Linear(8, 4))
    opt = plan.build(model.parameters())
    assert opt.update_kernel.name == name, opt.update_kernel.describe()
    assert opt.update_kernel.describe()
    before = [p.detach().float().clone() for p in model.parameters()]
    _train(opt, model, 2, plan.param_dtype)
    assert opt.update_kernel.name == name  # chosen once: the steps did not change it
    assert all(
        not torch.equal(b, p.detach().float())
        for b, p in zip(before, model.parameters(), strict=True)
    ), "the kernel did not update the parameters"


def test_every_cpu_kernel_is_reached_by_some_cell() -> None:
    """Triton is the one kernel a CPU process never runs."""
    reached = {name for name, _ in CELLS}
    assert reached == {k.name for k in KERNELS} - {"triton"}


def test_a_group_turning_amsgrad_on_leaves_the_fused_path_as_before() -> None:
    """torch's fused path ignores amsgrad: the choice is made again when a group turns it on
    (before the registry the engine asked at every step), so amsgrad is not silently lost."""
    plan = dtypeplan.resolve({"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = plan.build(model.parameters())
    _train(opt, model, 1, torch.float32)
    assert opt.update_kernel.name == "torch-fused"
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(KeyError, match="max_exp_avg_sq"):
        # torch's own step with amsgrad needs the state it creates at the first step; the
        # point is that the engine hands the step to it rather than to the fused path.
        _train(opt, model, 1, torch.float32)
    assert opt.update_kernel.name == "generic"
