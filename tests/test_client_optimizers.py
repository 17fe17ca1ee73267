"""The program's own optimizer: ``plan.build(params, optimizer=...)``, ``plan.wrap(opt)``,
``plan.with_optimizer`` and the table's optimizer-kind dimension.

Every elementwise ``torch.optim`` class runs at every ZeRO stage on 2 ranks against plain fp32
``torch.optim`` on the full batch (one spawned group for all cases); optimizers that need each
parameter's shape are NotSupported with the table's reason.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan.launch import spawn
from dtypeplan.resolver._optimizer_kind import ELEMENTWISE
from tests._helpers import CLIENT_HYPERPARAMETERS, assert_parity
from tests.workers.parity import run_cases

# fp32 everywhere: the only differences from the reference are the order of the sums (two
# ranks' micro-batches against one full batch), a few ulps per step over 4 steps.
FP32_RTOL = 1e-5
# bf16 parameters: as test_parity.py's low-precision bounds (8 mantissa bits in forward).
BF16_LOSS_RTOL = 1e-2
BF16_MASTER_RTOL = 2e-2

STAGES = (0, 1, 2, 3)


def _config(stage: int, bf16: bool = False) -> dict[str, Any]:
    # No optimizer block: the program's optimizer is the only one. Small buckets, so that the
    # flat shards cut through parameters.
    config: dict[str, Any] = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 200}}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def _cases() -> list[dict[str, Any]]:
    cases = []
    for number, name in enumerate(sorted(CLIENT_HYPERPARAMETERS)):
        for stage in STAGES:
            how = "wrap" if (number + stage) % 2 else "build"
            cases.append(
                {
                    "name": f"{name} stage {stage} {how}",
                    "config": _config(stage),
                    "client": {
                        "optimizer": name,
                        "hyperparameters": CLIENT_HYPERPARAMETERS[name],
                        "how": how,
                    },
                    "steps": 4,
                    "micro_batches": 2,
                    "param_groups": 2,
                    "seed": number,
                }
            )
    cases.append(
        {
            "name": "RMSprop stage 2 wrap bf16",
            "config": _config(2, bf16=True),
            "client": {"optimizer": "RMSprop", "hyperparameters": {"lr": 1e-3}, "how": "wrap"},
            "steps": 4,
            "micro_batches": 2,
            "param_groups": 1,
            "bf16": True,
        }
    )
    return cases


def test_the_cases_cover_every_elementwise_class() -> None:
    assert {getattr(torch.optim, name) for name in CLIENT_HYPERPARAMETERS} == set(ELEMENTWISE)


def test_client_optimizers_every_stage_two_ranks() -> None:
    cases = _cases()
    results = spawn(run_cases, 2, cases, timeout_s=400)[0]
    for case, result in zip(cases, results, strict=True):
        if case.get("bf16"):
            assert_parity(result, BF16_LOSS_RTOL, BF16_MASTER_RTOL)
        else:
            assert_parity(result, FP32_RTOL, FP32_RTOL)


# Adafactor and Muon run whole (tests/test_whole_tensor.py).
@pytest.mark.parametrize("torch_class", [torch.optim.LBFGS, torch.optim.SparseAdam])
@pytest.mark.parametrize("stage", STAGES)
def test_shaped_optimizers_are_not_supported(torch_class: type, stage: int) -> None:
    plan = dtypeplan.resolve(_config(stage))
    assert plan.status == "OK" and plan.optimizer_kind == "elementwise"
    shaped = plan.with_optimizer(torch_class)
    assert shaped.status == "NotSupported" and shaped.optimizer_kind == "shaped"
    assert shaped.rule_id == "shaped-optimizer"
    assert "each parameter's shape" in shaped.reason and "including 0" in shaped.reason
    assert f"{torch_class.__name__} is shaped" in shaped.explain()
    model = torch.nn.Linear(4, 3)
    with pytest.raises(dtypeplan.NotSupportedError, match="each parameter's shape"):
        plan.build(model.parameters(), optimizer=torch_class)
    with pytest.raises(dtypeplan.NotSupportedError, match="each parameter's shape"):
        plan.wrap(torch_class(model.parameters()))


def test_an_unknown_optimizer_class_is_shaped() -> None:
    class MyAdam(torch.optim.Adam):
        """A subclass may override the update: dtypeplan cannot tell whether it is elementwise."""

    plan = dtypeplan.resolve({}).with_optimizer(MyAdam, {"lr": 1e-3})
    assert plan.status == "NotSupported" and plan.optimizer_kind == "shaped"
    assert plan.alternatives and "optimizer.type=AdamW" in plan.alternatives[0].changes


def test_with_optimizer_keeps_the_rest_of_the_plan() -> None:
    plan = dtypeplan.resolve({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    other = plan.with_optimizer(torch.optim.Adagrad, {"lr": 0.1})
    assert other.status == "OK" and other.optimizer.torch_class is torch.optim.Adagrad
    assert other.optimizer.params == {"lr": 0.1}
    assert other.optimizer.state_bytes_per_param == 4
    assert (other.param_dtype, other.zero_stage, other.implementation) == (
        plan.param_dtype,
        plan.zero_stage,
        plan.implementation,
    )
    assert "the program's optimizer" in other.explain()
    assert other.memory(1000, 2)["optimizer_states"] == 4 * 1000 // 2
    assert plan.memory(1000, 2)["optimizer_states"] == 8 * 1000 // 2


def test_bad_hyperparameters_are_config_errors() -> None:
    plan = dtypeplan.resolve({})
    model = torch.nn.Linear(2, 2)
    with pytest.raises(dtypeplan.PrecisionConfigError, match="did you mean 'momentum'"):
        plan.build(model.parameters(), optimizer=torch.optim.SGD, lr=0.1, momentun=0.9)
    with pytest.raises(dtypeplan.PrecisionConfigError, match="Invalid learning rate"):
        plan.build(model.parameters(), optimizer=torch.optim.RMSprop, lr=-1.0)
    with pytest.raises(dtypeplan.PrecisionConfigError, match="torch.optim.Optimizer class"):
        plan.build(model.parameters(), optimizer=torch.nn.Linear)  # type: ignore[arg-type]


def test_build_hyperparameters_override_the_config() -> None:
    plan = dtypeplan.resolve({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    model = torch.nn.Linear(2, 2)
    optimizer = plan.build(model.parameters(), momentum=0.9)
    assert optimizer.plan.optimizer.torch_class is torch.optim.SGD
    assert optimizer.plan.optimizer.params == {"lr": 0.1, "momentum": 0.9}
    assert optimizer.inner.param_groups[0]["momentum"] == 0.9


def test_wrap_takes_groups_and_defaults_and_drops_fast_path_choices() -> None:
    model = torch.nn.Linear(4, 3)
    client = torch.optim.Adam(
        [{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}],
        lr=3e-3,
        weight_decay=0.1,
        foreach=False,
    )
    optimizer = dtypeplan.resolve({"zero_optimization": {"stage": 1}}).wrap(client)
    assert optimizer.plan.optimizer.torch_class is torch.optim.Adam
    assert "foreach" not in optimizer.plan.optimizer.params
    assert [g["weight_decay"] for g in optimizer.inner.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in optimizer.param_groups] == [3e-3, 3e-3]
    assert optimizer.inner.defaults["fused"] is True


def test_wrap_refuses_an_optimizer_that_has_stepped() -> None:
    model = torch.nn.Linear(2, 1)
    client = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    client.step()
    with pytest.raises(dtypeplan.NotSupportedError, match="already stepped"):
        dtypeplan.resolve({}).wrap(client)
