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

SHAPED = {"stage": 1, "params": "fp32", "optimizer": "shaped"}
"""A shaped optimizer (Adafactor) at ZeRO-1, which the ZeRO-1/2 optimizer hands flat buffers:
it runs unfactored, off torch's Adafactor (issue 43)."""


@dtypeplan.register("sharded-autocast-states", serves=[*SHARDED, AUTOCAST_STATES])
class ShardedAutocastStates(ShardedOptimizer):
    """ZeRO-1/2, also serving :data:`AUTOCAST_STATES` (what it computes)."""


@dtypeplan.register("sharded-shaped", serves=[SHAPED])
class ShardedShaped(ShardedOptimizer):
    """ZeRO-1/2 declared for :data:`SHAPED`, which it does not compute: a claim too many."""
