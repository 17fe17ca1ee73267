"""Distributed checkpoints of a dtypeplan optimizer that reshard across world sizes and stages.

    dtypeplan.checkpoint.save(optimizer, "ckpt/run1")   # on every rank of the optimizer's group
    dtypeplan.checkpoint.load(optimizer, "ckpt/run1")   # any world size, any ZeRO stage

What is stored: everything the optimizer owns -- the fp32 master weights, every full-size
optimizer state (``exp_avg``, ``momentum_buffer``, ...), the step count, the loss scaler, the
skipped-step count and the param groups' hyperparameters. The model's weights are the master
weights cast to the parameter dtype, so ``load`` writes them into the parameters as well.
Frozen parameters (``requires_grad=False``) are not the optimizer's and are not stored.

On disk (``path`` is a directory)::

    path/LATEST                  one line: the name of the current snapshot
    path/snapshot-<hex>/         a torch.distributed.checkpoint (DCP) directory ...
    path/snapshot-<hex>/manifest.json   ... plus what DCP does not describe (see _manifest)

Every tensor is stored under ``param.{i}.{name}`` as a 1-D fp32 tensor of the parameter's
``numel`` (``i`` numbers the trainable parameters over all param groups in order, as
``MixedPrecisionOptimizer.full_state`` does); shapes live in the manifest.

Sharded I/O. For the built-in flat-buffer optimizers each rank writes only the pieces of each
parameter that its own shard holds, as DCP chunks with their offsets, and on load reads only
the pieces that its new shard needs; DCP's resharding matches old chunks to new ones. No rank
ever materializes the full state. (At ZeRO stage 0 every rank holds everything; DCP then
writes each piece once.) Any other ``MixedPrecisionOptimizer`` goes through its layout-free
``full_state()`` / ``load_full_state()``: full tensors, replicated on every rank and written
once. Both ways write the same format, so either reads what the other wrote. (The sharded
way reads the flat optimizer's layout -- ``groups``, ``masters``, ``inner``, ``_write_back`` --
in ``_FlatAdapter``; a change there must keep ``tests/test_checkpoint.py`` passing.)

Atomic replacement. A save writes ``snapshot-<hex>.tmp`` inside ``path``; when every rank has
written (DCP's final collective) rank 0 adds the manifest, renames the directory to
``snapshot-<hex>``, and atomically replaces ``LATEST`` (write, fsync, ``os.replace``). Only then
are older snapshots and leftovers of failed saves deleted. A save that dies at any point leaves
``LATEST`` naming the previous complete snapshot, so ``load(path)`` still works. Concurrent
saves into one ``path`` are not supported.

Checks on load. A missing ``LATEST``, snapshot or data file, a file whose size differs from the
size recorded at save (truncation), a manifest that is not valid, or any failure inside DCP
raises :class:`CheckpointError` naming the path. (Bytes overwritten in place, sizes kept, are
caught only where they break DCP's serialization: there are no checksums.) A checkpoint
whose parameter count or shapes or optimizer type (AdamW, Adam, SGD) differ from the
optimizer's raises
:class:`CheckpointMismatchError` listing the differences. A different world size, ZeRO stage,
implementation or parameter dtype is allowed: the masters are fp32 whatever the parameter
dtype, so a run saved in fp32 resumes in bf16 and back. The loss scaler is restored only when
both the checkpoint and the optimizer use fp16. Hyperparameters (``lr``, ``betas``, ...) are
restored from the checkpoint when the number of param groups matches, as
``torch.optim.Optimizer.load_state_dict`` does. A load that fails leaves the optimizer as it
was: pieces are read into staging tensors (one shard's worth) and copied in only at the end.

Both calls are collective over the optimizer's process group (the default group when it has
none, a single process when ``torch.distributed`` is not initialized). Every rank must see the
same ``path`` (a shared filesystem). Errors are agreed on: when one rank fails, every rank
raises, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
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

from dtypeplan.optimizers._base import MixedPrecisionOptimizer
from dtypeplan.optimizers._engine import FlatMixedPrecisionOptimizer

__all__ = ["CheckpointError", "CheckpointMismatchError", "load", "save"]

FORMAT = "dtypeplan.checkpoint"
FORMAT_VERSION = 1
LATEST = "LATEST"
MANIFEST = "manifest.json"
_SNAPSHOT = re.compile(r"^snapshot-[0-9a-f]{16}$")
_LEFTOVER = re.compile(r"^(snapshot-[0-9a-f]{16}\.tmp|LATEST\.tmp-[0-9a-f]{16})$")
_NO_DIST_WARNING = "torch.distributed is disabled"

T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or corrupt, or could not be written.

    ``path`` is the checkpoint directory the message is about.
    """

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the optimizer (parameters or optimizer type differ)."""


# --- collectives -----------------------------------------------------------------------------
class _Group:
    """The optimizer's process group, or a single process when torch.distributed is off."""

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.size = dist.get_world_size(process_group) if self.distributed else 1

    def all_gather(self, value: T) -> list[T]:
        if not self.distributed or self.size == 1:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def broadcast(self, value: T) -> T:
        """``value`` of group rank 0, on every rank."""
        if not self.distributed or self.size == 1:
            return value
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        box = [value]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def agree(self, fn: Callable[[], T], what: str, path: str) -> T:
        """Run ``fn`` on every rank; if it fails on any rank, raise on every rank."""
        failure: tuple[str, str] | None = None
        result: Any = None
        try:
            result = fn()
        except CheckpointError as exc:
            failure = (type(exc).__name__, str(exc))
        except Exception as exc:  # any local failure must reach the other ranks
            failure = ("CheckpointError", f"{path}: {what} failed on rank {self.rank}: {exc!r}")
        failures = [f for f in self.all_gather(failure) if f is not None]
        if failures:
            kind, message = failures[0]
            cls = CheckpointMismatchError if kind == "CheckpointMismatchError" else CheckpointError
            raise cls(message, path)
        return result


# --- DCP planners for flat pieces ------------------------------------------------------------
@dataclass
class _Flat:
    """One saved tensor (a flattened parameter's state) and the pieces of it this rank holds."""

    numel: int
    pieces: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """``(offset, 1-D tensor)``: elements ``offset .. offset + len`` of the flattened tensor."""


class _PieceSavePlanner(DefaultSavePlanner):
    """Writes each rank's pieces as DCP chunks; dedup, metadata and validation are DCP's."""

    def __init__(self, flats: dict[str, _Flat]) -> None:
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
            for offset, tensor in flat.pieces:
                if tensor.numel() == 0:
                    continue
                self.by_index[(fqn, offset)] = tensor
                chunk = ChunkStorageMetadata(
                    offsets=torch.Size([offset]), sizes=torch.Size([tensor.numel()])
                )
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


class _PieceLoadPlanner(LoadPlanner):
    """Reads, for each piece this rank needs, the overlapping parts of the saved chunks."""

    def __init__(self, flats: dict[str, _Flat], path: str) -> None:
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
            for offset, tensor in flat.pieces:
                if tensor.numel() == 0:
                    continue
                self.by_index[(fqn, offset)] = tensor
                chunk = ChunkStorageMetadata(
                    offsets=torch.Size([offset]), sizes=torch.Size([tensor.numel()])
                )
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


# --- what an optimizer gives and takes -------------------------------------------------------
def _torch_class_name(opt: MixedPrecisionOptimizer) -> str:
    return opt.plan.optimizer.torch_class.__name__


def _is_adam(opt: MixedPrecisionOptimizer) -> bool:
    return issubclass(opt.plan.optimizer.torch_class, (torch.optim.Adam, torch.optim.AdamW))


class _FlatAdapter:
    """Per-rank pieces of a :class:`FlatMixedPrecisionOptimizer`'s shard (sharded I/O)."""

    layout = "sharded"

    def __init__(self, opt: FlatMixedPrecisionOptimizer) -> None:
        self.opt = opt

    def _walk(self) -> list[tuple[int, int, int, torch.Tensor, int]]:
        """``(global index, offset in the flat parameter, master chunk, offset in it, length)``."""
        out = []
        first = 0
        for state in self.opt.groups:
            flat = state.flat
            shard_offsets = flat.shard_offsets()
            for index in range(len(flat.params)):
                where = flat.param_chunk_ranges(index, self.opt.shard_rank)
                if where is not None:
                    begin, end, shard_offset = where
                    bucket = flat.bucket_of[index]
                    local = shard_offset - shard_offsets[bucket]
                    out.append((first + index, begin, state.masters[bucket], local, end - begin))
            first += len(flat.params)
        return out

    def shapes(self) -> list[list[int]]:
        return [list(p.shape) for state in self.opt.groups for p in state.flat.params]

    def state_names(self) -> list[str]:
        names = ["master"]
        for state in self.opt.groups:
            for master in state.masters:
                for key, value in self.opt.inner.state.get(master, {}).items():
                    if (
                        key != "step"
                        and torch.is_tensor(value)
                        and value.numel() == master.numel()
                        and key not in names
                    ):
                        names.append(key)
        return names

    def save_pieces(self, names: list[str]) -> dict[str, _Flat]:
        shapes = self.shapes()
        flats = {
            f"param.{i}.{name}": _Flat(_numel(shape))
            for name in names
            for i, shape in enumerate(shapes)
        }
        for index, begin, master, local, length in self._walk():
            slot = self.opt.inner.state.get(master, {})
            for name in names:
                if name == "master":
                    source = master
                elif name in slot:
                    source = slot[name]
                else:
                    # A state this rank has not created yet is still zero (as in full_state).
                    source = torch.zeros_like(master)
                flats[f"param.{index}.{name}"].pieces.append(
                    (begin, source[local : local + length])
                )
        return flats

    def scalars(self) -> dict[str, Any]:
        steps = [v["step"] for v in self.opt.inner.state.values() if "step" in v]
        return {
            "step": int(steps[0].item()) if steps else 0,
            "loss_scale": float(self.opt.scaler.scale),
            "skipped_steps": int(self.opt.skipped_steps),
            "scaler_enabled": bool(self.opt.scaler.enabled),
            "scaler": dict(self.opt.scaler.state_dict()),
        }

    def load_targets(self, names: list[str], shapes: list[list[int]]) -> dict[str, _Flat]:
        flats = {
            f"param.{i}.{name}": _Flat(_numel(shape))
            for name in names
            for i, shape in enumerate(shapes)
        }
        for index, begin, master, _local, length in self._walk():
            for name in names:
                staging = torch.empty(length, dtype=torch.float32, device=master.device)
                flats[f"param.{index}.{name}"].pieces.append((begin, staging))
        return flats

    @torch.no_grad()
    def commit(self, flats: dict[str, _Flat], names: list[str], scalars: dict[str, Any]) -> None:
        opt = self.opt
        inner = opt.inner
        step = int(scalars["step"])
        stateful = [name for name in names if name != "master"]
        for state, group in zip(opt.groups, inner.param_groups, strict=True):
            on_device = bool(group.get("fused") or group.get("capturable"))
            for master in state.masters:
                inner.state.pop(master, None)
                if not stateful:
                    continue
                slot = inner.state[master]
                for name in stateful:
                    slot[name] = torch.zeros_like(master)
                if _is_adam(opt):
                    device = master.device if on_device else torch.device("cpu")
                    slot["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)
        pieces = {key: dict(flat.pieces) for key, flat in flats.items()}
        for index, begin, master, local, length in self._walk():
            for name in names:
                target = master if name == "master" else inner.state[master][name]
                target[local : local + length].copy_(pieces[f"param.{index}.{name}"][begin])
        opt.skipped_steps = int(scalars["skipped_steps"])
        if opt.scaler.enabled and scalars.get("scaler_enabled"):
            opt.scaler.load_state_dict(scalars["scaler"])
        opt._write_back()


class _FullStateAdapter:
    """Any :class:`MixedPrecisionOptimizer`, through its layout-free full state."""

    layout = "full"

    def __init__(self, opt: MixedPrecisionOptimizer) -> None:
        self.opt = opt
        self._full: dict[str, Any] | None = None
        self._shapes: list[list[int]] | None = None

    def _state(self) -> dict[str, Any]:
        if self._full is None:
            self._full = self.opt.full_state()
        return self._full

    def shapes(self) -> list[list[int]]:
        if self._shapes is None:
            template = self._full if self._full is not None else self.opt.full_state_template()
            count = sum(
                1 for key in template if key.startswith("param.") and key.endswith(".master")
            )
            self._shapes = [list(template[f"param.{i}.master"].shape) for i in range(count)]
        return self._shapes

    def state_names(self) -> list[str]:
        names = ["master"]
        for key in self._state():
            if key.startswith("param."):
                name = key.split(".", 2)[2]
                if name not in names:
                    names.append(name)
        return names

    def save_pieces(self, names: list[str]) -> dict[str, _Flat]:
        state = self._state()
        flats = {}
        for name in names:
            for i, shape in enumerate(self.shapes()):
                tensor = state[f"param.{i}.{name}"].detach().float().reshape(-1)
                flats[f"param.{i}.{name}"] = _Flat(_numel(shape), [(0, tensor)])
        return flats

    def scalars(self) -> dict[str, Any]:
        state = self._state()
        scaler = {
            k[len("scalar.scaler.") :]: v
            for k, v in state.items()
            if k.startswith("scalar.scaler.")
        }
        return {
            "step": int(state.get("scalar.step", 0)),
            "loss_scale": float(state.get("scalar.loss_scale", 1.0)),
            "skipped_steps": int(state.get("scalar.skipped_steps", 0)),
            "scaler_enabled": self.opt.plan.param_dtype == torch.float16,
            "scaler": scaler,
        }

    def load_targets(self, names: list[str], shapes: list[list[int]]) -> dict[str, _Flat]:
        return {
            f"param.{i}.{name}": _Flat(_numel(shape), [(0, torch.empty(_numel(shape)))])
            for name in names
            for i, shape in enumerate(shapes)
        }

    def commit(self, flats: dict[str, _Flat], names: list[str], scalars: dict[str, Any]) -> None:
        shapes = self.shapes()
        state: dict[str, Any] = {}
        for key, flat in flats.items():
            index = int(key.split(".", 2)[1])
            state[key] = flat.pieces[0][1].view(shapes[index])
        state["scalar.step"] = int(scalars["step"])
        state["scalar.skipped_steps"] = int(scalars["skipped_steps"])
        if scalars.get("scaler_enabled") and self.opt.plan.param_dtype == torch.float16:
            state["scalar.loss_scale"] = float(scalars["loss_scale"])
            for key, value in scalars["scaler"].items():
                state[f"scalar.scaler.{key}"] = value
        self.opt.load_full_state(state)


_Adapter = _FlatAdapter | _FullStateAdapter


def _adapter_for(opt: MixedPrecisionOptimizer) -> _Adapter:
    if isinstance(opt, FlatMixedPrecisionOptimizer):
        return _FlatAdapter(opt)
    return _FullStateAdapter(opt)


def _numel(shape: list[int]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


# --- the manifest ----------------------------------------------------------------------------
def _jsonable(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _hyperparameters(opt: MixedPrecisionOptimizer) -> list[dict[str, Any]]:
    return [
        {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in g.items()
            if k != "params" and _jsonable(v)
        }
        for g in opt.param_groups
    ]


def _manifest(
    opt: MixedPrecisionOptimizer,
    adapter: _Adapter,
    names: list[str],
    scalars: dict[str, Any],
    world_size: int,
) -> dict[str, Any]:
    plan = opt.plan
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
        "world_size": world_size,
        "written_as": adapter.layout,
        "implementation": plan.implementation,
        "optimizer_class": type(opt).__name__,
        "optimizer": {
            "type": _torch_class_name(opt),
            "params": _jsonable_dict(plan.optimizer.params),
        },
        "param_groups": _hyperparameters(opt),
        "shapes": adapter.shapes(),
        "param_dtypes": [str(p.dtype).removeprefix("torch.") for p in params],
        "states": names,
        "scalars": scalars,
        "plan": plan.to_dict(),
        "files": {},
    }


def _jsonable_dict(params: Any) -> dict[str, Any]:
    return {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(params).items() if _jsonable(v)
    }


_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "format": str,
    "version": int,
    "world_size": int,
    "optimizer": dict,
    "param_groups": list,
    "shapes": list,
    "states": list,
    "scalars": dict,
    "files": dict,
}


def _check_manifest(manifest: Any, where: str) -> dict[str, Any]:
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: the manifest is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{where}: not a dtypeplan checkpoint manifest (format {manifest.get('format')!r})"
        )
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: manifest version {manifest.get('version')!r}; this dtypeplan reads version "
            f"{FORMAT_VERSION}"
        )
    for key, kind in _REQUIRED.items():
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"{where}: the manifest's {key!r} is missing or not a {kind}")
    shapes = manifest["shapes"]
    if not all(
        isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes
    ):
        raise CheckpointError(f"{where}: the manifest's 'shapes' is not a list of shapes")
    states = manifest["states"]
    if "master" not in states or not all(isinstance(s, str) and "." not in s for s in states):
        raise CheckpointError(f"{where}: the manifest's 'states' {states!r} is not valid")
    scalars = manifest["scalars"]
    for key, kind in (
        ("step", int),
        ("skipped_steps", int),
        ("loss_scale", (int, float)),
        ("scaler", dict),
    ):
        if not isinstance(scalars.get(key), kind):
            raise CheckpointError(f"{where}: the manifest's scalars.{key} is missing or not valid")
    if not isinstance(manifest["optimizer"].get("type"), str):
        raise CheckpointError(f"{where}: the manifest's optimizer.type is missing")
    return manifest


def _differences(
    manifest: dict[str, Any], opt: MixedPrecisionOptimizer, shapes: list[list[int]]
) -> list[str]:
    out = []
    saved_type, mine = manifest["optimizer"]["type"], _torch_class_name(opt)
    if saved_type != mine:
        out.append(f"optimizer type: the checkpoint has {saved_type}, this optimizer is {mine}")
    saved = manifest["shapes"]
    if len(saved) != len(shapes):
        out.append(
            f"parameter count: the checkpoint has {len(saved)} trainable parameters, "
            f"this optimizer {len(shapes)}"
        )
    pairs = enumerate(zip(saved, shapes, strict=False))
    differing = [(i, s, m) for i, (s, m) in pairs if list(s) != list(m)]
    for i, s, m in differing[:5]:
        out.append(f"parameter {i} shape: the checkpoint has {s}, this optimizer {m}")
    if len(differing) > 5:
        out.append(f"... and {len(differing) - 5} more parameters with other shapes")
    return out


# --- the directory ---------------------------------------------------------------------------
def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _prepare_directory(path: str) -> str:
    """Rank 0: check that ``path`` may hold a checkpoint and create a temporary snapshot dir."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(
            f"{path}: exists and is not a directory; cannot save a checkpoint there"
        )
    if os.path.isdir(path):
        foreign = [
            e
            for e in os.listdir(path)
            if e != LATEST and not _SNAPSHOT.match(e) and not _LEFTOVER.match(e)
        ]
        if foreign:
            raise CheckpointError(
                f"{path}: is not a dtypeplan checkpoint directory "
                f"(it holds {sorted(foreign)[:3]}); "
                "save into a new or empty directory"
            )
    os.makedirs(path, exist_ok=True)
    name = f"snapshot-{secrets.token_hex(8)}"
    os.mkdir(os.path.join(path, name + ".tmp"))
    return name


def _commit_directory(path: str, name: str, manifest: dict[str, Any]) -> None:
    """Rank 0, after every rank has written: manifest, rename, switch LATEST, clean up."""
    tmp = os.path.join(path, name + ".tmp")
    manifest["files"] = {
        entry: os.path.getsize(os.path.join(tmp, entry))
        for entry in sorted(os.listdir(tmp))
        if os.path.isfile(os.path.join(tmp, entry))
    }
    _write_file(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1, default=str) + "\n")
    _fsync_dir(tmp)
    os.rename(tmp, os.path.join(path, name))
    _fsync_dir(path)
    pointer = os.path.join(path, f"{LATEST}.tmp-{secrets.token_hex(8)}")
    _write_file(pointer, name + "\n")
    os.replace(pointer, os.path.join(path, LATEST))
    _fsync_dir(path)
    for entry in os.listdir(path):
        if entry != name and (_SNAPSHOT.match(entry) or _LEFTOVER.match(entry)):
            target = os.path.join(path, entry)
            if os.path.isdir(target):
                shutil.rmtree(target, ignore_errors=True)
            else:
                try:
                    os.remove(target)
                except OSError:
                    pass


def _open_snapshot(path: str) -> tuple[str, dict[str, Any]]:
    """Rank 0: the current snapshot directory and its checked manifest."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no checkpoint directory there")
    pointer = os.path.join(path, LATEST)
    try:
        with open(pointer, encoding="utf-8") as handle:
            name = handle.read().strip()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: no {LATEST} file; not a dtypeplan checkpoint, or no save into it completed"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read {LATEST}: {exc}") from exc
    if not _SNAPSHOT.match(name):
        raise CheckpointError(f"{path}: {LATEST} holds {name[:80]!r}, not a snapshot name")
    snapshot = os.path.join(path, name)
    if not os.path.isdir(snapshot):
        raise CheckpointError(f"{path}: {LATEST} names {name}, which does not exist")
    where = os.path.join(snapshot, MANIFEST)
    try:
        with open(where, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"{where}: the manifest is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{where}: the manifest is not valid JSON: {exc}") from exc
    _check_manifest(manifest, where)
    for entry, size in manifest["files"].items():
        file = os.path.join(snapshot, str(entry))
        if os.path.basename(str(entry)) != entry or not isinstance(size, int):
            raise CheckpointError(f"{where}: the manifest's file entry {entry!r} is not valid")
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing from the checkpoint")
        actual = os.path.getsize(file)
        if actual != size:
            raise CheckpointError(
                f"{file}: is {actual} bytes, the manifest recorded {size} "
                "(truncated or overwritten)"
            )
    if ".metadata" not in manifest["files"]:
        raise CheckpointError(f"{where}: the manifest lists no DCP .metadata file")
    return snapshot, manifest


def _dcp_call(fn: Callable[[], Any], distributed: bool, path: str, doing: str) -> Any:
    """Run a DCP call; its failures (raised on every rank alike) become a CheckpointError."""
    try:
        if distributed:
            return fn()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            return fn()
    except CheckpointException as exc:
        failures = [(rank, wrapped[0]) for rank, wrapped in sorted(exc.failures.items())]
        ours = [e for _rank, e in failures if isinstance(e, CheckpointError)]
        if ours:
            raise CheckpointError(str(ours[0]), path) from exc
        detail = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in failures)
        raise CheckpointError(f"{path}: {doing} the checkpoint failed: {detail}", path) from exc
    except Exception as exc:
        raise CheckpointError(f"{path}: {doing} the checkpoint failed: {exc!r}", path) from exc


def _restore_hyperparameters(opt: MixedPrecisionOptimizer, saved: list[dict[str, Any]]) -> None:
    if len(saved) != len(opt.param_groups):
        warnings.warn(
            f"the checkpoint has {len(saved)} param groups and the optimizer "
            f"{len(opt.param_groups)}; "
            "keeping the optimizer's hyperparameters",
            stacklevel=3,
        )
        return
    for group, values in zip(opt.param_groups, saved, strict=True):
        for key, value in values.items():
            group[key] = (
                tuple(value)
                if isinstance(group.get(key), tuple) and isinstance(value, list)
                else value
            )


# --- the public calls ------------------------------------------------------------------------
def save(opt: MixedPrecisionOptimizer, path: str | os.PathLike[str]) -> None:
    """Write a checkpoint of ``opt`` to the directory ``path``; collective over its group.

    Replaces an earlier checkpoint at ``path`` atomically: if the save fails or dies, the
    previous one stays loadable. Raises :class:`CheckpointError` on every rank if any rank fails.
    """
    path = os.fspath(path)
    if not isinstance(opt, MixedPrecisionOptimizer):
        raise TypeError(f"save() takes a dtypeplan optimizer, not {type(opt).__name__}")
    group = _Group(opt.process_group)
    name = group.agree(
        lambda: _prepare_directory(path) if group.rank == 0 else None, "preparing", path
    )
    name = group.broadcast(name)
    tmp = os.path.join(path, name + ".tmp")
    adapter = _adapter_for(opt)

    local_names = group.agree(adapter.state_names, "listing the optimizer states", path)
    # A state one rank has not created yet is still saved (as zeros) so that chunks cover it.
    names: list[str] = []
    for rank_names in group.all_gather(local_names):
        names += [n for n in rank_names if n not in names]
    flats, scalars = group.agree(
        lambda: (adapter.save_pieces(names), adapter.scalars()), "collecting the state", path
    )
    _dcp_call(
        lambda: dcp.save(
            {},
            storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
            planner=_PieceSavePlanner(flats),
            process_group=opt.process_group,
            no_dist=not group.distributed,
        ),
        group.distributed,
        path,
        "writing",
    )

    def commit() -> None:
        if group.rank == 0:
            _commit_directory(path, name, _manifest(opt, adapter, names, scalars, group.size))

    group.agree(commit, "committing", path)


def load(opt: MixedPrecisionOptimizer, path: str | os.PathLike[str]) -> None:
    """Load the checkpoint at ``path`` into ``opt`` and its model; collective over its group.

    The checkpoint may come from another world size, ZeRO stage or parameter dtype. Raises
    :class:`CheckpointMismatchError` if its parameters or optimizer type differ from ``opt``'s,
    :class:`CheckpointError` if it is missing, incomplete or corrupt; ``opt`` is then unchanged.
    """
    path = os.fspath(path)
    if not isinstance(opt, MixedPrecisionOptimizer):
        raise TypeError(f"load() takes a dtypeplan optimizer, not {type(opt).__name__}")
    group = _Group(opt.process_group)
    opened = group.agree(lambda: _open_snapshot(path) if group.rank == 0 else None, "opening", path)
    snapshot, manifest = group.broadcast(opened)
    adapter = _adapter_for(opt)
    shapes = group.agree(adapter.shapes, "reading the parameter shapes", path)

    def check() -> None:
        differences = _differences(manifest, opt, shapes)
        if differences:
            raise CheckpointMismatchError(
                f"{path}: the checkpoint does not fit this optimizer:\n  - "
                + "\n  - ".join(differences),
                path,
            )

    group.agree(check, "checking", path)
    names = list(manifest["states"])
    flats = group.agree(lambda: adapter.load_targets(names, shapes), "allocating", path)
    _dcp_call(
        lambda: dcp.load(
            {},
            storage_reader=dcp.FileSystemReader(snapshot),
            planner=_PieceLoadPlanner(flats, path),
            process_group=opt.process_group,
            no_dist=not group.distributed,
        ),
        group.distributed,
        path,
        "reading",
    )
    adapter.commit(flats, names, manifest["scalars"])
    _restore_hyperparameters(opt, manifest["param_groups"])
