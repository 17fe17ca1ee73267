"""The flat engine's update-kernel registry (``dtypeplan/optimizers/update/``).

Each precision cell is served by the kernel the registry names for it (on one CPU process:
no Triton), and a param group that turns ``maximize`` on after build moves the engine off
torch's direct fused path at the next step (as before the registry: the choice follows the
switches).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan.optimizers import MixedPrecisionOptimizer
from dtypeplan.optimizers.update import KERNELS

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
    (
        "torch-class-low-precision",
        {
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "optimizer_states": "bf16",
        },
    ),
    (
        "torch-class-low-precision",
        {
            **BF16,
            "master_weights": {"dtype": "bf16", "rounding": "kahan"},
            "optimizer": {"type": "Adagrad", "params": {"lr": 0.05}},
        },
    ),
]


def _train(opt: Any, model: torch.nn.Module, steps: int, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(4, 8, dtype=dtype)).square().sum()
        if isinstance(opt, MixedPrecisionOptimizer):
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()


@pytest.mark.parametrize(
    ("name", "config"), CELLS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CELLS)]
)
def test_each_cell_runs_the_kernel_the_registry_names(name: str, config: dict[str, Any]) -> None:
    plan = dtypeplan.resolve(config)
    torch.manual_seed(0)
    model = plan.prepare_model(torch.nn.Linear(8, 4))
    opt = plan.build(model.parameters())
    kernel = opt.update_kernel
    assert kernel.name == name, kernel.describe()
    assert kernel.describe()
    before = [p.detach().float().clone() for p in model.parameters()]
    _train(opt, model, 2, plan.param_dtype)
    assert opt.update_kernel is kernel  # chosen once: the steps did not build another
    assert all(
        not torch.equal(b, p.detach().float())
        for b, p in zip(before, model.parameters(), strict=True)
    ), "the kernel did not update the parameters"


def test_every_cpu_kernel_is_reached_by_some_cell() -> None:
    """The Triton kernels are the ones a CPU process never runs (outside Triton's interpreter:
    ``tests/test_low_precision_triton.py``)."""
    reached = {name for name, _ in CELLS}
    assert reached == {k.name for k in KERNELS} - {"triton", "triton-low-precision"}


def test_the_low_precision_triton_kernel_comes_after_the_16bit_hand_off() -> None:
    """torch's fused kernel keeps the cell it computes exactly (bf16 everything, nearest), and
    the one-pass Triton kernel improves on the fp32 pieces of ``low-precision`` (its engine
    tests run under Triton's interpreter: ``tests/test_low_precision_triton.py``)."""
    order = [k.name for k in KERNELS]
    hand_off, triton = order.index("torch-fused-16bit"), order.index("triton-low-precision")
    assert hand_off < triton < order.index("low-precision")


def test_a_group_turning_maximize_on_leaves_the_fused_path_as_before() -> None:
    """The direct fused path ignores ``maximize``: the choice is made again when a group turns
    it on after build (before the registry the engine asked at every step), so the update
    follows ``torch.optim.AdamW`` given the same switch rather than silently descending."""
    plan = dtypeplan.resolve({"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    reference = torch.nn.Linear(8, 4)
    reference.load_state_dict(model.state_dict())
    torch_opt = torch.optim.AdamW(reference.parameters(), **plan.optimizer.params)
    opt = plan.build(model.parameters())
    _train(opt, model, 2, torch.float32)
    _train(torch_opt, reference, 2, torch.float32)
    assert opt.update_kernel.name == "torch-fused"
    opt.param_groups[0]["maximize"] = True
    torch_opt.param_groups[0]["maximize"] = True
    _train(opt, model, 2, torch.float32)
    _train(torch_opt, reference, 2, torch.float32)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        # fp32, 4 steps of lr 1e-2: the two paths may differ by a few ulps of each update.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert opt.update_kernel.name == "generic"
