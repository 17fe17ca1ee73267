"""DCP's ``.metadata`` read without running code from it, and the storage reader that uses it.

torch's ``FileSystemReader.read_metadata`` reads a snapshot's ``.metadata`` with plain
``pickle.load``: a checkpoint from elsewhere (a shared directory, a downloaded run) could name
any callable in it (``os.system``, ``eval``, ``torch.save``...) and have it called by the load.
Here the same bytes go through :class:`_Unpickler`, whose ``find_class`` admits only the
globals that DCP's metadata is made of (listed in :data:`ADMITTED`, taken from the pickles
torch 2.13's ``FileSystemWriter`` writes: DCP's metadata dataclasses, ``torch.Size``, torch's
dtypes and layouts, ``pathlib`` paths) and refuses any other global, every persistent id
and copyreg extension code, with a :class:`CheckpointError` naming it. Nothing outside that
list is imported, looked up or called: ``REDUCE`` and ``NEWOBJ`` call only admitted classes (and
the layout lookup), ``BUILD`` fills in only instances of them (never a class or function). The
admitted classes only store what they are given (no ``__setstate__`` or ``__init__`` of theirs
touches anything but the object). It is Python's own unpickler in Python, its opcodes checked:
about 3 times slower than the C one (some 0.1 s per 1000 tensor entries on a loaded CPU).

The result is then checked for the shape a dtypeplan save writes (:func:`_check`): a
``Metadata`` of tensor (or bytes) entries whose storage items each name a data file listed in
the manifest, at an offset and length inside its recorded size, with no stream transforms (a
dtypeplan save writes none). So DCP's ``read_data`` afterwards opens only files that the
manifest lists and :func:`~dtypeplan.checkpoint._directory.open_snapshot` checked to be regular
files of the recorded size, and reads each tensor with ``torch.load(weights_only=True)``.

:class:`MetadataReader` is DCP's ``FileSystemReader`` with ``read_metadata`` answering the
metadata parsed here (on every rank, before any data file is read); it never reads the file
itself, and refuses the rank-local ``__<rank>.metadata`` files DCP falls back to (a dtypeplan
save writes one global ``.metadata``).

The file format is DCP's, unchanged: ``torch.distributed.checkpoint.load`` with its own
``FileSystemReader`` still reads a dtypeplan snapshot (trusting it, as plain pickle does).
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import pickle
import stat
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dtypeplan.checkpoint._errors import CheckpointError
from dtypeplan.resolver._input import InputError, regular_file

__all__ = ["ADMITTED", "METADATA", "MetadataReader", "read_metadata"]

METADATA = ".metadata"
"""DCP's global metadata file in a snapshot."""
_MAX_BYTES = 2**30

_DCP = "torch.distributed.checkpoint.metadata"
_LAYOUTS: dict[str, torch.layout] = {
    str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)
}


def _layout(name: object) -> torch.layout:
    """``torch.serialization._get_layout`` for the names of torch's layouts, and nothing else
    (torch pickles a layout as ``_get_layout("torch.strided")``)."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise CheckpointError(f"{name!r:.80} is not one of torch's layouts")
    return _LAYOUTS[name]


ADMITTED: dict[tuple[str, str], Any] = {
    (_DCP, "Metadata"): Metadata,
    (_DCP, "MetadataIndex"): MetadataIndex,
    (_DCP, "StorageMeta"): StorageMeta,
    (_DCP, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP, "TensorProperties"): TensorProperties,
    (_DCP, "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    # StorageMeta.checkpoint_id: the path the snapshot was written to. Read as a pure path,
    # which touches no filesystem (and a Windows path loads on Linux).
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    # torch pickles a dtype by name: ``torch.float32`` and the like.
    **{("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)},
}
"""The globals a ``.metadata`` pickle may name, and what each stands for when read."""


# By identity (the admitted objects live as long as the process): no object read from the
# pickle is hashed or compared to decide what may be called.
_CLASSES = frozenset(id(v) for v in ADMITTED.values() if isinstance(v, type))
_CALLABLES = _CLASSES | {id(_layout)}


def _refuse(what: str) -> CheckpointError:
    return CheckpointError(f"{what}; refused without calling anything (a checkpoint runs no code)")


# Python's own unpickler, in Python: its opcodes are methods that can be replaced (the C one's
# cannot). Typed as Any: typeshed gives it the C class's (narrower) attributes.
_PythonUnpickler: Any = pickle._Unpickler


class _Unpickler(_PythonUnpickler):
    """Python's unpickler with every opcode that reaches an object checked.

    ``find_class`` answers only :data:`ADMITTED`, by exact ``(module, name)`` (no dotted
    lookup); ``REDUCE`` and ``NEWOBJ`` call only admitted classes (and the layout lookup);
    ``BUILD`` sets the state of instances of admitted classes only (never of a class or
    function, whose attributes it would change for the whole process); persistent ids and the
    ``copyreg`` extension codes, which DCP's metadata never holds, are refused. As torch's
    ``weights_only`` unpickler does, but admitting DCP's metadata classes and nothing else.
    """

    dispatch = dict(_PythonUnpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        found = ADMITTED.get((module, name))
        if found is None:
            raise _refuse(f"names the global {module}.{name}, which DCP's metadata is not made of")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _refuse("holds a persistent id, which DCP's metadata never has")

    def _call(self, func: Any, args: Any) -> Any:
        if id(func) not in _CALLABLES:
            raise _refuse(f"calls a {type(func).__name__}, not one of the admitted classes")
        if not isinstance(args, tuple):
            raise _refuse("calls an admitted class without an argument tuple")
        return func(*args)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if id(cls) not in _CLASSES:
            raise _refuse(f"creates a {type(cls).__name__}, not one of the admitted classes")
        self.append(cls.__new__(cls, *args))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        if id(cls) not in _CLASSES or kwargs:
            raise _refuse(f"creates a {type(cls).__name__}, not one of the admitted classes")
        self.append(cls.__new__(cls, *args))

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if id(type(inst)) not in _CLASSES:
            raise _refuse(f"sets the state of a {type(inst).__name__}, not an admitted instance")
        setstate = getattr(inst, "__setstate__", None)
        if setstate is not None:
            setstate(state)
            return
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        for part in (state, slots):
            if part and not (isinstance(part, dict) and all(type(k) is str for k in part)):
                raise _refuse("sets an instance's state from something other than a dict")
        if state:
            inst.__dict__.update(state)
        for key, value in (slots or {}).items():
            setattr(inst, key, value)

    def load_refused(self) -> None:
        raise _refuse("uses a copyreg extension code or an old-style instance opcode")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4, pickle.INST, pickle.OBJ):
        dispatch[_op[0]] = load_refused
    del _op


def _read_bytes(file: str) -> bytes:
    """The bytes of the regular file ``file`` (opened without blocking, at most 1 GiB)."""
    try:
        size = regular_file(file).st_size
    except InputError as exc:
        raise CheckpointError(f"{file}: {exc}") from None
    if size > _MAX_BYTES:
        raise CheckpointError(f"{file}: is larger than {_MAX_BYTES} bytes ({size})")
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckpointError(f"{file}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{file}: is not a regular file")
        return handle.read(_MAX_BYTES + 1)


def _is_size(value: object) -> bool:
    return isinstance(value, torch.Size) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check(metadata: object, files: Mapping[str, int]) -> Metadata:
    """The parsed metadata, if it has the shape a dtypeplan save writes; raises otherwise."""
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"holds a {type(metadata).__name__}, not DCP Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise CheckpointError("its state_dict_metadata is not a dict")
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise CheckpointError(f"has an entry named {fqn!r:.80}, not a string")
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not (
            isinstance(entry, TensorStorageMetadata)
            and isinstance(entry.properties, TensorProperties)
            and isinstance(entry.properties.dtype, torch.dtype)
            and _is_size(entry.size)
            and isinstance(entry.chunks, list)
            and all(
                isinstance(c, ChunkStorageMetadata)
                and _is_size(c.offsets)
                and _is_size(c.sizes)
                and len(c.offsets) == len(c.sizes) == len(entry.size)
                for c in entry.chunks
            )
        ):
            raise CheckpointError(f"entry {fqn!r:.80} is not a valid tensor or bytes entry")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError("its storage_data is not a dict")
    for index, item in storage.items():
        if not (
            isinstance(index, MetadataIndex)
            and isinstance(index.fqn, str)
            and (index.offset is None or _is_size(index.offset))
        ):
            raise CheckpointError(f"has a storage key {index!r:.80} that is not a MetadataIndex")
        if not isinstance(item, _StorageInfo):
            raise CheckpointError(f"storage item of {index.fqn!r:.80} is not a _StorageInfo")
        where = item.relative_path
        if not isinstance(where, str) or where == METADATA or where not in files:
            raise CheckpointError(
                f"storage item of {index.fqn!r:.80} is in {where!r:.80}, "
                "which is not a data file the manifest lists"
            )
        if not (
            _is_count(item.offset)
            and _is_count(item.length)
            and item.offset + item.length <= files[where]
        ):
            raise CheckpointError(
                f"storage item of {index.fqn!r:.80} (offset {item.offset!r:.40}, length "
                f"{item.length!r:.40}) is not inside {where} ({files[where]} bytes)"
            )
        if item.transform_descriptors:
            raise CheckpointError(
                f"storage item of {index.fqn!r:.80} has stream transforms "
                f"{item.transform_descriptors!r:.80}; a dtypeplan save writes none"
            )
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise CheckpointError("its storage_meta is not a StorageMeta")
    return metadata


def read_metadata(snapshot: str, manifest: Mapping[str, Any], *, verify: bool) -> Metadata:
    """The snapshot's DCP metadata, parsed without running code from it and checked against the
    manifest's files (and, with ``verify``, the sha256 of the very bytes parsed)."""
    file = os.path.join(snapshot, METADATA)
    data = _read_bytes(file)
    files: Mapping[str, int] = manifest["files"]
    if len(data) != files.get(METADATA):
        raise CheckpointError(
            f"{file}: is {len(data)} bytes, the manifest recorded {files.get(METADATA)} "
            "(truncated or overwritten)"
        )
    digests = manifest.get("digests")
    if verify and digests is not None:
        if hashlib.new(digests["algorithm"], data).hexdigest() != digests["files"][METADATA]:
            raise CheckpointError(
                f"{file}: its {digests['algorithm']} differs from the one recorded at save: the "
                "file was damaged or overwritten (bytes changed, size kept); restore it or load "
                "an earlier checkpoint"
            )
    try:
        parsed = _Unpickler(io.BytesIO(data)).load()
    except CheckpointError as exc:
        raise CheckpointError(f"{file}: the DCP metadata {exc}") from None
    except Exception as exc:  # any malformed pickle: UnpicklingError, EOFError, TypeError...
        raise CheckpointError(
            f"{file}: is not valid DCP metadata ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    try:
        return _check(parsed, files)
    except CheckpointError as exc:
        raise CheckpointError(f"{file}: the DCP metadata {exc}") from None


class MetadataReader(FileSystemReader):
    """DCP's ``FileSystemReader`` answering ``read_metadata`` with metadata parsed here."""

    def __init__(self, snapshot: str, metadata: Metadata) -> None:
        super().__init__(snapshot)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(
                f"{self.path}: a dtypeplan checkpoint has one global {METADATA}; "
                "rank-local metadata files are not read"
            )
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata
