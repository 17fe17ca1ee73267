"""What ``.grad`` holds between backward and ``step()`` for a gradient the optimizer took in.

The flat engine (ZeRO 0-2) takes each gradient into its accumulator as autograd produces it
and frees ``.grad``. A tool that reads ``.grad`` then found nothing and said nothing:
``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` (the HF Trainer's, Accelerate's
and Lightning's clipping) returned a norm of 0 and clipped nothing, and frameworks logged that
0 as the gradient norm.

So after each backward, every parameter whose gradient the optimizer holds gets an
:class:`OwnedGradient` in ``.grad``: a tensor of the gradient's shape, dtype and device with
no storage, on which every operation raises an :class:`OptimizerUsageError` naming the way
out (``optimizer.clip_grad_norm_``, which clips for real, or ``gradient_clipping`` in the
config). Reading ``p.grad is not None`` still says that the parameter got a gradient, and
``model.zero_grad()`` / ``optimizer.zero_grad()`` clear it as any gradient, and that means
what it means in torch: a placeholder set to None, zeroed (``zero_()``, the one operation it
allows) or replaced by a tensor set by hand between backward passes discards what the
optimizer accumulated for that parameter. The optimizer looks for such changes before each
backward and at ``step()`` (``ReductionScheduler.check_grads``, ZeRO-3's ``_check_grads``).
The next backward clears it before autograd accumulates (a gradient pre-hook).

ZeRO-3 (FSDP2) with 16-bit accumulation or 16-bit master weights takes each reduced shard
into its accumulator too (``fsdp2/optimizer.py``); there the placeholder is a DTensor of the sharded
gradient's mesh and placements whose local tensor is an :class:`OwnedGradient`
(:func:`owned_sharded_gradient`), so that torch's norm over DTensors reaches it and raises.
FSDP2 adds each new shard into a ``.grad`` it finds, so the sharding
(``sharding.clear_owned_before_reduce``) clears the placeholders of a unit's
parameters right before the unit's next reduce-scatter.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dtypeplan.errors import OptimizerUsageError

__all__ = [
    "OWNED_MESSAGE",
    "SCALE_GRADS_MESSAGE",
    "OwnedGradient",
    "is_owned_gradient",
    "owned_sharded_gradient",
]

OWNED_MESSAGE = (
    "this parameter's gradient is held by a dtypeplan optimizer (summed in its accumulator, "
    "reduced over ranks in the step), not in .grad, so torch.nn.utils.clip_grad_norm_ and "
    "other code reading .grad cannot see it (it would find no gradient and report a norm of "
    "0). Clip with optimizer.clip_grad_norm_(max_norm) between the last backward and step() "
    "(it returns the global norm), or set gradient_clipping in the config; the norm of the "
    "last step is optimizer.grad_norm. A framework that clips for you calls "
    "torch.nn.utils.clip_grad_norm_ (transformers.Trainer with max_grad_norm, 1.0 by "
    "default): use its dtypeplan integration, which clips through the optimizer: "
    "dtypeplan.integrations.DtypeplanTrainer instead of transformers.Trainer (or start the "
    "unedited script with `dtypeplan run [torchrun options] script.py --deepspeed CONFIG`), "
    "DtypeplanAccelerator for Accelerate, DtypeplanStrategy for Lightning"
)

SCALE_GRADS_MESSAGE = (
    "a torch.distributed.pipelining schedule built with scale_grads=True (its default) "
    "divides each .grad by n_microbatches after the backward passes, but this parameter's "
    "gradient is held by a dtypeplan optimizer (summed in its accumulator), not in .grad. "
    "Build the schedule with scale_grads=False and divide the loss by the number of "
    "micro-batches in its loss_fn instead (the same gradients)"
)


def _in_pipeline_scale_grads() -> bool:
    """Whether the operation comes from a pipelining stage's ``scale_grads`` (the schedule
    calls it from Python, so its frame is on this thread's stack)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "scale_grads" and "pipelining" in code.co_filename:
            return True
        frame = frame.f_back
    return False


class OwnedGradient(torch.Tensor):
    """The placeholder in ``.grad``: shape, dtype and device of the gradient, no storage."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> OwnedGradient:
        return torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device, requires_grad=False
        )

    zeroed: bool = False
    """Set by ``zero_()`` (``model.zero_grad(set_to_none=False)``): the gradient the optimizer
    holds for this parameter is to be a zero one (the optimizer zeroes its part and clears
    the mark)."""

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        # Zeroing is the one operation with a meaning here: what model.zero_grad(
        # set_to_none=False) does between backward passes, discarding what was accumulated.
        if func is torch.ops.aten.zero_.default:
            args[0].zeroed = True
            return args[0]
        if func is torch.ops.aten._foreach_zero_.default:
            for tensor in args[0]:
                if type(tensor) is OwnedGradient:
                    tensor.zeroed = True
                else:
                    tensor.zero_()
            return None
        if _in_pipeline_scale_grads():
            raise OptimizerUsageError(f"{func}: {SCALE_GRADS_MESSAGE}")
        raise OptimizerUsageError(f"{func}: {OWNED_MESSAGE}")

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"OwnedGradient(shape={tuple(self.shape)}, dtype={self.dtype}, "
            "held by a dtypeplan optimizer)"
        )


def is_owned_gradient(grad: torch.Tensor | None) -> bool:
    """The placeholder, plain (ZeRO 0-2) or as the local tensor of a DTensor (ZeRO-3)."""
    if isinstance(grad, DTensor):
        grad = grad._local_tensor
    return type(grad) is OwnedGradient


def owned_sharded_gradient(sharded: DTensor) -> DTensor:
    """The ZeRO-3 placeholder for ``sharded`` (a sharded gradient): a DTensor of its global
    shape, mesh and placements whose local tensor is an :class:`OwnedGradient`."""
    # Built from the gradient's own spec (mesh, placements, global shape and stride):
    # DTensor.from_local would take a view of the placeholder, which raises.
    return DTensor(OwnedGradient(sharded._local_tensor), sharded._spec, requires_grad=False)
