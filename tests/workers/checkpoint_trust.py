"""Hostile checkpoints for tests/test_checkpoint_trust.py: payloads planted in DCP's ``.metadata``.

An attacker with write access to a checkpoint replaces the snapshot's ``.metadata`` with a
pickle whose ``__reduce__`` calls something, and rewrites ``manifest.json``'s recorded size
and sha256 of it to agree (so ``verify=True`` passes the digest check). Each payload, if it
ran, would create its marker file; a load must refuse the checkpoint with a
:class:`CheckpointError` naming the refused global, and the marker must not exist.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtypeplan import checkpoint
from tests.workers import checkpoint as cases


class Payload:
    """Pickles as a call of ``func(*args)``: what unpickling it with plain pickle runs."""

    def __init__(self, func: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.func = func
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def payloads(markers: str) -> dict[str, tuple[Payload, str, str]]:
    """Name -> (payload, the global a load must name in its refusal, its marker file)."""
    os.makedirs(markers, exist_ok=True)

    def marker(name: str) -> str:
        return os.path.join(markers, name)

    return {
        "open": (Payload(open, (marker("open"), "w")), "io.open", marker("open")),
        "os.system": (
            Payload(os.system, (f"touch {marker('os.system')}",)),
            "posix.system",
            marker("os.system"),
        ),
        "eval": (
            Payload(eval, (f"open({marker('eval')!r}, 'w')",)),
            "builtins.eval",
            marker("eval"),
        ),
        "torch.save": (
            Payload(torch.save, ({}, marker("torch.save"))),
            "torch.serialization.save",
            marker("torch.save"),
        ),
    }


def snapshot_dir(path: str) -> str:
    with open(os.path.join(path, checkpoint.LATEST), encoding="utf-8") as handle:
        return os.path.join(path, handle.read().strip())


def plant(path: str, data: bytes) -> None:
    """Replace the current snapshot's ``.metadata`` with ``data``; make the manifest agree."""
    snapshot = snapshot_dir(path)
    with open(os.path.join(snapshot, ".metadata"), "wb") as handle:
        handle.write(data)
    where = os.path.join(snapshot, checkpoint.MANIFEST)
    with open(where, encoding="utf-8") as handle:
        manifest = json.load(handle)
    manifest["files"][".metadata"] = len(data)
    manifest["digests"]["files"][".metadata"] = hashlib.sha256(data).hexdigest()
    with open(where, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle)


def hostile(original: bytes, payload: Payload, nested: bool) -> bytes:
    """The payload alone, or hidden inside the snapshot's real metadata (its planner_data)."""
    if not nested:
        return pickle.dumps(payload)
    metadata = copy.copy(pickle.loads(original))  # our own test checkpoint: trusted here
    metadata.planner_data = {"hidden": [payload]}
    return pickle.dumps(metadata)


def _read(file: str) -> bytes:
    with open(file, "rb") as handle:
        return handle.read()


def trust_group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """On every rank: save at ZeRO-2, then load each planted payload, verify or not."""
    model, opt = cases.build("fp32", stage=2)
    cases.train(model, opt, range(2))
    path = os.path.join(root, "ckpt")
    checkpoint.save(opt, path)
    snapshot = snapshot_dir(path)
    files = {name: _read(os.path.join(snapshot, name)) for name in os.listdir(snapshot)}
    before = cases.snapshot(opt)
    results: dict[str, Any] = {}
    for name, (payload, refused, marker) in payloads(os.path.join(root, "markers")).items():
        for nested in (False, True):
            for verify in (True, False):
                if rank == 0:
                    plant(path, hostile(files[".metadata"], payload, nested))
                dist.barrier()
                got = cases.capture(functools.partial(checkpoint.load, opt, path, verify=verify))
                dist.barrier()
                got.pop("trace", None)
                got["refused"] = refused
                got["ran"] = os.path.exists(marker)
                results[f"{name}/nested={nested}/verify={verify}"] = got
    after = cases.snapshot(opt)
    unchanged = all(
        torch.equal(a, b) for a, b in zip(before["masters"], after["masters"], strict=True)
    )
    if rank == 0:
        for name, data in files.items():
            with open(os.path.join(snapshot, name), "wb") as handle:
                handle.write(data)
    dist.barrier()
    clean = cases.capture(lambda: checkpoint.load(opt, path))
    clean.pop("trace", None)
    return {"loads": results, "unchanged": unchanged, "clean": clean}
