"""Every ZeRO stage under torch.distributed.pipelining, PP=2 x DP=2 on 4 gloo ranks.

This is the combination DeepSpeed's users could not run (pipeline + ZeRO-1 + bf16 failed with
``'DeepSpeedZeroOptimizer' object has no attribute 'clear_lp_grads'``): here the schedule runs
backward itself, the engine calls ``clear_lp_grads()``, and losses and master weights follow a
plain fp32 ``torch.optim`` run on the full batch.
"""

from __future__ import annotations

from dtypeplan.launch import spawn
from tests._helpers import assert_parity, ok_cells
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


def test_pipeline_parity_pp2_dp2() -> None:
    cases, autocast_cases = _cases(), _autocast_cases()
    # One spawned group for every case of the module.
    per_rank = spawn(run_pipeline_cases, 4, cases + autocast_cases, timeout_s=500)
    for results in per_rank:
        check_autocast_cases(results[len(cases) :], autocast_cases)
        for result, case in zip(results[: len(cases)], cases, strict=True):
            result["param_dtype_ok"] = True
            if case["exact"]:
                assert_parity(result, 1e-5, 1e-5)
            else:
                assert_parity(result, 1e-2, 2e-2)
            assert result["skipped_steps"] == 0, result
            if case["config"]["zero_optimization"]["stage"] == 3:
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
