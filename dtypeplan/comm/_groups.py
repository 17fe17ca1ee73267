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

Where the default group is bound to a device (``init_process_group(device_id=...)``), NCCL
makes every new group by splitting the default group's communicator, a collective that each
rank of the world must enter, members or not, in the same order (``ncclCommSplit``; torch
calls it for non-members of a plain ``new_group``, and skips them under local
synchronization). Stages that make different subgroups (another ``S``, another data-parallel
size) would then split different numbers of times and hang. There, every rank of the world
takes part in every subgroup: the ranks exchange their requests (parent ranks, ``S``) through
the default group's store, and each makes all requested layouts' subgroups, in the same
order, with a plain ``new_group``. So every rank of the world must call :func:`hybrid_groups`
at the same point (a rank that does not is named in a PrecisionConfigError, not a hang).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from dtypeplan.errors import PrecisionConfigError

__all__ = [
    "HybridGroups",
    "check_shard_group_size",
    "default_group_device_bound",
    "hybrid_groups",
]


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
    ranks = tuple(dist.get_process_group_ranks(parent))
    rank = dist.get_rank(parent)
    replicas = world // size
    shard_members = _shard_lists(ranks, size)[rank // size]
    replica_members = _replica_lists(ranks, size)[rank % size]
    if default_group_device_bound():
        made = _every_rank_makes_every_layout(ranks, size)
    else:
        # Only this rank's two subgroups: the members of each make it together (local sync).
        made = {
            members: _local_group(members)
            for members, needed in ((shard_members, replicas > 1), (replica_members, size > 1))
            if needed
        }
    mine_shard = parent if replicas == 1 else made[shard_members]
    mine_replica = parent if size == 1 else made[replica_members]
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


def default_group_device_bound() -> bool:
    """Whether the default group is bound to a device, so that NCCL splits its communicator to
    make each new group (which every rank of the world must enter)."""
    world = dist.group.WORLD
    return getattr(world, "bound_device_id", None) is not None


def _shard_lists(ranks: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    return [ranks[g * size : (g + 1) * size] for g in range(len(ranks) // size)]


def _replica_lists(ranks: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    return [ranks[i::size] for i in range(size)]


EXCHANGE_TIMEOUT = timedelta(seconds=300)
"""How long a rank waits for every rank of the world to make its request (device-bound case)."""

_ROUNDS = itertools.count()
"""Exchanges made by this process: every rank counts the same, as every rank takes part."""


def _every_rank_makes_every_layout(
    ranks: tuple[int, ...], size: int
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """Every rank of the world makes the subgroups that any rank asks for now, in one order.

    Each rank posts its request (parent ranks, ``S``) in the default group's store and reads
    every other rank's: through the store, not a collective, so that a rank that never comes (a
    stage that builds no hybrid layout) is a PrecisionConfigError naming it after
    :data:`EXCHANGE_TIMEOUT` rather than a hang. Each distinct request, in sorted order, makes
    its shard groups then its replica groups (those of one member are the parent itself and are
    not made), every rank calling a plain ``new_group`` for each. Returns the groups this rank
    is a member of, by their members.
    """
    store = dist.distributed_c10d._get_default_store()  # no public accessor
    me, world = dist.get_rank(), dist.get_world_size()
    prefix = f"dtypeplan/hybrid_groups/{next(_ROUNDS)}/"
    store.set(f"{prefix}{me}", json.dumps([list(ranks), size]))
    keys = [f"{prefix}{rank}" for rank in range(world)]
    try:
        store.wait(keys, EXCHANGE_TIMEOUT)
    except (RuntimeError, dist.DistStoreError) as exc:
        missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
        raise PrecisionConfigError(
            f"shard_group_size {size} under a default process group bound to a device: every "
            "rank of the world makes every hybrid subgroup (NCCL splits the default group's "
            "communicator, which all ranks must enter), and ranks "
            f"{', '.join(map(str, missing))} did not ask for theirs within "
            f"{EXCHANGE_TIMEOUT.total_seconds():g} s. Build the optimizer (and prepare_model) "
            "on every rank at the same point, with shard_group_size set on every pipeline "
            "stage"
        ) from exc
    requests = {_request(store.get(key)) for key in keys}
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for parent_list, parent_size in sorted(requests):
        lists = []
        if len(parent_list) > parent_size:
            lists += _shard_lists(parent_list, parent_size)
        if parent_size > 1:
            lists += _replica_lists(parent_list, parent_size)
        for members in lists:
            group = dist.new_group(list(members))
            if me in members:
                assert group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER
                made.setdefault(members, group)
    return made


def _request(posted: bytes) -> tuple[tuple[int, ...], int]:
    ranks, size = json.loads(posted)
    return tuple(int(r) for r in ranks), int(size)


def _local_group(members: tuple[int, ...]) -> dist.ProcessGroup:
    group = dist.new_group(list(members), use_local_synchronization=True)
    assert group is not None, "this rank is a member"
    return group
