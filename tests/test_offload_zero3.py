"""ZeRO-3 with ``offload_param`` and ``offload_optimizer`` cpu (the table's offload-zero3 rules).

FSDP2's CPUOffloadPolicy keeps the shards (the master weights), their gradients and the
optimizer states in host memory; the update runs there (torch's fused CPU Adam/AdamW, or the
low-precision state update). On this CPU-only machine the "device" is the CPU too, so what runs
is FSDP2's offload code path (host shards, device copies for the all-gather, reduced shards
copied back, pinning off without CUDA) with no asynchrony to hide.

Checked, on one spawned group of 2 ranks (and a 1-rank group):

* parity against plain fp32 torch.optim on the full batch, 3 steps, for cells drawn by
  hypothesis from every OK offloaded ZeRO-3 cell: each (accumulation, communication) pair with
  fp32 masters, the bf16-master roundings, and 16-bit / int8 / fp8 states, at tests/
  test_parity.py's bounds (fp32 states) or tests/test_optimizer_states.py's (other states);
* that the model really is offloaded (every unit's policy is CPUOffloadPolicy, the optimizer
  reports its shards, accumulators and states as host memory, none pinned without CUDA);
* ``plan.memory()``: 0 device bytes and the host bytes within 10% of what the optimizer holds;
* checkpoints: a resume bitwise equal to the uninterrupted run, and resharding to and from
  ZeRO-2 with the optimizer offloaded and ZeRO-3 without offload, without gathering.

The slow run adds every OK cell on 2 ranks and 4 ranks in 2 shard groups.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtypeplan
from dtypeplan.launch import spawn
from dtypeplan.resolver import load_rules
from tests._helpers import (
    FP32_RTOL,
    LOW_PRECISION_LOSS_RTOL,
    LOW_PRECISION_MASTER_RTOL,
    assert_memory_close,
    assert_parity,
    assert_replicas_equal,
    draw_parity_case,
    master_cells,
    ok_cells,
)
from tests.workers import offload as cases

OFFLOADED = {"offload_optimizer": "cpu", "offload_param": "cpu"}
STATES = ("fp32", "bf16", "int8", "fp8", "fp8/bf16")
# As tests/test_optimizer_states.py: the relative error per stored moment value (bf16: 8
# significant bits; fp8 e4m3: 3 mantissa bits; int8: torchao's dynamic-tree map, 12.3% signed
# and 6.6% unsigned, for values above 1e-2 of the block's absmax).
STATE_EPS = {"fp32": 0.0, "bf16": 2.0**-9, "fp8": 2.0**-4, "int8": 0.123}
STATE_EPS_UNSIGNED = {**STATE_EPS, "int8": 0.066}
LR, STEPS, WEIGHT_RMS = 1e-2, 3, 0.3
WIDTH = 256  # memory cases: ~130k parameters


def zero3_offload_cells(states: tuple[str, ...] = ("fp32",)) -> list[dict[str, Any]]:
    """The OK ZeRO-3 cells with both offloads, fp32 or bf16 masters, each of ``states``."""
    table = load_rules()
    cells: dict[tuple, dict[str, Any]] = {}
    cores = ok_cells(stages=(3,)) + master_cells(stages=(3,), states_values=("fp32",))
    for core in cores:
        for state in states:
            for reduction in core["reductions"]:
                point = {k: v for k, v in core.items() if k != "reductions"}
                point = {**point, **OFFLOADED, "states": state, "reduction": reduction}
                if table.lookup(point).status != "OK":
                    continue
                key = tuple(v for k, v in point.items() if k != "reduction")
                cell = cells.setdefault(key, {**point, "reductions": []})
                cell["reductions"].append(reduction)
    return list(cells.values())


def _states_rtol(states: str) -> float:
    """(STEPS - 1) perturbed steps of at most lr * eps * |u| per weight, |u| up to 2, over the
    weights' RMS (tests/test_optimizer_states.py's bound)."""
    first, _, second = states.partition("/")
    eps = STATE_EPS[first] + STATE_EPS_UNSIGNED[second or first] / 2
    return 2 * (STEPS - 1) * LR * eps / WEIGHT_RMS


def check_cases(results: list[dict[str, Any]], drawn: list[dict[str, Any]]) -> None:
    for result, case in zip(results, drawn, strict=True):
        point = case["point"]
        exact = point["params"] == point["accum"] == point["comm"] == "fp32"
        extra = _states_rtol(point.get("states", "fp32"))
        if exact and point.get("master", "fp32") == "fp32":
            assert_parity(result, FP32_RTOL + extra, FP32_RTOL + extra)
        else:
            assert_parity(
                result, LOW_PRECISION_LOSS_RTOL + extra, LOW_PRECISION_MASTER_RTOL + extra
            )


def _draw(data: st.DataObject, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    drawn = []
    for point in points:
        case = draw_parity_case(data, point)
        if point.get("states", "fp32") != "fp32":  # low-precision states: Adam/AdamW only
            case["config"]["optimizer"] = {
                "type": "AdamW",
                "params": {"lr": LR, "weight_decay": 0.1},
            }
        drawn.append(case)
    return drawn


def _key(cell: dict[str, Any]) -> tuple[str, ...]:
    return (cell["params"], cell["accum"], cell["comm"], cell["master"], cell["states"])


def default_points() -> list[dict[str, Any]]:
    """Each (accumulation, communication) pair once with fp32 masters, the parameter dtype and
    states rotated, and each bf16-master rounding once: 12 cells."""
    cells = zero3_offload_cells(STATES)
    chosen = []
    pairs = [(a, c) for a in ("fp32", "bf16", "fp16") for c in ("fp32", "bf16", "fp16")]
    for index, (accum, comm) in enumerate(pairs):
        params = ("fp32", "bf16", "fp16")[index % 3]
        states = STATES[index % len(STATES)]
        want = (params, accum, comm, "fp32", states)
        (cell,) = [
            c
            for c in cells
            if (c["params"], c["accum"], c["comm"], c["master"], c["states"]) == want
        ]
        chosen.append(cell)
    for index, master in enumerate(("bf16", "bf16_sr", "bf16_kahan")):
        want = ("bf16", "fp32", ("fp32", "bf16", "fp32")[index], master, STATES[index + 1])
        (cell,) = [
            c
            for c in cells
            if (c["params"], c["accum"], c["comm"], c["master"], c["states"]) == want
        ]
        chosen.append(cell)
    return chosen


def test_offloaded_zero3_cells_are_ok() -> None:
    # fp32 masters: params 3 x accum 3 x comm 3 x states 5; bf16 masters: accum 3 x comm 3 x
    # rounding 3 x states 5. Pipeline parallelism and autocast stay NotSupported.
    assert len(zero3_offload_cells(STATES)) == 27 * 5 + 27 * 5
    point = {**zero3_offload_cells()[0], "pipeline": True}
    assert load_rules().lookup(point).status == "NotSupported"


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    @settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        drawn.extend(_draw(data, default_points()))

    drawn: list[dict[str, Any]] = []
    draw()
    per_rank = spawn(
        cases.zero3_offload_group,
        2,
        str(tmp_path_factory.mktemp("zero3-offload")),
        drawn,
        _memory_configs(),
        WIDTH,
        ["bf16"],
        timeout_s=500,
    )
    return {"cases": drawn, "per_rank": per_rank}


@pytest.mark.slow
def test_parity_offloaded_zero3_two_ranks(group: dict[str, Any]) -> None:
    per_rank = [rank["parity"] for rank in group["per_rank"]]
    assert_replicas_equal(per_rank)
    check_cases(per_rank[0], group["cases"])
    plans = [dtypeplan.resolve(c["config"]) for c in group["cases"]]
    assert {(p.offload_param, p.offload_optimizer, p.implementation) for p in plans} == {
        ("cpu", "cpu", "fsdp2")
    }


@pytest.mark.slow
def test_offloaded_zero3_lives_in_host_memory(group: dict[str, Any]) -> None:
    for rank in group["per_rank"]:
        placement = _ok(rank["placement"])
        assert placement["policies"] == ["CPUOffloadPolicy"], placement
        assert placement["on_host"] == ["accumulator", "master", "optimizer_states", "params"]
        assert placement["devices"] == ["cpu"]
        # Pinned only where CUDA is: pinned memory belongs to a CUDA context.
        assert placement["pinned"] == [torch.cuda.is_available()]


def _memory_configs() -> list[dict[str, Any]]:
    zero = {"stage": 3, **cases.ZERO3_OFFLOAD}
    return [
        {"zero_optimization": zero},
        {"bf16": {"enabled": True}, "zero_optimization": zero},
        {
            "bf16": {"enabled": True},
            "gradient_accumulation_dtype": "bf16",
            "zero_optimization": zero,
        },
        {
            "bf16": {"enabled": True},
            "master_weights": {"dtype": "bf16", "rounding": "kahan"},
            "zero_optimization": zero,
        },
        {"optimizer_states": "int8", "zero_optimization": zero},
    ]


@pytest.mark.slow
def test_offloaded_zero3_memory_matches_plan_two_ranks(group: dict[str, Any]) -> None:
    """plan.memory(): nothing on the device between steps, and the host bytes as held."""
    results = _ok(group["per_rank"][0]["memory"])
    host_keys = ("host_params", "host_accumulator", "host_master", "host_optimizer_states")
    for config, result in zip(_memory_configs(), results, strict=True):
        measured, predicted = result["at_boundary"], result["predicted"]
        assert predicted["total"] == 0 and measured["total"] == 0, (config, measured)
        assert predicted["host_params"] > 0 and predicted["host_optimizer_states"] > 0
        assert_memory_close(measured, predicted, config, keys=(*host_keys, "host_total"))


def _ok(result: dict[str, Any]) -> Any:
    assert result["ok"], result.get("trace")
    return result["value"]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("precision", ["bf16"])
@pytest.mark.slow
def test_offloaded_zero3_resumes_bitwise_and_reshards(
    group: dict[str, Any], precision: str
) -> None:
    for rank in group["per_rank"]:
        runs = _ok(rank["resume"][precision])
        saved = runs["saved"]
        resumed = _ok(runs["zero3_offloaded"])
        assert _same(resumed["masters"], saved["masters"])
        assert resumed["losses_after"] == saved["losses_after"]
        assert _same(resumed["final"], saved["final"])
        for other in ("zero2_offloaded", "zero3_plain"):
            loaded = _ok(runs[other])
            # The masters and states move exactly; the layouts differ afterwards (another
            # reduction order), so the losses agree to the dtype's bound.
            assert _same(loaded["masters"], saved["masters"]), other
            assert loaded["states"].keys() == saved["states"].keys(), other
            for key, value in saved["states"].items():
                assert torch.equal(loaded["states"][key], value), (other, key)
            rtol = 1e-5 if precision == "fp32" else 2e-2
            for mine, ref in zip(loaded["losses_after"], saved["losses_after"], strict=True):
                assert abs(mine - ref) <= rtol * abs(ref), (other, mine, ref)
        back = runs["from_zero2"]
        loaded = _ok(back["loaded"])
        assert _same(loaded["masters"], back["saved"]["masters"])


def test_parity_offloaded_zero3_one_rank_group() -> None:
    """One rank: FSDP2 on a 1-rank process group (offload_param needs FSDP2)."""
    points = [p for p in default_points() if p["params"] in ("fp32", "bf16")][:2]

    @settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        drawn.extend(_draw(data, points))

    drawn: list[dict[str, Any]] = []
    draw()
    from tests.workers.parity import run_cases

    (results,) = spawn(run_cases, 1, drawn, timeout_s=300)
    check_cases(results, drawn)


def test_one_process_offloaded_zero3_says_to_start_a_group() -> None:
    plan = dtypeplan.resolve({"zero_optimization": {"stage": 3, **cases.ZERO3_OFFLOAD}})
    model = plan.prepare_model(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="needs torch.distributed"):
        plan.build(model.parameters())


@pytest.mark.parametrize(
    ("zero", "match"),
    [
        ({"stage": 3, "offload_param": {"device": "cpu"}}, "without offload_optimizer cpu"),
        ({"stage": 2, **cases.ZERO3_OFFLOAD}, "ZeRO-3 setting"),
        ({"stage": 3, "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "cpu"}},
         "NVMe"),
    ],
)  # fmt: skip
def test_offloads_dtypeplan_does_not_serve_say_what_to_set(zero: dict, match: str) -> None:
    plan = dtypeplan.resolve({"zero_optimization": zero})
    assert plan.status == "NotSupported" and match in plan.reason, plan.reason
    with pytest.raises(dtypeplan.NotSupportedError):
        plan.memory(1000, 2)


@pytest.mark.slow
@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_parity_every_offloaded_zero3_cell_two_and_four_ranks(data: st.DataObject) -> None:
    """Every OK cell with fp32 states on 2 ranks; the other states and 2 shard groups of 2 on 4
    ranks, drawn."""
    every = _draw(data, zero3_offload_cells())
    per_rank = spawn(cases.run_cases, 2, every, timeout_s=600)
    assert_replicas_equal(per_rank)
    check_cases(per_rank[0], every)
    others = zero3_offload_cells(STATES[1:])
    chosen = data.draw(st.lists(st.sampled_from(others), min_size=12, max_size=12))
    four = _draw(data, [*zero3_offload_cells()[:3], *chosen])
    for case in four:
        case["config"]["zero_optimization"]["shard_group_size"] = 2
    per_rank = spawn(cases.run_cases, 4, four, timeout_s=600)
    assert_replicas_equal(per_rank)
    check_cases(per_rank[0], four)
