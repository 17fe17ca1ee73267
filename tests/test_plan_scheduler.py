"""``plan.build_scheduler(optimizer)``: the config's DeepSpeed ``scheduler`` block on the
optimizer ``plan.build`` made, stepping with it and standing still on a skipped fp16 step.
(The formulas themselves are tested against DeepSpeed's in the schedulers' own tests.)
"""

from __future__ import annotations

from typing import Any

import torch

import dtypeplan
from dtypeplan.resolver import FrozenDict

WARMUP = {
    "type": "WarmupLR",
    "params": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 1e-3,
        "warmup_num_steps": 4,
        "warmup_type": "linear",
    },
}


def _plan(config: dict[str, Any], scheduler: dict[str, Any]) -> dtypeplan.PrecisionPlan:
    return dtypeplan.resolve({**config, "scheduler": scheduler})


def test_without_a_scheduler_block_there_is_none() -> None:
    plan = dtypeplan.resolve({})
    model = torch.nn.Linear(2, 2)
    assert plan.scheduler is None
    assert plan.build_scheduler(plan.build(model.parameters())) is None


def test_the_scheduler_block_builds_and_steps() -> None:
    plan = _plan({"bf16": {"enabled": True}}, WARMUP)
    assert isinstance(plan.scheduler, FrozenDict)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = plan.build(model.parameters())
    scheduler = plan.build_scheduler(optimizer)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
    lrs = []
    for _ in range(6):
        optimizer.backward(model(torch.randn(3, 4, dtype=torch.bfloat16)).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    # DeepSpeed's linear warmup: iteration t (0 after the first step) runs at 1e-3 * t / 4.
    assert lrs == [0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3]


def test_a_skipped_fp16_step_does_not_advance_the_schedule() -> None:
    plan = _plan({"fp16": {"enabled": True, "initial_scale_power": 4}}, WARMUP)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = plan.build(model.parameters())
    scheduler = plan.build_scheduler(optimizer)
    assert scheduler is not None
    x = torch.randn(3, 4, dtype=torch.float16)
    lrs = []
    for step in range(3):
        scale = float("inf") if step == 1 else 1.0  # an overflowing micro-batch at step 1
        optimizer.backward(model(x).float().square().mean() * scale)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert optimizer.skipped_steps == 1
    assert lrs == [0.0, 0.0, 2.5e-4]


def test_param_groups_hold_every_hyperparameter_as_torch_does() -> None:
    """betas, eps... are in param_groups (torch's own layout), so OneCycleLR's momentum cycle
    runs and what it sets reaches the update."""
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}
    plan = dtypeplan.resolve(config)
    model = torch.nn.Linear(3, 3)
    optimizer = plan.build(model.parameters())
    reference = torch.optim.AdamW(torch.nn.Linear(3, 3).parameters(), lr=1e-3, weight_decay=0.0)
    assert optimizer.param_groups[0].keys() - {"initial_lr"} >= {"betas", "eps", "amsgrad"}
    for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
        assert optimizer.param_groups[0][key] == reference.param_groups[0][key], key
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=10)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(2, 3)).sum().backward()
        optimizer.step()
        schedule.step()
    betas = optimizer.param_groups[0]["betas"]
    assert betas[0] < 0.95  # cycled down from max_momentum 0.95
    optimizer.zero_grad()
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()  # the next step takes the group's values into the update
    assert optimizer.inner.param_groups[0]["betas"] == betas
