"""ZeRO-3 with a shard group smaller than the world (issue 22): FSDP2's HSDP on a 2-D mesh.

One spawned group of 4 ranks as 2 shard groups of 2 runs every case
(``tests/workers/hybrid_zero3.py``):

* parity with flat ZeRO-3 on the same 4 ranks, 3 steps of 2 micro-batches: fp32 cells within
  1e-6 (the same math, the gradient summed in another order: within the shard group, then
  across), 16-bit cells within the bounds their parity tests use against torch (bf16: 8
  mantissa bits); the gradient norm too (summed over one replica, not W / S of them);
* the wire: the parameters' all-gathers and the gradients' reduce-scatters within the shard
  group, the gradients' all-reduce across groups in ``communication_data_type``, only the
  step's fp32 summary over the whole group;
* the bytes each rank holds: those of flat ZeRO-3 on S ranks, exactly;
* the replicas (ranks with the same index in their shard group) end with the same bits,
  stochastic rounding included;
* checkpoints: one process -> hybrid (2 x 2) -> flat (4) -> hybrid -> one process, each load
  giving back the saved state bit for bit;
* refusals: a block-quantized or other-dtype wire across groups (NotSupportedError: FSDP2's
  replicate all-reduce is internal), a shard group size that does not divide the world, and an
  optimizer whose plan's layout is not the one the model was sharded with.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan.launch import spawn
from tests._helpers import FP32_RTOL, LOW_PRECISION_LOSS_RTOL, LOW_PRECISION_MASTER_RTOL
from tests.workers.hybrid_zero3 import CELLS, build, plan_for, run_group, train

WORLD = 4
FP32_PARITY = 1e-6
# The norm of bf16 gradients reduced in another order, as check_parity_cases allows.
LOW_PRECISION_NORM_RTOL = 5e-2
assert FP32_PARITY <= FP32_RTOL


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.double().norm())
    return float((got.double() - want.double()).norm()) / max(scale, 1e-30)


def _assert_same_state(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """Bit for bit: every tensor and every scalar."""
    assert got.keys() == want.keys(), (where, sorted(got.keys() ^ want.keys()))
    for key, value in want.items():
        if torch.is_tensor(value):
            assert torch.equal(got[key], value), (where, key)
        else:
            assert got[key] == value, (where, key, got[key], value)


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("hybrid_zero3"))
    # One process (no torch.distributed): the checkpoint the 4 ranks start from.
    plan = plan_for(CELLS["bf16-adamw-clip"], None)
    model, one = build(plan)
    train(model, one, range(2))
    dtypeplan.checkpoint.save(one, f"{root}/one")
    per_rank = spawn(run_group, WORLD, root, timeout_s=600)
    for rank, results in enumerate(per_rank):
        for part, value in results.items():
            assert "error" not in value, f"rank {rank} {part}: {value['error']}"
    return {"root": root, "one": one.full_state(), "per_rank": per_rank}


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.slow
def test_parity_with_flat_zero3(group: dict[str, Any], cell: str) -> None:
    exact = not any(key in CELLS[cell] for key in ("bf16", "fp16"))
    loss_rtol = FP32_PARITY if exact else LOW_PRECISION_LOSS_RTOL
    state_rtol = FP32_PARITY if exact else LOW_PRECISION_MASTER_RTOL
    norm_rtol = FP32_PARITY if exact else LOW_PRECISION_NORM_RTOL
    for rank, results in enumerate(group["per_rank"]):
        runs = results["parity"][cell]
        flat, hybrid = runs["flat"], runs["hybrid"]
        where = f"{cell} rank {rank}"
        assert flat["mesh"] == [WORLD] and hybrid["mesh"] == [2, 2], where
        for step, (got, want) in enumerate(zip(hybrid["losses"], flat["losses"], strict=True)):
            assert abs(got - want) <= loss_rtol * abs(want), (where, step, got, want)
        for got, want in zip(hybrid["norms"], flat["norms"], strict=True):
            assert abs(got - want) <= norm_rtol * want, (where, hybrid["norms"], flat["norms"])
        assert hybrid["state"].keys() == flat["state"].keys(), where
        for key, want in flat["state"].items():
            if torch.is_tensor(want):
                error = _rel(hybrid["state"][key], want)
                assert error <= state_rtol, (where, key, error)
            else:
                assert hybrid["state"][key] == want, (where, key)
        # The wire: flat, everything spans the world; hybrid, the parameters' all-gathers and
        # the gradients' reduce-scatters stay within the shard group, the gradients'
        # all-reduce across groups is in communication_data_type, and only the step's fp32
        # summary spans the world.
        comm = str(plan_for(CELLS[cell], None).comm_dtype)
        param = str(plan_for(CELLS[cell], None).param_dtype)
        assert {level for _, level, _ in flat["wire"]} == {"world"}, (where, flat["wire"])
        assert set(hybrid["wire"]) == {
            ("all_gather_single", "shard", param),
            ("reduce_scatter_single", "shard", comm),
            ("all_reduce", "replica", comm),
            ("all_reduce", "world", "torch.float32"),
        }, (where, hybrid["wire"])
        # Held: what flat ZeRO-3 holds on S ranks (the shards are 1/S of each parameter).
        assert hybrid["held"] == runs["flat_S"]["held"], (where, hybrid["held"], runs)
        assert hybrid["held"]["params"] > flat["held"]["params"], where
        # Every rank gathers the same full state.
        _assert_same_state(
            hybrid["state"], group["per_rank"][0]["parity"][cell]["hybrid"]["state"], where
        )
    # The replicas of each shard stay equal, bit for bit (stochastic rounding included).
    by_shard: dict[int, set[str]] = {}
    for results in group["per_rank"]:
        runs = results["parity"][cell]
        by_shard.setdefault(runs["shard_rank"], set()).add(runs["hybrid"]["digest"])
    assert sorted(by_shard) == [0, 1] and all(len(d) == 1 for d in by_shard.values()), by_shard


@pytest.mark.slow
def test_flat_layout_makes_no_subgroup(group: dict[str, Any]) -> None:
    assert [r["parity"]["flat_new_groups"] for r in group["per_rank"]] == [0] * WORLD


@pytest.mark.slow
def test_shard_group_of_the_whole_world_or_of_one_rank(group: dict[str, Any]) -> None:
    for rank, results in enumerate(group["per_rank"]):
        flat = results["parity"]["fp32-adamw-clip"]["flat"]
        whole, single = results["parity"]["S=W"], results["parity"]["S=1"]
        # S = W: the flat layout, bit for bit.
        assert whole["mesh"] == [WORLD], rank
        assert whole["losses"] == flat["losses"] and whole["norms"] == flat["norms"], rank
        _assert_same_state(whole["state"], flat["state"], f"S=W rank {rank}")
        # S = 1: every rank holds the whole model (fp32) and its states; the same math.
        assert single["mesh"] == [WORLD, 1], rank
        assert single["held"]["params"] == 4 * single["numel"], (rank, single["held"])
        for got, want in zip(single["norms"], flat["norms"], strict=True):
            assert abs(got - want) <= FP32_PARITY * want, (rank, single["norms"], flat["norms"])
        for key, want in flat["state"].items():
            if torch.is_tensor(want):
                assert _rel(single["state"][key], want) <= FP32_PARITY, (rank, key)


@pytest.mark.slow
def test_checkpoints_between_flat_hybrid_and_one_process(group: dict[str, Any]) -> None:
    for rank, results in enumerate(group["per_rank"]):
        got = results["checkpoints"]
        where = f"rank {rank}"
        _assert_same_state(got["hybrid_from_one"], group["one"], f"one -> hybrid, {where}")
        # export_model_state: the fp32 masters by name (make_model's order is param.{i}).
        assert list(got["exported"]) == sorted(got["names"]), where
        for index, name in enumerate(got["names"]):
            master = got["hybrid_trained"][f"param.{index}.master"]
            assert torch.equal(got["exported"][name], master), (where, name)
        _assert_same_state(
            got["flat_from_hybrid"], got["hybrid_trained"], f"hybrid -> flat, {where}"
        )
        _assert_same_state(got["hybrid_from_flat"], got["flat_trained"], f"flat -> hybrid, {where}")
        assert got["state_dict_layout"].startswith("OptimizerUsageError"), got["state_dict_layout"]
        assert "shard_group_size" in got["state_dict_layout"], got["state_dict_layout"]
    # Back on one process.
    plan = plan_for(CELLS["bf16-adamw-clip"], None)
    _, one = build(plan)
    dtypeplan.checkpoint.load(one, f"{group['root']}/hybrid2")
    want = group["per_rank"][0]["checkpoints"]["flat_trained"]
    _assert_same_state(one.full_state(), want, "hybrid -> one process")


@pytest.mark.slow
def test_refusals(group: dict[str, Any]) -> None:
    for rank, results in enumerate(group["per_rank"]):
        got = results["refusals"]
        for wire in ("int8", "fp8"):
            message = got[f"wire {wire}"]
            assert message.startswith("NotSupportedError"), (rank, message)
            assert f"wire across groups {wire}" in message and "shard_group_size 2" in message
            assert "ZeRO stage 1 or 2" in message, message
        message = got["wire fp32"]
        assert (
            message.startswith("NotSupportedError") and "communication_data_type to fp32" in message
        )
        assert got["wire bf16 (the comm dtype)"] == "ok", got
        message = got["shard_group_size 3"]
        assert message.startswith("PrecisionConfigError") and " 3 " in message and " 4" in message
        message = got["flat model, hybrid plan"]
        assert message.startswith("ValueError") and "(4,)" in message and "(2, 2)" in message
