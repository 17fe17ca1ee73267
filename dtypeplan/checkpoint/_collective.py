"""The optimizer's process group as a checkpoint sees it: objects exchanged, failures agreed on.

Every step of ``save`` and ``load`` that can fail on one rank runs through :meth:`Group.agree`
or :meth:`Group.dcp`, so that a failure anywhere raises on every rank and no rank is left
waiting in a later collective.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dtypeplan.checkpoint._errors import CheckpointError, CheckpointMismatchError

__all__ = ["Group"]

_NO_DIST_WARNING = "torch.distributed is disabled"

T = TypeVar("T")


class Group:
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
            detail = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in failures)
            raise CheckpointError(f"{path}: {doing} the checkpoint failed: {detail}", path) from exc
        except Exception as exc:
            raise CheckpointError(f"{path}: {doing} the checkpoint failed: {exc!r}", path) from exc
