"""Implementations a user registers for a rules file of their own (tests/test_prove.py): each is
the shipped ZeRO-1/2 optimizer under a new name, with the boxes it declares it serves.
``prove(..., imports=["tests.workers.prove_implementations"])`` (``dtypeplan lint --prove
--import ...``) imports this module here and in every rank."""

from __future__ import annotations

import dtypeplan
from dtypeplan.optimizers import ShardedOptimizer
from dtypeplan.optimizers.contract.served import SHARDED

AUTOCAST_STATES = {
    "stage": 1, "params": "fp32", "autocast": "bf16", "states": "bf16",
    "shard_groups": "*", "state_kind": "*",
}  # fmt: skip
"""bf16 optimizer states under bf16 autocast at ZeRO-1: refused by the shipped table for want of
a parity test, computed by the ZeRO-1/2 optimizer as any other states cell (the update of fp32
parameters, the states rounded to bf16)."""

SHAPED = {
    "stage": 1, "optimizer": "shaped", "param_access": "owner",
    "master": ["fp32", "bf16", "bf16_sr", "bf16_kahan"],
    "states": ["fp32", "bf16", "fp32/bf16", "bf16/fp32"], "shard_groups": ["flat", "hybrid"],
}  # fmt: skip
"""A shaped optimizer (Muon, Adafactor) at ZeRO-1, the shipped ``whole-tensor`` rule's box at
that stage, which the ZeRO-1/2 optimizer hands flat buffers: Adafactor runs unfactored, Muon as
AdamW (issue 43)."""


@dtypeplan.register("sharded-autocast-states", serves=[*SHARDED, AUTOCAST_STATES])
class ShardedAutocastStates(ShardedOptimizer):
    """ZeRO-1/2, also serving :data:`AUTOCAST_STATES` (what it computes)."""


@dtypeplan.register("sharded-shaped", serves=[SHAPED])
class ShardedShaped(ShardedOptimizer):
    """ZeRO-1/2 declared for :data:`SHAPED`, which it does not compute: a claim too many."""
