"""ZeRO 0-2: the flat-buffer engine, registered as ``replicated`` and ``sharded`` (the names
``precision_rules.yaml`` uses).

    engine.py             FlatMixedPrecisionOptimizer: the step's phases
    checkpoint_state.py   masters and states saved, loaded, gathered
    own_histories.py      per-parameter step counts inside flat chunks
    model_sync.py         model changes after build picked up before the step
"""

from __future__ import annotations

from dtypeplan.optimizers.contract.registry import register
from dtypeplan.optimizers.contract.served import REPLICATED, SHARDED, SHARDED_ALONE
from dtypeplan.optimizers.flat.engine import FlatMixedPrecisionOptimizer

__all__ = ["FlatMixedPrecisionOptimizer", "ReplicatedOptimizer", "ShardedOptimizer"]


@register("replicated", serves=REPLICATED)
class ReplicatedOptimizer(FlatMixedPrecisionOptimizer):
    """ZeRO stage 0: master weights, optimizer states and the accumulator whole on every rank."""

    shard_state = False


@register("sharded", serves=SHARDED, serves_alone=SHARDED_ALONE)
class ShardedOptimizer(FlatMixedPrecisionOptimizer):
    """ZeRO stages 1 and 2: master weights and optimizer states sharded over the group.

    The accumulator is whole (stage 1 default: summed locally, reduce-scattered once per step)
    or sharded (stage 2, or stage 1 with ``sharded: true``: reduce-scattered per micro-batch).
    """

    shard_state = True
