"""Run dtypeplan.schedulers against deepspeed.runtime.lr_schedules and print the largest
difference of lr (and OneCycle's beta1) per schedule over 500 steps.

Usage: python tools/check_schedulers_against_deepspeed.py   (needs deepspeed importable; it is
not a dependency of dtypeplan). The last line is JSON.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from dtypeplan.schedulers import DEEPSPEED_SCHEDULERS

CASES: list[tuple[str, dict[str, Any]]] = [
    ("WarmupLR", {"warmup_num_steps": 100}),
    (
        "WarmupLR",
        {
            "warmup_min_lr": 1e-5,
            "warmup_max_lr": 3e-4,
            "warmup_num_steps": 77,
            "warmup_type": "linear",
        },
    ),
    ("WarmupLR", {"warmup_num_steps": 1}),
    ("WarmupDecayLR", {"total_num_steps": 400, "warmup_num_steps": 50, "warmup_max_lr": 2e-3}),
    (
        "WarmupDecayLR",
        {
            "total_num_steps": 300,
            "warmup_num_steps": 30,
            "warmup_type": "linear",
            "warmup_min_lr": [1e-6, 2e-6],
        },
    ),
    ("WarmupCosineLR", {"total_num_steps": 450, "warmup_num_steps": 40}),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 350,
            "warmup_num_steps": 25,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.05,
            "warmup_type": "linear",
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 100,
            "decay_step_size": 10,
            "decay_lr_rate": 0.01,
            "decay_mom_rate": 0.02,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": [1e-4, 2e-4],
            "cycle_max_lr": [1e-3, 3e-3],
            "cycle_first_step_size": 60,
            "cycle_second_step_size": 90,
            "cycle_first_stair_count": 4,
            "cycle_second_stair_count": 6,
            "cycle_min_mom": [0.85, 0.8],
            "cycle_max_mom": 0.95,
        },
    ),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 1e-4,
            "lr_range_test_step_size": 30,
            "lr_range_test_step_rate": 0.5,
        },
    ),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": [1e-4, 3e-4],
            "lr_range_test_step_size": 25,
            "lr_range_test_staircase": True,
        },
    ),
]
STEPS = 500


def _optimizer() -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 5e-4}], lr=1e-3)


def main() -> None:
    from deepspeed.runtime import lr_schedules

    worst: dict[str, float] = {}
    for name, params in CASES:
        ours_opt, ds_opt = _optimizer(), _optimizer()
        ours = DEEPSPEED_SCHEDULERS[name](ours_opt, **params)
        theirs = getattr(lr_schedules, name)(ds_opt, **params)
        diff = 0.0
        for _ in range(STEPS + 1):  # the constructor's t = -1, then STEPS steps
            for g, h in zip(ours_opt.param_groups, ds_opt.param_groups, strict=True):
                diff = max(diff, abs(g["lr"] - h["lr"]), abs(g["betas"][0] - h["betas"][0]))
                assert g["betas"][1] == h["betas"][1]
            ours.step()
            theirs.step()
        worst[name] = max(worst.get(name, 0.0), diff)
        print(f"{name:16s} {json.dumps(params)[:70]:72s} max |diff| = {diff:.3g}")
    print(json.dumps({"steps": STEPS, "max_abs_diff": worst}))


if __name__ == "__main__":
    main()
