"""Which rank owns each parameter whole: balanced by size, the same on every rank.

Greedy, largest first (LPT scheduling): each parameter, in decreasing size (ties by their
order), goes to the rank that owns the fewest elements so far (ties: the lowest rank). Every
rank computes the same assignment from the shapes alone, so nothing is communicated. Its
balance is the largest rank's owned elements over the mean (1.0: perfect; LPT keeps it within
4/3 of the best possible assignment).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dtypeplan.resolver import owner_ranks

__all__ = ["Owners", "assign_owners"]


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
