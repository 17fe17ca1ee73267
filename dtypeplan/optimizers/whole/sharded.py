"""ZeRO-3: a whole parameter from FSDP2's shards, and its shards from the whole.

At ZeRO-3 FSDP2 holds each parameter as a DTensor sharded over the mesh (the fp32 sharded
parameters are its master weights) and reduce-scatters each micro-batch's gradient into the
sharded ``.grad`` (the mean over the ranks). A whole-tensor update needs the full gradient and
the full parameter on the owner: :func:`full_from_shards` all-gathers a local shard into the
whole tensor (every rank receives it; only the owner uses it), and :func:`write_shards` gives
each rank its shard of the updated whole, broadcast from the owner. In shard groups FSDP2's mesh
is HSDP's (replicated across the groups, sharded within): the gather runs within the shard
group, and the broadcast is given the shard group (each group has its own owner).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["full_from_shards", "write_shards"]


def full_from_shards(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor whose shard on this rank is ``local``, laid out as ``param`` (a DTensor;
    collective over its mesh)."""
    assert isinstance(param, DTensor), "ZeRO-3 parameters are FSDP2's DTensors"
    sharded = DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )
    return sharded.full_tensor()


@torch.no_grad()
def write_shards(
    param: torch.Tensor, whole: torch.Tensor | None, src: int, group: dist.ProcessGroup | None
) -> None:
    """Broadcast ``whole`` (on global rank ``src``; None elsewhere) and copy this rank's shard
    of it into ``param``'s local shard (``param``: a DTensor)."""
    assert isinstance(param, DTensor), "ZeRO-3 parameters are FSDP2's DTensors"
    local = param.to_local().detach()
    if whole is None:
        whole = torch.empty(param.shape, dtype=local.dtype, device=local.device)
    else:
        whole = whole.to(local.dtype)
    dist.broadcast(whole, src=src, group=group)
    mine = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
    local.copy_(mine.to_local())
