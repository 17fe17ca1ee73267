"""The optimizer's process group as a checkpoint sees it: objects exchanged, failures agreed on.

Every step of ``save`` and ``load`` that can fail on one rank runs through :meth:`Group.agree`
or :meth:`Group.dcp`, so that a failure anywhere raises on every rank and no rank is left
waiting in a later collective.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dtypeplan.checkpoint._errors import CheckpointError, CheckpointMismatchError

__all__ = ["Group"]

_NO_DIST_WARNING = "torch.distributed is disabled"
_LOW_SPACE = 16 * 2**20

T = TypeVar("T")


class Group:
    """The optimizer's process group, or a single process when torch.distributed is off."""

    def __init__(self, process_group: dist.ProcessGroup | None, path: str) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group
        self.path = path
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.size = dist.get_world_size(process_group) if self.distributed else 1

    def _peer_failure(self, op: str, exc: BaseException) -> CheckpointError:
        name = "the default group" if self.group is None else f"group {self.group.group_name!r}"
        return CheckpointError(
            f"{self.path}: {op} over {name} ({self.size} ranks) failed on rank {self.rank}: a "
            f"peer rank died or stalled past the group's timeout ({type(exc).__name__}: "
            f"{str(exc).strip()[:300]}); the checkpoint step did not complete on every rank",
            self.path,
        )

    def all_gather(self, value: T) -> list[T]:
        if not self.distributed or self.size == 1:
            return [value]
        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, value, group=self.group)
        except RuntimeError as exc:  # gloo/NCCL report a dead or stalled peer this way
            raise self._peer_failure("all_gather_object", exc) from exc
        return out

    def broadcast(self, value: T) -> T:
        """``value`` of group rank 0, on every rank."""
        if not self.distributed or self.size == 1:
            return value
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        box = [value]
        try:
            dist.broadcast_object_list(box, src=src, group=self.group)
        except RuntimeError as exc:
            raise self._peer_failure("broadcast_object_list", exc) from exc
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

    def dcp(self, fn: Callable[[], T], path: str, doing: str) -> T:
        """Run a DCP call; its failures (raised on every rank alike) become a CheckpointError."""
        try:
            if self.distributed:
                return fn()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
                return fn()
        except CheckpointException as exc:
            failures = [(rank, wrapped[0]) for rank, wrapped in sorted(exc.failures.items())]
            ours = [e for _rank, e in failures if isinstance(e, CheckpointError)]
            if ours:
                raise CheckpointError(str(ours[0]), path) from exc
            detail = "; ".join(f"rank {rank}: {_cause(e)}" for rank, e in failures)
            raise CheckpointError(
                f"{path}: {doing} the checkpoint failed: {detail}{_free_space(path)}", path
            ) from exc
        except Exception as exc:
            raise CheckpointError(
                f"{path}: {doing} the checkpoint failed: {_cause(exc)}{_free_space(path)}", path
            ) from exc


def _cause(exc: BaseException) -> str:
    """The failure, led by its OS cause when it has one ("no space left on device: ...")."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"{os.strerror(seen.errno).lower()} ({type(exc).__name__}: {exc})"
        seen = seen.__cause__ or seen.__context__
    return f"{type(exc).__name__}: {exc}"


def _free_space(path: str) -> str:
    """A note when the filesystem is (nearly) full: torch's writer may report a full disk as a
    short write ("unexpected pos ...") that never mentions space."""
    try:
        info = os.statvfs(path)
    except (OSError, AttributeError):
        return ""
    free = info.f_bavail * info.f_frsize
    if free >= _LOW_SPACE:
        return ""
    return f" (the filesystem holding {path} has {free} bytes free: no space left on device?)"
