"""Rank side of tests/test_traffic.py: the bytes one optimizer step really sends."""

from __future__ import annotations

import os
from typing import Any

import torch

import dtypeplan
from tests._helpers import memory_mlp


def traffic_case(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    # torchrun's node layout, as each rank of a multi-node launch sees it (restored after).
    saved = {name: os.environ.get(name) for name in case.get("env", {})}
    os.environ.update(case.get("env", {}))
    try:
        plan = dtypeplan.resolve(case["config"])
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    model = memory_mlp(case["width"]).to(plan.param_dtype)
    optimizer = plan.build(model.parameters())
    generator = torch.Generator().manual_seed(rank)

    def one_step() -> None:
        for _ in range(case["micro_batches"]):
            x = torch.randn(4, case["width"], generator=generator).to(plan.param_dtype)
            optimizer.backward(model(x).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()

    one_step()  # lazily built state is not part of a step's traffic
    levels = optimizer.levels
    across = levels.across.comm.stats if levels.across is not None else None
    for stats in {
        id(s): s for s in (optimizer.comm.stats, levels.shard.stats, across) if s
    }.values():
        stats.reset()
    one_step()
    return {
        "num_params": sum(p.numel() for p in model.parameters()),
        "padded": sum(group.flat.numel for group in optimizer.groups),
        "buckets": sum(len(group.flat.buckets) for group in optimizer.groups),
        "bucket_sizes": [b.numel for group in optimizer.groups for b in group.flat.buckets],
        "shard_group_size": plan.shard_group_size,
        "shard_ranks": torch.distributed.get_process_group_ranks(levels.shard.group),
        "bytes_sent": dict(levels.shard.stats.bytes_sent),
        "across_bytes_sent": dict(across.bytes_sent) if across is not None else {},
        # Hybrid: the whole group carries only the step's scalar summary.
        "world_bytes_sent": (
            dict(optimizer.comm.stats.bytes_sent) if optimizer.comm is not levels.shard else {}
        ),
    }


def traffic_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[Any]:
    return [traffic_case(rank, world_size, case) for case in cases]
