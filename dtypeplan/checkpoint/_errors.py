"""The errors a checkpoint raises; every rank raises the same one (see ``_collective``)."""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointMismatchError"]


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or corrupt, or could not be written.

    ``path`` is the checkpoint directory the message is about.
    """

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the optimizer (parameters or optimizer type differ)."""
