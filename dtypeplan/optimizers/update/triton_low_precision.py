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
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dtypeplan._dtypes import DTYPE_NAMES
from dtypeplan.optimizers.kernels import one_pass as update_kernel
from dtypeplan.optimizers.kernels.torch_adam import FlatAdamUpdate, decoupled_weight_decay
from dtypeplan.optimizers.state.keys import KAHAN_COMPENSATION, MOMENTS
from dtypeplan.optimizers.update.interface import (
    FlatEngine,
    Gather,
    GradsByGroup,
    HostStepKernel,
    finish,
)
from dtypeplan.optimizers.update.torch_fused import torch_fused_adam

if TYPE_CHECKING:
    from dtypeplan.optimizers.update.pieces import LowPrecisionAdamUpdate

__all__ = ["HostSteps", "TritonLowPrecisionKernel", "launch_one_pass", "serves_shards"]

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
            flat = state.flat
            chunks = [flat.chunk_view(flat.buffer, b, engine.shard_rank) for b in flat.buckets]
            launch_one_pass(
                update,
                group,
                state.masters,
                per_bucket,
                [
                    None if chunk.data_ptr() == master.data_ptr() else chunk
                    for chunk, master in zip(chunks, state.masters, strict=True)
                ],
                factor[1],
                step,
                engine.device,
            )
            if gather is not None:
                gathers += [gather(state, bucket) for bucket in flat.buckets]
        self._step = step
        finish(gathers)


def launch_one_pass(
    update: LowPrecisionAdamUpdate,
    group: dict[str, Any],
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    params: list[torch.Tensor | None],
    grad_scale: torch.Tensor,
    step: int,
    device: torch.device,
) -> None:
    """One launch of the one-pass Triton update over ``masters`` (one param group's, all at
    step count ``step - 1``, which this increments): their states in ``update``'s slots, the
    noise of each master its own (``update``'s numbering, as on the host), ``params`` written
    where not None."""
    from dtypeplan.optimizers.kernels import triton_one_pass as kernel

    slots = [update.slot(master) for master in masters]
    torch._foreach_add_([slot["step"] for slot in slots], 1.0)
    decoupled = decoupled_weight_decay(update.torch_class, group)
    hyper = _upload(
        update_kernel.hyperparameters(group, step, decoupled, torch.device("cpu")), device
    )
    kernel.adam_one_pass_triton_multi_(
        [master.view(-1) for master in masters],
        [grad.reshape(-1) for grad in grads],
        [slot[MOMENTS[0]].view(-1) for slot in slots],
        [slot[MOMENTS[1]].view(-1) for slot in slots],
        [
            slot[KAHAN_COMPENSATION].view(-1) if KAHAN_COMPENSATION in slot else None
            for slot in slots
        ],
        [None if param is None else param.view(-1) for param in params],
        hyper,
        grad_scale,
        [kernel.noise_key_base(update.seed, update._numbers.get(id(m), 0)) for m in masters],
        step,
        decoupled=decoupled,
        weight_decay=float(group["weight_decay"]) != 0.0,
        rounding=update.rounding,
    )


def serves_shards(
    update: LowPrecisionAdamUpdate | None,
    inner: torch.optim.Optimizer,
    torch_class: type[torch.optim.Optimizer],
    device: torch.device,
) -> bool:
    """Whether the one-pass Triton update may run ZeRO-3's local shards on ``device`` (each
    launch still checks its tensors' dtypes, :func:`shards_dtypes_served`): bf16 or fp32
    moments, torch's fused path's settings, Triton there, ``DTYPEPLAN_FUSED_KERNEL`` not 0."""
    from dtypeplan.optimizers.kernels import triton_adamw as fp32_kernel

    return (
        os.environ.get("DTYPEPLAN_FUSED_KERNEL", "1") != "0"
        and update is not None
        and not update.quantized
        and FlatAdamUpdate.supports(inner, torch_class)
        and fp32_kernel.fused_kernel_available(device)
    )


def shards_dtypes_served(
    update: LowPrecisionAdamUpdate, masters: list[torch.Tensor], grads: list[torch.Tensor]
) -> bool:
    """Whether one launch serves these local shards (the master is the parameter there): one
    dtype each for the masters, the gradients and each moment, and the kernel takes them."""
    from dtypeplan.optimizers.kernels import triton_one_pass as kernel

    slots = [update.slot(master) for master in masters]
    kinds = {
        (master.dtype, grad.dtype, slot[MOMENTS[0]].dtype, slot[MOMENTS[1]].dtype)
        for master, grad, slot in zip(masters, grads, slots, strict=True)
    }
    if len(kinds) != 1:
        return False
    master, grad, exp_avg, exp_avg_sq = kinds.pop()
    return kernel.supports(master, exp_avg, exp_avg_sq, grad, None)


class HostSteps:
    """The step counts of state slots as host ints, without reading the device each step.

    A count is read from its tensor once (one device sync) and then followed on the host:
    :meth:`advance` records the increment a launch makes. A tensor changed by anything else
    (a load copies into it, a user sets it) has a newer version counter, and is read again."""

    def __init__(self) -> None:
        self._known: weakref.WeakKeyDictionary[torch.Tensor, tuple[int, int]] = (
            weakref.WeakKeyDictionary()
        )

    def count(self, step: torch.Tensor) -> int:
        known = self._known.get(step)
        if known is not None and known[0] == step._version:
            return known[1]
        value = int(step.item())
        self._known[step] = (step._version, value)
        return value

    def advance(self, steps: list[torch.Tensor], counts: list[int]) -> None:
        """After a launch added one to each of ``steps`` (whose counts were ``counts``)."""
        for step, count in zip(steps, counts, strict=True):
            self._known[step] = (step._version, count + 1)
