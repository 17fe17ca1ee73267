"""fp8 compute (issue 33): the fp8 block, the table's refusals, the conversion against torchao's
own, training on 2 gloo ranks at ZeRO 0-3 (ZeRO-3 with and without the fp8 all-gather), resume.

Everything runs emulated here (no GPU: fp8 rounding of every operand, the matmul in high
precision), which is also what ``explain()`` says.

Bounds. The converted model is torchao's code path, so its forward and backward equal torchao's
own conversion bit for bit. Trained on 2 ranks, dtypeplan's fp8 run is torchao's conversion with
torch.optim.AdamW on the whole batch up to the order of the data-parallel fp32 gradient sums:
``REFERENCE_RTOL`` on the loss (measured: equal to 5 digits over 6 steps). Against bf16 compute
(the same config, fp8 off) fp8 moves the loss by e4m3's rounding of three operands per matmul
(2**-4 relative each, averaged over a 64-wide contraction): ``BF16_RTOL`` (measured over 6
steps at lr 1e-2: at most 1.1% tensorwise, 0.7% MXFP8; the fp8 all-gather, whose weight is
rounded from the fp32 master once instead of through bf16, 0.9%).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan.launch import spawn
from dtypeplan.optimizers.contract import MXFP8Linear
from dtypeplan.optimizers.contract.fp8_compute import eligible_linears
from tests._helpers import assert_memory_close
from tests.workers.fp8 import Head, batch, cost_case, resume_case, training_cases

REFERENCE_RTOL = 1e-4
BF16_RTOL = 3e-2
STEPS = 6
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2}}


def _config(stage: int, **fp8: Any) -> dict[str, Any]:
    return {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "fp8": {"enabled": True, **fp8},
        "optimizer": ADAMW,
    }


# --- the config ----------------------------------------------------------------------------
def test_the_block_defaults_and_explain_says_emulated() -> None:
    plan = dtypeplan.resolve({"bf16": {"enabled": True}, "fp8": {"enabled": True}})
    assert plan.status == "OK" and plan.fp8
    assert (plan.fp8_recipe, plan.fp8_all_gather) == ("tensorwise", "param_dtype")
    assert plan.fp8_exclude_modules == ("lm_head", "output", "score", "classifier")
    if not torch.cuda.is_available():
        assert plan.fp8_execution == "emulated" and "emulated" in plan.explain()
    assert plan.rule_id == "fp8-compute+stage0-data-parallel"
    assert plan.to_dict()["fp8_recipe"] == "tensorwise"


def test_each_key_is_read_and_a_bad_value_refused() -> None:
    plan = dtypeplan.resolve(
        _config(
            3, recipe="tensorwise", all_gather="fp8", exclude_modules=["blocks.0.*"], emulate=True
        )
    )
    assert plan.status == "OK" and plan.fp8_all_gather == "fp8"
    assert plan.fp8_exclude_modules == ("blocks.0.*",) and plan.fp8_execution == "emulated"
    with pytest.raises(dtypeplan.PrecisionConfigError, match="recipe"):
        dtypeplan.resolve({"fp8": {"enabled": True, "recipe": "delayed"}})
    off = dtypeplan.resolve({"fp8": {"recipe": "rowwise"}})
    assert not off.fp8 and any("no effect" in w for w in off.config_warnings)


@pytest.mark.parametrize(
    ("config", "pipeline", "rule", "status"),
    [
        (
            {"fp16": {"enabled": True}, "fp8": {"enabled": True}},
            False,
            "fp8-fp16-params",
            "NotSupported",
        ),
        (
            _config(1, recipe="rowwise", all_gather="fp8"),
            False,
            "fp8-all-gather-below-zero3",
            "Error",
        ),
        (
            _config(3, recipe="rowwise", all_gather="fp8"),
            False,
            "fp8-all-gather-not-tensorwise",
            "NotSupported",
        ),
        (
            _config(3, recipe="mxfp8", all_gather="fp8"),
            False,
            "fp8-all-gather-not-tensorwise",
            "NotSupported",
        ),
        (
            {**_config(1), "torch_autocast": {"enabled": True}, "bf16": {"enabled": False}},
            False,
            "fp8-autocast",
            "NotSupported",
        ),
        (_config(1), True, "fp8-pipeline", "NotSupported"),
        (
            {
                **_config(2),
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            },
            False,
            "fp8-offload-optimizer",
            "NotSupported",
        ),
        (
            {**_config(2), "zero_optimization": {"stage": 2, "shard_group_size": 2}},
            False,
            "fp8-shard-groups",
            "NotSupported",
        ),
    ],
)
def test_refusals_are_named_with_their_reasons(
    config: dict[str, Any], pipeline: bool, rule: str, status: str
) -> None:
    plan = dtypeplan.resolve(config, pipeline_parallel=pipeline)
    assert (plan.rule_id, plan.status) == (rule, status), plan.explain()
    assert plan.reason and plan.alternatives
    with pytest.raises((dtypeplan.PrecisionConfigError, dtypeplan.NotSupportedError)):
        plan.build(torch.nn.Linear(16, 16).parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU has no fp8 kernels")
def test_native_fp8_on_the_cpu_is_an_error_with_the_fix() -> None:
    plan = dtypeplan.resolve(_config(0, emulate=False))
    assert (plan.rule_id, plan.status) == ("fp8-unavailable", "Error")
    assert any("fp8.emulate=true" in "; ".join(a.changes) for a in plan.alternatives)


def test_a_framework_spelling_is_the_block_the_plan_reads() -> None:
    plan = dtypeplan.resolve(_config(2, recipe="rowwise_with_gw_hp"))
    assert plan.status == "OK" and plan.implementation == "sharded"
    assert plan.rule_id == "fp8-compute+zero2"


# --- the conversion against torchao's own ----------------------------------------------------
def _fwd_bwd(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(x)
    out.float().square().mean().backward()
    return out.detach(), [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_float8_conversion_is_torchaos_bit_for_bit(recipe: str) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    plan = dtypeplan.resolve(_config(0, recipe=recipe))
    ours = plan.prepare_model(Head(5))
    theirs = Head(5)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(theirs, config=config, module_filter_fn=lambda _m, n: n != "lm_head")
    theirs.bfloat16()
    x = batch(0, 32)[0].bfloat16()
    (out, grads), (ref_out, ref_grads) = _fwd_bwd(ours, x), _fwd_bwd(theirs, x)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    assert [type(m).__name__ for m in ours.blocks.modules() if "Linear" in str(type(m))] == [
        "Float8Linear"
    ] * 3
    assert type(ours.lm_head) is torch.nn.Linear  # the output layer stays bf16


def test_mxfp8_conversion_is_torchaos_bit_for_bit() -> None:
    """Against torchao's MXFP8TrainingOpConfig (its weight-wrapper subclass) on bias-free
    layers: torchao's wrapper drops the bias of F.linear, which MXFP8Linear adds."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    def bias_free() -> torch.nn.Module:
        torch.manual_seed(3)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 64, bias=False),
            torch.nn.Tanh(),
            torch.nn.Linear(64, 32, bias=False),
        )

    plan = dtypeplan.resolve(_config(0, recipe="mxfp8"))
    ours = plan.prepare_model(bias_free())
    theirs = bias_free().bfloat16()
    recipe = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    quantize_(theirs, recipe, filter_fn=lambda m, _n: isinstance(m, torch.nn.Linear))
    x = torch.randn(32, 64).bfloat16()
    (out, grads), (ref_out, ref_grads) = _fwd_bwd(ours, x), _fwd_bwd(theirs, x)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    assert all(type(ours[i]) is MXFP8Linear for i in (0, 2))


def test_eligibility_sizes_and_patterns() -> None:
    model = torch.nn.ModuleDict(
        {
            "a": torch.nn.Linear(32, 48),
            "odd": torch.nn.Linear(32, 20),  # 20 is no multiple of 16
            "lm_head": torch.nn.Linear(48, 32),
            "b": torch.nn.Linear(64, 32),
        }
    )
    plan = dtypeplan.resolve(_config(0, exclude_modules=["lm_head", "b*"]))
    assert eligible_linears(model, plan) == ["a"]
    mx = dtypeplan.resolve(_config(0, recipe="mxfp8"))
    assert eligible_linears(model, mx) == ["b"]  # a: 48 is no multiple of MXFP8's 32
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match="multiple of 32 tokens"):
        mx.prepare_model(torch.nn.Sequential(torch.nn.Linear(64, 64)))(x.bfloat16())


def test_a_model_with_nothing_to_convert_is_warned_about() -> None:
    """GPT-2's projections are transformers' Conv1D, not nn.Linear: fp8 would run nowhere."""
    from tests.workers.real_models import build_model

    plan = dtypeplan.resolve(_config(0))
    with pytest.warns(UserWarning, match="Conv1D"):
        plan.prepare_model(build_model("gpt2"))
    with pytest.warns(UserWarning, match="multiples of 16"):
        plan.prepare_model(torch.nn.Sequential(torch.nn.Linear(20, 20)))


def test_zero3_in_one_process_runs_the_flat_optimizer_without_an_fp8_gather() -> None:
    plan = dtypeplan.resolve(_config(3, all_gather="fp8"))
    model = plan.prepare_model(Head(1))
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    optimizer = plan.build(model.parameters())
    x, y = batch(0, 32)
    optimizer.backward(torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y))
    optimizer.step()


# --- training on 2 ranks -----------------------------------------------------------------------
def _case(name: str, stage: int, **fp8: Any) -> dict[str, Any]:
    return {"name": name, "seed": 1, "config": _config(stage, **fp8)}


def _check_training(result: dict[str, Any], case: dict[str, Any]) -> None:
    losses, bf16 = result["losses"], result["bf16_losses"]
    assert "emulated" in result["explain"]
    for step, (mine, ref) in enumerate(zip(losses, bf16, strict=True)):
        assert abs(mine - ref) <= BF16_RTOL * ref, (case["name"], step, mine, ref)
    assert losses != bf16, case["name"]  # fp8 rounding happened
    gathered_in_fp8 = case["config"]["fp8"].get("all_gather") == "fp8"
    assert ("WeightWithDynamicFloat8CastTensor" in result["local_types"]) == gathered_in_fp8
    assert result["scales_off"] == [], case["name"]
    if "reference" in result and not gathered_in_fp8:
        for mine, ref in zip(losses, result["reference"], strict=True):
            assert abs(mine - ref) <= REFERENCE_RTOL * ref, (case["name"], mine, ref)


_DEFAULT_CASE = {
    "name": "tensorwise-zero3-fp8-all-gather",
    "seed": 1,
    "config": _config(3, all_gather="fp8"),
}


@pytest.fixture(scope="module")
def two_ranks() -> list[tuple[Any, ...]]:
    """The default run's 2-rank cases, one process group for the tests that read them."""
    return spawn(_default_group, 2, _DEFAULT_CASE, timeout_s=600)


@pytest.mark.slow
def test_zero3_fp8_all_gather_trains_and_zero3_fp8_resumes_bit_for_bit_on_two_ranks(
    two_ranks: list[tuple[Any, ...]],
) -> None:
    """Resume bitwise with the bf16 all-gather and with the fp8 one. The fp8 all-gather's
    scales are one all-reduce over the layers' stacked maxima: every rank must stack the
    layers in the same order (they once came from a set, ordered by object ids: each rank's
    maximum met another layer's, one weight's shards were cast with different scales and
    gathered under one, and a resumed run, with other ids, took another pairing: 0.2% off)."""
    training, resumed, resumed_fp8_gather, _ = two_ranks[0]
    _check_training(training, _DEFAULT_CASE)
    assert training["scales_off"] == []  # each weight's scale is its own, on both ranks
    assert resumed["resumed"] == resumed["straight"]  # ZeRO-3 tensorwise, bf16 all-gather
    assert resumed_fp8_gather["resumed"] == resumed_fp8_gather["straight"]
    # export_model_state: plain full-shape fp32 weights by the model's own names.
    assert sorted(resumed["exported"]) == sorted(resumed["names"])
    assert {dtype for _, dtype in resumed["exported"].values()} == {"torch.float32"}


def _default_group(rank: int, world: int, case: dict[str, Any]) -> tuple[Any, ...]:
    (training,) = training_cases(rank, world, [case], STEPS)
    config = copy.deepcopy(case["config"])
    config["fp8"] = {"enabled": True}
    return (
        training,
        resume_case(rank, world, config, 4),
        resume_case(rank, world, case["config"], 4),
        # The fp8 all-gather's costs, and the bf16 all-gather's.
        [cost_case(rank, world, c) for c in (case["config"], _config(3))],
    )


@pytest.mark.slow
def test_traffic_and_memory_of_the_fp8_all_gather_are_the_bytes_sent_and_held(
    two_ranks: list[tuple[Any, ...]],
) -> None:
    """ZeRO-3 on 2 ranks, the step after the first: each collective's bytes equal
    plan.traffic()'s, the bytes held plan.memory()'s, for the fp8 all-gather and the bf16 one.
    The Head's units shard without padding (64 rows on 2 ranks) and its root holds no
    parameter of its own, so FSDP2 gathers every unit twice a step, as the model counts."""
    from dtypeplan.optimizers.contract import fp8_weight_numels

    per_rank = [results[3] for results in two_ranks]
    weights = (64 * 64,) * 3  # the blocks' weights; lm_head is left out, biases are not linears
    for fp8_gather, bf16_gather in per_rank:
        for result in (fp8_gather, bf16_gather):
            assert result["fp8_weights"] == result["fp8_weights_before_prepare"] == list(weights)
            sent = dict(result["sent"])
            assert sent.pop("summary") > 0  # the step's scalar summary, not counted by the plan
            assert sent == result["traffic"], (sent, result["traffic"])
            # params (the shards, and the fp8 scales) to the byte; the states hold besides
            # the AdamW step counters (4 bytes a parameter), which the model leaves out.
            held, memory = result["held"], result["memory"]
            assert held["params"] == memory["params"]
            assert 0 <= held["optimizer_states"] - memory["optimizer_states"] <= 4 * 7
            assert_memory_close(held, memory, result["fp8_weights"])
        # The fp8 gather: the three weights as one byte a value (biases and lm_head in bf16),
        # and the scales: 3 fp32 maxima all-reduced after the step and at the forward (weights
        # changed outside step() are followed), 3 fp32 scales held.
        n = sum(p.numel() for p in Head(0).parameters())
        f = sum(weights)
        assert fp8_gather["sent"]["all_gather"] == 2 * (2 * (n - f) + f) // 2
        assert bf16_gather["sent"]["all_gather"] == 2 * 2 * n // 2
        ratio = fp8_gather["sent"]["all_gather"] / bf16_gather["sent"]["all_gather"]
        assert 0.5 < ratio < 0.7, ratio
        assert fp8_gather["sent"]["all_reduce"] == 2 * (2 * 4 * 3 // 2)
        assert "all_reduce" not in bf16_gather["sent"]
        assert fp8_gather["held"]["params"] - bf16_gather["held"]["params"] == 4 * 3
    # Without the weights' sizes an fp8-gathering plan has no figure to give; elsewhere the
    # sizes change nothing (the bf16 all-gather, other stages, one process).
    plan = dtypeplan.resolve(_config(3, all_gather="fp8"))
    with pytest.raises(dtypeplan.PrecisionConfigError, match="fp8_weight_numels"):
        plan.traffic(10**6, 8)
    with pytest.raises(dtypeplan.PrecisionConfigError, match="fp8_weight_numels"):
        plan.memory(10**6, 8)
    assert "traffic: not estimated" in plan.explain(10**6, 8)
    assert plan.traffic(10**6, 1) == plan.traffic(10**6, 1, fp8_weights=[1000])
    for other in (_config(3), _config(2)):
        other_plan = dtypeplan.resolve(other)
        assert other_plan.traffic(10**6, 8) == other_plan.traffic(10**6, 8, fp8_weights=[1000])
        assert other_plan.memory(10**6, 8) == other_plan.memory(10**6, 8, fp8_weights=[1000])
    assert fp8_weight_numels(Head(0), dtypeplan.resolve({"bf16": {"enabled": True}})) == ()


MATRIX = [
    _case(f"{recipe}-zero{stage}", stage, recipe=recipe)
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
    for stage in (0, 1, 2, 3)
] + [_case("tensorwise-zero3-fp8-all-gather", 3, all_gather="fp8")]


@pytest.mark.slow
def test_every_recipe_at_every_stage_on_two_ranks() -> None:
    per_rank = spawn(training_cases, 2, MATRIX, STEPS, timeout_s=1800)
    for result, case in zip(per_rank[0], MATRIX, strict=True):
        _check_training(result, case)
        deviation = max(
            abs(a - b) / b for a, b in zip(result["losses"], result["bf16_losses"], strict=True)
        )
        print(f"{case['name']}: max loss deviation from bf16 compute {deviation:.2%}")
    for result, case in zip(per_rank[0], MATRIX, strict=True):
        if case["config"]["zero_optimization"]["stage"] == 3:
            continue
        assert result["losses"] == per_rank[1][per_rank[0].index(result)]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_resume_is_bit_for_bit_for_mxfp8_and_rowwise(stage: int) -> None:
    recipe = "mxfp8" if stage == 1 else "rowwise"
    per_rank = spawn(resume_case, 2, _config(stage, recipe=recipe), 4, timeout_s=600)
    for result in per_rank:
        assert result["resumed"] == result["straight"]


# --- the benchmarks (their numbers: benchmarks/results/fp8_fidelity-*.md) ---------------------
@pytest.mark.slow
def test_fidelity_benchmark_runs_and_converts_every_projection() -> None:
    from benchmarks import bench_fp8_fidelity

    summary = bench_fp8_fidelity.main(["--steps", "2", "--no-write"])
    assert set(summary["max_curve_deviation"]) == set(bench_fp8_fidelity.VARIANTS)
    assert 0.5 < summary["fp8_over_bf16_all_gather"] < 0.8


@pytest.mark.slow
def test_gpu_fp8_step_dry_run_checks_pass(tmp_path: Any) -> None:
    from benchmarks.gpu import bench_fp8_step

    summary = bench_fp8_step.main(["--dry-run", "--out", str(tmp_path)])
    assert summary["errors"] == [] and all(summary["check_ok"].values()), summary
    assert summary["all_gather_ok"] == {"param_dtype": True, "fp8": True}, summary
    assert list(tmp_path.glob("gpu_fp8_step_dryrun-*.json"))


@pytest.mark.slow
def test_zero3_fp8_all_gather_of_a_unit_of_fp8_weights_alone_on_gloo() -> None:
    """A unit of fp8 weights alone is gathered as a float8 tensor, which gloo refuses; it
    travels as bytes (fsdp2/sharding.NamedAllGather). The tensorwise scale is the whole
    weight's absmax whether the cast happens before the gather or after, so the loss and the
    gradient match the bf16 gather's up to accumulation order."""
    from tests.workers.fp8 import bias_free_gather_case

    found = spawn(bias_free_gather_case, 2, timeout_s=300)
    assert found[0] == found[1]
    for what in ("loss", "grad_norm"):
        fp8, bf16 = found[0][f"{what}_fp8"], found[0][f"{what}_param_dtype"]
        assert fp8 == pytest.approx(bf16, rel=1e-2), found[0]
