"""Gradients travel only in communication_data_type, parameters only in the parameter dtype."""

from __future__ import annotations

import itertools

import pytest

from dtypeplan.launch import spawn
from tests.workers.optimizer import wire_cases

_DTYPE = {"fp32": "torch.float32", "fp16": "torch.float16", "bf16": "torch.bfloat16"}
# A small initial loss scale: 2**16-scaled gradients can overflow fp16 on the wire, and a
# skipped step sends no parameters.
_MODEL_KEYS = {
    "fp32": {},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 4}},
    "bf16": {"bf16": {"enabled": True}},
}


def _cases() -> list[dict]:
    cases = []
    for model, accum, comm, (stage, sharded), reduction in itertools.product(
        ["fp32", "bf16", "fp16"],
        ["fp32", "bf16"],
        ["fp32", "fp16", "bf16"],
        [(0, False), (1, False), (1, True), (2, True), (3, True)],
        ["collective", "fp32_sum"],
    ):
        if reduction == "fp32_sum" and (comm == "fp32" or model != "bf16"):
            continue
        if stage == 3 and reduction != "collective":
            continue  # NotSupported in the table
        cases.append(
            {
                "model": model,
                "accum": accum,
                "comm": comm,
                "stage": stage,
                "sharded": sharded,
                "reduction": reduction,
                "config": {
                    **_MODEL_KEYS[model],
                    "gradient_accumulation_dtype": {"dtype": accum, "sharded": sharded},
                    "communication_data_type": comm,
                    "communication_reduction": reduction,
                    "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
                    "gradient_clipping": 1.0,
                },
            }
        )
    return cases


def test_wire_dtypes() -> None:
    cases = _cases()
    logs = spawn(wire_cases, 2, [c["config"] for c in cases], timeout_s=300)
    for case, log in zip(cases, logs[0], strict=True):
        # The step's summary (squared norm and per-parameter "got a gradient" flags, fp32) is
        # one all-reduce of a few elements; every gradient bucket is padded to a multiple of
        # world_size * ALIGN = 128 elements, so nothing shorter is a gradient.
        summaries = [(op, dtype) for op, dtype, numel in log if op == "all_reduce" and numel < 128]
        gradient_ops = [
            (op, dtype)
            for op, dtype, numel in log
            if op != "all_gather" and not (op == "all_reduce" and numel < 128)
        ]
        gathers = [(op, dtype) for op, dtype, numel in log if op == "all_gather"]
        assert gradient_ops, case
        assert {dtype for _, dtype in gradient_ops} == {_DTYPE[case["comm"]]}, (case, log)
        if case["stage"] == 0:
            ops = (
                {"all_to_all", "all_gather"} if case["reduction"] == "fp32_sum" else {"all_reduce"}
            )
            assert {op for op, _ in gradient_ops} | {op for op, _ in gathers} == ops, log
            if case["reduction"] == "fp32_sum":
                assert {dtype for _, dtype in gathers} == {_DTYPE[case["comm"]]}
        else:
            assert gathers and {dtype for _, dtype in gathers} == {_DTYPE[case["model"]]}, (
                case,
                log,
            )
            expected = "all_to_all" if case["reduction"] == "fp32_sum" else "reduce_scatter"
            assert {op for op, _ in gradient_ops} == {expected}, log
        # Only the step's summary travels outside the gradient dtype: one fp32 all-reduce.
        assert summaries == [("all_reduce", "torch.float32")], log
        if case["stage"] == 3:
            # FSDP2 gathers every sharded module before forward and again before backward.
            assert len(gathers) >= 2 * 2, log
    # Ranks record the same traffic: the collectives pair up.
    assert logs[0] == logs[1]


@pytest.mark.slow
def test_sharded_accumulator_reduces_every_micro_batch() -> None:
    whole = {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 10**6},
    }
    sharded = {**whole, "gradient_accumulation_dtype": {"dtype": "fp32", "sharded": True}}
    log_whole, log_sharded = spawn(wire_cases, 2, [whole, sharded])[0]
    count = lambda log: sum(1 for op, _, _ in log if op == "reduce_scatter")  # noqa: E731
    # Two micro-batches, one bucket: whole reduces once per step, sharded once per micro-batch.
    assert count(log_whole) == 1
    assert count(log_sharded) == 2
