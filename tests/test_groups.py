"""The shard and replica groups of a hybrid layout (``dtypeplan/comm/_groups.py``)."""

from __future__ import annotations

import pytest

from dtypeplan.comm._groups import check_shard_group_size
from dtypeplan.errors import PrecisionConfigError
from dtypeplan.launch import spawn
from tests.workers.groups import device_bound_stage_groups, stage_groups


@pytest.mark.slow  # 8 ranks on 2 cores: about 35 s
def test_each_pipeline_stage_makes_its_own_subgroups() -> None:
    """8 ranks as 2 pipeline stages of 4 data-parallel ranks, each 2 shard groups of 2: each
    stage's ranks make their subgroups without the other stage's ranks, and every collective
    sums exactly its members (made with a plain new_group, both stages' subgroups got the same
    counter-based names and the run hung)."""
    results = spawn(stage_groups, 8, 2, 2, timeout_s=300, group_timeout_s=60)
    for rank, result in enumerate(results):
        stage_first = rank // 4 * 4
        local = rank - stage_first
        shard = [stage_first + local // 2 * 2, stage_first + local // 2 * 2 + 1]
        replica = [stage_first + local % 2, stage_first + local % 2 + 2]
        assert result["shard_ranks"] == shard, (rank, result)
        assert result["replica_ranks"] == replica, (rank, result)
        assert result["shard"] == sum(shard), (rank, result)
        assert result["replica"] == sum(replica), (rank, result)
        assert result["cached"], rank


@pytest.mark.parametrize("size", [3, 0, -2, 8])
def test_a_size_that_does_not_divide_the_world_names_both(size: int) -> None:
    with pytest.raises(PrecisionConfigError, match=f"shard_group_size {size} does not divide"):
        check_shard_group_size(size, 4)


@pytest.mark.parametrize("size", [2.0, "2", True])
def test_a_size_that_is_not_an_integer_is_refused(size: object) -> None:
    with pytest.raises(PrecisionConfigError, match="positive integer"):
        check_shard_group_size(size, 4)  # type: ignore[arg-type]


@pytest.mark.slow
def test_device_bound_default_group_every_rank_makes_every_subgroup() -> None:
    """Issue 32: with NCCL under a device-bound default group each new group is a split of the
    world's communicator that every rank must enter; made with local synchronization, two
    pipeline stages asking for different layouts split different groups (a hang). Every rank
    now makes every requested subgroup, in the same order, and a stage that never asks is
    named in an error after the exchange timeout (bounded: the spawn times out too)."""
    results = spawn(device_bound_stage_groups, 4, timeout_s=120, group_timeout_s=30)
    singles = [([r], False) for r in range(4)]
    whole = [([0, 1], False), ([2, 3], False), ([0, 2], False), ([1, 3], False)]
    for rank, result in enumerate(results):
        stages, world = result["stages"], result["world"]
        assert stages["calls"] == singles, (rank, stages)  # the same on every rank
        if rank < 2:  # S 1: its own shard group, the stage its replica group
            assert (stages["shard_ranks"], stages["replica_ranks"]) == ([rank], [0, 1])
        else:  # S 2 over a stage of 2: the stage its shard group, replica groups of one
            assert (stages["shard_ranks"], stages["replica_ranks"]) == ([2, 3], [rank])
        assert stages["shard"] == sum(stages["shard_ranks"]), (rank, stages)
        assert stages["replica"] == sum(stages["replica_ranks"]), (rank, stages)
        assert world["calls"] == whole, (rank, world)
        assert world["shard"] == sum(world["shard_ranks"]) == [1, 5][rank // 2], (rank, world)
        assert world["replica"] == sum(world["replica_ranks"]) == [2, 4][rank % 2], (rank, world)
        if rank < 2:
            assert result["missing"].startswith("PrecisionConfigError"), result["missing"]
            assert "ranks 2, 3 did not ask" in result["missing"], result["missing"]
        else:
            assert "missing" not in result
