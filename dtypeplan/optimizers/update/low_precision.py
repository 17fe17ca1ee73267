"""Adam/AdamW on low-precision state, through ``LowPrecisionAdamUpdate.bucket``: the update in
fp32, the results rounded or quantized back. Two kernels share the bucket loop of
:class:`BucketChunkKernel` and split the plans between them.

**16-bit master weights or bf16 moments** (:class:`LowPrecisionKernel`):
``LowPrecisionAdamUpdate.bucket`` (``update/pieces.py``) runs each bucket chunk: on the
host, a master with fp32 or bf16 moments takes the one-pass update (``kernels/one_pass.py``:
compiled, or eager with the same numbers); on other devices, fp32 pieces around torch's fused
Adam/AdamW, the master rounded as the plan says (nearest, stochastic, Kahan).

**int8 or fp8 moments** (torchao's blockwise codes; :class:`QuantizedKernel`): dequantize,
update in fp32, quantize back.
``LowPrecisionAdamUpdate.bucket`` (``update/pieces.py``) goes over each bucket chunk in
pieces of whole blocks (``state/storage.py``): each moment's piece is dequantized into fp32
scratch, updated by torch's fused Adam/AdamW with the master (rounded back where 16-bit), and
quantized into its blocks again.

**Any other elementwise class** (SGD, Adagrad, RMSprop, ..., Adam with amsgrad;
:class:`TorchClassKernel`): ``TorchClassUpdate.bucket`` (``update/pieces.py``) decodes the
master and every per-element state of a bucket chunk into fp32, runs the class's own torch
step on them, and rounds or quantizes them back.
"""

from __future__ import annotations

import torch

from dtypeplan import _update_path as update_path
from dtypeplan.optimizers.update.interface import FlatEngine
from dtypeplan.optimizers.update.pieces import TorchClassUpdate
from dtypeplan.optimizers.update.torch_fused import BucketChunkKernel, torch_fused_adam

__all__ = ["LowPrecisionKernel", "QuantizedKernel", "TorchClassKernel"]


class LowPrecisionKernel(BucketChunkKernel):
    """Adam/AdamW with 16-bit masters or bf16 moments (not quantized ones)."""

    name = "low-precision"

    @classmethod
    def applies(cls, engine: FlatEngine) -> bool:
        update = engine._low_precision
        return update is not None and not update.quantized and torch_fused_adam(engine)

    def describe(self) -> str:
        if self.engine.device.type == "cpu":
            return f"one pass over master, gradient and moments ({update_path.path()})"
        return "fp32 pieces around torch's fused Adam/AdamW, rounded back"


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


class TorchClassKernel(BucketChunkKernel):
    """An elementwise class other than plain fused Adam/AdamW with 16-bit masters or
    low-precision states: torch's own step on fp32 copies of each bucket chunk."""

    name = "torch-class-low-precision"

    @classmethod
    def applies(cls, engine: FlatEngine) -> bool:
        return isinstance(engine._low_precision, TorchClassUpdate)

    def describe(self) -> str:
        plan = self.engine.plan
        masters = plan.master_rounding if plan.master_dtype != torch.float32 else "fp32"
        return (
            f"{plan.optimizer.torch_class.__name__}'s torch step on fp32 copies per bucket "
            f"chunk (masters {masters}, "
            f"signed states {plan.exp_avg_dtype}, non-negative states {plan.exp_avg_sq_dtype})"
        )
