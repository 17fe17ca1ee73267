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


def device_bound_stage_groups(rank: int, world_size: int) -> dict[str, Any]:
    """Issue 32: under a default group bound to a device (stood in for by patching the check:
    gloo cannot be bound, and a gloo group marked bound has no no-color split), every rank of
    the world makes every subgroup, in one order, whatever layout its own stage asked for.

    4 ranks as 2 pipeline stages of 2: stage 0 asks ``S`` 1 (shard groups of one rank), stage
    1 ``S`` 2 (its replica groups of one rank); then the whole world with ``S`` 2; then stage 0
    alone asks (stage 1 never does), which must fail on stage 0 naming ranks 2 and 3."""
    from datetime import timedelta
    from unittest import mock

    from dtypeplan.comm import _groups

    def stages() -> list[dist.ProcessGroup]:
        return [dist.new_group([0, 1]), dist.new_group([2, 3])]

    parents = stages()
    stage = rank // 2
    calls: list[tuple[list[int], bool]] = []
    real = dist.new_group

    def recording(ranks: list[int] | None = None, **kw: Any) -> Any:
        calls.append((sorted(ranks or []), bool(kw.get("use_local_synchronization"))))
        return real(ranks, **kw)

    out: dict[str, Any] = {}
    with (
        mock.patch.object(_groups, "default_group_device_bound", lambda: True),
        mock.patch.object(dist, "new_group", recording),
    ):
        for case, parent, size in (
            ("stages", parents[stage], 1 if stage == 0 else 2),
            ("world", None, 2),
        ):
            calls.clear()
            groups = hybrid_groups(parent, size)
            sums = {}
            for name, group in (("shard", groups.shard), ("replica", groups.replica)):
                value = torch.tensor([float(rank)])
                dist.all_reduce(value, group=group)
                sums[name] = value.item()
            out[case] = {
                "calls": list(calls),
                "shard_ranks": list(groups.shard_ranks),
                "replica_ranks": list(groups.replica_ranks),
                **sums,
            }
        fresh = stages()  # not cached: a new parent
        with mock.patch.object(_groups, "EXCHANGE_TIMEOUT", timedelta(seconds=3)):
            if stage == 0:
                try:
                    hybrid_groups(fresh[0], 1)
                    out["missing"] = "no error"
                except Exception as exc:  # noqa: BLE001 - the error is the result
                    out["missing"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return out
