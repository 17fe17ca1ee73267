"""Which rank owns each parameter whole, for the cost model of the whole-tensor layout.

The rule is ``optimizers/whole/owners.assign_owners``' (the resolver imports nothing of the
optimizers, and tests/test_whole_cost.py checks that the two agree): greedy, largest first
(LPT), each parameter in decreasing size (ties by their order) to the rank that owns the
fewest elements so far (ties: the lowest rank).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["owner_ranks"]


def owner_ranks(sizes: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The owning rank of each parameter of ``sizes`` (element counts) over ``world_size``."""
    # A heap of (owned elements, rank) pops the least loaded rank, the lowest on a tie: the
    # same choice as a scan of every rank, in O(log W) (the planner asks for thousands).
    loads = [(0, rank) for rank in range(world_size)]
    ranks = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owned, rank = heapq.heappop(loads)
        ranks[index] = rank
        heapq.heappush(loads, (owned + sizes[index], rank))
    return tuple(ranks)
