"""ZeRO-3 on FSDP2, registered as ``fsdp2``.

Split as the flat engine is::

    optimizer.py          FSDP2Optimizer: construction, backward, step
    checkpoint_state.py   its state_dict, shard pieces, full state
    sharding.py           mesh, units, policies, named collectives
    units.py              which modules become FSDP2 units
"""

from dtypeplan.optimizers.fsdp2.optimizer import FSDP2Optimizer
from dtypeplan.optimizers.fsdp2.sharding import gatherable

__all__ = [
    "FSDP2Optimizer",
    "gatherable",
]
