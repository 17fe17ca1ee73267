"""Any other elementwise optimizer: its own ``inner.step()`` over every master chunk at once.

The reduced gradients are set as the masters' ``.grad`` in fp32, scaled inside torch's step
where the class takes a ``grad_scale`` (fused Adagrad, SGD, ...) and by one multiply otherwise
(``torch_adam.inner_step_grads``). With optimizer offload they are copied to the host first.
Then every parameter chunk is written and all-gathered.
"""

from __future__ import annotations

import torch

from dtypeplan.optimizers.kernels.torch_adam import inner_step_grads
from dtypeplan.optimizers.update.interface import (
    FlatEngine,
    Gather,
    GradsByGroup,
    UpdateKernel,
    flat_grads,
    write_params,
)

__all__ = ["GenericKernel"]


class GenericKernel(UpdateKernel):
    """``inner.step()``: serves every plan, the fallback of the registry."""

    name = "generic"

    @classmethod
    def applies(cls, engine: FlatEngine) -> bool:
        return True

    def describe(self) -> str:
        where = " on the host" if self.engine.offload is not None else ""
        return f"{type(self.engine.inner).__name__}.step() over every master chunk{where}"

    def update(
        self, grads: GradsByGroup, factor: tuple[torch.Tensor, torch.Tensor], gather: Gather | None
    ) -> None:
        engine = self.engine
        masters = [m for state in engine.groups for m in state.masters]
        chunks = flat_grads(grads)
        if engine.offload is not None:
            chunks = engine.offload.gradients_to_host(chunks)
        with inner_step_grads(engine.inner, masters, chunks, *factor):
            engine.inner.step()
        if gather is not None:
            write_params(engine.groups, engine.shard_rank, gather)
