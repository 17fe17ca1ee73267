"""The two levels of a hybrid layout: shard groups, and the replica groups across them.

A data-parallel group of ``W`` ranks with ``shard_group_size`` ``S`` splits into ``W / S``
shard groups of ``S`` consecutive ranks (``[0 .. S-1]``, ``[S .. 2S-1]``, ...: under torchrun
the ranks of one node, where the links are fast) and ``S`` replica groups, the ranks with the
same index in their shard group (``{0, S, 2S, ...}``, ``{1, S+1, ...}``, ...), which cross the
slow links. States are sharded within a shard group and replicated across the replica group.

The subgroups are made with ``new_group(..., use_local_synchronization=True)``: only their
members take part, and each is named by its ranks. The data-parallel group need not be the
whole world: under pipeline parallelism each stage's data-parallel group builds its own
optimizer, and the other stages' ranks never enter this function (a plain ``new_group`` must
be entered by every rank of the world, in the same order, and would hang or pair the wrong
groups there). :func:`hybrid_groups` makes them once per (parent group, S) and caches the
result, so optimizers built one after another share the subgroups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from dtypeplan.errors import PrecisionConfigError

__all__ = ["HybridGroups", "check_shard_group_size", "hybrid_groups"]


@dataclass(frozen=True)
class HybridGroups:
    """This rank's place in a hybrid layout (``shard`` and ``replica`` are None on one process)."""

    shard_size: int
    """Ranks per shard group (``S``)."""
    replicas: int
    """Shard groups, each holding a full copy of the states (``W / S``)."""
    shard_rank: int
    """This rank's index within its shard group."""
    replica_rank: int
    """Which shard group this rank is in."""
    shard_ranks: tuple[int, ...]
    """The parent group's ranks (global) in this rank's shard group."""
    replica_ranks: tuple[int, ...]
    """The parent group's ranks (global) in this rank's replica group."""
    shard: dist.ProcessGroup | None
    replica: dist.ProcessGroup | None

    @property
    def hybrid(self) -> bool:
        """More than one shard group (else this is the flat layout)."""
        return self.replicas > 1


def check_shard_group_size(shard_group_size: int | None, world_size: int) -> int:
    """``S`` for a world of ``world_size`` ranks (``None``: the whole group); a
    PrecisionConfigError naming both numbers when ``S`` does not divide it."""
    if shard_group_size is None:
        return world_size
    if isinstance(shard_group_size, bool) or not isinstance(shard_group_size, int):
        raise PrecisionConfigError(
            f"zero_optimization.shard_group_size must be a positive integer, got "
            f"{shard_group_size!r}"
        )
    if shard_group_size < 1 or world_size % shard_group_size:
        raise PrecisionConfigError(
            f"zero_optimization.shard_group_size {shard_group_size} does not divide the "
            f"data-parallel world size {world_size}: each shard group must hold the same number "
            f"of ranks; use a divisor of {world_size} (under torchrun, usually the ranks per "
            "node, LOCAL_WORLD_SIZE)"
        )
    return shard_group_size


_CACHE: dict[tuple[int, int], tuple[dist.ProcessGroup, HybridGroups]] = {}
"""Keyed by ``id(parent)``; the parent is kept in the value, so its id is not reused."""


def hybrid_groups(group: dist.ProcessGroup | None, shard_group_size: int | None) -> HybridGroups:
    """The shard and replica groups of this rank in ``group`` (the default group if None)."""
    if not (dist.is_available() and dist.is_initialized()):
        check_shard_group_size(shard_group_size, 1)
        return HybridGroups(1, 1, 0, 0, (0,), (0,), None, None)
    parent = group if group is not None else dist.group.WORLD
    assert parent is not None
    world = dist.get_world_size(parent)
    size = check_shard_group_size(shard_group_size, world)
    key = (id(parent), size)
    if key in _CACHE and _CACHE[key][0] is parent:
        return _CACHE[key][1]
    ranks = dist.get_process_group_ranks(parent)
    rank = dist.get_rank(parent)
    replicas = world // size
    shard_lists = [tuple(ranks[g * size : (g + 1) * size]) for g in range(replicas)]
    replica_lists = [tuple(ranks[i::size]) for i in range(size)]
    # Only this rank's two subgroups: the members of each make it together (local sync).
    shard_members, replica_members = shard_lists[rank // size], replica_lists[rank % size]
    mine_shard = parent if replicas == 1 else _local_group(shard_members)
    mine_replica = parent if size == 1 else _local_group(replica_members)
    result = HybridGroups(
        shard_size=size,
        replicas=replicas,
        shard_rank=rank % size,
        replica_rank=rank // size,
        shard_ranks=shard_members,
        replica_ranks=replica_members,
        shard=mine_shard,
        replica=mine_replica,
    )
    _CACHE[key] = (parent, result)
    return result


def _local_group(members: tuple[int, ...]) -> dist.ProcessGroup:
    group = dist.new_group(list(members), use_local_synchronization=True)
    assert group is not None, "this rank is a member"
    return group
