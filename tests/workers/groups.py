"""Rank side of tests/test_groups.py: shard and replica groups inside several data-parallel
groups at once (pipeline stages), each stage building its own."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dtypeplan.comm._groups import hybrid_groups


def stage_groups(rank: int, world_size: int, stages: int, shard_group_size: int) -> dict[str, Any]:
    """Every rank makes the stages' data-parallel groups (as a pipeline's setup does); then
    each stage's ranks alone make their hybrid subgroups, and sum their global ranks in each."""
    per_stage = world_size // stages
    parents = [
        dist.new_group(list(range(s * per_stage, (s + 1) * per_stage))) for s in range(stages)
    ]
    mine = parents[rank // per_stage]
    groups = hybrid_groups(mine, shard_group_size)
    sums = {}
    for name, group in (("shard", groups.shard), ("replica", groups.replica)):
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=group)
        sums[name] = value.item()
    return {
        "shard_ranks": list(groups.shard_ranks),
        "replica_ranks": list(groups.replica_ranks),
        **sums,
        "cached": hybrid_groups(mine, shard_group_size) is groups,
    }
