"""Optimizer offload: Adam/AdamW on the host, a bucket chunk at a time, between copies.

The pipeline of copies and waits is ``buffers/host_offload.py``'s; this kernel gives it the update
(torch's fused CPU Adam/AdamW on each fp32 master chunk as its gradient arrives, through
``FlatAdamUpdate.bucket``) and starts each bucket's all-gather once its parameters are on their
way back. Other optimizers on offloaded masters step through ``generic.py``. The engine brings
the step's factor to the host once, before the update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dtypeplan._dtypes import DTYPE_NAMES
from dtypeplan.errors import NotSupportedError
from dtypeplan.optimizers.buffers.group_state import GroupState
from dtypeplan.optimizers.buffers.host_offload import HostOffload, OffloadedChunk
from dtypeplan.optimizers.update.interface import (
    FlatEngine,
    Gather,
    GradsByGroup,
    UpdateKernel,
    finish,
)
from dtypeplan.optimizers.update.torch_fused import torch_fused_adam

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["HostOffloadKernel", "host_offload_for"]


def host_offload_for(plan: PrecisionPlan, params: list[torch.Tensor]) -> HostOffload | None:
    """The host side of ``offload_optimizer: cpu`` (fp32 masters and states only) for the
    trainable ``params``, or None without offload."""
    if plan.offload_optimizer == "none":
        return None
    if plan.offload_optimizer != "cpu" or plan.master_dtype != torch.float32:
        raise NotSupportedError(
            f"offload_optimizer {plan.offload_optimizer} with "
            f"{DTYPE_NAMES[plan.master_dtype]} master weights: the flat engine offloads "
            "fp32 master weights and fp32 optimizer states to host memory (device cpu) "
            "only; use offload_optimizer device cpu with fp32 masters and states"
        )
    if plan.optimizer_states != "fp32":
        raise NotSupportedError(
            f"offload_optimizer with {plan.optimizer_states} optimizer states: the host "
            "update keeps fp32 states; remove optimizer_states / exp_avg_dtype / "
            "exp_avg_sq_dtype / bf16_optimizer_states / fp32_optimizer_states: false"
        )
    return HostOffload(params[0].device if params else torch.device("cpu"))


class HostOffloadKernel(UpdateKernel):
    """Adam/AdamW on offloaded fp32 masters: torch's fused CPU kernel per bucket chunk."""

    name = "host-offload"

    @classmethod
    def applies(cls, engine: FlatEngine) -> bool:
        return engine.offload is not None and torch_fused_adam(engine)

    def describe(self) -> str:
        return "torch's fused CPU Adam/AdamW on the host, per bucket chunk between copies"

    def update(
        self, grads: GradsByGroup, factor: tuple[torch.Tensor, torch.Tensor], gather: Gather | None
    ) -> None:
        """The update on the host (``buffers/host_offload.py``); ``factor`` is already there.

        Each bucket chunk steps with torch's fused CPU kernel as its gradient arrives (the next
        chunk's copy runs meanwhile), and each chunk's parameters go back and are all-gathered
        at once.
        """
        engine = self.engine
        assert engine.offload is not None
        offload = engine.offload
        chunks: list[OffloadedChunk] = []
        places: list[tuple[GroupState, dict[str, Any], Any]] = []
        for state, group, per_bucket in zip(
            engine.groups, engine.inner.param_groups, grads, strict=True
        ):
            flat = state.flat
            for bucket, master, grad in zip(flat.buckets, state.masters, per_bucket, strict=True):
                param = flat.chunk_view(flat.buffer, bucket, engine.shard_rank)
                chunks.append(OffloadedChunk(grad=grad, master=master, param=param))
                places.append((state, group, bucket))
        gathers: list[Callable[[], None]] = []

        def update(k: int, host_grad: torch.Tensor) -> None:
            _, group, _ = places[k]
            engine._adam_update.bucket(group, chunks[k].master, host_grad, None, factor[1])

        def written(k: int) -> None:
            state, _, bucket = places[k]
            assert gather is not None, "upload=False does not call written()"
            gathers.append(gather(state, bucket))

        offload.step(chunks, update, written, upload=gather is not None)
        finish(gathers)
