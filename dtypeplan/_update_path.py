"""Which way the host's one-pass optimizer update runs in this process: compiled or eager.

``optimizers/kernels/one_pass.py`` compiles its update with torch.compile unless
``DTYPEPLAN_EAGER_UPDATE=1`` is set, and runs it eagerly (the same numbers) for the rest of the
process once a compile failed (no C++ compiler). Kept apart from the kernel so that
``plan.explain()`` can say which runs without the resolver importing the optimizers.
"""

from __future__ import annotations

import os

__all__ = ["EAGER_ENV", "compile_failed", "path"]

EAGER_ENV = "DTYPEPLAN_EAGER_UPDATE"
"""Set to ``1`` to run the one-pass update eagerly (no compile) in this process."""

_failures: list[str] = []
"""Why compiling failed in this process, if it did: the eager path runs after."""


def compile_failed(reason: str) -> None:
    """Record a failed compile: :func:`path` says ``"eager"`` from now on."""
    _failures.append(reason)


def path() -> str:
    """``"compiled"`` or ``"eager"``: which the host's one-pass update runs now."""
    forced = os.environ.get(EAGER_ENV, "0") not in ("", "0")
    return "eager" if forced or _failures else "compiled"
