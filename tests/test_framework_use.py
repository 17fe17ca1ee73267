"""What training frameworks do to a model and optimizer, met by the library itself.

HF Trainer, Accelerate and Lightning build the optimizer at their own time, wrap the model in
DDP, move it with ``.to``, clip with torch's utility and save it with safetensors. Each test
here is one such thing done to a model and optimizer of dtypeplan without any integration.
"""

from __future__ import annotations

import pytest
import torch

import dtypeplan
from dtypeplan.errors import OptimizerUsageError
from tests._helpers import make_model


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_build_without_a_group_under_a_multi_rank_launcher_is_refused(
    stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = dtypeplan.resolve({"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}})
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = make_model(0)
    with pytest.raises(OptimizerUsageError, match="prepare_model.*WORLD_SIZE=2"):
        plan.prepare_model(model)
    with pytest.raises(OptimizerUsageError, match="WORLD_SIZE=2.*Initialize the process group"):
        plan.build(model.parameters())
    monkeypatch.setenv("WORLD_SIZE", "1")
    plan.build(plan.prepare_model(model).parameters()).close()
