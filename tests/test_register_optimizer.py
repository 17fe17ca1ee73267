"""``dtypeplan.register_optimizer``: a user's own elementwise class joins every cell the
``torch.optim`` elementwise classes have, and dtypeplan's built-in Lion (DeepSpeed's ``"Lion"``).

The user's class is a 20-line Lion written here, with its momentum under its own state name
(``momentum``, which no ``torch.optim`` class uses), declared signed. Every case trains on 2
ranks against the same class in one process, fp32, on the full batch (one spawned group).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan.launch import spawn
from tests._helpers import assert_parity
from tests.workers.parity import run_cases

# fp32: sums in another order (two ranks' micro-batches against one batch): a few ulps a step.
# Lion's step is lr * sign(.), so an ulp can flip no sign except at an exact tie (none here).
FP32_RTOL = 1e-5
# bf16 masters (stochastic rounding) and bf16 states: test_parity.py's bf16 bounds.
BF16_LOSS_RTOL = 1e-2
BF16_MASTER_RTOL = 2e-2


class MyLion(torch.optim.Optimizer):
    """Lion (arXiv 2302.06675), as a user writes it."""

    def __init__(
        self, params: Any, lr: float = 1e-4, betas: Any = (0.9, 0.99), weight_decay: float = 0.0
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.state[p].setdefault("momentum", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(momentum * beta1 + p.grad * (1 - beta1)), alpha=-group["lr"])
                momentum.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class UndeclaredLion(MyLion):
    """The same class registered without its states: fp32 states only."""


dtypeplan.register_optimizer(MyLion, kind="elementwise", signed_states=["momentum"])
dtypeplan.register_optimizer(UndeclaredLion, kind="elementwise")

MINE = f"{__name__}:MyLion"
HYPER = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}


def _case(
    name: str, stage: int, *, client: bool = True, low_precision: bool = False
) -> dict[str, Any]:
    config: dict[str, Any] = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 200}}
    if low_precision:
        config |= {
            "bf16": {"enabled": True},
            "master_weights": {"dtype": "bf16", "rounding": "stochastic"},
            "optimizer_states": {"exp_avg": "bf16", "exp_avg_sq": "bf16"},
        }
    case: dict[str, Any] = {
        "name": name,
        "config": config,
        "steps": 4,
        "micro_batches": 2,
        "param_groups": 2,
        "bf16": low_precision,
    }
    if client:
        case["client"] = {
            "optimizer": MINE,
            "hyperparameters": HYPER,
            "how": ("build", "wrap")[stage % 2],
        }
    else:
        config["optimizer"] = {"type": "lion", "params": {**HYPER, "betas": list(HYPER["betas"])}}
    return case


@pytest.mark.slow
def test_a_registered_class_and_lion_train_at_every_stage_two_ranks() -> None:
    cases = [_case(f"MyLion stage {s}", s) for s in (0, 1, 2, 3)]
    cases += [_case(f"Lion stage {s}", s, client=False) for s in (0, 1, 2, 3)]
    cases += [_case("MyLion stage 2 bf16 masters and states", 2, low_precision=True)]
    cases += [_case("Lion stage 1 bf16 masters and states", 1, client=False, low_precision=True)]
    results = spawn(run_cases, 2, cases, timeout_s=400)[0]
    for case, result in zip(cases, results, strict=True):
        if case["bf16"]:
            assert_parity(result, BF16_LOSS_RTOL, BF16_MASTER_RTOL)
        else:
            assert_parity(result, FP32_RTOL, FP32_RTOL)


def test_registered_classes_are_elementwise_and_name_their_states() -> None:
    plan = dtypeplan.resolve({"zero_optimization": {"stage": 2}})
    mine = plan.with_optimizer(MyLion, HYPER)
    assert mine.status == "OK" and mine.optimizer_kind == "elementwise"
    assert mine.optimizer.state_bytes_per_param == 4
    lion = dtypeplan.resolve({"optimizer": {"type": "Lion"}})
    assert lion.status == "OK" and lion.optimizer.torch_class is dtypeplan.Lion
    assert lion.optimizer.state_bytes_per_param == 4


def test_undeclared_states_run_in_fp32_only() -> None:
    fp32 = dtypeplan.resolve({"zero_optimization": {"stage": 1}}).with_optimizer(UndeclaredLion)
    assert fp32.status == "OK"
    model = torch.nn.Linear(4, 3)
    fp32.build(model.parameters(), optimizer=UndeclaredLion).close()
    low = dtypeplan.resolve(
        {"bf16": {"enabled": True}, "optimizer_states": {"exp_avg": "bf16", "exp_avg_sq": "bf16"}}
    )
    with pytest.raises(
        dtypeplan.NotSupportedError, match="registered without its per-element states"
    ):
        low.build(model.parameters(), optimizer=UndeclaredLion)


def test_bad_registrations_are_refused() -> None:
    with pytest.raises(dtypeplan.RegistryError, match="already registered"):
        dtypeplan.register_optimizer(MyLion, kind="elementwise")
    with pytest.raises(dtypeplan.RegistryError, match="already registered"):
        dtypeplan.register_optimizer(torch.optim.AdamW, kind="elementwise")
    with pytest.raises(dtypeplan.RegistryError, match="kind is 'elementwise'"):
        dtypeplan.register_optimizer(type("X", (torch.optim.SGD,), {}), kind="shaped")
    with pytest.raises(dtypeplan.RegistryError, match="torch.optim.Optimizer class"):
        dtypeplan.register_optimizer(int, kind="elementwise")  # type: ignore[arg-type]
