"""The shard and replica groups of a hybrid layout (``dtypeplan/comm/_groups.py``)."""

from __future__ import annotations

import pytest

from dtypeplan.comm._groups import check_shard_group_size
from dtypeplan.errors import PrecisionConfigError
from dtypeplan.launch import spawn
from tests.workers.groups import stage_groups


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
