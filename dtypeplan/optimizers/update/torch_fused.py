"""torch's fused Adam/AdamW per bucket chunk: fp32 masters and states, and the 16-bit hand-off.

Both drive one update object's ``bucket`` over every bucket chunk in order
(``kernels/torch_adam.py`` for fp32 masters and states; ``update/pieces.py`` for the
16-bit hand-off, which gives bf16 master, gradient and moments rounded to nearest to torch's
fused kernel as they are) and start each bucket's all-gather as soon as its chunk is written,
while the next buckets update.
The low-precision and quantized kernels share this loop (:class:`BucketChunkKernel`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dtypeplan._dtypes import DTYPE_NAMES
from dtypeplan.optimizers.kernels.torch_adam import FlatAdamUpdate
from dtypeplan.optimizers.update.interface import (
    FlatEngine,
    Gather,
    GradsByGroup,
    UpdateKernel,
    finish,
)

__all__ = ["BucketChunkKernel", "Fused16BitKernel", "TorchFusedKernel", "torch_fused_adam"]


def torch_fused_adam(engine: FlatEngine) -> bool:
    """Adam/AdamW with every group on torch's fused path, plain (``FlatAdamUpdate.supports``)."""
    return FlatAdamUpdate.supports(engine.inner, engine.plan.optimizer.torch_class)


class BucketChunkKernel(UpdateKernel):
    """The engine's update object (``engine._adam_update``) over each bucket chunk, in order,
    on the gradients over ``grad_scale`` (the factor's inverse)."""

    def update(
        self, grads: GradsByGroup, factor: tuple[torch.Tensor, torch.Tensor], gather: Gather | None
    ) -> None:
        engine, grad_scale = self.engine, factor[1]
        gathers: list[Callable[[], None]] = []
        for state, group, per_bucket in zip(
            engine.groups, engine.inner.param_groups, grads, strict=True
        ):
            for bucket, master, grad in zip(
                state.flat.buckets, state.masters, per_bucket, strict=True
            ):
                chunk = state.flat.chunk_view(state.flat.buffer, bucket, engine.shard_rank)
                aliased = chunk.data_ptr() == master.data_ptr()
                engine._adam_update.bucket(
                    group, master, grad, None if aliased else chunk, grad_scale
                )
                if gather is not None:
                    gathers.append(gather(state, bucket))
        finish(gathers)


class TorchFusedKernel(BucketChunkKernel):
    """fp32 masters and fp32 states: torch's fused Adam/AdamW on each chunk, the factor
    folded into its ``grad_scale`` (no scaling pass); 16-bit accumulators are converted a
    piece at a time through a reused fp32 scratch."""

    name = "torch-fused"

    @classmethod
    def applies(cls, engine: FlatEngine) -> bool:
        return engine._low_precision is None and torch_fused_adam(engine)

    def describe(self) -> str:
        return "torch's fused Adam/AdamW per bucket chunk (fp32 masters and states)"


class Fused16BitKernel(BucketChunkKernel):
    """16-bit masters rounded to nearest with moments and accumulator of the same dtype:
    torch's fused kernel on those tensors computes in fp32 and rounds each back, the bits of
    the fp32 pieces, in one pass (``LowPrecisionAdamUpdate.bucket`` hands it off)."""

    name = "torch-fused-16bit"

    @classmethod
    def applies(cls, engine: FlatEngine) -> bool:
        plan = engine.plan
        dtype = plan.master_dtype
        return (
            engine._low_precision is not None
            and torch_fused_adam(engine)
            and dtype != torch.float32
            and plan.master_rounding == "nearest"
            and plan.grad_accum_dtype == dtype
            and plan.exp_avg_dtype == plan.exp_avg_sq_dtype == DTYPE_NAMES[dtype]
        )

    def describe(self) -> str:
        return (
            f"torch's fused Adam/AdamW on the {DTYPE_NAMES[self.engine.plan.master_dtype]} "
            "tensors per bucket chunk (masters rounded to nearest)"
        )
