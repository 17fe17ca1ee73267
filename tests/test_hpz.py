"""ZeRO-3 with ZeRO++ hpZ (``zero_hpz_partition_size``): FSDP2's ``reshard_after_forward=H``.

On one spawned group of 4 gloo ranks with H = 2 (two "nodes" of two ranks):

* parity against plain fp32 torch.optim for each parameter dtype, at tests/test_parity.py's
  bounds;
* the same bits as ZeRO-3 without hpZ (losses and shards after 3 steps), and every unit but
  the root resharded to 2 ranks after its forward;
* ``plan.traffic()``: the forward's all-gathers over 4 ranks and the backward's within 2
  (all_gather_secondary), equal to the bytes the all-gathers send;
* issue 47 item 1: a forward under ``no_grad`` between backward and ``step()`` (or a load)
  leaves no unit on its secondary partition for the next forward to gather old weights from.
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
    assert_parity,
    assert_replicas_equal,
    draw_parity_case,
    ok_cells,
)
from tests.workers import checkpoint as ckpt
from tests.workers import hpz as cases

HPZ = 2
WORLD = 4
WIDTH = 64


def hpz_cells() -> list[dict[str, Any]]:
    """The OK ZeRO-3 cells with hpZ: flat, fp32 masters and states, no offload."""
    table = load_rules()
    cells = []
    for core in ok_cells(stages=(3,)):
        point = {**core, "hierarchical_partitioning": True}
        point["reductions"] = [
            r for r in core["reductions"] if table.lookup({**point, "reduction": r}).status == "OK"
        ]
        if (
            point["reductions"]
            and table.lookup({**point, "reduction": "collective"}).status == "OK"
        ):
            cells.append(point)
    return cells


def test_hpz_cells() -> None:
    """params 3 x accum 3 x comm 3; elsewhere NotSupported, or the Error of ZeRO-3."""
    cells = hpz_cells()
    assert len(cells) == 27 and all(c["shard_groups"] == "flat" for c in cells)
    table = load_rules()
    point = {k: v for k, v in cells[0].items() if k != "reductions"}
    for change in (
        {"stage": 2},
        {"shard_groups": "hybrid"},
        {"pipeline": True},
        {"offload_optimizer": "cpu"},
        {"offload_optimizer": "cpu", "offload_param": "cpu"},
        {"offload_param": "cpu"},
        {"states": "bf16"},
        {"master": "bf16", "params": "bf16"},
        {"reduction": "fp32_sum"},
        {"autocast": "bf16"},
        {"quantized_communication": "weights"},
    ):
        assert table.lookup({**point, **change}).status == "NotSupported", change
    assert table.lookup({**point, "sharded": False}).status == "Error"


def _with_hpz(config: dict[str, Any]) -> dict[str, Any]:
    config["zero_optimization"]["zero_hpz_partition_size"] = HPZ
    return config


@pytest.fixture(scope="module")
def group() -> dict[str, Any]:
    cells = hpz_cells()
    chosen = [
        c
        for c in cells
        if (c["params"], c["accum"], c["comm"])
        in {("fp32", "fp32", "fp32"), ("bf16", "fp32", "bf16"), ("fp16", "fp16", "fp16")}
    ]
    drawn: list[dict[str, Any]] = []

    @settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        drawn.extend(draw_parity_case(data, point) for point in chosen)

    draw()
    for case in drawn:
        _with_hpz(case["config"])
    compare = [_with_hpz(ckpt.config("bf16", 3))]  # fp32: the parity case above
    traffic = _with_hpz({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}})
    per_rank = spawn(
        cases.hpz_group, WORLD, drawn, compare, traffic, WIDTH, list(PROGRAMS.values()),
        timeout_s=500,
    )  # fmt: skip
    return {"cases": drawn, "per_rank": per_rank}


_FP32_HPZ = {
    "zero_optimization": {"stage": 3, "zero_hpz_partition_size": HPZ},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
}
PROGRAMS = {
    "step after an eval": (
        _FP32_HPZ,
        [
            ("train", 0),
            ("eval", 1),
            ("step",),
            ("zero_grad",),
            ("train", 2),
            ("step",),
            ("eval", 3),
        ],
    ),
    "optimizer.load_state_dict after an eval": (
        _FP32_HPZ,
        [
            ("train", 0),
            ("step",),
            ("zero_grad",),
            ("save", "a"),
            ("train", 1),
            ("step",),
            ("zero_grad",),
            ("eval", 2),
            ("load_opt", "a"),
            ("eval", 3),
            ("train", 4),
            ("step",),
        ],
    ),
}
"""Issue 47 item 1: a forward under no_grad left every unit on its secondary partition, which
the next forward gathered from after step() or a load had written the shards (tests/
test_zero3_caches.py has the programs' language and the root's case)."""


def _ok(result: dict[str, Any]) -> Any:
    assert result["ok"], result.get("trace")
    return result["value"]


@pytest.mark.slow
def test_parity_hpz_four_ranks(group: dict[str, Any]) -> None:
    per_rank = [rank["parity"] for rank in group["per_rank"]]
    assert_replicas_equal(per_rank)
    for result, case in zip(per_rank[0], group["cases"], strict=True):
        point = case["point"]
        if point["params"] == point["accum"] == point["comm"] == "fp32":
            assert_parity(result, FP32_RTOL, FP32_RTOL)
        else:
            assert_parity(result, LOW_PRECISION_LOSS_RTOL, LOW_PRECISION_MASTER_RTOL)
    plans = [dtypeplan.resolve(c["config"]) for c in group["cases"]]
    assert {(p.hpz_partition_size, p.rule_id) for p in plans} == {(HPZ, "zero3")}


@pytest.mark.slow
def test_hpz_gathers_the_same_bits_and_reshards_to_the_secondary_group(
    group: dict[str, Any],
) -> None:
    for rank in group["per_rank"]:
        for result in rank["same_bits"]:
            runs = _ok(result)
            hpz, plain = runs["hpz"], runs["plain"]
            assert hpz["losses"] == plain["losses"]
            assert all(
                torch.equal(a, b) for a, b in zip(hpz["shards"], plain["shards"], strict=True)
            )
            assert hpz["post_forward_sizes"] == [HPZ]  # every unit but the root, to 2 ranks
            assert plain["post_forward_sizes"] == [WORLD]


@pytest.mark.slow
def test_hpz_traffic_equals_the_bytes_the_gathers_send(group: dict[str, Any]) -> None:
    for rank in group["per_rank"]:
        result = _ok(rank["traffic"])
        sent, predicted = result["sent"], result["predicted"]
        assert sent == {WORLD: predicted["all_gather"], HPZ: predicted["all_gather_secondary"]}


def test_hpz_traffic_and_memory_by_hand() -> None:
    n, w, h, k = 1 << 20, 8, 4, 3
    plan = dtypeplan.resolve(
        {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": h}}
    )
    t = plan.traffic(n, w, micro_batches=k)
    assert dict(t.within) == {
        "all_gather": k * (2 * n * (w - 1) // w),
        "all_gather_secondary": k * (2 * n * (h - 1) // h),
        "reduce_scatter": k * (4 * n * (w - 1) // w),
    }
    # Between steps hpZ holds nothing more: the memory is ZeRO-3's.
    plain = dtypeplan.resolve({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}})
    assert plan.memory(n, w) == plain.memory(n, w)


def test_hpz_that_does_not_divide_the_world_is_refused() -> None:
    from dtypeplan.optimizers.fsdp2.sharding import hpz_reshard

    plan = dtypeplan.resolve({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}})
    with pytest.raises(dtypeplan.PrecisionConfigError, match="does not divide"):
        hpz_reshard(plan, 4)
    assert hpz_reshard(plan, 6) == {"reshard_after_forward": 3}
    with pytest.raises(dtypeplan.PrecisionConfigError, match="zero_hpz_partition_size"):
        dtypeplan.resolve({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}})


@pytest.mark.slow
def test_parity_every_hpz_cell_four_ranks() -> None:
    """Every OK hpZ cell (params x accumulation x communication dtypes), drawn extras."""
    drawn: list[dict[str, Any]] = []

    @settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        drawn.extend(draw_parity_case(data, point) for point in hpz_cells())

    draw()
    for case in drawn:
        _with_hpz(case["config"])
    from tests.workers.parity import run_cases

    per_rank = spawn(run_cases, WORLD, drawn, timeout_s=900)
    assert_replicas_equal(per_rank)
    for result, case in zip(per_rank[0], drawn, strict=True):
        point = case["point"]
        if point["params"] == point["accum"] == point["comm"] == "fp32":
            assert_parity(result, FP32_RTOL, FP32_RTOL)
        else:
            assert_parity(result, LOW_PRECISION_LOSS_RTOL, LOW_PRECISION_MASTER_RTOL)


@pytest.mark.parametrize("name", list(PROGRAMS))
@pytest.mark.slow
def test_hpz_a_no_grad_forward_leaves_no_stale_secondary_partition(
    group: dict[str, Any], name: str
) -> None:
    result = group["per_rank"][0]["programs"][list(PROGRAMS).index(name)]
    value = _ok(result)
    for mine, ref in zip(value["weights"], value["ref_weights"], strict=True):
        assert float((mine - ref).norm() / ref.norm()) < FP32_RTOL, name
    for mine, ref in zip(value["evals"], value["ref_evals"], strict=True):
        assert float((mine - ref).norm() / ref.norm()) < FP32_RTOL, name
