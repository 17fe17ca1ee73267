"""torch_autocast: fp32 parameters, forward under torch.autocast in bf16 or fp16.

The table makes autocast OK exactly where fp32 parameters are OK, with the same optimizer: the
optimizer sees fp32 gradients either way. What autocast adds is proven here: that
``prepare_model`` runs forward under it (and ``plan.autocast()`` gives the context), that fp16
autocast scales the loss as ``torch.amp.GradScaler`` would (skipping an overflowed step and
halving the scale), and parity at every ZeRO stage against plain torch under ``torch.autocast``
(tests/workers/autocast.py). Pipeline parallelism: tests/test_pipeline.py.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan.launch import spawn
from dtypeplan.resolver import load_rules
from tests._helpers import assert_memory_close, make_model
from tests.workers.autocast import run_autocast_cases

# The reference runs each micro-batch's autocast forward and backward on the same values as
# dtypeplan (bit for bit); with fp32 accumulation and an fp32 wire the runs differ only in the
# order of at most 4 fp32 additions per gradient (2 micro-batches x 2 ranks): a few units of
# 2**-24 relative, which 3 Adam/SGD steps do not lift anywhere near 1e-5.
EXACT_RTOL = 1e-5
# A bf16 accumulator or wire rounds every gradient element to 8 mantissa bits, once per
# micro-batch or once on the wire plus once in the 2-rank bf16 sum: <= 2**-7 relative per
# element (more only where partial sums cancel). After 3 steps of lr 1e-2 that moves each
# weight by <= 3 * 1e-2 * 2**-7 = 2.3e-4 (~1e-3 of the ~0.3 weights) and the loss by about as
# much; the bounds are test_parity.py's for 16-bit cells, 10x above that.
ROUNDED_LOSS_RTOL = 1e-2
ROUNDED_MASTER_RTOL = 2e-2
# Before the first update both runs compute the same forward: only the order of summing the 4
# micro-batch losses (fp32 here, float64 in the reference) differs.
FIRST_LOSS_RTOL = 1e-6

WIDTH = 128  # ~33k parameters for the memory cases: bucket padding is well under 1%

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}
# SGD is not scale-invariant as Adam is: a loss scale or world size left in the gradient shows.
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}


def autocast_config(dtype: str, stage: int, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "torch_autocast": {"enabled": True, "dtype": dtype},
        "zero_optimization": {"stage": stage},
        "optimizer": ADAMW,
        **extra,
    }
    if dtype == "fp16":
        # GradScaler's schedule (no hysteresis), with a growth interval short enough to show.
        config["fp16"] = {"enabled": False, "loss_scale_window": 2, "hysteresis": 1}
    return config


def _parity_cases() -> list[dict[str, Any]]:
    cases = []
    for stage in (0, 1, 2, 3):
        for dtype in ("bf16", "fp16"):
            sgd = (stage + (dtype == "fp16")) % 2 == 1
            case: dict[str, Any] = {
                "name": f"stage{stage}-{dtype}-fp32accum-fp32wire-{'sgd' if sgd else 'adamw'}",
                "config": autocast_config(dtype, stage, optimizer=SGD if sgd else ADAMW),
                "exact": True,
                "steps": 3,
                "loss_backward": dtype == "bf16" and stage % 2 == 0,
            }
            if stage == 1:  # stage 1's sharded accumulator (stage 2's is its default)
                case["config"]["gradient_accumulation_dtype"] = {"dtype": "fp32", "sharded": True}
                case["name"] += "-sharded"
            if dtype == "fp16":
                case.update(steps=4, overflow_step=1)
            cases.append(case)
    variants = [
        ("stage0-bf16-bf16wire", "bf16", 0, {"communication_data_type": "bf16"}),
        ("stage1-bf16-bf16accum", "bf16", 1, {"gradient_accumulation_dtype": "bf16"}),
        (
            "stage2-bf16-bf16wire-fp32sum",
            "bf16",
            2,
            {"communication_data_type": "bf16", "communication_reduction": "fp32_sum"},
        ),
        ("stage2-fp16-bf16wire", "fp16", 2, {"communication_data_type": "bf16"}),
        ("stage3-bf16-bf16wire", "bf16", 3, {"communication_data_type": "bf16"}),
    ]
    for name, dtype, stage, extra in variants:
        case = {"name": name, "config": autocast_config(dtype, stage, **extra), "exact": False}
        case["steps"] = 4 if dtype == "fp16" else 3
        cases.append(case)
    return cases


def _memory_configs() -> list[dict[str, Any]]:
    return [autocast_config("bf16", stage) for stage in (0, 1, 2, 3)] + [
        autocast_config("fp16", 1, gradient_accumulation_dtype={"dtype": "fp32", "sharded": True})
    ]


# --- the table and the plan ------------------------------------------------------------------


def test_autocast_is_ok_exactly_where_fp32_parameters_are() -> None:
    table = load_rules()
    for point in table.points():
        if point["params"] != "fp32":
            continue
        plain = table.lookup(point)
        for dtype in ("bf16", "fp16"):
            rule = table.lookup({**point, "autocast": dtype})
            assert rule.status == plain.status, (point, dtype, rule.id, plain.id)
            assert rule.implementation == plain.implementation, (point, rule.id)
            assert rule.single_process_implementation == plain.single_process_implementation


@pytest.mark.parametrize("params", ["bf16", "fp16"])
def test_autocast_with_16_bit_parameters_is_refused_with_the_way_out(params: str) -> None:
    for dtype in ("bf16", "fp16"):
        plan = dtypeplan.resolve(
            {params: {"enabled": True}, "torch_autocast": {"enabled": True, "dtype": dtype}}
        )
        assert plan.status == "NotSupported", plan.rule_id
        assert "expects the loss not to match" in plan.reason  # DeepSpeed's own test
        assert "fp32 parameters" in plan.reason
        # The advice leads back to OK plans: drop torch_autocast (or the 16-bit mode).
        advice = "; ".join(change for alt in plan.alternatives for change in alt.changes)
        assert "torch_autocast.enabled=false" in advice, plan.explain()
        with pytest.raises(dtypeplan.NotSupportedError):
            plan.build(make_model(0).parameters())


def test_16_bit_masters_with_autocast_are_an_error() -> None:
    plan = dtypeplan.resolve(
        {
            "bf16": {"enabled": False, "bf16_master_weights_and_grads": True},
            "torch_autocast": {"enabled": True},
        }
    )
    assert plan.status == "Error", plan.rule_id
    assert plan.rule_id == "master-weights-below-params"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_plan_keeps_everything_fp32_and_scales_only_fp16(dtype: str) -> None:
    plan = dtypeplan.resolve(autocast_config(dtype, 2))
    assert plan.status == "OK"
    assert plan.autocast_dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert plan.param_dtype == plan.master_dtype == torch.float32
    assert plan.grad_accum_dtype == plan.comm_dtype == torch.float32  # the fp32 defaults
    if dtype == "fp16":
        assert plan.loss_scaling is not None and plan.loss_scaling.loss_scale == 0  # dynamic
        assert plan.check_nonfinite
    else:
        assert plan.loss_scaling is None and not plan.check_nonfinite
    text = plan.explain()
    assert f"torch.autocast(dtype={dtype})" in text
    assert "lower_precision_safe_modules" in text  # DeepSpeed's per-module wire dtype
    assert ("GradScaler" in text) == (dtype == "fp16")
    assert plan.to_dict()["autocast_dtype"] == dtype


def test_configured_wire_and_accumulation_dtypes_apply_under_autocast() -> None:
    plan = dtypeplan.resolve(
        autocast_config(
            "bf16", 1, communication_data_type="bf16", gradient_accumulation_dtype="bf16"
        )
    )
    assert plan.status == "OK"
    assert plan.comm_dtype == plan.grad_accum_dtype == torch.bfloat16
    assert plan.param_dtype == torch.float32


def test_deepspeed_default_autocast_dtype_is_flagged() -> None:
    plan = dtypeplan.resolve({"torch_autocast": {"enabled": True}})
    assert plan.autocast_dtype == torch.bfloat16
    assert any("torch_autocast.dtype absent" in d for d in plan.deepspeed_differences)
    given = dtypeplan.resolve({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    assert not any("dtype absent" in d for d in given.deepspeed_differences)


def test_memory_is_the_fp32_parameters_memory() -> None:
    """Autocast's bf16/fp16 copies of weights and activations live only during forward and
    backward; plan.memory() counts what the optimizer holds at the boundary, as for fp32."""
    for stage in (0, 1, 2, 3):
        for dtype in ("bf16", "fp16"):
            config = autocast_config(dtype, stage)
            plain = {k: v for k, v in config.items() if k not in ("torch_autocast", "fp16")}
            for world in (1, 2, 8):
                memory = dtypeplan.resolve(config).memory(10_000, world)
                assert memory == dtypeplan.resolve(plain).memory(10_000, world)
                assert memory["grads"] == 0
                assert memory["params"] == 40_000 // (world if stage == 3 else 1)


# --- the context and prepare_model -----------------------------------------------------------


def test_plan_autocast_is_the_torch_context_or_nothing() -> None:
    none = dtypeplan.resolve({})
    with none.autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")
    plan = dtypeplan.resolve(autocast_config("fp16", 0))
    for device in ("cpu", torch.device("cpu"), make_model(0), None):
        with plan.autocast(device):
            assert torch.is_autocast_enabled("cpu")
            assert torch.get_autocast_dtype("cpu") == torch.float16
    assert not torch.is_autocast_enabled("cpu")


def test_prepare_model_runs_forward_under_autocast_and_nothing_else() -> None:
    plan = dtypeplan.resolve(autocast_config("bf16", 0))
    model = make_model(0)
    names = [name for name, _ in model.named_parameters()]
    prepared = plan.prepare_model(model)
    assert prepared is model
    assert [name for name, _ in model.named_parameters()] == names
    assert all(p.dtype == torch.float32 for p in model.parameters())
    out = model(torch.randn(2, 12))
    assert out.dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")  # left after forward
    # Preparing again does not stack the hooks; a plan without autocast removes them.
    plan.prepare_model(model)
    assert len(model._forward_pre_hooks) == 1
    dtypeplan.resolve({}).prepare_model(model)
    assert model(torch.randn(2, 12)).dtype == torch.float32
    assert not model._forward_pre_hooks


def test_a_prepared_model_copies_and_pickles_with_its_autocast() -> None:
    plan = dtypeplan.resolve(autocast_config("fp16", 0))
    model = plan.prepare_model(make_model(0))
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin(torch.randn(2, 12)).dtype == torch.float16
        assert not torch.is_autocast_enabled("cpu")


def test_autocast_is_left_when_forward_raises() -> None:
    plan = dtypeplan.resolve(autocast_config("bf16", 0))
    model = plan.prepare_model(make_model(0))
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # wrong width
    assert not torch.is_autocast_enabled("cpu")


def test_build_warns_when_the_model_was_not_prepared_for_autocast() -> None:
    """Without prepare_model, forward would silently run in fp32: build says so, once."""
    plan = dtypeplan.resolve(autocast_config("bf16", 1))
    with pytest.warns(UserWarning, match=r"torch_autocast is bf16 but 6 of 6 parameters"):
        plan.build(make_model(0).parameters()).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan.build(plan.prepare_model(make_model(0)).parameters()).close()
        dtypeplan.resolve({"zero_optimization": {"stage": 1}}).build(
            make_model(0).parameters()
        ).close()


def test_single_process_trains_under_autocast() -> None:
    """One process (no torch.distributed) under bf16 autocast follows plain torch exactly."""
    plan = dtypeplan.resolve(autocast_config("bf16", 3))
    reference = make_model(0)
    model = plan.prepare_model(make_model(0))
    optimizer = plan.build(model.parameters())
    ref_opt = torch.optim.AdamW(reference.parameters(), **plan.optimizer.params)
    x, y = torch.randn(8, 12), torch.randn(8, 6)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_out = reference(x)
        ref_loss = torch.nn.functional.mse_loss(ref_out.float(), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        optimizer.backward(loss)
        optimizer.step()
        mine, ref = float(loss.detach()), float(ref_loss.detach())
        assert abs(mine - ref) <= EXACT_RTOL * ref
    for mine, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.detach(), ref.detach(), rtol=EXACT_RTOL, atol=1e-7)


# --- parity and memory on 2 ranks (one spawned group) ----------------------------------------


def test_autocast_parity_and_memory_two_ranks() -> None:
    cases = _parity_cases()
    memory_configs = _memory_configs()
    per_rank = spawn(run_autocast_cases, 2, cases, memory_configs, WIDTH, timeout_s=400)
    for rank_results in per_rank:
        for result, case in zip(rank_results["parity"], cases, strict=True):
            _check_parity(result, case)
    for config, result in zip(memory_configs, per_rank[0]["memory"], strict=True):
        predicted = result["predicted"]
        keys = ["params", "accumulator", "optimizer_states", "total"]
        if config["zero_optimization"]["stage"] < 3:
            keys.append("master")  # as tests/test_memory.py: FSDP2's shards count as params
        # plan.memory() counts the accumulation boundary; stages 0-2 keep the same after the
        # step (the accumulator is cleared in place), FSDP2 frees its gradients in step().
        stage = config["zero_optimization"]["stage"]
        for moment in ("at_boundary", "after_step") if stage < 3 else ("at_boundary",):
            measured = result[moment]
            assert_memory_close(measured, predicted, (moment, config), keys)


def _check_parity(result: dict[str, Any], case: dict[str, Any]) -> None:
    name = case["name"]
    assert "error" not in result, result["error"]
    dtype = case["config"]["torch_autocast"]["dtype"]
    # The model computed in the autocast dtype, with fp32 parameters, and left autocast off.
    assert result["output_dtypes"] == [str(dict(bf16=torch.bfloat16, fp16=torch.float16)[dtype])]
    assert result["param_dtypes"] == ["torch.float32"], name
    assert not result["autocast_left_on"], name
    assert result["loss_scales"] == result["ref_loss_scales"], name
    assert result["skipped_steps"] == result["ref_skipped_steps"], name
    assert result["skipped_steps"] == (1 if "overflow_step" in case else 0), name
    first, ref_first = result["losses"][0], result["ref_losses"][0]
    assert abs(first - ref_first) <= FIRST_LOSS_RTOL * ref_first, (name, first, ref_first)
    loss_rtol, master_rtol = (
        (EXACT_RTOL, EXACT_RTOL) if case["exact"] else (ROUNDED_LOSS_RTOL, ROUNDED_MASTER_RTOL)
    )
    for step, (mine, ref) in enumerate(zip(result["losses"], result["ref_losses"], strict=True)):
        assert abs(mine - ref) <= loss_rtol * abs(ref) + 1e-7, (name, step, mine, ref)
    error = result["master_rel_error"]
    assert error <= master_rtol, f"{name}: master weights rel error {error:.2e}"
