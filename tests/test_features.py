"""The feature dimensions (DeepSpeed settings dtypeplan does not run yet) from real configs.

Each value's config fragment (the dimension record's, which the table and the resolver's
advice print) must resolve to that value, every value but "not used" must give a plan that is
not OK with the rule's reason, and the advice must lead back to an OK plan.
"""

from __future__ import annotations

from typing import Any

import pytest

import dtypeplan
from dtypeplan.resolver import DTYPE_NAMES
from dtypeplan.resolver._dimensions import (
    FEATURE_DIMENSIONS,
    OPTIMIZER_KIND,
    config_for,
    shard_groups_value,
)
from dtypeplan.resolver._effective import fp8_native

PLAN_FIELDS = {
    "master": lambda plan: (
        DTYPE_NAMES[plan.master_dtype]
        + {"nearest": "", "stochastic": "_sr", "kahan": "_kahan"}[plan.master_rounding]
    ),
    "states": lambda plan: plan.optimizer_states,
    "autocast": lambda plan: (
        "none" if plan.autocast_dtype is None else DTYPE_NAMES[plan.autocast_dtype]
    ),
    "shard_groups": lambda plan: shard_groups_value(plan.shard_group_size, plan.wire_across_groups),
    "offload_optimizer": lambda plan: plan.offload_optimizer,
    "offload_param": lambda plan: plan.offload_param,
    "quantized_communication": lambda plan: plan.quantized_communication,
    "hierarchical_partitioning": lambda plan: plan.hierarchical_partitioning,
    "gradient_prescaling": lambda plan: plan.gradient_prescaling,
    "fp8": lambda plan: plan.fp8,
    "optimizer": lambda plan: plan.optimizer_kind,
    "param_access": lambda plan: plan.point["param_access"],
    "state_kind": lambda plan: plan.state_kind,
    "fp8_recipe": lambda plan: plan.fp8_recipe,
    "fp8_all_gather": lambda plan: plan.fp8_all_gather,
    "fp8_execution": lambda plan: plan.fp8_execution,
}

CASES = [
    (dim.name, value)
    for dim in FEATURE_DIMENSIONS.values()
    if dim is not OPTIMIZER_KIND  # set by the program's class: test_client_optimizers.py
    for value in dim.values
]


IMPLEMENTED = (
    {("autocast", "bf16"), ("autocast", "fp16"), ("fp8", True)}
    | {("shard_groups", value) for value in ("hybrid", "hybrid_fp32")}
    | {("fp8_recipe", r) for r in ("rowwise", "rowwise_with_gw_hp", "mxfp8")}
    | {("fp8_all_gather", "fp8"), ("fp8_execution", "emulated")}
    | {("state_kind", kind) for kind in ("step_sizes", "averaged_weights")}
    | {("offload_optimizer", "cpu"), ("hierarchical_partitioning", True)}
    | {("param_access", "owner")}
)
"""Values OK at ZeRO-3 with their fragment alone (fp32 parameters): tests/test_autocast.py
proves autocast, and refuses it with 16-bit parameters; shard groups run FSDP2's HSDP mesh
(issue 22), whose reduction across the groups is in communication_data_type (fp32 here) only:
another wire across is refused by build, and so by the table. fp8 compute with each recipe,
emulated, and its fp8 all-gather at ZeRO-3: tests/test_fp8.py. Rprop's step sizes and ASGD's
averaged weights in fp32, as torch keeps them: tests/test_every_optimizer.py. The optimizer
alone offloaded: tests/test_offload_zero3_optimizer.py; ZeRO++ hpZ: tests/test_hpz.py. A class
run whole (Muon: param_access owner): tests/test_whole_tensor.py."""


def _config(name: str, value: Any) -> dict[str, Any]:
    # ZeRO-3, where every feature applies; a feature's fragment may enable bf16 or fp16 itself;
    # fp8's own dimensions with fp8 on, where they mean anything.
    config = {
        **config_for({name: value}),
        "zero_optimization": {"stage": 3, **config_for({name: value}).get("zero_optimization", {})},
    }
    if FEATURE_DIMENSIONS[name].requires:
        config = {**config, **config_for({**FEATURE_DIMENSIONS[name].requires, name: value})}
        config["fp8"] = {**config_for({name: value}).get("fp8", {}), "enabled": True}
    return config


def test_the_plan_reports_every_feature() -> None:
    assert set(PLAN_FIELDS) == set(FEATURE_DIMENSIONS)


@pytest.mark.parametrize(("name", "value"), CASES)
def test_each_value_resolves_from_its_config(name: str, value: Any) -> None:
    dim = FEATURE_DIMENSIONS[name]
    plan = dtypeplan.resolve(_config(name, value))
    if (name, value) == ("fp8_execution", "native") and not fp8_native("tensorwise"):
        # emulate auto on a device without fp8 kernels runs emulated (explain() says so)
        assert plan.fp8_execution == "emulated" and "emulated" in plan.explain()
        return
    assert PLAN_FIELDS[name](plan) == value, plan.explain()
    if value == dim.default_value or (name, value) in IMPLEMENTED:
        assert plan.status == "OK", plan.explain()
        return
    if name == "master" and value in ("bf16", "bf16_sr", "bf16_kahan"):
        # Implemented at ZeRO-3 too (FSDP2 with bf16 shards; tests/test_parity.py).
        assert plan.status == "OK" and plan.rule_id == "zero3", plan.explain()
        return
    if name == "states":
        # Every state dtype is implemented at ZeRO-3 too (FSDP2 local shards;
        # tests/test_optimizer_states.py).
        assert plan.status == "OK" and plan.rule_id == "zero3", plan.explain()
        return
    assert plan.status != "OK"
    rule = next(r for r in dtypeplan.load_rules().rules if r.id == plan.rule_id)
    assert name in rule.when and value in rule.when[name]
    assert plan.reason in plan.explain()
    # The advice names the feature's "not used" setting, and following it gives an OK plan.
    unused = dim.setting(dim.default_value)
    assert any(unused in "; ".join(alt.changes) for alt in plan.alternatives), plan.explain()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_memory_refuses_an_offloaded_plan(device: str) -> None:
    """No figure for what dtypeplan does not offload: NVMe, parameters without the optimizer
    (the CPU optimizer offload at stages 1-3 has its host keys: tests/test_offload.py,
    tests/test_offload_zero3_optimizer.py)."""
    keys = ("offload_optimizer", "offload_param") if device == "nvme" else ("offload_param",)
    for key in keys:
        plan = dtypeplan.resolve({"zero_optimization": {"stage": 3, key: {"device": device}}})
        assert plan.status == "NotSupported" and getattr(plan, key) == device
        with pytest.raises(dtypeplan.NotSupportedError, match=f"{key} to {device}"):
            plan.memory(7_000_000_000, 8)
    assert dtypeplan.resolve({"zero_optimization": {"stage": 3}}).memory(10, 2)["total"] > 0


def test_check_prints_why_an_offloaded_plan_has_no_memory_figure(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from dtypeplan.cli import main

    path = tmp_path / "offload.json"
    path.write_text(
        '{"bf16": {"enabled": true}, "zero_optimization": {"stage": 3, '
        '"offload_param": {"device": "cpu"}}}'
    )
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "memory: not estimated, memory(): the plan asks for offload_param to cpu" in out
    assert "offload params         cpu" in out
    # The optimizer offload is implemented: device rows, and the host rows hold the optimizer.
    path.write_text(
        '{"bf16": {"enabled": true}, "zero_optimization": {"stage": 2, '
        '"offload_optimizer": {"device": "cpu"}}}'
    )
    assert main(["check", str(path), "--params", "1000", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "host_master" in out and "host_optimizer_states" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("host_total "))
    assert "6,000" in row  # 12 bytes per parameter over 2 ranks


def test_features_in_use_are_decided_by_the_first_gate_holding_them() -> None:
    """bf16 masters are served at ZeRO-2, optimizer offload too, not the two together: the
    offload gate (its unless leaves fp32 masters only) refuses, and each alternative lifts one
    of the two."""
    plan = dtypeplan.resolve(
        {
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        }
    )
    assert (plan.rule_id, plan.status) == ("offload-optimizer", "NotSupported")
    changes = ["; ".join(alt.changes) for alt in plan.alternatives]
    assert any("offload_optimizer.device=none" in c for c in changes), changes
    assert any("bf16_master_weights_and_grads=false" in c for c in changes), changes
