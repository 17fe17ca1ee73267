"""The trained weights by parameter name, in fp32: what ``save_pretrained`` and the like take.

At stages 0-2 ``model.state_dict()`` holds the 16-bit weights, and the fp32 master weights
live in the optimizer, split between ranks at stages 1-2; at ZeRO-3 the model's parameters
are FSDP2 shards, and gathering them is collective. :func:`export_model_state` hides both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtypeplan.optimizers.contract import MixedPrecisionOptimizer
from dtypeplan.optimizers.flat import FlatMixedPrecisionOptimizer
from dtypeplan.optimizers.fsdp2 import SCALAR_NAMES, FSDP2Optimizer, gatherable
from dtypeplan.optimizers.state import MASTER, ShardPiece, param_key

__all__ = ["export_model_state"]


@torch.no_grad()
def export_model_state(
    optimizer: MixedPrecisionOptimizer,
    model: torch.nn.Module,
    *,
    rank0_only: bool = False,
    cpu: bool = True,
) -> dict[str, torch.Tensor]:
    """The fp32 weights of ``model`` by parameter name, at every ZeRO stage.

    Keys are ``model.named_parameters()`` names, tied ones included: every name of a tied
    parameter (GPT-2's ``transformer.wte.weight`` and ``lm_head.weight``) is present and maps
    to the same tensor object. Values are full-shape fp32 tensors: for a parameter the
    optimizer updates, its fp32 master weight (not the 16-bit parameter); for any other
    (frozen, or left out of ``build``), its current value cast to fp32.

    Collective at stages 1-3: every rank of the optimizer's process group must call it, in
    the same order relative to other collectives (calling it on rank 0 alone hangs; so does
    ``model.state_dict()`` at ZeRO-3). At stage 0 it communicates nothing, but calling it on
    every rank is always right. Parameters are gathered one at a time: a rank never holds
    more than the model's shards plus one full parameter on its device.

    ``rank0_only=True``: rank 0 of the optimizer's group gets the dict, every other rank an
    empty one (they still take part in the gathers). ``cpu=True`` (default) moves each
    tensor to host memory as soon as it is gathered, so the whole model never sits on a GPU;
    ``cpu=False`` leaves them on the parameters' device.
    """
    if not isinstance(optimizer, MixedPrecisionOptimizer):
        raise TypeError(
            f"export_model_state() takes a dtypeplan optimizer, not {type(optimizer).__name__}"
        )
    distributed = dist.is_available() and dist.is_initialized()
    keep = not rank0_only or not distributed or dist.get_rank(optimizer.process_group) == 0
    value_of = _values(optimizer)
    # ZeRO-3 holds 0-dim parameters as 1-element ones (fsdp2/sharding.py): 0-dim again here.
    scalars: frozenset[str] = getattr(model, SCALAR_NAMES, frozenset())
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor | None] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in done:
            value = value_of(param)  # every rank: the gather is collective
            if name in scalars:
                value = value.reshape(())
            done[id(param)] = (value.cpu() if cpu else value) if keep else None
        tensor = done[id(param)]
        if tensor is not None:
            out[name] = tensor
    return out


def _current(param: torch.Tensor) -> torch.Tensor:
    """A parameter's own value, whole, in fp32 (a ZeRO-3 shard is gathered: collective)."""
    value = param.detach()
    if isinstance(value, DTensor):
        value = gatherable(value).full_tensor()
    return value.float()


def _values(optimizer: MixedPrecisionOptimizer) -> Callable[[torch.Tensor], torch.Tensor]:
    """``param -> its full fp32 value``, called for every parameter in the same order per rank."""
    if isinstance(optimizer, FSDP2Optimizer):
        # The sharded fp32 parameters are the master weights: gather each one.
        return _current
    index = {id(p): i for i, p in enumerate(optimizer.trainable_parameters())}
    if isinstance(optimizer, FlatMixedPrecisionOptimizer):
        return _flat_values(optimizer, index)
    state = optimizer.full_state()  # any other implementation: its layout-free state

    def from_full_state(param: torch.Tensor) -> torch.Tensor:
        if id(param) not in index:
            return _current(param)
        master = state[param_key(index[id(param)], MASTER)]
        assert isinstance(master, torch.Tensor)
        return master.float().reshape(param.shape)

    return from_full_state


def _flat_values(
    optimizer: FlatMixedPrecisionOptimizer, index: dict[int, int]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Masters of the flat engine: this rank's pieces, and at stages 1-2 the others' too.

    Each parameter is assembled from the pieces of it every rank holds: zeros elsewhere, then
    one all-reduce of the bit patterns as int32 (one rank holds each element, so the sum is
    that rank's bits exactly: no rounding, and -0.0 stays -0.0).
    """
    pieces: dict[int, list[ShardPiece]] = {}
    for piece in optimizer.shard_pieces():
        pieces.setdefault(piece.index, []).append(piece)
    # Within the shard group: in a hybrid layout the other groups hold the same pieces.
    shard_comm = optimizer.shard_comm
    gather = optimizer.shard_state and shard_comm.world_size > 1

    def value(param: torch.Tensor) -> torch.Tensor:
        if id(param) not in index:
            return _current(param)
        mine = pieces.get(index[id(param)], [])
        flat = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        for piece in mine:
            flat[piece.begin : piece.end].copy_(piece.of(piece.master))
        if gather:
            with shard_comm._guard("all_reduce of master weight bits", flat.numel()):
                dist.all_reduce(
                    flat.view(torch.int32), op=dist.ReduceOp.SUM, group=shard_comm.group
                )
        return flat.view(param.shape)

    return value
