"""Which rank owns each parameter whole: balanced by size, the same on every rank.

Greedy, largest first (LPT scheduling): each parameter, in decreasing size (ties by their
order), goes to the rank that owns the fewest elements so far (ties: the lowest rank). Every
rank computes the same assignment from the shapes alone, so nothing is communicated. Its
balance is the largest rank's owned elements over the mean (1.0: perfect; LPT keeps it within
4/3 of the best possible assignment).

With shard groups (``zero_optimization.shard_group_size`` ``S`` below the world ``W``;
``comm/_groups.py``) the owners are assigned over the ``S`` ranks of a shard group, the same
local index in every group: each parameter has ``W / S`` owners, one per shard group, and they
are exactly one replica group (the ranks of that index). :class:`OwnerLayout` is this rank's
place in it: which parameters it owns, each owner's global rank in this shard group, and the
groups the optimizer's collectives run on (to and from the owner within the shard group; among
the owners across the replica group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from dtypeplan.comm import Communicator
from dtypeplan.comm._groups import check_shard_group_size, hybrid_groups
from dtypeplan.resolver import owner_ranks

__all__ = ["OwnerLayout", "Owners", "assign_owners", "owner_layout"]


@dataclass(frozen=True)
class Owners:
    """Each parameter's owning rank, in the order given."""

    ranks: tuple[int, ...]
    sizes: tuple[int, ...]
    world_size: int

    def owned_elements(self) -> list[int]:
        """Elements owned per rank."""
        owned = [0] * self.world_size
        for rank, size in zip(self.ranks, self.sizes, strict=True):
            owned[rank] += size
        return owned

    @property
    def balance(self) -> float:
        """The largest rank's owned elements over the mean (1.0 where nothing is owned)."""
        owned = self.owned_elements()
        mean = sum(owned) / self.world_size
        return max(owned) / mean if mean else 1.0


def assign_owners(sizes: Sequence[int], world_size: int) -> Owners:
    """The owner of each parameter of ``sizes`` (element counts) over ``world_size`` ranks:
    the rule of ``resolver/_owners.py``, which the cost model reads too."""
    return Owners(owner_ranks(sizes, world_size), tuple(sizes), world_size)


@dataclass(frozen=True)
class OwnerLayout:
    """This rank's place among the owners: ``owners`` over the ranks of its shard group (the
    whole group when flat), and the groups their collectives run on."""

    owners: Owners
    """Each parameter's owner, by its index within a shard group."""
    shard_rank: int
    """This rank's index within its shard group."""
    replica_rank: int
    """Which shard group this rank is in (0 when flat)."""
    shard_ranks: tuple[int, ...]
    """The global ranks of this rank's shard group, by index."""
    shard: dist.ProcessGroup | None
    """The shard group: each gradient is reduced to its owner, and the parameter broadcast
    from it, here (None on one process)."""
    replica: dist.ProcessGroup | None
    """The replica group, which holds the other groups' owners of the parameters this rank
    owns (None when flat: one owner per parameter)."""

    def owns(self, index: int) -> bool:
        return self.owners.ranks[index] == self.shard_rank

    def owner(self, index: int) -> int:
        """The global rank of parameter ``index``'s owner in this rank's shard group."""
        return self.shard_ranks[self.owners.ranks[index]]

    @property
    def replicated(self) -> bool:
        """Several shard groups: each owner's reduced gradient still to be summed across."""
        return self.replica is not None


def owner_layout(
    sizes: Sequence[int], comm: Communicator, shard_group_size: int | None
) -> OwnerLayout:
    """The owners of parameters of ``sizes`` over ``comm``'s group, in shard groups of
    ``shard_group_size`` ranks (None: flat, the whole group one shard group)."""
    if not comm.distributed:
        check_shard_group_size(shard_group_size, 1)
        return OwnerLayout(assign_owners(sizes, 1), 0, 0, (0,), None, None)
    groups = hybrid_groups(comm.group, shard_group_size) if shard_group_size is not None else None
    if groups is None or not groups.hybrid:
        # Flat: the group itself, no subgroup made (as fsdp2/sharding.hybrid_layout).
        ranks = tuple(dist.get_process_group_ranks(comm.group))
        owners = assign_owners(sizes, comm.world_size)
        return OwnerLayout(owners, comm.rank, 0, ranks, comm.group, None)
    return OwnerLayout(
        assign_owners(sizes, groups.shard_size),
        groups.shard_rank,
        groups.replica_rank,
        groups.shard_ranks,
        groups.shard,
        groups.replica,
    )
