"""The exceptions that dtypeplan raises on purpose.

Each one is a ``ValueError`` so that callers who only know the standard library still catch it.
"""

from __future__ import annotations

__all__ = [
    "NotSupportedError",
    "OptimizerUsageError",
    "PrecisionConfigError",
    "RankMismatchError",
    "RulesError",
]


class PrecisionConfigError(ValueError):
    """The config is not valid, or asks for a combination the table calls an Error.

    ``path`` is the JSON path of the offending value (``$`` for the whole config).
    """

    def __init__(self, message: str, path: str = "$") -> None:
        super().__init__(message)
        self.path = path


class NotSupportedError(ValueError):
    """The combination is valid but no implementation is registered for it yet."""


class RulesError(ValueError):
    """A rules file is not valid. The message starts with ``file:line``."""

    def __init__(self, message: str, file: str = "<rules>", line: int | None = None) -> None:
        location = f"{file}:{line}" if line is not None else file
        super().__init__(f"{location}: {message}")
        self.file = file
        self.line = line


class RankMismatchError(RuntimeError):
    """Ranks of one process group were given different plans or parameter shapes."""


class OptimizerUsageError(ValueError):
    """A call the optimizer cannot follow as made; the message says what to do instead.

    Raised at the call that causes it: a closed (replaced) optimizer stepped, a parameter
    listed twice, a param group added after build, a model changed in a way the flat buffers
    cannot follow (another dtype or device, a parameter unfrozen after build).
    """
