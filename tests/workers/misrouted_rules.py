"""A model prepared by one plan and built by another whose rules route ZeRO-3 elsewhere."""

from __future__ import annotations

from typing import Any

import torch

import dtypeplan

CONFIG = {
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
}


def prepare_with_one_build_with_other(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    """ZeRO-3 prepared (FSDP2 shards the model), built by the plan of ``stage`` (the flat
    sharded engine, which takes whole tensors): what build raises (or None)."""
    shipped = dtypeplan.resolve(CONFIG)
    misrouted = dtypeplan.resolve({**CONFIG, "zero_optimization": {"stage": stage}})
    torch.manual_seed(0)
    model = shipped.prepare_model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
    try:
        misrouted.build(model.parameters())
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None, "message": ""}
