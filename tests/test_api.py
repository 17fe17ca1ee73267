"""The public names of /work/shared/API.md exist, with the documented types."""

from __future__ import annotations

import json

import pytest
import torch

import dtypeplan

API_NAMES = [
    "resolve",
    "PrecisionConfigError",
    "RulesError",
    "NotSupportedError",
    "register",
    "register_optimizer",
    "Lion",
    "plan_for",
]
PLAN_DTYPES = ["param_dtype", "grad_accum_dtype", "comm_dtype", "master_dtype"]
OPTIMIZER_CALLS = [
    "backward",
    "step",
    "zero_grad",
    "clear_lp_grads",
    "state_dict",
    "load_state_dict",
]


def test_every_exported_name_exists() -> None:
    assert len(dtypeplan.__all__) == len(set(dtypeplan.__all__))
    for name in dtypeplan.__all__:
        assert hasattr(dtypeplan, name), name
    namespace: dict[str, object] = {}
    exec("from dtypeplan import *", namespace)
    assert set(dtypeplan.__all__) <= set(namespace)


@pytest.mark.parametrize("name", API_NAMES)
def test_api_md_names_exist(name: str) -> None:
    assert name in dtypeplan.__all__
    assert callable(getattr(dtypeplan, name))


@pytest.mark.parametrize("name", ["save", "load", "export_model_state"])
def test_checkpoint_functions(name: str) -> None:
    checkpoint = getattr(dtypeplan, "checkpoint", None)
    if checkpoint is None or not hasattr(checkpoint, name):
        pytest.skip(f"dtypeplan.checkpoint.{name} is not there yet")
    assert callable(getattr(checkpoint, name))


def test_errors_are_value_errors_with_their_fields() -> None:
    for cls in (dtypeplan.PrecisionConfigError, dtypeplan.RulesError, dtypeplan.NotSupportedError):
        assert issubclass(cls, ValueError)
    assert not issubclass(dtypeplan.NotSupportedError, dtypeplan.PrecisionConfigError)
    assert not issubclass(dtypeplan.PrecisionConfigError, dtypeplan.NotSupportedError)
    assert dtypeplan.PrecisionConfigError("bad", "$.bf16").path == "$.bf16"
    error = dtypeplan.RulesError("bad", "rules.yaml", 7)
    assert (error.file, error.line, str(error)) == ("rules.yaml", 7, "rules.yaml:7: bad")


def test_status_is_a_str_enum() -> None:
    status = dtypeplan.Status
    assert [s.value for s in status] == ["OK", "NotSupported", "Error"]
    for member in status:
        assert isinstance(member, str)
        assert member == member.value and str(member) == member.value
        assert status(member.value) is member


@pytest.mark.parametrize(
    ("config", "pipeline", "status"),
    [
        ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, False, "OK"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, False, "Error"),
        (
            {
                "zero_optimization": {"stage": 0},
                "gradient_accumulation_dtype": {"dtype": "fp32", "sharded": True},
            },
            False,
            "Error",
        ),
    ],
)
def test_plan_attributes_have_the_documented_types(
    config: dict[str, object], pipeline: bool, status: str
) -> None:
    plan = dtypeplan.resolve(config, pipeline_parallel=pipeline)
    assert isinstance(plan, dtypeplan.PrecisionPlan)
    assert isinstance(plan.status, dtypeplan.Status) and plan.status == status
    assert plan.implementation is None if status != "OK" else isinstance(plan.implementation, str)
    assert isinstance(plan.rule_id, str) and isinstance(plan.reason, str) and plan.reason
    for name in PLAN_DTYPES:
        assert isinstance(getattr(plan, name), torch.dtype), name
    assert isinstance(plan.accumulator_sharded, bool)
    assert type(plan.zero_stage) is int and 0 <= plan.zero_stage <= 3
    assert isinstance(plan.pipeline_parallel, bool) and plan.pipeline_parallel is pipeline
    assert isinstance(plan.explain(), str)
    assert plan.rule_id in plan.explain()
    data = plan.to_dict()
    assert json.loads(json.dumps(data)) == data
    for name in [
        "status",
        "implementation",
        "rule_id",
        "reason",
        "accumulator_sharded",
        "zero_stage",
        "pipeline_parallel",
        *PLAN_DTYPES,
    ]:
        assert name in data, name
    assert data["status"] == status
    assert set(plan.memory(1000, 2)) == {
        "host_params",
        "host_accumulator",
        "host_master",
        "host_optimizer_states",
        "host_total",
        "params",
        "grads",
        "accumulator",
        "master",
        "optimizer_states",
        "total",
    }
    assert callable(plan.build)


@pytest.mark.parametrize("stage", [0, 1])
def test_built_optimizer_keeps_the_contract(stage: int) -> None:
    plan = dtypeplan.resolve(
        {
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        }
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = plan.build(model.parameters())
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert isinstance(optimizer, dtypeplan.MixedPrecisionOptimizer)
    for name in OPTIMIZER_CALLS:
        assert callable(getattr(optimizer, name)), name
    assert optimizer.loss_scale == 1.0 and optimizer.skipped_steps == 0
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.backward(model(torch.randn(3, 4, dtype=torch.bfloat16)).float().square().mean())
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert isinstance(optimizer.grad_norm, float) and optimizer.grad_norm > 0
    optimizer.zero_grad()
    optimizer.clear_lp_grads()
    state = optimizer.state_dict()
    optimizer.load_state_dict(state)


def test_fp16_optimizer_reports_its_loss_scale() -> None:
    plan = dtypeplan.resolve({"fp16": {"enabled": True, "initial_scale_power": 8}})
    optimizer = plan.build(torch.nn.Linear(2, 2).parameters())
    assert optimizer.loss_scale == 256.0


def test_registered_names_list_the_builtin_implementations() -> None:
    names = dtypeplan.registered_names()
    assert names == sorted(names)
    for rule in dtypeplan.load_rules().rules:
        if rule.implementation is not None:
            assert rule.implementation in names


# --- the plan holds what runs --------------------------------------------------------------------
HASHABLE_CONFIGS = [
    {},
    {"fp16": {"enabled": True, "loss_scale": 128}, "zero_optimization": {"stage": 3}},
    {
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "betas": [0.8, 0.9]}},
        "gradient_accumulation_dtype": {"dtype": "bf16", "sharded": True},
        "zero_optimization": {"stage": 0},
    },
    {"bf16": {"enabled": True}, "fp16": {"enabled": True}},
]


@pytest.mark.parametrize("config", HASHABLE_CONFIGS)
def test_plans_are_hashable_and_equal_configs_give_equal_plans(config: dict) -> None:
    first, second = dtypeplan.resolve(config), dtypeplan.resolve(json.loads(json.dumps(config)))
    assert first == second and hash(first) == hash(second)
    assert len({first, second}) == 1
    with pytest.raises(TypeError):
        first.origins["param_dtype"] = "mutated"  # type: ignore[index]
    with pytest.raises(TypeError):
        first.optimizer.params["lr"] = 1.0  # type: ignore[index]


def test_effective_values_under_fp16_and_bf16() -> None:
    fp16 = dtypeplan.resolve({"fp16": {"enabled": True}})
    assert fp16.check_nonfinite is True and fp16.loss_scaling is not None
    assert "non-finite check       on" in fp16.explain()
    bf16 = dtypeplan.resolve({"bf16": {"enabled": True}})
    assert bf16.check_nonfinite is False and bf16.loss_scaling is None
    assert fp16.reduce_dtype == fp16.comm_dtype  # FSDP2's MixedPrecisionPolicy name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_build_returns_the_class_the_plan_names(stage: int) -> None:
    """Without torch.distributed the builder makes ``single_process_implementation``."""
    plan = dtypeplan.resolve({"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}})
    model = plan.prepare_model(torch.nn.Linear(4, 2))
    optimizer = plan.build(model.parameters())
    name = plan.implementation_for(distributed=False)
    assert name == plan.single_process_implementation
    assert type(optimizer) is dtypeplan.optimizers.get_implementation(name)
    if stage == 3:
        assert (plan.implementation, name) == ("fsdp2", "sharded")
    else:
        assert name == plan.implementation
