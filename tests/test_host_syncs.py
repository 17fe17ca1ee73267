"""No host syncs on the hot path: backward and ``step()`` never wait for the device.

Counted with a dispatch mode (``.item()``, ``float()``/``int()``/``bool()`` of a tensor, any
copy from an accelerator to the host) plus patches of ``.tolist()``, ``.cpu()`` and
``.numpy()``, over two steps of two micro-batches (``opt.backward`` and bare
``loss.backward()``), at ZeRO stages 0-3, on one process and on two gloo ranks (ZeRO-3 on
one process is the flat engine; on two, FSDP2). Allowed per
step: none, or one where the step may be skipped (fp16's overflow check, or
``check_nonfinite``): the loss scaler decides on the host. ``grad_norm`` syncs once when read.
"""

from __future__ import annotations

import math

import pytest
import torch

from dtypeplan.launch import spawn
from tests.workers.hot_path import count_host_syncs, sync_case, sync_cases

_MODELS = {
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 4}},
    "fp32": {},
}


def _config(model: str, stage: int, sharded: bool, **extra: object) -> dict:
    return {
        **_MODELS[model],
        "gradient_accumulation_dtype": {"dtype": "fp32", "sharded": sharded},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        **extra,
    }


_CASES = [
    ("bf16", 0, False, {}, 0),
    ("bf16", 1, False, {}, 0),
    ("bf16", 2, True, {}, 0),
    ("fp32", 1, False, {}, 0),
    ("fp16", 0, False, {}, 1),
    ("fp16", 2, True, {}, 1),
    ("bf16", 1, False, {"check_nonfinite": True}, 1),
    ("bf16", 3, True, {}, 0),
    ("fp32", 3, True, {}, 0),
    ("fp16", 3, True, {}, 1),
]


def _check(result: dict, allowed: int, case: object) -> None:
    for log in result["per_step"]:
        assert len(log) == allowed, (case, log)
    assert result["skipped"] == 0, case
    # Reading the norm syncs once, and the value is kept.
    assert result["grad_norm_reads"] == [0 if allowed else 1, 0], (case, result)
    assert math.isfinite(result["grad_norm"]) and result["grad_norm"] > 0, result
    assert result["grad_norm_again"] == result["grad_norm"]


@pytest.mark.parametrize(("model", "stage", "sharded", "extra", "allowed"), _CASES)
def test_host_syncs_one_process(
    model: str, stage: int, sharded: bool, extra: dict, allowed: int
) -> None:
    config = _config(model, stage, sharded, **extra)
    try:
        result = sync_case(0, 1, config)
    except ValueError as exc:  # a config key this build does not know
        pytest.skip(str(exc))
    _check(result, allowed, (model, stage, sharded, extra))


@pytest.mark.slow
def test_host_syncs_two_ranks() -> None:
    cases = [c for c in _CASES if not c[3]]
    configs = [_config(m, s, sh) for m, s, sh, _, _ in cases]
    results = spawn(sync_cases, 2, configs, timeout_s=300)
    for rank_results in results:
        for case, result in zip(cases, rank_results, strict=True):
            _check(result, case[4], case)


def test_the_counter_sees_every_kind_of_read() -> None:
    """The counter itself: each way of reading a value is one logged sync."""
    t = torch.ones(3)
    with count_host_syncs() as log:
        t.sum().item()
        float(t[0])
        bool(t[1] > 0)
        t.tolist()
        t.cpu()
    assert len(log) == 5, log
