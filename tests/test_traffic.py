"""plan.traffic(): the bytes each rank sends per step, against what the collectives send.

The flat layout is checked against a real 4-rank gloo run (``Communicator.stats``), per
collective, at ZeRO 0-2 with whole and sharded accumulators, several micro-batches, 16-bit and
fp32 wires and the fp32-summing all-to-all. The hybrid figures are checked here against the
formulas of ``resolver/_traffic.py`` worked by hand, and the layout's rules (the table, the
config, a shard group size that does not divide the world).
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

import dtypeplan
from dtypeplan.errors import PrecisionConfigError
from dtypeplan.launch import spawn
from dtypeplan.optimizers.buffers.layout import ALIGN
from dtypeplan.resolver._traffic import QUANTIZED_WIRE_BLOCK
from tests.workers.traffic import traffic_cases

WORLD = 4
WIDTH = 24  # 2 * (24 * 24 + 24) = 1200 parameters: padding to 4 * 64 is visible


def _flat_cases() -> list[dict]:
    cases = []
    wires = [  # (params, comm, reduction)
        ("bf16", "bf16", "collective"),
        ("bf16", "bf16", "fp32_sum"),
        ("bf16", "fp32", "collective"),
        ("fp32", "fp32", "collective"),
    ]
    for (params, comm, reduction), (stage, sharded), micro_batches in itertools.product(
        wires, [(0, False), (1, False), (1, True), (2, True)], [1, 3]
    ):
        if micro_batches == 3 and (params, comm, reduction) != wires[0]:
            continue
        config = {
            "communication_data_type": comm,
            "communication_reduction": reduction,
            "gradient_accumulation_dtype": {"dtype": "fp32", "sharded": sharded},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        }
        if params == "bf16":
            config["bf16"] = {"enabled": True}
        cases.append({"config": config, "micro_batches": micro_batches, "width": WIDTH})
    return cases


@pytest.mark.slow
def test_flat_traffic_equals_the_bytes_the_collectives_send() -> None:
    cases = _flat_cases()
    per_rank = spawn(traffic_cases, WORLD, cases, timeout_s=300)
    for case, *results in zip(cases, *per_rank, strict=True):
        plan = dtypeplan.resolve(case["config"])
        for result in results:
            # The flat buffer is padded to whole buckets of a multiple of W * ALIGN elements:
            # the model counts the padded size exactly, the bare size to within that padding.
            padded, n = result["padded"], result["num_params"]
            assert n <= padded < n + result["buckets"] * WORLD * ALIGN
            predicted = plan.traffic(padded, WORLD, micro_batches=case["micro_batches"])
            assert dict(predicted.within) == result["bytes_sent"], case
            assert not predicted.across
            bare = plan.traffic(n, WORLD, micro_batches=case["micro_batches"])
            assert bare.total_bytes <= predicted.total_bytes


def _hybrid_cases() -> list[dict]:
    """ZeRO-1 (whole and sharded accumulator) and ZeRO-2 as 2 shard groups of 2, one bucket (the
    quantized wire pads each bucket's slice to whole blocks: one bucket is the model's count)."""
    cases = []
    for (stage, sharded), across, micro_batches in itertools.product(
        [(1, False), (1, True), (2, True)], [None, "fp32", "int8", "fp8"], [1, 3]
    ):
        if micro_batches == 3 and across not in (None, "int8"):
            continue
        config: dict = {
            "bf16": {"enabled": True},
            "communication_data_type": "bf16",
            "gradient_accumulation_dtype": {"dtype": "fp32", "sharded": sharded},
            "zero_optimization": {"stage": stage, "shard_group_size": 2},
        }
        if across is not None:
            config["communication_data_type_across_groups"] = across
        cases.append({"config": config, "micro_batches": micro_batches, "width": 4 * WIDTH})
    # The fp32-summing all-to-all on both levels (a bf16 wire), and a quantized wire across.
    for across in (None, "int8"):
        config = {
            "bf16": {"enabled": True},
            "communication_data_type": "bf16",
            "communication_reduction": "fp32_sum",
            "zero_optimization": {"stage": 2, "shard_group_size": 2},
        }
        if across is not None:
            config["communication_data_type_across_groups"] = across
        cases.append({"config": config, "micro_batches": 2, "width": 4 * WIDTH})
    # 4 ranks as torchrun starts 2 nodes of 2: "auto" takes the shard group from the node.
    cases.append(
        {
            "config": {
                "bf16": {"enabled": True},
                "communication_data_type_across_groups": "int8",
                "zero_optimization": {"stage": 2, "shard_group_size": "auto"},
            },
            "env": {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"},
            "micro_batches": 1,
            "width": 4 * WIDTH,
        }
    )
    return cases


@pytest.mark.slow
def test_hybrid_traffic_equals_the_bytes_each_level_sends() -> None:
    """Per level and per collective, the bytes of a real 2 x 2 gloo run are plan.traffic()'s:
    within the shard group (reduce-scatters, all-gathers), across the groups (the all-reduce
    of each shard, dtype or block-quantized), and no gradient byte on the whole group. One case
    runs the 4 ranks as torchrun starts 2 nodes of 2 (LOCAL_WORLD_SIZE 2): ``"auto"`` puts each
    node's ranks in one shard group."""
    cases = _hybrid_cases()
    per_rank = spawn(traffic_cases, WORLD, cases, timeout_s=300)
    for case, *results in zip(cases, *per_rank, strict=True):
        config = case["config"]
        if "env" in case:  # "auto": the parent resolves with the node layout given
            config = {**config, "zero_optimization": {"stage": 2, "shard_group_size": 2}}
        plan = dtypeplan.resolve(config)
        for rank, result in enumerate(results):
            assert result["shard_group_size"] == 2, case
            node = rank // 2  # torchrun numbers the ranks node by node
            assert result["shard_ranks"] == [2 * node, 2 * node + 1], case
            assert result["buckets"] == 1, case
            predicted = plan.traffic(result["padded"], WORLD, micro_batches=case["micro_batches"])
            assert predicted.hybrid, case
            assert dict(predicted.within) == result["bytes_sent"], case
            assert dict(predicted.across) == result["across_bytes_sent"], case
            assert result["across_bytes_sent"], case
            assert sum(result["world_bytes_sent"].values()) == 0, case


@pytest.mark.slow
def test_quantized_wire_across_counts_each_bucket_chunk_padding() -> None:
    """Issue 29 item 7: with several buckets the int8/fp8 wire across the groups pads each
    bucket's chunk to whole blocks per rank on its own; plan.traffic(buckets=...) counts it
    (a real 2 x 2 gloo run, stages 1 and 2, several buckets and param groups' worth)."""
    cases = []
    for stage, across in itertools.product((1, 2), ("int8", "fp8")):
        config = {
            "bf16": {"enabled": True},
            "communication_data_type_across_groups": across,
            "zero_optimization": {"stage": stage, "shard_group_size": 2, "reduce_bucket_size": 300},
        }
        cases.append({"config": config, "micro_batches": 1, "width": WIDTH})
    per_rank = spawn(traffic_cases, WORLD, cases, timeout_s=300)
    for case, *results in zip(cases, *per_rank, strict=True):
        plan = dtypeplan.resolve(case["config"])
        for result in results:
            assert result["buckets"] >= 3, case
            sizes = result["bucket_sizes"]
            predicted = plan.traffic(result["padded"], WORLD, buckets=sizes)
            assert dict(predicted.across) == result["across_bytes_sent"], (case, sizes)
            assert dict(predicted.within) == result["bytes_sent"], case
            # The padded total as one chunk (the model before): fewer bytes than sent.
            one = plan.traffic(result["padded"], WORLD, buckets=[result["padded"]])
            assert one.across_bytes < predicted.across_bytes, case


def _plan(stage: int, **extra: object) -> dtypeplan.PrecisionPlan:
    zero = {"stage": stage, "shard_group_size": extra.pop("shard_group_size", None)}
    config = {"bf16": {"enabled": True}, "communication_data_type": "bf16", **extra}
    return dtypeplan.resolve({**config, "zero_optimization": zero})


def test_hybrid_zero2_by_hand() -> None:
    n, w, s, k = 8 * 1024 * 1024, 16, 4, 3
    r = w // s
    plan = _plan(2, shard_group_size=s)
    t = plan.traffic(n, w, micro_batches=k)
    assert t.hybrid and t.shard_group_size == s
    # Within: a bf16 reduce-scatter per micro-batch and one bf16 all-gather, over S ranks.
    assert dict(t.within) == {
        "reduce_scatter": k * 2 * n * (s - 1) // s,
        "all_gather": 2 * n * (s - 1) // s,
    }
    # Across: one bf16 all-reduce of the N / S shard per step over the W / S groups.
    assert dict(t.across) == {"all_reduce": 2 * (2 * (n // s) * (r - 1) // r)}
    flat = _plan(2).traffic(n, w, micro_batches=k)
    assert not flat.across
    assert flat.within["reduce_scatter"] == k * 2 * n * (w - 1) // w


def test_hybrid_quantized_wire_across_by_hand() -> None:
    n, w, s = 1_000_003, 8, 2
    r = w // s
    t = _plan(1, shard_group_size=s, communication_data_type_across_groups="int8").traffic(n, w)
    shard = n // s
    unit = r * QUANTIZED_WIRE_BLOCK
    padded = -(-shard // unit) * unit
    one = (padded + 4 * padded // QUANTIZED_WIRE_BLOCK) * (r - 1) // r
    assert dict(t.across) == {"all_to_all": one, "all_gather": one}
    bf16 = _plan(1, shard_group_size=s).traffic(n, w)
    # int8 blocks: 1 + 4/256 bytes a value against bf16's 2 (less the padding to whole blocks).
    assert t.across_bytes / bf16.across_bytes == pytest.approx((1 + 4 / 256) / 2, rel=unit / shard)
    assert t.within == bf16.within


def test_zero3_hybrid_gathers_within_and_all_reduces_across_every_micro_batch() -> None:
    n, w, s, k = 4096 * 256, 8, 4, 2
    r = w // s
    t = _plan(3, shard_group_size=s).traffic(n, w, micro_batches=k)
    assert dict(t.within) == {
        "all_gather": 2 * k * (2 * n * (s - 1) // s),
        "reduce_scatter": k * (2 * n * (s - 1) // s),
    }
    assert dict(t.across) == {"all_reduce": k * 2 * (2 * (n // s) * (r - 1) // r)}


def test_micro_batches_default_to_the_config() -> None:
    plan = dtypeplan.resolve(
        {
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2},
            "gradient_accumulation_steps": 4,
        }
    )
    assert plan.traffic(1024, 2) == plan.traffic(1024, 2, micro_batches=4)
    assert "4 micro-batches" in plan.explain(1024, 2)


def test_one_rank_sends_nothing() -> None:
    assert _plan(2).traffic(10**6, 1).total_bytes == 0


@pytest.mark.parametrize("size, world", [(3, 8), (16, 8), (5, 12)])
def test_a_shard_group_size_that_does_not_divide_the_world_is_refused(
    size: int, world: int
) -> None:
    plan = _plan(2, shard_group_size=size)
    for call in (plan.traffic, plan.memory):
        with pytest.raises(PrecisionConfigError, match=rf"\b{size}\b.*\b{world}\b"):
            call(10**6, world)


def test_memory_shards_over_the_shard_group() -> None:
    n, w, s = 10**9, 64, 8
    hybrid = _plan(2, shard_group_size=s).memory(n, w)
    assert hybrid == _plan(2).memory(n, s)  # sharded over S as the flat layout over S ranks
    assert hybrid["optimizer_states"] == 8 * n // s
    zero3 = _plan(3, shard_group_size=s).memory(n, w)
    assert zero3["params"] == 4 * n // s
    # Shard groups of one rank at ZeRO-3: FSDP2 (HSDP) holds whole fp32 shards, not the one
    # process's flat optimizer (16-bit parameters and an fp32 master).
    assert _plan(3, shard_group_size=1).memory(n, w)["params"] == 4 * n


def _several_machines_section() -> str:
    """docs/multi-node.md, the page that the README's "Several machines" section became."""
    return (Path(__file__).resolve().parent.parent / "docs" / "multi-node.md").read_text()


def test_readme_several_machines_config_and_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    section = _several_machines_section()
    config = json.loads(re.search(r"```json\n(.*?)```", section, re.DOTALL).group(1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("WORLD_SIZE", "32")
    plan = dtypeplan.resolve(config)
    assert plan.status == "OK" and plan.shard_group_size == 8
    assert plan.wire_across_groups == "int8"
    # The table: 7B, bf16 on the wire, 4 nodes x 8 GPUs, one micro-batch.
    n, w = 7_000_000_000, 32
    rows = re.findall(
        r"^\| ZeRO-(\d) \| ([^|]+) \| ([^|]+) \| ([\d.]+) GiB[^|]* \| ([\d.]+) GiB \|$",
        section,
        re.MULTILINE,
    )
    assert len(rows) == 8
    for stage, layout, within, across, memory in rows:
        layout = layout.strip()
        extra = {"communication_data_type": "bf16"}
        if layout != "flat":
            extra["shard_group_size"] = 8
        if "int8" in layout:
            extra["communication_data_type_across_groups"] = "int8"
        t = _plan(int(stage), **extra).traffic(n, w, micro_batches=1)
        if layout == "flat":
            assert within.strip() == "-"
            assert float(across) == round(t.total_bytes / 2**30, 2)
        else:
            assert float(within.strip().removesuffix(" GiB")) == round(t.within_bytes / 2**30, 2)
            assert float(across) == round(t.across_bytes / 2**30, 2)
        assert float(memory) == round(_plan(int(stage), **extra).memory(n, w)["total"] / 2**30, 2)


def test_scale_model_benchmark_runs_and_places_zeropp() -> None:
    from benchmarks import bench_scale_model

    summary = bench_scale_model.main(["--no-write"])
    for model in bench_scale_model.MODELS:
        assert summary["zero3_flat_over_zeropp_model_at_384"][model] == 4.0
        assert summary["zero3_flat_over_hybrid_at_384"][model] > 4.0
        assert summary["zero2_flat_over_hybrid_int8_at_384"][model] > 1.0


def test_fp32_sum_across_follows_the_wire_across() -> None:
    n, w, s = 1 << 20, 8, 2
    r = w // s
    config = {"communication_data_type": "fp32", "communication_reduction": "fp32_sum"}
    t = _plan(1, shard_group_size=s, communication_data_type_across_groups="bf16", **config)
    across = t.traffic(n, w).across
    # An fp32 wire within is summed by the collective; the bf16 wire across by the receiver.
    one = 2 * (n // s) * (r - 1) // r
    assert dict(across) == {"all_to_all": one, "all_gather": one}
    assert "reduce_scatter" in t.traffic(n, w).within
