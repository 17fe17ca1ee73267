"""ZeRO 0-3 for optimizers that need each parameter whole (Muon, Adafactor), registered as
``whole``: each parameter owned whole by one rank, balanced by size.

    owners.py      which rank owns each parameter (largest first to the least loaded rank)
    optimizer.py   WholeTensorOptimizer: reduce to the owner, update, broadcast back
    sharded.py     ZeRO-3: the whole tensor from FSDP2's shards, and the shards from it
"""

from __future__ import annotations

from dtypeplan.optimizers.contract.registry import register
from dtypeplan.optimizers.whole.optimizer import WholeTensorOptimizer
from dtypeplan.optimizers.whole.owners import Owners, assign_owners

__all__ = ["Owners", "WholeTensorOptimizer", "assign_owners"]

register("whole")(WholeTensorOptimizer)
