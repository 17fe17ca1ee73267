"""What training frameworks do to a model and optimizer, met by the library itself.

HF Trainer, Accelerate and Lightning build the optimizer at their own time, wrap the model in
DDP, move it with ``.to``, clip with torch's utility and save it with safetensors. Each test
here is one such thing done to a model and optimizer of dtypeplan without any integration.
"""

from __future__ import annotations

import copy

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


DDP_CASES = [
    # stage, bf16 params + fp32 accumulation, DDP's options, micro-batches per step
    {"stage": 0, "bf16": True, "micro_batches": 1},
    {"stage": 1, "bf16": False, "bucket_view": True, "micro_batches": 2, "no_sync": True},
    {"stage": 1, "bf16": True, "micro_batches": 2},  # every micro-batch synchronized
    {"stage": 2, "bf16": True, "find_unused": True, "micro_batches": 1},  # the HF Trainer's
    {"stage": 2, "bf16": False, "static_graph": True, "bucket_view": True, "micro_batches": 2},
]
DDP_DEFAULTS = {"bucket_view": False, "find_unused": False, "static_graph": False, "no_sync": False}


def test_under_a_ddp_wrapper_the_optimizer_alone_reduces() -> None:
    """DDP around parameters the optimizer owns (Accelerate, Lightning 32-true, the Trainer):
    the same losses and parameters, bit for bit, as without DDP, the same gradient-sized
    collectives on the wire (DDP's buckets go nowhere), no .grad left after backward, and no
    "set by hand" error at step. A DDP with a communication hook of its own is refused."""
    from dtypeplan.launch import spawn
    from tests.workers.framework_use import ddp_cases

    cases = [{**DDP_DEFAULTS, **case} for case in DDP_CASES]
    cases.append({**DDP_DEFAULTS, "stage": 1, "bf16": True, "micro_batches": 1, "own_hook": True})
    for rank_results in spawn(ddp_cases, 2, cases):
        *compared, refused = rank_results
        assert "communication hook of its own" in refused
        for case, (wrapped, bare) in zip(cases, compared, strict=False):
            assert wrapped["losses"] == bare["losses"], case
            for mine, theirs in zip(wrapped["params"], bare["params"], strict=True):
                assert torch.equal(mine, theirs), case
            assert wrapped["wire"] == bare["wire"], case
            assert bare["wire"], "the profiler saw the optimizer's own collectives"
            assert not any(wrapped["grads_after_backward"]), case


class _TakesMany(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, extra: dict, ids: torch.Tensor, *, scale: torch.Tensor):
        assert ids.dtype == torch.long
        return self.linear(x) + self.linear(extra["y"][0]) * scale + ids


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_prepare_model_casts_floating_forward_inputs(stage: int) -> None:
    """As FSDP2's cast_forward_inputs: floating tensors (positional, keyword, nested) to the
    parameter dtype; integer ones untouched; preparing twice installs one cast."""
    plan = dtypeplan.resolve({"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}})
    model = plan.prepare_model(plan.prepare_model(_TakesMany()))
    out = model(
        torch.randn(4, 3),
        {"y": [torch.randn(4, 3, dtype=torch.float64)]},
        torch.ones(4, 2, dtype=torch.long),
        scale=torch.tensor(2.0),
    )
    assert out.dtype == torch.bfloat16
    assert len(model._forward_pre_hooks) == 1
    twin = copy.deepcopy(model)
    ids = torch.ones(4, 2, dtype=torch.long)
    out = twin(torch.randn(4, 3), {"y": [torch.randn(4, 3)]}, ids, scale=torch.tensor(1.0))
    assert out.dtype == torch.bfloat16
    dtypeplan.resolve({"zero_optimization": {"stage": stage}}).prepare_model(model)
    assert not model._forward_pre_hooks
