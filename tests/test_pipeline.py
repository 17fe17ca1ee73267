"""Every ZeRO stage under torch.distributed.pipelining, PP=2 x DP=2 on 4 gloo ranks.

This is the combination DeepSpeed's users could not run (pipeline + ZeRO-1 + bf16 failed with
``'DeepSpeedZeroOptimizer' object has no attribute 'clear_lp_grads'``): here the schedule runs
backward itself, the engine calls ``clear_lp_grads()``, and losses and master weights follow a
plain fp32 ``torch.optim`` run on the full batch.
"""

from __future__ import annotations

import dtypeplan
from dtypeplan.launch import spawn
from tests._helpers import assert_parity, ok_cells
from tests.test_optimizer_states import _eps
from tests.workers.pipeline import run_pipeline_cases

_MODEL_KEYS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "loss_scale": 128}},
}


def _cases() -> list[dict]:
    """One case per grid cell (stage x model dtype x accumulation dtype) that is OK."""
    cells = ok_cells(stages=(0, 1, 2, 3), pipeline=True)
    cases = []
    dtypes = ("fp32", "bf16", "fp16")
    for stage in sorted({c["stage"] for c in cells}):
        for index, (model, accum) in enumerate((m, a) for m in dtypes for a in dtypes):
            if not any(
                c["stage"] == stage and c["params"] == model and c["accum"] == accum for c in cells
            ):
                continue
            # Alternate the schedules so that every combination meets both across stages.
            schedule = ("gpipe", "1f1b")[(index + stage) % 2]
            config = {
                **_MODEL_KEYS[model],
                "gradient_accumulation_dtype": accum,
                "zero_optimization": {"stage": stage},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            }
            cases.append(
                {
                    "name": f"stage{stage}-{model}-{accum}-{schedule}",
                    "config": config,
                    "micro_batches": 4,
                    "schedule": schedule,
                    "steps": 2,
                    "exact": model == accum == "fp32",
                }
            )
    return cases


# bf16 master weights: each rounding once, the stages rotated, bf16 moments in one case, both
# schedules. (stage, rounding, bf16 optimizer states, schedule)
_MASTER_CELLS = [
    (0, "nearest", False, "1f1b"),
    (1, "stochastic", True, "gpipe"),
    (2, "kahan", False, "1f1b"),
    (3, "kahan", True, "gpipe"),
]


def _master_cases() -> list[dict]:
    """A few bf16-master cells under the pipeline (the update is the one tested without it)."""
    cases = []
    for stage, rounding, states, schedule in _MASTER_CELLS:
        config = {
            "bf16": {"enabled": True, "bf16_optimizer_states": states},
            "master_weights": {"dtype": "bf16", "rounding": rounding},
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        }
        bf16_states = "-bf16-states" if states else ""
        cases.append(
            {
                "name": f"stage{stage}-bf16-masters-{rounding}{bf16_states}-{schedule}",
                "config": config,
                "micro_batches": 4,
                "schedule": schedule,
                "steps": 2,
                "exact": False,
            }
        )
    return cases


# Optimizer-state dtypes under the pipeline: the update is the one of
# tests/test_optimizer_states.py (the flat engine's, fed by the same gradient hooks; at ZeRO-3
# FSDP2's, on each local shard). Every ZeRO stage, both schedules, fp32 and bf16 masters.
# (stage, model dtype, master rounding or None for fp32 masters, states, schedule)
_STATES_CELLS = [
    (0, "fp32", None, "int8", "gpipe"),
    (1, "bf16", None, "fp8/bf16", "1f1b"),
    (2, "fp32", None, "bf16", "1f1b"),
    (2, "bf16", "stochastic", "int8", "gpipe"),
    (3, "fp32", None, "int8/fp8", "1f1b"),
    (3, "bf16", "kahan", "fp8", "gpipe"),
]
_STATES_STEPS, _STATES_LR = 2, 1e-2
# The smallest RMS of a stage's parameters (weights N(0, 0.4^2), biases N(0, 0.1^2)): ~0.39.
_STATES_WEIGHT_RMS = 0.39


def _states_master_rtol(states: str) -> float:
    """tests/test_optimizer_states.py's bound: step 1 is exact (the moments are computed in
    fp32 from zero), each later step reads moments rounded by at most eps (``_eps``) and so
    moves a weight by at most lr * eps * |u| (|u| <= 2) more or less than fp32, over the
    weights' RMS."""
    return 2 * (_STATES_STEPS - 1) * _STATES_LR * _eps(states) / _STATES_WEIGHT_RMS


def _states_cases() -> list[dict]:
    cases = []
    for stage, model, rounding, states, schedule in _STATES_CELLS:
        exp_avg, _, exp_avg_sq = states.partition("/")
        config: dict = {
            **_MODEL_KEYS[model],
            "optimizer_states": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq or exp_avg},
            "zero_optimization": {"stage": stage},
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": _STATES_LR, "weight_decay": 0.01},
            },
        }
        masters = "fp32-masters"
        if rounding is not None:
            config["master_weights"] = {"dtype": "bf16", "rounding": rounding}
            masters = f"bf16-masters-{rounding}"
        cases.append(
            {
                "name": f"stage{stage}-{model}-{masters}-{states}-states-{schedule}",
                "config": config,
                "micro_batches": 4,
                "schedule": schedule,
                "steps": _STATES_STEPS,
                "exact": False,
                "states_rtol": _states_master_rtol(states),
            }
        )
    return cases


def test_states_cases_are_ok_cells() -> None:
    for case in _states_cases():
        plan = dtypeplan.resolve(case["config"], pipeline_parallel=True)
        assert plan.status == "OK", (case["name"], plan.explain())


def test_master_cases_are_ok_cells() -> None:
    for case in _master_cases():
        plan = dtypeplan.resolve(case["config"], pipeline_parallel=True)
        assert plan.status == "OK", (case["name"], plan.explain())


def test_pipeline_cases_cover_the_whole_grid() -> None:
    cases = _cases()
    # 4 stages x 3 parameter dtypes x 3 accumulation dtypes, all OK in the table.
    assert len(cases) == 4 * 3 * 3
    names = [c["name"] for c in cases]
    for model in ("fp32", "bf16", "fp16"):
        for accum in ("fp32", "bf16", "fp16"):
            combo = f"-{model}-{accum}-"
            assert any(combo + "gpipe" in n for n in names), combo
            assert any(combo + "1f1b" in n for n in names), combo


def _hybrid_cases() -> list[dict]:
    """Shard groups inside each stage's data-parallel group (DP = 2 as 2 groups of 1: states
    replicated, the gradient all-reduced across the groups): the subgroups are made by each
    stage's ranks alone, while the other stage's ranks do something else."""
    cases = []
    for stage, model, across, schedule in (
        (1, "fp32", None, "gpipe"),
        (2, "bf16", "bf16", "1f1b"),
        (3, "fp32", None, "1f1b"),
    ):
        config: dict = {
            **_MODEL_KEYS[model],
            "zero_optimization": {"stage": stage, "shard_group_size": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        }
        if across is not None:
            config["communication_data_type_across_groups"] = across
        cases.append(
            {
                "name": f"stage{stage}-{model}-hybrid-{schedule}",
                "config": config,
                "micro_batches": 4,
                "schedule": schedule,
                "steps": 2,
                "exact": model == "fp32",
            }
        )
    return cases


def test_pipeline_parity_pp2_dp2() -> None:
    # One spawned group for the grid, the bf16-master and the autocast cells. The bf16-master
    # cells take the bf16 tolerances (as tests/test_parity.py's bf16-master cells): over 2 steps
    # a bf16 master
    # adds at most 2 roundings of half an ulp (nearest, Kahan) or one ulp (stochastic) per
    # weight, 2 * 2**-8 = 8e-3 relative per element at worst, about 2**-8 / sqrt(6) = 1.6e-3
    # as a norm: inside 2e-2, beside the bf16 forward's ~1e-3 on the loss.
    # The autocast cases (after them) check themselves: tests/workers/pipeline.py.
    # The optimizer-state cells take test_optimizer_states.py's bound (_states_master_rtol:
    # int8 8e-3, fp8/bf16 2.6e-3, bf16 1e-4 relative on the masters) on top of the 16-bit
    # cells' bounds where the model is 16-bit; fp32 models get that bound alone (the loss, a
    # smooth function of the weights, too).
    cases = _cases() + _master_cases() + _states_cases() + _hybrid_cases()
    autocast_cases = _autocast_cases()
    per_rank = spawn(run_pipeline_cases, 4, cases + autocast_cases, timeout_s=500)
    for results in per_rank:
        check_autocast_cases(results[len(cases) :], autocast_cases)
        for result, case in zip(results[: len(cases)], cases, strict=True):
            result["param_dtype_ok"] = True
            if case["exact"]:
                assert_parity(result, 1e-5, 1e-5)
            elif "states_rtol" in case:
                rtol = case["states_rtol"]
                fp32_model = not {"bf16", "fp16"} & set(case["config"])
                if fp32_model:
                    assert_parity(result, rtol, rtol)
                else:
                    assert_parity(result, 1e-2 + rtol, 2e-2 + rtol)
            else:
                assert_parity(result, 1e-2, 2e-2)
            assert result["skipped_steps"] == 0, result
            zero = case["config"]["zero_optimization"]
            if zero["stage"] == 3 and zero.get("shard_group_size") is None:
                # ZeRO-3 under the schedule still reduce-scatters every micro-batch (into the
                # sharded accumulator): 4 micro-batches x 2 sharded Linear layers per stage.
                assert result["backward_reduce_scatters"] == 4 * 2, result


def _autocast_cases() -> list[dict]:
    """torch_autocast (fp32 parameters) under the schedule: every ZeRO stage in bf16 and fp16,
    both schedules, and a bf16 wire. The stage module gets autocast only from prepare_model."""
    cases = []
    for stage in (0, 1, 2, 3):
        for index, dtype in enumerate(("bf16", "fp16")):
            schedule = ("gpipe", "1f1b")[(index + stage) % 2]
            config: dict = {
                "torch_autocast": {"enabled": True, "dtype": dtype},
                "zero_optimization": {"stage": stage},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            }
            name = f"autocast-stage{stage}-{dtype}-{schedule}"
            if stage in (1, 3) and dtype == "bf16":
                config["communication_data_type"] = "bf16"
                name += "-bf16wire"
            cases.append(
                {
                    "name": name,
                    "config": config,
                    "micro_batches": 4,
                    "schedule": schedule,
                    "steps": 2,
                }
            )
    return cases


def check_autocast_cases(results: list[dict], cases: list[dict]) -> None:
    """The reference runs the whole batch under torch.autocast, the pipeline 4 micro-batches per
    data-parallel rank: each weight gradient is a matmul rounded to the autocast dtype, over
    the whole batch there and per micro-batch here (2**-8 relative per element, bf16), so the
    bounds are those of the 16-bit cells. The stage's output dtype shows that the schedule's
    calls of the module ran under autocast."""
    dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}
    for result, case in zip(results, cases, strict=True):
        result["param_dtype_ok"] = True
        assert_parity(result, 1e-2, 2e-2)
        assert result["skipped_steps"] == 0, result
        assert result["output_dtypes"] == [dtype[case["config"]["torch_autocast"]["dtype"]]]
