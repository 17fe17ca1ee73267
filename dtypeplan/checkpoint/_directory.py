"""The checkpoint directory: snapshots, the ``LATEST`` pointer, atomic commit, size and digest
checks (sha256 of every data file, computed and checked by the ranks in parallel, each a share).

Rank 0 alone changes the directory here; the callers agree on the outcome across ranks. Every
file a load reads must be a regular file: ``LATEST`` and the manifest are read as config files
are (``resolver/_input.read_text``: checked before opening, opened without blocking), and a
data file that is a FIFO, device or socket is refused by name, so no ``open`` waits forever.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from typing import Any

from dtypeplan.checkpoint._errors import CheckpointError
from dtypeplan.checkpoint._manifest import DIGEST, check_manifest
from dtypeplan.resolver._input import InputError, InputLimits, read_text, regular_file

__all__ = [
    "LATEST",
    "MANIFEST",
    "commit_directory",
    "digest_share",
    "discard_snapshot",
    "open_snapshot",
    "prepare_directory",
    "verify_share",
]

LATEST = "LATEST"
MANIFEST = "manifest.json"
_SNAPSHOT = re.compile(r"^snapshot-[0-9a-f]{16}$")
_CHUNK = 4 * 2**20
_LEFTOVER = re.compile(r"^(snapshot-[0-9a-f]{16}\.tmp|LATEST\.tmp-[0-9a-f]{16})$")
# LATEST holds one snapshot name; a manifest lists a few lines per parameter.
_POINTER_LIMITS = InputLimits(max_bytes=4096)
_MANIFEST_LIMITS = InputLimits(max_bytes=2**30)


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


def prepare_directory(path: str) -> str:
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


def _data_files(directory: str) -> list[str]:
    return sorted(e for e in os.listdir(directory) if os.path.isfile(os.path.join(directory, e)))


def _digest(file: str) -> str:
    digest = hashlib.new(DIGEST)
    with open(file, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def digest_share(path: str, name: str, rank: int, size: int) -> dict[str, str]:
    """Every rank, after all have written: the digests of its share of the snapshot's files."""
    tmp = os.path.join(path, name + ".tmp")
    files = _data_files(tmp)
    return {entry: _digest(os.path.join(tmp, entry)) for entry in files[rank::size]}


def verify_share(snapshot: str, manifest: dict[str, Any], rank: int, size: int) -> None:
    """Every rank at load: check its share of the files against the manifest's digests."""
    digests = manifest.get("digests")
    if digests is None:
        return
    for entry in sorted(manifest["files"])[rank::size]:
        file = os.path.join(snapshot, entry)
        if _digest(file) != digests["files"][entry]:
            raise CheckpointError(
                f"{file}: its {DIGEST} differs from the one recorded at save: the file was "
                "damaged or overwritten (bytes changed, size kept); restore it or load an "
                "earlier checkpoint"
            )


def discard_snapshot(path: str, name: str) -> None:
    """Rank 0, after a failed save: remove what it wrote, unless LATEST already names it."""
    shutil.rmtree(os.path.join(path, name + ".tmp"), ignore_errors=True)
    try:
        current: str | None = read_text(os.path.join(path, LATEST), _POINTER_LIMITS).strip()
    except InputError:
        current = None
    if current != name:
        shutil.rmtree(os.path.join(path, name), ignore_errors=True)


def commit_directory(
    path: str, name: str, manifest: dict[str, Any], digests: dict[str, str] | None = None
) -> None:
    """Rank 0, after every rank has written: manifest, rename, switch LATEST, clean up."""
    tmp = os.path.join(path, name + ".tmp")
    files = _data_files(tmp)
    manifest["files"] = {entry: os.path.getsize(os.path.join(tmp, entry)) for entry in files}
    if digests is not None:
        if sorted(digests) != files:
            raise CheckpointError(
                f"{path}: the files the ranks hashed ({sorted(digests)}) are not the files "
                f"written ({files}); is another save running into this directory?"
            )
        manifest["digests"] = {"algorithm": DIGEST, "files": dict(sorted(digests.items()))}
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


def open_snapshot(path: str) -> tuple[str, dict[str, Any]]:
    """Rank 0: the current snapshot directory and its checked manifest."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no checkpoint directory there")
    pointer = os.path.join(path, LATEST)
    if not os.path.lexists(pointer):
        raise CheckpointError(
            f"{path}: no {LATEST} file; not a dtypeplan checkpoint, or no save into it completed"
        )
    try:
        name = read_text(pointer, _POINTER_LIMITS).strip()
    except InputError as exc:
        raise CheckpointError(f"{path}: cannot read {LATEST} ({exc})") from None
    if not _SNAPSHOT.match(name):
        raise CheckpointError(f"{path}: {LATEST} holds {name[:80]!r}, not a snapshot name")
    snapshot = os.path.join(path, name)
    if not os.path.isdir(snapshot):
        raise CheckpointError(f"{path}: {LATEST} names {name}, which does not exist")
    where = os.path.join(snapshot, MANIFEST)
    if not os.path.lexists(where):
        raise CheckpointError(f"{where}: the manifest is missing")
    try:
        manifest = json.loads(read_text(where, _MANIFEST_LIMITS))
    except InputError as exc:
        raise CheckpointError(f"{where}: cannot read the manifest ({exc})") from None
    except ValueError as exc:
        raise CheckpointError(f"{where}: the manifest is not valid JSON: {exc}") from exc
    check_manifest(manifest, where)
    for entry, size in manifest["files"].items():
        file = os.path.join(snapshot, str(entry))
        if os.path.basename(str(entry)) != entry or not isinstance(size, int):
            raise CheckpointError(f"{where}: the manifest's file entry {entry!r} is not valid")
        if not os.path.lexists(file):
            raise CheckpointError(f"{file}: missing from the checkpoint")
        try:
            actual = regular_file(file).st_size
        except InputError as exc:
            raise CheckpointError(f"{file}: {exc}") from None
        if actual != size:
            raise CheckpointError(
                f"{file}: is {actual} bytes, the manifest recorded {size} "
                "(truncated or overwritten)"
            )
    if ".metadata" not in manifest["files"]:
        raise CheckpointError(f"{where}: the manifest lists no DCP .metadata file")
    return snapshot, manifest
