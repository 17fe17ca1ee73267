"""The update kernels in the order the engine tries them; the first that applies runs.

A new precision cell is a rule in ``precision_rules.yaml`` plus, where no kernel here serves
it, a module with an :class:`UpdateKernel` placed in :data:`KERNELS` before the ones it
improves on. The order encodes preference: the host offload first (its masters live on the
host, where nothing else can reach them), the one-pass Triton kernel where the device has it,
torch's fused kernels next (the one-pass Triton kernel of the 16-bit cells before the fp32
pieces that would serve them), and ``inner.step()`` last, which serves every plan.
"""

from __future__ import annotations

from typing import Any

from dtypeplan.optimizers.update.generic import GenericKernel
from dtypeplan.optimizers.update.host_offload import HostOffloadKernel
from dtypeplan.optimizers.update.interface import FlatEngine, UpdateKernel
from dtypeplan.optimizers.update.low_precision import (
    LowPrecisionKernel,
    QuantizedKernel,
    TorchClassKernel,
)
from dtypeplan.optimizers.update.torch_fused import Fused16BitKernel, TorchFusedKernel
from dtypeplan.optimizers.update.triton import TritonKernel
from dtypeplan.optimizers.update.triton_low_precision import TritonLowPrecisionKernel

__all__ = ["KERNELS", "choice_key", "choose"]

KERNELS: tuple[type[UpdateKernel], ...] = (
    HostOffloadKernel,
    TritonKernel,
    TorchFusedKernel,
    Fused16BitKernel,
    QuantizedKernel,
    TritonLowPrecisionKernel,
    LowPrecisionKernel,
    TorchClassKernel,
    GenericKernel,
)
"""Every update kernel, most preferred first; :class:`GenericKernel` applies to every plan."""

_names = [kernel.name for kernel in KERNELS]
if len(set(_names)) != len(_names):
    raise ImportError(f"update kernel names must be unique: {_names}")


def choose(engine: FlatEngine) -> UpdateKernel:
    """The first kernel of :data:`KERNELS` that applies to ``engine``, built for it."""
    for kernel in KERNELS:
        if kernel.applies(engine):
            return kernel(engine)
    raise AssertionError("GenericKernel applies to every plan")


_SWITCHES = ("fused", "amsgrad", "maximize", "differentiable")
"""The param-group settings a kernel's :meth:`~UpdateKernel.applies` reads."""


def choice_key(engine: FlatEngine) -> tuple[Any, ...]:
    """What the choice depends on that may change after build: the param groups' switches
    (a scheduler or the user may set ``amsgrad`` or ``maximize`` on a group)."""
    return tuple(
        tuple(bool(group.get(name, False)) for name in _SWITCHES)
        for groups in (engine.param_groups, engine.inner.param_groups)
        for group in groups
    )
