"""Optimizer offload (``offload_optimizer: cpu``): parity, host syncs, checkpoints, refusals.

Every OK offload cell of the shipped table (parameter dtype x accumulation dtype x wire dtype x
ZeRO 1 whole / 1 sharded / 2 sharded) runs 3 steps on 2 ranks against plain fp32 torch.optim,
with the tolerances of tests/test_parity.py (the host step is the same fused kernel on the
same fp32 values: offloading adds no rounding). All multi-rank cases run in one spawned group.
On this CPU-only machine the "device" is the CPU as well: the offloaded code path (host
masters and states, gradient slots, copies, waits) runs as it would on CUDA, without the
asynchrony.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtypeplan
from dtypeplan.errors import NotSupportedError
from dtypeplan.launch import spawn
from dtypeplan.resolver import load_rules
from tests._helpers import (
    assert_replicas_equal,
    check_parity_cases,
    draw_parity_case,
    make_batch,
    make_model,
    mse,
    ok_cells,
)
from tests.workers import checkpoint as ckpt
from tests.workers import offload as cases

# As tests/test_checkpoint.py: a resumed run continues the uninterrupted one's losses.
LOSS_RTOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}


def offload_cells() -> list[dict[str, Any]]:
    """The OK cells with offload_optimizer cpu at ZeRO 0-2 (the core points with the optimizer
    offloaded; ZeRO-3's are tests/test_offload_zero3_optimizer.py's)."""
    table = load_rules()
    cells: dict[tuple, dict[str, Any]] = {}
    for core in ok_cells(stages=(0, 1, 2)):
        for reduction in core["reductions"]:
            point = {k: v for k, v in core.items() if k != "reductions"}
            point = {**point, "reduction": reduction, "offload_optimizer": "cpu"}
            if table.lookup(point).status != "OK":
                continue
            key = tuple(v for k, v in point.items() if k != "reduction")
            cell = cells.setdefault(key, {**point, "reductions": []})
            cell["reductions"].append(reduction)
    return list(cells.values())


def _sync_configs() -> list[dict[str, Any]]:
    return [
        {
            "bf16": {"enabled": True},
            "gradient_accumulation_dtype": {"dtype": "fp32", "sharded": sharded},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, **cases.OFFLOAD},
            "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        }
        for stage, sharded in ((1, False), (2, True))
    ]


def test_every_offload_cell_is_listed() -> None:
    # params 3 x accum 3 x comm 3 x (stage 1 whole, stage 1 sharded, stage 2 sharded)
    cells = offload_cells()
    assert len(cells) == 3 * 3 * 3 * 3
    assert {(c["stage"], c["sharded"]) for c in cells} == {(1, False), (1, True), (2, True)}


@pytest.fixture(scope="module")
def reshard_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A checkpoint saved by one offloaded process (torch.distributed off), for 2 ranks."""
    path = str(tmp_path_factory.mktemp("offload") / "one-process")
    return {"path": path, **cases.save_run(path, cases.offload_config("bf16", 1, True))}


@pytest.fixture(scope="module")
def group(
    tmp_path_factory: pytest.TempPathFactory, reshard_reference: dict[str, Any]
) -> dict[str, Any]:
    """The one spawned group of 2 ranks: per rank, everything multi-rank."""
    root = str(tmp_path_factory.mktemp("offload-ckpt"))

    @settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        drawn.extend(draw_parity_case(data, point) for point in offload_cells())

    drawn: list[dict[str, Any]] = []
    draw()
    per_rank = spawn(
        cases.offload_group,
        2,
        root,
        drawn,
        _sync_configs(),
        reshard_reference["path"],
        timeout_s=500,
    )
    return {"root": root, "cases": drawn, "per_rank": per_rank}


@pytest.mark.slow
def test_parity_every_offload_cell_two_ranks(group: dict[str, Any]) -> None:
    per_rank = [rank["parity"] for rank in group["per_rank"]]
    assert_replicas_equal(per_rank)
    check_parity_cases(per_rank[0], group["cases"])
    # The cases' configs offload (feature_config spells the cell's offload_optimizer value).
    assert all(dtypeplan.resolve(c["config"]).offload_optimizer == "cpu" for c in group["cases"])


@pytest.mark.slow
def test_offloaded_step_adds_no_host_sync_and_waits_once_per_chunk(group: dict[str, Any]) -> None:
    """No read of a device value (the counter of tests/test_host_syncs.py) in an offloaded
    bf16 step; the offload itself waits for the device once per bucket chunk (its gradient's
    copy), once per parameter slot written again (C - 2 of C chunks), once for the step's
    gradient factor and once after the last upload (the staged pipeline, as on an
    accelerator); unstaged (the CPU's own step) only for the factor."""
    for rank in group["per_rank"]:
        for result in rank["syncs"]:
            assert result["ok"], result
            value = result["value"]
            assert value["chunks"] > 2, value  # several chunks: the pipeline turns its slots
            assert value["logs"] == [[], [], []], value
            chunks = value["chunks"]
            assert value["waits"] == [chunks + (chunks - 2) + 2] * 2, value
            # Where the device is the host nothing travels: only the factor's wait is left.
            assert value["unstaged_waits"] == [1], value


def _ok(result: dict[str, Any]) -> Any:
    assert result["ok"], f"{result['type']}: {result['message']}\n{result['trace']}"
    return result["value"]


def _assert_resumed(loaded: dict[str, Any], saved: dict[str, Any], precision: str, name: str):
    for i, (mine, ref) in enumerate(zip(loaded["masters"], saved["masters"], strict=True)):
        assert torch.equal(mine, ref), f"{name}: master {i} differs"
    for i, (param, ref) in enumerate(zip(loaded["params"], saved["masters"], strict=True)):
        stored = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        assert torch.equal(param, ref.to(stored[precision]).float()), f"{name}: param {i}"
    assert loaded["states"].keys() == saved["states"].keys(), name
    for key, ref in saved["states"].items():
        assert torch.equal(loaded["states"][key], ref), f"{name}: {key} differs"
    assert loaded["step"] == saved["step"] and loaded["loss_scale"] == saved["loss_scale"]
    for step, (mine, ref) in enumerate(
        zip(loaded["losses_after"], saved["losses_after"], strict=True)
    ):
        assert abs(mine - ref) <= LOSS_RTOL[precision] * abs(ref), (name, step, mine, ref)


@pytest.mark.slow
def test_checkpoints_move_between_offloaded_and_plain(group: dict[str, Any]) -> None:
    """Offloaded -> plain, plain -> offloaded and offloaded -> offloaded, across stages and
    bucket layouts, on 2 ranks: weights, states and scalars load exactly, and the resumed run
    continues the uninterrupted one."""
    for rank in group["per_rank"]:
        for name, (saver, loader) in cases.CHECKPOINT_RUNS.items():
            saved = _ok(rank["checkpoints"][name]["saved"])
            loaded = _ok(rank["checkpoints"][name]["loaded"])
            assert (saved["offloaded"], loaded["offloaded"]) == (saver[2], loader[2]), name
            _assert_resumed(loaded, saved, saver[0], name)


@pytest.mark.slow
def test_checkpoints_reshard_across_world_sizes(
    group: dict[str, Any], reshard_reference: dict[str, Any]
) -> None:
    """1 offloaded process -> 2 offloaded ranks, and 2 offloaded ranks -> 1 process, offloaded
    and plain."""
    for rank in group["per_rank"]:
        _assert_resumed(_ok(rank["resharded"]), reshard_reference, "bf16", "1 -> 2 ranks")
    saved = _ok(group["per_rank"][0]["checkpoints"]["bf16-offloaded-to-plain"]["saved"])
    path = os.path.join(group["root"], "bf16-offloaded-to-plain")
    for offload in (True, False):
        loaded = cases.load_run(path, cases.offload_config("bf16", 1, offload))
        assert loaded["offloaded"] is offload
        _assert_resumed(loaded, saved, "bf16", f"2 ranks -> 1 process, offload {offload}")


def test_one_process_offload_is_the_plain_update_bit_for_bit() -> None:
    """With one process the host step is the same fused kernel on the same fp32 values: the
    parameters, masters and states equal the non-offloaded run's exactly, for Adam (per bucket
    chunk) and SGD with momentum (one inner.step() on the host), at every parameter dtype:
    through the accelerator's staged pipeline (host slots, copies) and the CPU's own unstaged
    step (the update reads the gradient chunk in place and writes the parameters in its pass)."""
    for precision in ("fp32", "bf16", "fp16"):
        for optimizer in ("adamw", "sgd"):
            runs = []
            for offload, staged in ((False, None), (True, True), (True, False)):
                plan = dtypeplan.resolve(cases.offload_config(precision, 2, offload, optimizer))
                model = plan.prepare_model(make_model(0))
                opt = plan.build(model.parameters())
                if offload:
                    assert opt.offload.staged is False  # the CPU's default
                    opt.offload.staged = staged
                ckpt.train(model, opt, range(3))
                runs.append((list(model.parameters()), opt.full_state()))
            (plain_params, plain_state), *offloaded = runs
            for staged, (params, state) in zip((True, False), offloaded, strict=True):
                where = (precision, optimizer, f"staged={staged}")
                for mine, ref in zip(params, plain_params, strict=True):
                    assert torch.equal(mine, ref), where
                assert state.keys() == plain_state.keys(), where
                for key, value in state.items():
                    expected = torch.as_tensor(plain_state[key])
                    assert torch.equal(torch.as_tensor(value), expected), (where, key)


def test_offloaded_tensors_are_on_the_host_and_none_on_the_device() -> None:
    """Masters and states are host tensors not sharing storage with the parameters, even for
    fp32 parameters (which are otherwise their own masters); the device keeps parameters and
    accumulator only, and held_tensors() says so."""
    plan = dtypeplan.resolve(cases.offload_config("fp32", 1, True))
    model = plan.prepare_model(make_model(0))
    opt = plan.build(model.parameters())
    ckpt.train(model, opt, range(1))
    held = opt.held_tensors()
    assert held.on_host == {"master", "optimizer_states"}
    buffers = {state.flat.buffer.untyped_storage().data_ptr() for state in opt.groups}
    for tensor in held.master + held.optimizer_states:
        assert tensor.device.type == "cpu"
        assert tensor.untyped_storage().data_ptr() not in buffers
    figures = held.nbytes()
    assert figures["master"] == figures["optimizer_states"] == 0
    assert figures["host_master"] > 0 and figures["host_optimizer_states"] > 0


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"zero_optimization": {"stage": 0}}, "stage 1"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "NVMe"),
        ({"master_weights": {"dtype": "bf16"}}, "fp32 master weights"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "fp32 optimizer states"),
    ],
)
def test_unsupported_offload_cells_say_what_to_set(extra: dict, match: str) -> None:
    config: dict[str, Any] = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    for key, value in extra.items():
        config[key] = {**config.get(key, {}), **value}
    config["zero_optimization"].update(cases.OFFLOAD)
    plan = dtypeplan.resolve(config)
    assert plan.status == "NotSupported", plan.explain()
    assert match in plan.reason, plan.reason
    with pytest.raises(NotSupportedError):
        plan.build(make_model(0).parameters())


def test_nvme_offload_is_not_supported() -> None:
    plan = dtypeplan.resolve(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}
    )
    assert plan.status == "NotSupported" and "NVMe" in plan.reason
    with pytest.raises(NotSupportedError, match="nvme"):
        plan.memory(1000, 2)


def test_model_changes_after_build_reach_the_host_masters() -> None:
    """model.load_state_dict() after build writes the parameters; the next step takes the new
    values into the offloaded masters (fp32 parameters are not their own masters here)."""
    for precision in ("fp32", "bf16"):
        plan = dtypeplan.resolve(cases.offload_config(precision, 1, True))
        model = plan.prepare_model(make_model(0))
        opt = plan.build(model.parameters())
        other = plan.prepare_model(make_model(3))
        model.load_state_dict(other.state_dict())
        x, y = make_batch(0, 8)
        opt.backward(mse(model, x, y))
        opt.step()
        masters = opt.full_state()
        for i, (name, param) in enumerate(other.named_parameters()):
            moved = (masters[f"param.{i}.master"] - param.detach().float()).abs().max()
            assert moved <= 1.1e-2, (precision, name, float(moved))  # one Adam step of lr 1e-2


@pytest.mark.slow
def test_zero3_fsdp2_cpu_offload_trains_exactly_as_zero3_without_it() -> None:
    """FSDP2's CPUOffloadPolicy, which plan.prepare_model passes for offload_param cpu (with
    offload_optimizer cpu: the table's offload-zero3 rule), runs on a gloo CPU mesh and trains
    bit for bit as ZeRO-3 without it: the host-resident shards take the same fused update."""
    shipped = dtypeplan.resolve(
        {"zero_optimization": {"stage": 3, **cases.OFFLOAD, "offload_param": {"device": "cpu"}}}
    )
    assert shipped.status == "OK" and shipped.rule_id == "zero3-offload", shipped.explain()
    precisions = ["fp32", "bf16"]
    results = spawn(cases.zero3_offload_cases, 2, None, precisions, timeout_s=300)
    for rank in results:
        for precision, result in zip(precisions, rank, strict=True):
            value = _ok(result)
            offloaded, plain = value["offloaded"], value["plain"]
            assert offloaded["cpu_offload"] and not plain["cpu_offload"], value
            assert offloaded["devices"] == ["cpu"]
            assert offloaded["losses"] == plain["losses"], precision
            for mine, ref in zip(offloaded["shards"], plain["shards"], strict=True):
                assert torch.equal(mine, ref), precision


def test_deepspeed_cpu_adam_16bit_moments_are_refused_clearly() -> None:
    """fp32_optimizer_states false (DeepSpeed's CPU Adam with moments in the parameter dtype):
    bf16 moments are a NotSupported cell with its reason, fp16 ones an error at the key; a
    partial offload (ratio < 1) is an error at the key."""

    def config(params: str, **offload: Any) -> dict[str, Any]:
        return {
            params: {"enabled": True},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", **offload}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "fp32_optimizer_states": False}},
        }

    plan = dtypeplan.resolve(config("bf16"))
    assert plan.status == "NotSupported" and plan.rule_id == "offload-optimizer"
    with pytest.raises(dtypeplan.PrecisionConfigError) as info:
        dtypeplan.resolve(config("fp16"))
    assert info.value.path == "$.optimizer.params.fp32_optimizer_states"
    with pytest.raises(dtypeplan.PrecisionConfigError) as info:
        dtypeplan.resolve(config("bf16", ratio=0.5))
    assert info.value.path == "$.zero_optimization.offload_optimizer.ratio"
