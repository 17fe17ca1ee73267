"""int8 or fp8 moments (torchao's blockwise codes): dequantize, update in fp32, quantize back.

``LowPrecisionAdamUpdate.bucket`` (``state/low_precision.py``) goes over each bucket chunk in
pieces of whole blocks (``state/storage.py``): each moment's piece is dequantized into fp32
scratch, updated by torch's fused Adam/AdamW with the master (rounded back where 16-bit), and
quantized into its blocks again.
"""

from __future__ import annotations

from dtypeplan.optimizers.update_kernels._interface import FlatEngine
from dtypeplan.optimizers.update_kernels.torch_fused import BucketChunkKernel, torch_fused_adam

__all__ = ["QuantizedKernel"]


class QuantizedKernel(BucketChunkKernel):
    """Adam/AdamW with a moment stored as int8 or fp8 blocks."""

    name = "quantized"

    @classmethod
    def applies(cls, engine: FlatEngine) -> bool:
        update = engine._low_precision
        return update is not None and update.quantized and torch_fused_adam(engine)

    def describe(self) -> str:
        plan = self.engine.plan
        return (
            f"fp32 pieces around torch's fused Adam/AdamW, moments dequantized and quantized "
            f"again (exp_avg {plan.exp_avg_dtype}, exp_avg_sq {plan.exp_avg_sq_dtype})"
        )
