"""fp32 accumulation is measurably closer to a float64 sum than bf16 accumulation.

This proves the accumulation dtype is really used, at every stage.
"""

from __future__ import annotations

from dtypeplan.launch import spawn
from tests.workers.optimizer import accumulation_cases, accumulation_error

MICRO_BATCHES = 48


def _config(accum: str, stage: int, sharded: bool) -> dict:
    return {
        "bf16": {"enabled": True},
        "gradient_accumulation_dtype": {"dtype": accum, "sharded": sharded},
        "communication_data_type": "fp32",
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
    }


def test_single_process() -> None:
    fp32 = accumulation_error(0, 1, _config("fp32", 0, False), MICRO_BATCHES)
    bf16 = accumulation_error(0, 1, _config("bf16", 0, False), MICRO_BATCHES)
    assert fp32 < 1e-4, fp32
    assert bf16 > 10 * fp32, (fp32, bf16)


def test_stages_one_and_two() -> None:
    layouts = [(1, False), (1, True), (2, True)]
    configs = [
        _config(accum, stage, sharded) for stage, sharded in layouts for accum in ("fp32", "bf16")
    ]
    errors = spawn(accumulation_cases, 2, configs, MICRO_BATCHES)[0]
    for index, (stage, sharded) in enumerate(layouts):
        fp32, bf16 = errors[2 * index], errors[2 * index + 1]
        assert fp32 < 1e-4, (stage, sharded, fp32)
        assert bf16 > 10 * fp32, (stage, sharded, fp32, bf16)
