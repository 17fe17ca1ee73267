"""The one-pass Triton update on CUDA for the cells the fp32 Triton kernel does not serve.

bf16 masters rounded to nearest, stochastically or with Kahan compensation, with fp32 or bf16
moments, and fp32 masters with bf16 moments: one launch per param group over all of its
bucket chunks (``triton_one_pass.adam_one_pass_triton_multi_``), which gives the bits
of the host's one-pass update (``one_pass.adam_one_pass``, the same hashed
stochastic-rounding noise) instead of the fp32 pieces around torch's fused kernel that
``low_precision.py`` runs on CUDA.
bf16 masters rounded to nearest with bf16 moments and a bf16 accumulator stay with torch's
fused kernel (``torch_fused.py``, before this one in the registry). Quantized moments are
not served. ``DTYPEPLAN_FUSED_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from dtypeplan._dtypes import DTYPE_NAMES
from dtypeplan.optimizers.kernels import one_pass as update_kernel
from dtypeplan.optimizers.kernels.torch_adam import decoupled_weight_decay
from dtypeplan.optimizers.state.keys import KAHAN_COMPENSATION, MOMENTS
from dtypeplan.optimizers.update.interface import (
    FlatEngine,
    Gather,
    GradsByGroup,
    HostStepKernel,
    finish,
)
from dtypeplan.optimizers.update.torch_fused import torch_fused_adam

__all__ = ["TritonLowPrecisionKernel"]

_MOMENT_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without waiting: a copy from pageable memory would block the
    host until the device is done; from pinned memory it is queued on the stream."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class TritonLowPrecisionKernel(HostStepKernel):
    """Adam/AdamW (torch's fused path's settings) with bf16 masters or bf16 moments, not
    quantized ones, on a CUDA device with Triton."""

    name = "triton-low-precision"

    @classmethod
    def applies(cls, engine: FlatEngine) -> bool:
        from dtypeplan.optimizers.kernels import triton_adamw as fp32_kernel
        from dtypeplan.optimizers.kernels import triton_one_pass as kernel

        update = engine._low_precision
        plan = engine.plan
        if (
            os.environ.get("DTYPEPLAN_FUSED_KERNEL", "1") == "0"
            or update is None
            or update.quantized
            or engine.offload is not None  # the masters live on the host
            or not torch_fused_adam(engine)
            or plan.exp_avg_dtype not in _MOMENT_NAMES
            or plan.exp_avg_sq_dtype not in _MOMENT_NAMES
        ):
            return False
        master = plan.master_dtype
        return kernel.supports(
            master,
            _MOMENT_NAMES[plan.exp_avg_dtype],
            _MOMENT_NAMES[plan.exp_avg_sq_dtype],
            plan.grad_accum_dtype,
            # A bf16 master is the parameters' memory; an fp32 one writes them.
            None if master != torch.float32 else plan.param_dtype,
        ) and fp32_kernel.fused_kernel_available(engine.device)

    def describe(self) -> str:
        plan = self.engine.plan
        masters = (
            "fp32 masters"
            if plan.master_dtype == torch.float32
            else f"{DTYPE_NAMES[plan.master_dtype]} masters rounded {plan.master_rounding}"
        )
        return (
            f"one-pass Triton Adam/AdamW, one launch per param group ({masters}, exp_avg "
            f"{plan.exp_avg_dtype}, exp_avg_sq {plan.exp_avg_sq_dtype})"
        )

    def update(
        self, grads: GradsByGroup, factor: tuple[torch.Tensor, torch.Tensor], gather: Gather | None
    ) -> None:
        """Every master chunk of a param group in one launch, from its gradient over
        ``factor[1]``; the group's all-gathers run while the next groups' launches do."""
        from dtypeplan.optimizers.kernels import triton_one_pass as kernel

        engine = self.engine
        update = engine._low_precision
        assert update is not None
        step = self._host_step() + 1
        gathers: list[Callable[[], None]] = []
        for state, group, per_bucket in zip(
            engine.groups, engine.inner.param_groups, grads, strict=True
        ):
            if not state.masters:
                continue
            slots = [update.slot(master) for master in state.masters]
            torch._foreach_add_([slot["step"] for slot in slots], 1.0)
            decoupled = decoupled_weight_decay(update.torch_class, group)
            hyper = _upload(
                update_kernel.hyperparameters(group, step, decoupled, torch.device("cpu")),
                engine.device,
            )
            flat = state.flat
            chunks = [flat.chunk_view(flat.buffer, b, engine.shard_rank) for b in flat.buckets]
            kernel.adam_one_pass_triton_multi_(
                [master.view(-1) for master in state.masters],
                [grad.reshape(-1) for grad in per_bucket],
                [slot[MOMENTS[0]].view(-1) for slot in slots],
                [slot[MOMENTS[1]].view(-1) for slot in slots],
                [
                    slot[KAHAN_COMPENSATION].view(-1) if KAHAN_COMPENSATION in slot else None
                    for slot in slots
                ],
                [
                    None if chunk.data_ptr() == master.data_ptr() else chunk.view(-1)
                    for chunk, master in zip(chunks, state.masters, strict=True)
                ],
                hyper,
                factor[1],
                [
                    kernel.noise_key_base(update.seed, update._numbers.get(id(master), 0))
                    for master in state.masters
                ],
                step,
                decoupled=decoupled,
                weight_decay=float(group["weight_decay"]) != 0.0,
                rounding=update.rounding,
            )
            if gather is not None:
                gathers += [gather(state, bucket) for bucket in flat.buckets]
        self._step = step
        finish(gathers)
