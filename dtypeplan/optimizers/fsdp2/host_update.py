"""ZeRO-3 with ``offload_optimizer: cpu`` alone: the shards on the device, the update on the host.

As DeepSpeed's ZeRO-3 with the optimizer offloaded (and not the parameters), FSDP2's sharded
parameters stay on the device, where each unit is all-gathered for forward and backward
without a host copy in between, while the fp32 master weights, the optimizer states and the
update live in host memory (pinned on CUDA)::

    device   FSDP2's shards (fp32, gathered in the parameter dtype), the sharded accumulator
    host     fp32 master shards (one per local shard, same shape), the optimizer states

Each step is the ZeRO 1-2 offload's pipeline (``buffers/host_offload.py``), one local shard a
chunk: the reduced gradient shard is copied down into a pinned slot while the host steps the
previous one (torch's fused CPU Adam/AdamW by direct calls, ``kernels/torch_adam.FlatAdamUpdate``;
other optimizers through their CPU ``step``), and the updated master is copied up into the
device shard. The device shards are always equal to the masters (both fp32), so what reads the
sharded parameters (FSDP2's gather, ``full_tensor``) reads the masters' values.

With shard groups (HSDP) each rank's host masters are those of its shard in its group, and the
replicas across the groups update the same reduced shards alike.

What differs from DeepSpeed: its device partitions are 16-bit (2 bytes a parameter) and its
fp32 gradient partitions live on the host; FSDP2 keeps its sharded parameters in one dtype,
the masters' (fp32: 4 bytes), and its reduced gradients in them, so the device holds
``4 + A`` bytes a parameter over the shard group (``A`` the accumulation dtype's) against
DeepSpeed's 2, and the host ``4 + S`` (``S`` the states) against DeepSpeed's ``4 + S + 4``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dtypeplan._dtypes import dtype_name
from dtypeplan.errors import NotSupportedError
from dtypeplan.optimizers.buffers.host_offload import HostOffload, OffloadedChunk
from dtypeplan.optimizers.kernels.torch_adam import FlatAdamUpdate, inner_step_grads

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["HostUpdate", "offloads_optimizer_alone"]


def offloads_optimizer_alone(plan: PrecisionPlan) -> bool:
    """Whether ``plan`` offloads the optimizer to the host and leaves the parameters on the
    device (checked: fp32 masters and states, the host update's only dtypes)."""
    if plan.offload_optimizer == "none" or plan.offload_param != "none":
        return False
    if plan.offload_optimizer != "cpu":
        raise NotSupportedError(
            f"offload_optimizer {plan.offload_optimizer} at ZeRO-3: the optimizer is offloaded "
            "to host memory only; use offload_optimizer device cpu"
        )
    if plan.master_dtype != torch.float32 or plan.optimizer_states != "fp32":
        raise NotSupportedError(
            f"offload_optimizer cpu at ZeRO-3 with {dtype_name(plan.master_dtype)} master "
            f"weights and {plan.optimizer_states} optimizer states: the host update keeps "
            "fp32 masters and fp32 states (torch's fused CPU Adam steps fp32 moments); remove "
            "master_weights / optimizer_states, or offload the parameters too (offload_param "
            "cpu, FSDP2's CPUOffloadPolicy, serves those cells)"
        )
    return True


class HostUpdate:
    """The host masters of a rank's local shards and the step that updates them there."""

    def __init__(self, shards: list[list[torch.Tensor]], device: torch.device) -> None:
        # Staged even where the device is the host: the fused kernels overwrite the gradient
        # they read (unscaled in place), and the step keeps the sharded .grad until zero_grad.
        self.offload = HostOffload(device, staged=True)
        self.masters = [[self._host_copy(shard) for shard in group] for group in shards]
        """Per param group, an fp32 host master per local shard (the inner optimizer's keys)."""

    def _host_copy(self, shard: torch.Tensor) -> torch.Tensor:
        host = self.offload.host_zeros(shard.numel()).view(shard.shape)
        host.copy_(shard)
        return host

    def step(
        self,
        inner: torch.optim.Optimizer,
        shards: list[list[torch.Tensor]],
        grads: list[torch.Tensor],
        touched: list[bool],
        factor: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Update every touched master from its reduced gradient shard, ``grad * factor``, and
        copy it into its device shard; an untouched one keeps its weights and states."""
        offload = self.offload
        scale = offload.factor_to_host(factor[0]), offload.factor_to_host(factor[1])
        chunks: list[OffloadedChunk] = []
        groups: list[dict[str, Any]] = []
        flat = iter(zip(grads, touched, strict=True))
        for group, masters, locals_ in zip(inner.param_groups, self.masters, shards, strict=True):
            for master, shard in zip(masters, locals_, strict=True):
                grad, got_one = next(flat)
                if got_one:
                    chunks.append(OffloadedChunk(grad.reshape(-1), master, shard))
                    groups.append(group)
        update = self._update_function(inner, chunks, groups, scale)
        try:
            offload.step(chunks, update, lambda _: None)
        finally:
            offload.release()

    @staticmethod
    def _update_function(
        inner: torch.optim.Optimizer,
        chunks: list[OffloadedChunk],
        groups: list[dict[str, Any]],
        scale: tuple[torch.Tensor, torch.Tensor],
    ) -> Callable[[int, torch.Tensor], None]:
        torch_class = type(inner)
        if FlatAdamUpdate.supports(inner, torch_class):
            adam = FlatAdamUpdate(inner, torch_class)

            def adam_update(k: int, host_grad: torch.Tensor) -> None:
                master = chunks[k].master
                adam.bucket(groups[k], master, host_grad.view(master.shape), None, scale[1])

            return adam_update

        def step_one(k: int, host_grad: torch.Tensor) -> None:
            # One parameter a call: torch's fused SGD decides "first step" per call, and a
            # parameter without a .grad is skipped by every torch step.
            master = chunks[k].master
            with inner_step_grads(inner, [master], [host_grad.view(master.shape)], *scale):
                inner.step()

        return step_one

    @torch.no_grad()
    def upload(self, shards: list[list[torch.Tensor]]) -> None:
        """Write every master into its device shard (after a load wrote the masters)."""
        for masters, locals_ in zip(self.masters, shards, strict=True):
            for master, shard in zip(masters, locals_, strict=True):
                shard.copy_(master, non_blocking=self.offload.on_accelerator)
        self.offload.settle()
