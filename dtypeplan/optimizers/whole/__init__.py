"""ZeRO 0-3 for optimizers that need each parameter whole (Muon, Adafactor), registered as
``whole``: each parameter owned whole by one rank, balanced by size.

    owners.py      which rank owns each parameter (largest first to the least loaded rank;
                   with shard groups, one owner in each group) and the owners' groups
    optimizer.py   WholeTensorOptimizer: reduce to the owner, update, broadcast back
    sharded.py     ZeRO-3: the whole tensor from FSDP2's shards, and the shards from it
    full_state.py  the layout-free state for checkpoints: each state of its own shape, the
                   scalar states per parameter, the states the class keeps for a parameter
"""

from __future__ import annotations

from dtypeplan.optimizers.contract.registry import register
from dtypeplan.optimizers.whole.optimizer import WholeTensorOptimizer
from dtypeplan.optimizers.whole.owners import Owners, assign_owners

__all__ = ["SERVES", "Owners", "WholeTensorOptimizer", "assign_owners"]

_WHOLE = {
    "param_access": "owner",
    "optimizer": "shaped",
    "stage": "*",
    "sharded": "*",
    "accum": "fp32",
    "comm": "fp32",
    "reduction": "collective",
    "pipeline": False,
    "shard_groups": ["flat", "hybrid"],
    "states": ["fp32", "bf16", "fp32/bf16", "bf16/fp32"],
}
SERVES = [
    {**_WHOLE, "params": ["fp32", "bf16"], "master": "fp32"},
    {**_WHOLE, "params": "bf16", "master": ["bf16", "bf16_sr", "bf16_kahan"]},
]
"""What tests/test_whole_tensor.py proves against one-process torch: ZeRO 0-3 (1-3 also in
shard groups, the communication dtype across), fp32 or bf16 parameters with fp32 accumulation
and wire, fp32 masters or bf16 ones (each rounding), fp32 or
bf16 states."""

register("whole", serves=SERVES)(WholeTensorOptimizer)
