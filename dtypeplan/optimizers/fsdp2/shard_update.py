"""The update of ZeRO-3's local shards when masters or moments are low-precision.

Each param group's shards that got a gradient are updated from ``grad / grad_scale``: on a
CUDA device with Triton (or Triton's interpreter on the host), in one launch of the one-pass
Triton update per param group and step count (``update/triton_low_precision.py``: the bits
of the host's one-pass update, its hashed noise), instead of the fp32 pieces around torch's
fused kernel, about ten launches per shard; elsewhere, and for shards the kernel does not
take (quantized moments, mixed dtypes), shard by shard through
``LowPrecisionAdamUpdate.bucket`` (``update/pieces.py``). The flat engine's kernel steps
every master at once; here a parameter no rank gave a gradient keeps its weights and states
(as in torch), so shards may hold different step counts, and each count gets its launch.
The counts are followed on the host (``triton_low_precision.HostSteps``): the device is read
once, not every step.
"""

from __future__ import annotations

from typing import Any

import torch

from dtypeplan.optimizers.update.pieces import LowPrecisionAdamUpdate
from dtypeplan.optimizers.update.triton_low_precision import (
    HostSteps,
    launch_one_pass,
    serves_shards,
    shards_dtypes_served,
)

__all__ = ["ShardUpdate"]


class ShardUpdate:
    """The low-precision update of the local shards of every param group."""

    def __init__(
        self,
        update: LowPrecisionAdamUpdate,
        inner: torch.optim.Optimizer,
        torch_class: type[torch.optim.Optimizer],
        device: torch.device,
    ) -> None:
        self.update = update
        self.device = device
        self.triton = serves_shards(update, inner, torch_class, device)
        """The one-pass Triton launch may run here (each launch checks its dtypes)."""
        self._steps = HostSteps()

    def step(
        self,
        param_groups: list[dict[str, Any]],
        locals_by_group: list[list[torch.Tensor]],
        grads: list[torch.Tensor],
        touched: list[bool],
        grad_scale: torch.Tensor,
    ) -> list[bool]:
        """Update each local shard that got a gradient (``grads`` and ``touched`` in the order
        of the groups' shards); the others keep their weights and states. Returns per gradient
        whether the update left ``grad / grad_scale`` in it (torch's fused kernel unscales
        the gradient it is handed in place; the Triton launch only reads them)."""
        pending = iter(zip(grads, touched, strict=True))
        scaled: list[bool] = []
        try:
            for group, locals_ in zip(param_groups, locals_by_group, strict=True):
                mine = [next(pending) for _ in locals_]
                stepped = [(local, grad) for local, (grad, got_one) in zip(
                    locals_, mine, strict=True
                ) if got_one]  # fmt: skip
                masters = [local for local, _ in stepped]
                shard_grads = [grad for _, grad in stepped]
                if (
                    self.triton
                    and masters
                    and shards_dtypes_served(self.update, masters, shard_grads)
                ):
                    self._launch_by_count(group, masters, shard_grads, grad_scale)
                    scaled += [False] * len(locals_)
                    continue
                for master, grad in stepped:
                    self.update.bucket(group, master, grad, None, grad_scale)
                scaled += [
                    got_one and self.update.unscales_in_place(local, grad, grad_scale)
                    for local, (grad, got_one) in zip(locals_, mine, strict=True)
                ]
        finally:
            # Working copies live only inside the step (plan.memory() counts between steps).
            self.update.release_scratch()
        return scaled

    def _launch_by_count(
        self,
        group: dict[str, Any],
        masters: list[torch.Tensor],
        grads: list[torch.Tensor],
        grad_scale: torch.Tensor,
    ) -> None:
        """One launch per step count among ``masters`` (one, unless some skipped steps)."""
        steps = [self.update.slot(master)["step"] for master in masters]
        counts = [self._steps.count(step) for step in steps]
        for count in sorted(set(counts)):
            chosen = [i for i, c in enumerate(counts) if c == count]
            launch_one_pass(
                self.update,
                group,
                [masters[i] for i in chosen],
                [grads[i] for i in chosen],
                [None] * len(chosen),
                grad_scale,
                count + 1,
                self.device,
            )
        self._steps.advance(steps, counts)
