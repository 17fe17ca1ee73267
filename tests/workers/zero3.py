"""ZeRO-3 on spawned ranks: how the model is sharded (units, device, dtypes) and read back."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.distributed.fsdp as fsdp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import dtypeplan
from tests._models import Block, lm_loss, tied_lm, token_batch

CONFIG: dict[str, Any] = {
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
}


def fp32_unsharded_never_whole(rank: int, world: int) -> dict[str, Any]:
    """C3: a bf16-built model is turned fp32 one unit at a time, just before it is sharded."""
    model = tied_lm(0).to(torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    seen: list[int] = []
    real = fsdp.fully_shard

    def counting(module: Any, **kw: Any) -> Any:
        seen.append(
            sum(
                p.numel()
                for p in model.parameters()
                if not isinstance(p, DTensor) and p.dtype == torch.float32
            )
        )
        return real(module, **kw)

    with mock.patch.object(fsdp, "fully_shard", counting):
        dtypeplan.resolve(CONFIG).prepare_model(model)
    largest_unit = max(sum(p.numel() for p in b.parameters()) for b in model.layers)
    return {"seen": seen, "total": total, "largest_unit": largest_unit}


def replicas_equal_unit_by_unit(rank: int, world: int) -> dict[str, Any]:
    """Issue 32: every rank shards the first rank's weights, each unit broadcast right before
    it is sharded, on the mesh device (NCCL serves no CPU tensor: a CPU-built model's
    parameters move to the mesh device unit by unit, not the whole model up front)."""
    from dtypeplan.comm import Communicator

    model = tied_lm(rank)  # other weights on every rank
    sharded = [0]
    broadcasts: list[tuple[int, list[str]]] = []
    real_shard, real_broadcast = fsdp.fully_shard, Communicator.broadcast_from_first_

    def counting(module: Any, **kw: Any) -> Any:
        sharded[0] += 1
        return real_shard(module, **kw)

    def recording(self: Any, tensors: list[torch.Tensor]) -> None:
        broadcasts.append((sharded[0], sorted({str(t.device) for t in tensors})))
        real_broadcast(self, tensors)

    with (
        mock.patch.object(fsdp, "fully_shard", counting),
        mock.patch.object(Communicator, "broadcast_from_first_", recording),
    ):
        dtypeplan.resolve(CONFIG).prepare_model(model)
    first = dict(tied_lm(0).named_parameters())
    equal = {
        name: torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, first[name])
        for name, p in model.named_parameters()
    }
    return {"units": sharded[0], "broadcasts": broadcasts, "equal": equal}


def wrap_classes_choose_units(rank: int, world: int) -> dict[str, Any]:
    """wrap={Block}: only the blocks (and the root) are units; the model still trains."""
    model = dtypeplan.resolve(CONFIG).prepare_model(tied_lm(0), wrap={Block})
    units = sorted(n or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule))
    opt = dtypeplan.resolve(CONFIG).build(model.parameters())
    losses = []
    for step in range(2):
        opt.zero_grad()
        loss = lm_loss(model, token_batch(step, 4 * world).chunk(world)[rank])
        opt.backward(loss)
        opt.step()
        losses.append(float(loss))
    return {"units": units, "losses": losses, "tied": model.head.weight is model.embed.weight}


def export_rank0_only(rank: int, world: int) -> dict[str, Any]:
    """rank0_only: rank 0 gets every name (tied ones sharing a tensor), the others nothing."""
    plan = dtypeplan.resolve(CONFIG)
    model = plan.prepare_model(tied_lm(0))
    opt = plan.build(model.parameters())
    calls = []
    real = DTensor.full_tensor

    def counting(self: DTensor, **kw: Any) -> torch.Tensor:
        calls.append(self.numel())
        return real(self, **kw)

    with mock.patch.object(DTensor, "full_tensor", counting):
        exported = dtypeplan.checkpoint.export_model_state(opt, model, rank0_only=True)
    return {
        "names": sorted(exported),
        "tied_shared": exported.get("head.weight") is exported.get("embed.weight"),
        "devices": sorted({str(t.device) for t in exported.values()}),
        "dtypes": sorted({str(t.dtype) for t in exported.values()}),
        "gathers": calls,
        "unique_params": len(list(model.parameters())),
    }


def bf16_masters_sum_uncast(rank: int, world: int) -> dict[str, Any]:
    """bf16 masters, fp32 on the wire and in the accumulator: the sums are FSDP2's fp32
    reduce-scatter outputs, never cast to the bf16 shards' dtype on the way.

    At the first step the gathered bf16 weights are the same with fp32 and with bf16 masters
    (the fp32 masters rounded to nearest), so the accumulated gradients must be bitwise those
    of an fp32-master run, whose accumulator is FSDP2's fp32 ``.grad``.
    """
    sums = {}
    wire = {"gradient_accumulation_dtype": "fp32", "communication_data_type": "fp32"}
    bf16_masters = {"master_weights": {"dtype": "bf16", "rounding": "kahan"}}
    for master, extra in (("fp32", {}), ("bf16", bf16_masters)):
        config = {**CONFIG, **wire, **extra}
        plan = dtypeplan.resolve(config)
        model = plan.prepare_model(tied_lm(0))
        opt = plan.build(model.parameters())
        for micro in range(2):
            opt.backward(lm_loss(model, token_batch(micro, 4 * world).chunk(world)[rank]) / 2)
        held = opt.held_tensors().accumulator
        sums[master] = [t.detach().clone() for t in held]
        opt.step()
    return {
        "same": len(sums["fp32"]) == len(sums["bf16"])
        and all(torch.equal(a, b) for a, b in zip(sums["fp32"], sums["bf16"], strict=True)),
        "dtypes": sorted({str(t.dtype) for t in sums["bf16"]}),
        "wider_than_bf16": any(
            not torch.equal(t, t.to(torch.bfloat16).float()) for t in sums["bf16"]
        ),
    }


def empty_shards_with_16bit_accumulation(rank: int, world: int) -> dict[str, Any]:
    """A parameter smaller than the world size leaves a rank an empty local shard; with a
    16-bit accumulator that rank's squared norm goes through the CPU's 16-bit path, which must
    count an empty shard as zero (it once raised: ``stack expects a non-empty TensorList``).
    Every rank sees the same data, so the step's norm is the one-process norm."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    config = {
        "bf16": {"enabled": True},
        "gradient_accumulation_dtype": "bf16",
        "zero_optimization": {"stage": 3},
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    plan = dtypeplan.resolve(config)
    model = plan.prepare_model(model)
    opt = plan.build(model.parameters())
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).bfloat16()
    opt.backward(model(x).float().square().mean())
    opt.step()
    return {
        "local_numels": [p.to_local().numel() for p in model.parameters()],
        "grad_norm": opt.grad_norm,
    }


class _WithLogitScale(torch.nn.Module):
    """CLIP's shape of the problem: a 0-dim trainable temperature beside the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.6592))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x * self.logit_scale.exp()


def scalar_parameter_trains(rank: int, world: int) -> dict[str, Any]:
    """Issue 29 item 5: a 0-dim parameter at ZeRO-3, flat and hybrid (groups of 1), trains as
    torch trains it: fp32 AdamW on the full batch against this rank's half under ZeRO-3."""
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 4, generator=generator)
    optimizer = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}
    torch.manual_seed(0)
    reference = _WithLogitScale()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses = []
    for _ in range(3):
        loss = (reference(x) - y).square().mean()
        ref_losses.append(float(loss))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    out: dict[str, Any] = {"ref_losses": ref_losses}
    for layout, shard_group_size in (("flat", None), ("hybrid", 1)):
        zero: dict[str, Any] = {"stage": 3}
        if shard_group_size is not None:
            zero["shard_group_size"] = shard_group_size
        plan = dtypeplan.resolve({"zero_optimization": zero, "optimizer": optimizer})
        torch.manual_seed(0)
        model = plan.prepare_model(_WithLogitScale())
        opt = plan.build(model.parameters())
        mine_x, mine_y = x.chunk(world)[rank], y.chunk(world)[rank]
        losses = []
        for _ in range(3):
            loss = (model(mine_x) - mine_y).square().mean()
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            losses.append(float(total) / world)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
        full = opt.full_state()
        exported = dtypeplan.checkpoint.export_model_state(opt, model)
        out[layout] = {
            "exported_shapes": {name: tuple(t.shape) for name, t in exported.items()},
            "losses": losses,
            "masters": [full[f"param.{i}.master"] for i in range(len(list(model.parameters())))],
            "names": [(n, tuple(p.shape)) for n, p in model.named_parameters()],
            "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
            "outside_forward": type(model.logit_scale).__name__,
        }
    out["ref_masters"] = [p.detach().clone() for p in reference.parameters()]
    return out


CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "scalar_parameter_trains": scalar_parameter_trains,
    "empty_shards_with_16bit_accumulation": empty_shards_with_16bit_accumulation,
    "bf16_masters_sum_uncast": bf16_masters_sum_uncast,
    "fp32_unsharded_never_whole": fp32_unsharded_never_whole,
    "wrap_classes_choose_units": wrap_classes_choose_units,
    "replicas_equal_unit_by_unit": replicas_equal_unit_by_unit,
    "export_rank0_only": export_rank0_only,
}


def run_cases(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, fn in CASES.items():
        try:
            results[name] = fn(rank, world)
        except Exception as exc:  # noqa: BLE001 - reported per case
            results[name] = f"{exc!r}\n{traceback.format_exc(limit=-4)}"
        torch.distributed.barrier()
    return results


__all__ = ["CASES", "run_cases"]
