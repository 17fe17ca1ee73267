"""Importing torchao (directly, or through transformers' model and Trainer modules) without
the log lines that are not the user's to act on.

On a CPU build of torch torchao logs one warning per CUDA kernel library it cannot load (the
quantizers dtypeplan uses are plain torch code and need none), and torch's pytree logs a
deprecation of how torchao registers an enum: a few lines on every rank of every run. Other
warnings of those loggers, and everything after the import, are left as they are.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

__all__ = ["torchao_import_quiet"]


@contextlib.contextmanager
def torchao_import_quiet() -> Iterator[None]:
    """Within: torchao's and torch pytree's import-time warnings are not logged."""
    names = ["torch.utils._pytree"]
    if torch.version.cuda is None and torch.version.hip is None:
        names.append("torchao")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
