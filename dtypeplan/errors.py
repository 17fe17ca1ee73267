"""The exceptions that dtypeplan raises on purpose.

A bad config, rules file or registration is a ``ValueError``, so that callers who only know the
standard library still catch it; a failure while training (ranks that disagree, an fp16 scale
that cannot go lower) is a ``RuntimeError``.
"""

from __future__ import annotations

__all__ = [
    "MinimumLossScaleError",
    "NotSupportedError",
    "OptimizerUsageError",
    "PrecisionConfigError",
    "RankMismatchError",
    "RegistryError",
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
        self.message = message
        self.file = file
        self.line = line


class RegistryError(ValueError):
    """An implementation name registered twice, or asked for but never registered, or a
    registered class that is not a :class:`dtypeplan.MixedPrecisionOptimizer`."""


class MinimumLossScaleError(RuntimeError):
    """fp16 gradients overflowed again with the loss scale already at its minimum."""


class RankMismatchError(RuntimeError):
    """Ranks of one process group were given different plans or parameter shapes."""


class OptimizerUsageError(ValueError):
    """A call the optimizer cannot follow as made; the message says what to do instead.

    Raised at the call that causes it: a closed (replaced) optimizer stepped, a parameter
    listed twice, a param group added after build, a model changed in a way the flat buffers
    cannot follow (another dtype or device, a parameter unfrozen after build).
    """
