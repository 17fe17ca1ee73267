"""ZeRO-3 on FSDP2, registered as ``fsdp2``.

Split as the flat engine is::

    optimizer.py          FSDP2Optimizer: construction, backward, step
    checkpoint_state.py   its state_dict, shard pieces, full state
    host_update.py        offload_optimizer cpu alone: host masters, the update on the host
    caches.py             gathered units, hpZ partitions, fp8 scales: they follow the shards
    sharding.py           mesh, units, policies, named collectives, former scalars
    units.py              which modules become FSDP2 units
"""

from dtypeplan.optimizers.fsdp2.optimizer import FSDP2Optimizer
from dtypeplan.optimizers.fsdp2.sharding import SCALAR_NAMES, gatherable

__all__ = [
    "SCALAR_NAMES",
    "FSDP2Optimizer",
    "gatherable",
]
