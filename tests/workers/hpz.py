"""Rank side of tests/test_hpz.py: ZeRO-3 with ZeRO++ hpZ (FSDP2's reshard_after_forward=H)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from dtypeplan.optimizers.fsdp2.sharding import NamedAllGather
from tests._helpers import make_model, memory_mlp
from tests.workers import checkpoint as ckpt
from tests.workers.parity import run_cases
from tests.workers.zero3_caches import run_programs


def _without_hpz(config: dict[str, Any]) -> dict[str, Any]:
    zero = {k: v for k, v in config["zero_optimization"].items() if k != "zero_hpz_partition_size"}
    return {**config, "zero_optimization": zero}


def _train(config: dict[str, Any]) -> dict[str, Any]:
    plan = dtypeplan.resolve(config)
    assert plan.status == "OK" and plan.implementation == "fsdp2", plan.explain()
    model = plan.prepare_model(make_model(0))
    opt = plan.build(model.parameters())
    losses = ckpt.train(model, opt, range(3))
    sizes = set()
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = get_state()._fsdp_param_group if get_state is not None else None
        if group is not None and group.post_forward_mesh_info is not None:
            sizes.add(group.post_forward_mesh_info.shard_mesh_size)
    return {
        "losses": losses,
        "shards": [p.to_local().detach().clone() for p in model.parameters()],
        "post_forward_sizes": sorted(sizes),
    }


def same_bits(config: dict[str, Any]) -> dict[str, Any]:
    """The same training with hpZ and without: losses, shards and where units reshard to."""
    return {"hpz": _train(config), "plain": _train(_without_hpz(config))}


def measured_traffic(rank: int, config: dict[str, Any], width: int) -> dict[str, Any]:
    """Bytes this rank's all-gathers send in one step, by the size of their group, counted
    as CommStats counts a ring all-gather; and the plan's prediction."""
    plan = dtypeplan.resolve(config)
    model = plan.prepare_model(memory_mlp(width))
    opt = plan.build(model.parameters())
    generator = torch.Generator().manual_seed(rank)
    micro_batches = 2

    def one_step() -> None:
        for _ in range(micro_batches):
            x = torch.randn(4, width, generator=generator)
            opt.backward(model(x).float().square().mean())
        opt.step()
        opt.zero_grad()

    one_step()
    sent: dict[int, int] = {}
    original = NamedAllGather.__call__

    def counting(self: NamedAllGather, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Any, async_op: bool = False) -> Any:  # fmt: skip
        size = dist.get_world_size(group)
        nbytes = output_tensor.numel() * output_tensor.element_size()
        sent[size] = sent.get(size, 0) + nbytes * (size - 1) // size
        return original(self, output_tensor, input_tensor, group, async_op)

    NamedAllGather.__call__ = counting  # type: ignore[method-assign]
    try:
        one_step()
    finally:
        NamedAllGather.__call__ = original  # type: ignore[method-assign]
    num_params = sum(p.numel() for p in model.parameters())
    predicted = plan.traffic(num_params, dist.get_world_size(), micro_batches=micro_batches)
    return {"sent": sent, "predicted": dict(predicted.within)}


def hpz_group(
    rank: int,
    world_size: int,
    parity_cases: list[dict[str, Any]],
    compare_configs: list[dict[str, Any]],
    traffic_config: dict[str, Any],
    width: int,
    programs: list[tuple[dict[str, Any], list[tuple[Any, ...]]]],
) -> dict[str, Any]:
    return {
        "parity": run_cases(rank, world_size, parity_cases),
        "same_bits": [ckpt.capture(lambda c=c: same_bits(c)) for c in compare_configs],
        "traffic": ckpt.capture(lambda: measured_traffic(rank, traffic_config, width)),
        # Training-loop programs against torch (tests/workers/zero3_caches.py).
        "programs": run_programs(rank, world_size, programs),
    }
