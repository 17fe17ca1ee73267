"""16-bit master weights or bf16 moments: the update in fp32, the results rounded back.

``LowPrecisionAdamUpdate.bucket`` (``state/low_precision.py``) runs each bucket chunk: on the
host, a 16-bit master with fp32 or bf16 moments takes the one-pass update
(``kernels/one_pass.py``: compiled, or eager with the same numbers); otherwise fp32 pieces around
torch's fused Adam/AdamW, the master rounded as the plan says (nearest, stochastic, Kahan).
"""

from __future__ import annotations

import torch

from dtypeplan import _update_path as update_path
from dtypeplan.optimizers.update_kernels._interface import FlatEngine
from dtypeplan.optimizers.update_kernels.torch_fused import BucketChunkKernel, torch_fused_adam

__all__ = ["LowPrecisionKernel"]


class LowPrecisionKernel(BucketChunkKernel):
    """Adam/AdamW with 16-bit masters or bf16 moments (not quantized ones)."""

    name = "low-precision"

    @classmethod
    def applies(cls, engine: FlatEngine) -> bool:
        update = engine._low_precision
        return update is not None and not update.quantized and torch_fused_adam(engine)

    def describe(self) -> str:
        plan = self.engine.plan
        if plan.master_dtype != torch.float32 and self.engine.device.type == "cpu":
            return f"one pass over master, gradient and moments ({update_path.path()})"
        return "fp32 pieces around torch's fused Adam/AdamW, rounded back"
