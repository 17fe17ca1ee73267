"""What an update kernel is: the one interface every way of running the step's update keeps.

An update kernel updates this rank's master chunks of every param group from the step's
reduced gradients and writes the parameters. The flat engine (``flat/engine.py``) picks one per
optimizer from the registry (``registry.py``) and calls only :meth:`UpdateKernel.update`; it
keeps the step's phases (reduce, check/clip, update, write back) and knows no kernel's
internals. A kernel reads what it needs from the engine through :class:`FlatEngine`, a
protocol, so this package never imports the engine.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from dtypeplan.optimizers.buffers.group_state import GroupState
    from dtypeplan.optimizers.buffers.host_offload import HostOffload
    from dtypeplan.optimizers.kernels.torch_adam import FlatAdamUpdate
    from dtypeplan.optimizers.update.pieces import LowPrecisionAdamUpdate
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = [
    "FlatEngine",
    "Gather",
    "GradsByGroup",
    "HostStepKernel",
    "UpdateKernel",
    "finish",
    "flat_grads",
    "write_params",
]

GradsByGroup = list[list[torch.Tensor]]
"""Per param group, per bucket: this rank's chunk of the reduced (still scaled) gradient."""

Gather = Callable[["GroupState", Any], Callable[[], None]]
"""The engine's ``start_gather(state, bucket)``: launch the all-gather of a bucket whose
parameter chunk this rank has written; returns the call that waits for it."""


class FlatEngine(Protocol):
    """The parts of the flat engine that an update kernel reads."""

    plan: PrecisionPlan
    groups: list[GroupState]
    shard_rank: int
    offload: HostOffload | None
    param_groups: list[dict[str, Any]]
    _low_precision: LowPrecisionAdamUpdate | None
    _adam_update: FlatAdamUpdate | LowPrecisionAdamUpdate

    @property
    def inner(self) -> torch.optim.Optimizer: ...

    @property
    def device(self) -> torch.device: ...

    def step_count(self) -> int: ...


class UpdateKernel(abc.ABC):
    """One way of running the update of every master chunk of a step.

    A subclass is registered in ``registry.py``; the engine builds the first whose
    :meth:`applies` holds as ``cls(engine)``, once, and again only when a param group turns
    a switch the choice depends on (amsgrad, maximize) on or off.
    """

    name: ClassVar[str]
    """The kernel's name in the registry (unique)."""

    def __init__(self, engine: FlatEngine) -> None:
        self.engine = engine

    @classmethod
    @abc.abstractmethod
    def applies(cls, engine: FlatEngine) -> bool:
        """Whether this kernel serves ``engine``'s plan, device and optimizer class."""

    @abc.abstractmethod
    def update(
        self, grads: GradsByGroup, factor: tuple[torch.Tensor, torch.Tensor], gather: Gather | None
    ) -> None:
        """Update every master chunk from ``grads`` times ``factor[0]`` (``factor[1]`` is its
        inverse, which torch's fused kernels divide by). With ``gather``, also write each
        bucket's parameter chunk and start its all-gather through it, and wait for them all
        before returning; without, leave the parameters to the caller."""

    @abc.abstractmethod
    def describe(self) -> str:
        """In a few words, what runs the update (for ``explain``-like reports and logs)."""

    def state_changed(self) -> None:
        """The optimizer states were replaced or stepped outside this kernel (a load, a reset,
        the own-history path): drop any host copy of them. Most kernels keep none."""
        return None


class HostStepKernel(UpdateKernel):
    """A kernel that computes the bias corrections (and the noise key) on the host: it keeps
    a host copy of the step counter, read from the states once after a load or a reset, since
    reading the device's every step would wait for the device."""

    def __init__(self, engine: FlatEngine) -> None:
        super().__init__(engine)
        self._step: int | None = None
        """The step counter as of the last step (None: read it at the next)."""

    def state_changed(self) -> None:
        self._step = None

    def _host_step(self) -> int:
        """The step counter as of the last step, kept on the host (synced once if unknown)."""
        if self._step is None:
            self._step = self.engine.step_count()
        return self._step


def flat_grads(grads: GradsByGroup) -> list[torch.Tensor]:
    """The gradient chunks of every group, in the order of the groups' masters."""
    return [g for per_bucket in grads for g in per_bucket]


def finish(gathers: list[Callable[[], None]]) -> None:
    """Wait for the all-gathers started (in order)."""
    for wait in gathers:
        wait()


def write_params(
    groups: list[GroupState], shard_rank: int, gather: Gather, cast: bool = True
) -> None:
    """Cast the master chunks into the parameters (unless they are the same memory) and
    all-gather them, bucket by bucket."""
    gathers: list[Callable[[], None]] = []
    for state in groups:
        flat = state.flat
        for bucket, master in zip(flat.buckets, state.masters, strict=True):
            chunk = flat.chunk_view(flat.buffer, bucket, shard_rank)
            if cast and master.data_ptr() != chunk.data_ptr():
                chunk.copy_(master)
            gathers.append(gather(state, bucket))
    finish(gathers)
