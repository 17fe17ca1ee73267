"""DCP planners that write and read flat pieces of 1-D tensors, each at its offset.

A saved tensor is a :class:`Flat`: a flattened parameter's state of ``numel`` elements, of
which this rank holds some ``(offset, 1-D tensor)`` pieces. On save each non-empty piece
becomes one DCP chunk; on load each piece is filled from whichever saved chunks overlap it,
so the pieces on load need not match those on save (resharding).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dtypeplan.checkpoint._errors import CheckpointError

__all__ = ["Flat", "PieceLoadPlanner", "PieceSavePlanner"]


@dataclass
class Flat:
    """One saved tensor (a flattened parameter's state) and the pieces of it this rank holds."""

    numel: int
    pieces: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """``(offset, 1-D tensor)``: elements ``offset .. offset + len`` of the flattened tensor."""


def _chunks(
    fqn: str, flat: Flat, by_index: dict[tuple[str, int], torch.Tensor]
) -> Iterator[tuple[int, torch.Tensor, ChunkStorageMetadata]]:
    """The non-empty pieces of ``flat`` as DCP chunks, each recorded in ``by_index``."""
    for offset, tensor in flat.pieces:
        if tensor.numel() == 0:
            continue
        by_index[(fqn, offset)] = tensor
        yield (
            offset,
            tensor,
            ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=torch.Size([tensor.numel()])),
        )


class PieceSavePlanner(DefaultSavePlanner):
    """Writes each rank's pieces as DCP chunks; dedup, metadata and validation are DCP's."""

    def __init__(self, flats: dict[str, Flat]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.flats = flats
        self.by_index: dict[tuple[str, int], torch.Tensor] = {}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, flat in self.flats.items():
            for offset, tensor, chunk in _chunks(fqn, flat, self.by_index):
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, torch.Size([offset])),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=chunk,
                            properties=TensorProperties.create_from_tensor(tensor),
                            size=torch.Size([flat.numel]),
                        ),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        assert write_item.index.offset is not None
        return self.by_index[(write_item.index.fqn, write_item.index.offset[0])].detach()


class PieceLoadPlanner(LoadPlanner):
    """Reads, for each piece this rank needs, the overlapping parts of the saved chunks."""

    def __init__(self, flats: dict[str, Flat], path: str) -> None:
        self.flats = flats
        self.path = path
        self.by_index: dict[tuple[str, int], torch.Tensor] = {}
        self.metadata: Metadata | None = None

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self.state_dict = state_dict
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        requests: list[ReadItem] = []
        for fqn, flat in self.flats.items():
            md = saved.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(
                    f"{self.path}: the data files hold no tensor {fqn!r}", self.path
                )
            if list(md.size) != [flat.numel]:
                raise CheckpointError(
                    f"{self.path}: tensor {fqn!r} has {list(md.size)} elements in the data files, "
                    f"the manifest says {flat.numel}",
                    self.path,
                )
            for offset, tensor, chunk in _chunks(fqn, flat, self.by_index):
                reads = create_read_items_for_chunk_list(fqn, md, [chunk])
                covered = sum(read.lengths[0] for read in reads)
                if covered != tensor.numel():
                    raise CheckpointError(
                        f"{self.path}: tensor {fqn!r} elements {offset}..{offset + tensor.numel()} "
                        f"are only {covered} elements in the data files",
                        self.path,
                    )
                requests += reads
        return LoadPlan(requests)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(
            f"{self.path}: unexpected non-tensor entry {read_item.dest_index.fqn!r}"
        )

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        assert index.offset is not None
        piece = self.by_index[(index.fqn, index.offset[0])]
        return piece.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass
