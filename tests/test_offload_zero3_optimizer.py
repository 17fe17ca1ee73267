"""ZeRO-3 with ``offload_optimizer: cpu`` alone (the table's zero3-offload-optimizer rule).

FSDP2's shards stay on the device; the fp32 master shards, the optimizer states and the update
live on the host (``optimizers/fsdp2/host_update.py``). On this CPU-only machine the device is
the host, and the host update runs staged (the accelerator's pipeline of pinned slots and
copies, without asynchrony), so what runs is the code path of a GPU but for the copies' speed.

Checked, on one spawned group of 2 ranks (and a 1-rank group):

* parity against plain fp32 torch.optim on the full batch, 3 steps, for every (parameter,
  accumulation, communication) dtype cell the rule makes OK, drawn optimizer, clipping, micro-
  batches and groups, at tests/test_parity.py's bounds;
* the placement: the optimizer updates separate host masters (never FSDP2's shards), which
  equal the shards after each step, and the host update went through the staged pipeline;
* ``plan.memory()``: the device bytes (shards, accumulator) and the host bytes (masters,
  states) within 10% of what the optimizer holds;
* checkpoints: a resume bitwise equal to the uninterrupted run, and loads into ZeRO-3 without
  offload and with both offloads that move the masters and states exactly.
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
    ok_cells,
)
from tests.workers import offload as cases

OPTIMIZER_ONLY = {"offload_optimizer": "cpu", "offload_param": "none"}
WIDTH = 256  # memory cases: ~130k parameters


def optimizer_offload_cells() -> list[dict[str, Any]]:
    """The OK ZeRO-3 cells (fp32 masters and states) with the optimizer alone offloaded."""
    table = load_rules()
    cells: dict[tuple, dict[str, Any]] = {}
    flat = [
        c for c in ok_cells(stages=(3,)) if c["shard_groups"] == "flat" and c["master"] == "fp32"
    ]
    for core, layout in [(c, layout) for layout in ("flat", "hybrid") for c in flat]:
        for reduction in core["reductions"]:
            point = {k: v for k, v in core.items() if k != "reductions"}
            point = {**point, **OPTIMIZER_ONLY, "reduction": reduction, "shard_groups": layout}
            if table.lookup(point).status != "OK":
                continue
            key = tuple(v for k, v in point.items() if k != "reduction")
            cell = cells.setdefault(key, {**point, "reductions": []})
            cell["reductions"].append(reduction)
    return list(cells.values())


def check_cases(results: list[dict[str, Any]], drawn: list[dict[str, Any]]) -> None:
    for result, case in zip(results, drawn, strict=True):
        point = case["point"]
        if point["params"] == point["accum"] == point["comm"] == "fp32":
            assert_parity(result, FP32_RTOL, FP32_RTOL)
        else:
            assert_parity(result, LOW_PRECISION_LOSS_RTOL, LOW_PRECISION_MASTER_RTOL)


def _draw(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    drawn: list[dict[str, Any]] = []

    @settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        drawn.extend(draw_parity_case(data, point) for point in points)

    draw()
    return drawn


def test_optimizer_offload_zero3_cells() -> None:
    """params 3 x accum 3 x comm 3, flat and hybrid; another wire across, pipeline, other
    states NotSupported."""
    cells = optimizer_offload_cells()
    assert len(cells) == 27 * 2
    assert {c["shard_groups"] for c in cells} == {"flat", "hybrid"}
    table = load_rules()
    for change in (
        {"shard_groups": "hybrid_int8"},
        {"shard_groups": "hybrid_bf16"},
        {"pipeline": True},
        {"states": "bf16"},
        {"master": "bf16"},
        {"reduction": "fp32_sum"},
    ):
        assert table.lookup({**cells[0], **change}).status == "NotSupported", change


def _memory_configs() -> list[dict[str, Any]]:
    zero = {"stage": 3, **cases.OFFLOAD}
    return [
        {"zero_optimization": zero},
        {"bf16": {"enabled": True}, "zero_optimization": zero},
        {
            "bf16": {"enabled": True},
            "gradient_accumulation_dtype": "bf16",
            "zero_optimization": zero,
        },
    ]


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cells = [c for c in optimizer_offload_cells() if c["shard_groups"] == "flat"]
    # Each parameter dtype, each accumulation and each communication dtype at least once.
    chosen = [
        c
        for c in cells
        if (c["params"], c["accum"], c["comm"])
        in {("fp32", "fp32", "fp32"), ("bf16", "fp32", "bf16"), ("fp16", "fp16", "fp16"),
            ("bf16", "bf16", "fp32"), ("fp32", "fp32", "fp16")}
    ]  # fmt: skip
    drawn = _draw(chosen)
    per_rank = spawn(
        cases.zero3_optimizer_offload_group,
        2,
        str(tmp_path_factory.mktemp("zero3-optimizer-offload")),
        drawn,
        _memory_configs(),
        WIDTH,
        ["bf16"],
        timeout_s=500,
    )
    return {"cases": drawn, "per_rank": per_rank}


def _ok(result: dict[str, Any]) -> Any:
    assert result["ok"], result.get("trace")
    return result["value"]


@pytest.mark.slow
def test_parity_optimizer_offloaded_zero3_two_ranks(group: dict[str, Any]) -> None:
    per_rank = [rank["parity"] for rank in group["per_rank"]]
    assert_replicas_equal(per_rank)
    check_cases(per_rank[0], group["cases"])
    plans = [dtypeplan.resolve(c["config"]) for c in group["cases"]]
    assert {(p.offload_param, p.offload_optimizer, p.implementation) for p in plans} == {
        ("none", "cpu", "fsdp2")
    }


def test_optimizer_offloaded_zero3_masters_on_the_host(group: dict[str, Any]) -> None:
    for rank in group["per_rank"]:
        placement = _ok(rank["placement"])
        assert placement["policies"] == ["OffloadPolicy"], placement  # FSDP2 offloads nothing
        assert placement["on_host"] == ["master", "optimizer_states"]
        assert placement["shards_are_params"] and placement["masters_apart"], placement
        assert placement["masters_equal_shards"], placement
        assert placement["staged_waits"] > 0, placement


def test_optimizer_offloaded_zero3_memory_matches_plan(group: dict[str, Any]) -> None:
    results = _ok(group["per_rank"][0]["memory"])
    keys = ("params", "accumulator", "total", "host_master", "host_optimizer_states", "host_total")
    for config, result in zip(_memory_configs(), results, strict=True):
        measured, predicted = result["at_boundary"], result["predicted"]
        assert predicted["host_master"] > 0 and predicted["master"] == 0, predicted
        assert predicted["optimizer_states"] == 0 and predicted["params"] > 0, predicted
        assert_memory_close(measured, predicted, config, keys=keys)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_optimizer_offloaded_zero3_resumes_bitwise(group: dict[str, Any]) -> None:
    for rank in group["per_rank"]:
        runs = _ok(rank["resume"]["bf16"])
        saved = runs["saved"]
        resumed = _ok(runs["same"])
        assert _same(resumed["masters"], saved["masters"])
        assert resumed["losses_after"] == saved["losses_after"]
        assert _same(resumed["final"], saved["final"])
        for other in ("zero3_plain", "zero3_both"):
            loaded = _ok(runs[other])
            assert _same(loaded["masters"], saved["masters"]), other
            for key, value in saved["states"].items():
                assert torch.equal(loaded["states"][key], value), (other, key)
            # Another optimizer layout, the same arithmetic: the same run, bit for bit.
            assert loaded["losses_after"] == saved["losses_after"], other


def test_parity_optimizer_offloaded_zero3_one_rank_group() -> None:
    """One rank: FSDP2 on a 1-rank process group, the host masters beside its shards."""
    flat = [c for c in optimizer_offload_cells() if c["shard_groups"] == "flat"]
    points = [c for c in flat if c["accum"] == c["comm"]][:2]
    drawn = _draw(points)
    from tests.workers.parity import run_cases

    (results,) = spawn(run_cases, 1, drawn, timeout_s=300)
    check_cases(results, drawn)


@pytest.mark.slow
def test_parity_optimizer_offloaded_zero3_shard_groups_four_ranks() -> None:
    """2 shard groups of 2 (FSDP2's HSDP mesh): the host update of each rank's shard, the
    replicas equal bit for bit."""
    hybrid = [c for c in optimizer_offload_cells() if c["shard_groups"] == "hybrid"]
    points = [
        c
        for c in hybrid
        if (c["params"], c["accum"], c["comm"])
        in {("fp32", "fp32", "fp32"), ("bf16", "fp32", "bf16")}
    ]
    assert len(points) == 2
    # Drawn as flat points (the config's layout is shard_group_size, set below).
    drawn = _draw([{**point, "shard_groups": "flat"} for point in points])
    for case in drawn:
        case["config"]["zero_optimization"]["shard_group_size"] = 2
    from tests.workers.parity import run_cases

    plans = [dtypeplan.resolve(case["config"]) for case in drawn]
    assert {(p.shard_group_size, p.rule_id) for p in plans} == {(2, "zero3-offload-optimizer")}
    per_rank = spawn(run_cases, 4, drawn, timeout_s=300)
    assert_replicas_equal(per_rank)
    check_cases(per_rank[0], drawn)


@pytest.mark.slow
def test_parity_every_optimizer_offloaded_zero3_cell_two_ranks() -> None:
    """Every OK flat cell (params x accumulation x communication dtypes), drawn extras, 2
    ranks."""
    every = _draw([c for c in optimizer_offload_cells() if c["shard_groups"] == "flat"])
    from tests.workers.parity import run_cases

    per_rank = spawn(run_cases, 2, every, timeout_s=900)
    assert_replicas_equal(per_rank)
    check_cases(per_rank[0], every)
