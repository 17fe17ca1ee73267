"""ZeRO-3 and prepare_model (issue 10 items 9-11, 14; issue 14 C2-C4).

One process: the choice of FSDP2 units (ties, containers, ``wrap``), the mesh device per
backend (mocked backend names), and the cast of ``prepare_model`` at stages 0-2 that keeps
the fp32 values for the masters. Two ranks (one spawned group): a bf16-built model is never
whole in fp32, ``wrap`` chooses the units, and ``export_model_state(rank0_only=True)``.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import dtypeplan
from dtypeplan.errors import PrecisionConfigError
from dtypeplan.launch import spawn
from dtypeplan.optimizers.fsdp2.sharding import (
    broadcast_unit_from_first,
    mesh_device,
    mesh_device_type,
)
from dtypeplan.optimizers.fsdp2.units import choose_units
from tests._models import Block, norm_and_frozen, tied_lm
from tests.workers.zero3 import run_cases


# --- C2: the mesh lives where the process group communicates ------------------------------------
@pytest.mark.parametrize(
    ("backend", "accelerator", "device"),
    [
        ("nccl", "cuda", "cuda"),
        ("NCCL", None, "cuda"),
        ("gloo", "cuda", "cpu"),
        ("cpu:gloo,cuda:nccl", "cuda", "cuda"),
        ("cpu:gloo,cuda:nccl", None, "cpu"),
        ("xccl", "xpu", "xpu"),
        ("no-such-backend", "cuda", None),
    ],
)
def test_mesh_device_type_follows_the_backend(
    backend: str, accelerator: str | None, device: str | None
) -> None:
    # issue 14 C2
    assert mesh_device_type(backend, accelerator) == device


def test_nccl_mesh_is_the_current_cuda_device_even_for_a_cpu_model() -> None:
    # issue 14 C2: a model still on CPU with an NCCL group gets a CUDA mesh, not a CPU one
    model = nn.Linear(2, 2)
    with mock.patch("torch.cuda.current_device", return_value=3):
        assert mesh_device("nccl", model) == torch.device("cuda", 3)
    assert mesh_device("gloo", model) == torch.device("cpu")
    unknown = mesh_device("no-such-backend", model.to(torch.float64))
    assert unknown == torch.device("cpu")  # a backend of unknown kind: the model's device


# --- items 9/10: units ------------------------------------------------------------------------
def _names(model: nn.Module, units: list[nn.Module]) -> list[str]:
    by_id = {id(m): n for n, m in model.named_modules()}
    return [by_id[id(u)] for u in units]


def test_default_units_are_the_blocks_and_ties_share_the_root() -> None:
    # issue 10 items 9, 10: each block of the ModuleList; the tied embedding and head in the root
    model = tied_lm(0)
    assert _names(model, choose_units(model)) == ["final_norm", "layers.1", "layers.0"]
    untied = tied_lm(0)
    untied.head.weight = nn.Parameter(untied.head.weight.detach().clone())
    assert sorted(_names(untied, choose_units(untied))) == [
        "embed", "final_norm", "head", "layers.0", "layers.1",
    ]  # fmt: skip


def test_sequential_blocks_are_units_the_container_is_not() -> None:
    # a model that iterates its Sequential never runs the container's forward (FSDP2's hook)
    model = tied_lm(0, container=nn.Sequential)
    assert "layers" not in _names(model, choose_units(model))
    assert {"layers.0", "layers.1"} <= set(_names(model, choose_units(model)))


def test_wrap_chooses_units() -> None:
    model = tied_lm(0)
    assert sorted(_names(model, choose_units(model, {Block}))) == ["layers.0", "layers.1"]
    chosen = choose_units(model, lambda m: isinstance(m, nn.LayerNorm))
    assert sorted(_names(model, chosen)) == ["final_norm", "layers.0.norm", "layers.1.norm"]
    with pytest.raises(PrecisionConfigError, match="no forward"):
        choose_units(model, {nn.ModuleList})
    with pytest.raises(PrecisionConfigError, match="callable"):
        choose_units(model, [3])  # type: ignore[list-item]
    with pytest.warns(UserWarning, match="tied"):
        assert _names(model, choose_units(model, {nn.Embedding})) == []


# --- item 11: one dtype for the whole model, fp32 masters kept ----------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_prepare_model_then_build_keeps_exact_fp32_masters(stage: int) -> None:
    # issue 10 item 11: casting before build loses nothing; a change after the cast wins
    plan = dtypeplan.resolve(
        {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    )  # fmt: skip
    original = norm_and_frozen(0)
    model = plan.prepare_model(norm_and_frozen(0))
    floating = [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]
    assert all(t.dtype == torch.bfloat16 for t in floating)
    assert model.bn.num_batches_tracked.dtype == torch.int64
    new_bias = torch.full_like(model.head.bias, 0.3)
    model.head.bias.data.copy_(new_bias)  # written between prepare_model and build
    opt = plan.build(p for p in model.parameters() if p.requires_grad)
    exported = dtypeplan.checkpoint.export_model_state(opt, model)
    for name, param in original.named_parameters():
        want = new_bias.float() if name == "head.bias" else param.detach()
        if name.startswith("frozen"):
            want = want.to(torch.bfloat16).float()  # frozen: the current (cast) value
        assert torch.equal(exported[name], want), name
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


# --- two ranks ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return spawn(run_cases, 2, timeout_s=300, group_timeout_s=60)


def _ok(results: list[dict[str, Any]], case: str) -> list[dict[str, Any]]:
    out = [per_rank[case] for per_rank in results]
    for rank, got in enumerate(out):
        assert isinstance(got, dict), f"rank {rank}: {got}"
    return out


def test_fp32_is_made_one_unit_at_a_time(two_ranks: list[dict[str, Any]]) -> None:
    # issue 14 C3: at no fully_shard call is more than one unit unsharded in fp32
    for got in _ok(two_ranks, "fp32_unsharded_never_whole"):
        assert len(got["seen"]) == 4, got  # final_norm, two blocks, the root
        assert max(got["seen"]) <= max(got["largest_unit"], got["total"] - 2 * got["largest_unit"])
        assert max(got["seen"]) < got["total"], got


def test_replicas_equal_broadcast_unit_by_unit_on_the_mesh_device(
    two_ranks: list[dict[str, Any]],
) -> None:
    # issue 32: each unit is broadcast right before it is sharded (not the whole model on the
    # model's device first, which NCCL refuses for a CPU-built model); ranks built other weights
    for got in _ok(two_ranks, "replicas_equal_unit_by_unit"):
        assert all(got["equal"].values()), got["equal"]
        assert {tuple(devices) for _, devices in got["broadcasts"]} == {("cpu",)}  # gloo
        assert got["units"] == 4, got  # final_norm, two blocks, the root
        # a broadcast before every fully_shard of a unit with parameters of its own, none after
        assert sorted({k for k, _ in got["broadcasts"]}) == list(range(got["units"])), got


def test_a_deferred_init_parameter_is_not_broadcast() -> None:
    # issue 32: meta parameters (FSDP2's deferred initialisation) stay there, unbroadcast; the
    # others are broadcast on the mesh device
    seen: list[list[str]] = []

    class RecordingComm:
        def broadcast_from_first_(self, tensors: list[torch.Tensor]) -> None:
            seen.append([str(t.device) for t in tensors])

    unit = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1, device="meta"))
    broadcast_unit_from_first(RecordingComm(), unit, torch.device("cpu"))  # type: ignore[arg-type]
    assert seen == [["cpu"], ["cpu"]]  # one call per parameter, the meta ones left out
    assert [p.device.type for p in unit.parameters()] == ["cpu", "cpu", "meta", "meta"]


def test_wrap_classes_at_zero3(two_ranks: list[dict[str, Any]]) -> None:
    for got in _ok(two_ranks, "wrap_classes_choose_units"):
        assert got["units"] == ["<root>", "layers.0", "layers.1"], got
        assert got["tied"] and all(torch.isfinite(torch.tensor(got["losses"])))


def test_export_rank0_only_gathers_one_parameter_at_a_time(
    two_ranks: list[dict[str, Any]],
) -> None:
    # issue 10 item 14: collective on every rank, kept on rank 0, on CPU, fp32
    rank0, rank1 = _ok(two_ranks, "export_rank0_only")
    names = sorted(n for n, _ in tied_lm(0).named_parameters(remove_duplicate=False))
    assert rank0["names"] == names and rank0["tied_shared"]
    assert rank0["devices"] == ["cpu"] and rank0["dtypes"] == ["torch.float32"]
    assert rank1["names"] == []
    for got in (rank0, rank1):
        # one gather per unique parameter (the tie gathered once), each of one parameter
        assert len(got["gathers"]) == got["unique_params"]


def test_bf16_master_gradients_are_summed_uncast(two_ranks: list[dict[str, Any]]) -> None:
    # FSDP2 casts each reduced shard to the sharded parameters' dtype (bf16 with bf16 masters);
    # the accumulation hook reads the fp32 reduce-scatter output instead: no extra rounding.
    for got in _ok(two_ranks, "bf16_masters_sum_uncast"):
        assert got["dtypes"] == ["torch.float32"], got
        assert got["wider_than_bf16"], got
        assert got["same"], got


def test_an_empty_local_shard_with_a_16bit_accumulator(two_ranks: list[dict[str, Any]]) -> None:
    got = _ok(two_ranks, "empty_shards_with_16bit_accumulation")
    assert any(0 in g["local_numels"] for g in got), got  # some rank holds an empty shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    model.bfloat16()(x.bfloat16()).float().square().mean().backward()
    reference = float(torch.cat([p.grad.float().reshape(-1) for p in model.parameters()]).norm())
    for g in got:
        # bf16 gradients reduced and summed in bf16: within a few bf16 ulps of one rank's norm
        assert abs(g["grad_norm"] - reference) <= 4 * 2**-8 * reference, (g, reference)


def test_a_scalar_parameter_trains_as_in_torch(two_ranks: list[dict[str, Any]]) -> None:
    # issue 29 item 5: FSDP2's fully_shard died on CLIP's logit_scale; it is held as a
    # 1-element parameter, seen 0-dim by the forward, flat and hybrid.
    for got in _ok(two_ranks, "scalar_parameter_trains"):
        for layout in ("flat", "hybrid"):
            run = got[layout]
            assert run["sharded"] and run["outside_forward"] == "DTensor", run
            # The same name, place and order; its state_dict shape is [1].
            assert run["names"][0] == ("logit_scale", (1,)), run["names"]
            # The exported fp32 weights (save_pretrained's input) have the model's shapes.
            assert run["exported_shapes"]["logit_scale"] == (), run["exported_shapes"]
            # fp32 throughout; the only difference is the order of the sums over two ranks.
            for mine, ref in zip(run["losses"], got["ref_losses"], strict=True):
                assert abs(mine - ref) <= 1e-5 * abs(ref), (layout, mine, ref)
            for mine, ref in zip(run["masters"], got["ref_masters"], strict=True):
                assert torch.allclose(mine.reshape(ref.shape), ref, rtol=1e-5, atol=1e-6), layout
