"""The communicators of one optimizer, per link level of a hybrid layout.

A flat layout has one level: every collective spans the data-parallel group. A hybrid layout
(``shard_group_size`` ``S`` < ``W``, see ``_groups.py``) has three communicators, each with its
own :class:`CommStats`, so the bytes on each level are counted apart::

    world    the whole data-parallel group: the step's small summary all-reduce (touched flags,
             hyperparameter fingerprint, consistency checks); no gradient or parameter bytes
    shard    the S ranks of this rank's shard group (under torchrun: one node's, fast links):
             the gradients' reduce-scatters in ``comm_dtype`` and the parameters' all-gathers
    across   the W/S ranks of this rank's replica group (the slow links): the all-reduce of
             this rank's reduced chunk, in ``wire_across_groups`` (None: ``comm_dtype``;
             "int8" / "fp8": block-quantized, summed in fp32, ``_quantized_wire.py``)

The sum of the two levels is the group-wide sum: the shard group sums the S ranks' gradients
of a chunk, the replica group sums the W/S shard groups' sums of the same chunk. On gloo both
levels sum, and the result is still to be divided by ``S * W/S = W``; NCCL averages on each
level, leaving 1; a quantized wire across sums on any backend, leaving W/S
(:attr:`Levels.reduction_divisor`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dtypeplan._dtypes import DTYPES
from dtypeplan.comm._collectives import Communicator
from dtypeplan.comm._groups import check_shard_group_size, hybrid_groups
from dtypeplan.comm._quantized_wire import WIRE_FORMATS
from dtypeplan.errors import NotSupportedError

__all__ = ["QUANTIZED_WIRES", "AcrossGroups", "Levels", "across_wire", "levels"]

QUANTIZED_WIRES = tuple(WIRE_FORMATS)
"""Block-quantized wire formats (summed in fp32 by the receiver)."""


def across_wire(name: str | None, comm_dtype: torch.dtype) -> torch.dtype | str:
    """The wire of the all-reduce across shard groups for ``plan.wire_across_groups``: a
    dtype, or the name of a block-quantized format (``_quantized_wire.py``)."""
    if name is None:
        return comm_dtype
    if name in QUANTIZED_WIRES:
        return name
    if name not in DTYPES:
        raise NotSupportedError(
            f"wire_across_groups {name!r}: not a wire format; use one of "
            f"{', '.join((*DTYPES, *QUANTIZED_WIRES))}"
        )
    return DTYPES[name]


@dataclass(frozen=True)
class AcrossGroups:
    """The second level of a hybrid layout: an all-reduce over the replica group."""

    comm: Communicator
    """Over this rank's replica group (its own CommStats: the bytes across groups)."""
    wire: torch.dtype | str
    """The dtype on the wire across groups, or a block-quantized format ("int8", "fp8":
    each rank's contribution quantized per block of 256, summed in fp32 by the receiver)."""
    method: str
    """``"collective"`` or ``"fp32_sum"`` (``_collectives.py``), as within the group."""

    @property
    def reduction_divisor(self) -> int:
        """What the result is still to be divided by: a quantized wire always sums (the
        replica group's size), a dtype wire averages where the backend does (NCCL: 1)."""
        if isinstance(self.wire, str):
            return self.comm.world_size
        return self.comm.reduction_divisor

    def start(self, chunk: torch.Tensor) -> Callable[[], None]:
        """Launch the in-place all-reduce of ``chunk`` over the replica group (the sum over
        ``reduction_divisor``); call the result to finish it."""
        if isinstance(self.wire, str):
            return self.comm.start_all_reduce_quantized(chunk, self.wire)
        return self.comm.start_all_reduce_mean(chunk, self.wire, self.method)


@dataclass(frozen=True)
class Levels:
    """An optimizer's communicators, one per level (all three the same object when flat)."""

    world: Communicator
    """The whole data-parallel group."""
    shard: Communicator
    """The shard group: reduce-scatters, all-gathers (``world`` itself when flat)."""
    across: AcrossGroups | None
    """The all-reduce across shard groups (None when flat)."""
    replica_rank: int
    """Which shard group this rank is in (0 when flat): replica 0's ranks write checkpoints."""

    @property
    def replicas(self) -> int:
        """Shard groups holding a copy each (``W / S``; 1 when flat)."""
        return self.across.comm.world_size if self.across is not None else 1

    @property
    def reduction_divisor(self) -> int:
        """What a gradient reduced over both levels is still to be divided by."""
        across = self.across.reduction_divisor if self.across is not None else 1
        return self.shard.reduction_divisor * across


def levels(
    world: Communicator,
    shard_group_size: int | None,
    *,
    sharded: bool,
    comm_dtype: torch.dtype,
    method: str,
    wire_across_groups: str | None,
) -> Levels:
    """The levels of an optimizer over ``world`` (a flat one unless ``sharded`` and ``S < W``).

    Unsharded (ZeRO-0) every rank holds everything and there is nothing to shard within a
    group: the layout stays flat, ``S`` is only checked to divide ``W``.
    """
    flat = Levels(world, world, None, 0)
    if shard_group_size is None:
        return flat
    if not sharded or not world.distributed:
        check_shard_group_size(shard_group_size, world.world_size)
        return flat
    groups = hybrid_groups(world.group, shard_group_size)
    if not groups.hybrid:
        return flat
    wire = across_wire(wire_across_groups, comm_dtype)
    across = AcrossGroups(Communicator(groups.replica), wire, method)
    return Levels(world, Communicator(groups.shard), across, groups.replica_rank)
