"""The checkpoint directory: snapshots, the ``LATEST`` pointer, atomic commit, size checks.

Rank 0 alone touches the directory here; the callers agree on the outcome across ranks.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from typing import Any

from dtypeplan.checkpoint._errors import CheckpointError
from dtypeplan.checkpoint._manifest import check_manifest

__all__ = ["LATEST", "MANIFEST", "commit_directory", "open_snapshot", "prepare_directory"]

LATEST = "LATEST"
MANIFEST = "manifest.json"
_SNAPSHOT = re.compile(r"^snapshot-[0-9a-f]{16}$")
_LEFTOVER = re.compile(r"^(snapshot-[0-9a-f]{16}\.tmp|LATEST\.tmp-[0-9a-f]{16})$")


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


def commit_directory(path: str, name: str, manifest: dict[str, Any]) -> None:
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


def open_snapshot(path: str) -> tuple[str, dict[str, Any]]:
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
    check_manifest(manifest, where)
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
