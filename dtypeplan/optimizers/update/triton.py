"""The one-pass Triton AdamW on CUDA: one launch per param group, fp32 masters and states.

Reads each accumulator chunk as it is (no fp32 copy), updates master and moments and writes
the 16-bit parameters in a single pass (``kernels/triton_adamw.py``).
``DTYPEPLAN_FUSED_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from dtypeplan.optimizers.kernels.torch_adam import decoupled_weight_decay, is_adam
from dtypeplan.optimizers.update.interface import (
    FlatEngine,
    Gather,
    GradsByGroup,
    HostStepKernel,
    finish,
)

__all__ = ["TritonKernel"]


class TritonKernel(HostStepKernel):
    """Adam/AdamW without amsgrad or maximize, fp32 masters and states, on a CUDA device
    with Triton."""

    name = "triton"

    @classmethod
    def applies(cls, engine: FlatEngine) -> bool:
        from dtypeplan.optimizers.kernels import triton_adamw as kernel

        # Per-group settings count too: a param group may turn amsgrad on for itself.
        unsupported = any(
            g.get("amsgrad", False) or g.get("maximize", False) for g in engine.param_groups
        )
        return (
            os.environ.get("DTYPEPLAN_FUSED_KERNEL", "1") != "0"
            and engine._low_precision is None  # the kernel keeps fp32 masters
            and engine.offload is None  # the kernel runs on the device
            and is_adam(engine.plan.optimizer.torch_class)
            and not unsupported
            and kernel.fused_kernel_available(engine.device)
        )

    def describe(self) -> str:
        return "one-pass Triton AdamW, one launch per param group"

    def update(
        self, grads: GradsByGroup, factor: tuple[torch.Tensor, torch.Tensor], gather: Gather | None
    ) -> None:
        """Read each accumulator chunk as it is, update master and moments, write the params.

        One kernel launch per param group covers all of its bucket chunks. The moments live
        in ``inner.state`` under torch's names, so ``state_dict``, ``full_state`` and
        checkpoints do not know which path ran. The factor is read from device memory, and
        the bias corrections come from a host copy of the step counter (read once after a
        load), so nothing waits for the device.
        """
        from dtypeplan.optimizers.kernels.triton_adamw import fused_mixed_adamw_multi_

        engine = self.engine
        step = self._host_step() + 1
        gathers: list[Callable[[], None]] = []
        for state, group, per_bucket in zip(
            engine.groups, engine.inner.param_groups, grads, strict=True
        ):
            if not state.masters:
                continue
            slots = [engine._adam_update.slot(master) for master in state.masters]
            torch._foreach_add_([slot["step"] for slot in slots], 1.0)
            flat = state.flat
            chunks = [flat.chunk_view(flat.buffer, b, engine.shard_rank) for b in flat.buckets]
            aliased = chunks[0].data_ptr() == state.masters[0].data_ptr()
            beta1, beta2 = group["betas"]
            fused_mixed_adamw_multi_(
                state.masters,
                [slot["exp_avg"] for slot in slots],
                [slot["exp_avg_sq"] for slot in slots],
                per_bucket,
                None if aliased else chunks,
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                step=step,
                grad_factor=factor[0],
                adam_w_mode=decoupled_weight_decay(engine.plan.optimizer.torch_class, group),
            )
            if gather is not None:
                # The group's all-gathers run while the next groups' kernels do.
                gathers += [gather(state, bucket) for bucket in flat.buckets]
        self._step = step
        finish(gathers)
