"""``torch_autocast``: the ``torch.autocast`` context of a plan, and a module's forward under it.

DeepSpeed's engine runs ``forward`` under ``torch.autocast(dtype=torch_autocast.dtype)`` itself;
dtypeplan has no engine, so :meth:`PrecisionPlan.prepare_model` installs the same context
around the model's ``forward`` with a pair of forward hooks (:func:`forward_under_autocast`).
Hooks rather than a wrapper module keep the parameter names (checkpoints, ``state_dict``) and
the module's class (FSDP2 swaps it at ZeRO-3), and they reach a pipeline stage's forward, which
the schedule calls and the program cannot wrap. :func:`autocast_context` is the context for
code outside the model (a loss computed under autocast, as DeepSpeed's docs suggest for a loss
function). Backward needs no context: autograd replays the casts forward recorded.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = [
    "DeviceLike",
    "autocast_context",
    "device_type_of",
    "forward_under_autocast",
    "params_without_autocast",
]

DeviceLike = str | torch.device | torch.nn.Module | None
"""Where autocast runs: a device type (``"cuda"``), a device, a module (the device of its
first parameter or buffer), or ``None`` (the current accelerator, else the CPU)."""

_HANDLES = "_dtypeplan_autocast_hooks"
"""The module attribute holding the hooks :func:`forward_under_autocast` installed."""

_PARAM_MARK = "_dtypeplan_forward_autocast"
"""The parameter attribute naming the autocast dtype its module's forward runs under."""


def device_type_of(where: DeviceLike) -> str:
    """The ``device_type`` argument of ``torch.autocast`` for ``where`` (see ``DeviceLike``)."""
    if isinstance(where, torch.nn.Module):
        tensor: torch.Tensor | None = next(iter(where.parameters()), None)
        if tensor is None:
            tensor = next(iter(where.buffers()), None)
        where = None if tensor is None else tensor.device  # a DTensor reports its local device
    if isinstance(where, torch.device):
        return where.type
    if isinstance(where, str):
        return torch.device(where).type
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            return accelerator.type
    return "cpu"


def autocast_context(
    dtype: torch.dtype | None, where: DeviceLike = None
) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast(device_type, dtype)``, or a context that does nothing for ``None``."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type_of(where), dtype=dtype)


def forward_under_autocast(module: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Make every call of ``module`` run under :func:`autocast_context` (``dtype``, the device
    of the module's parameters at the call). ``None`` removes what an earlier call installed;
    calling it again replaces the hooks, so a module is never wrapped twice."""
    for handle in getattr(module, _HANDLES, ()):
        handle.remove()
    for param in module.parameters():
        setattr(param, _PARAM_MARK, dtype)
    if dtype is None:
        if hasattr(module, _HANDLES):
            delattr(module, _HANDLES)
        return
    hooks = _AutocastHooks(dtype)
    handles: tuple[RemovableHandle, ...] = (
        module.register_forward_pre_hook(hooks.enter),
        # always_call: also when forward raises, so autocast never stays on after a failure.
        module.register_forward_hook(hooks.leave, always_call=True),
    )
    setattr(module, _HANDLES, handles)


def params_without_autocast(
    params: list[torch.Tensor], dtype: torch.dtype | None
) -> list[torch.Tensor]:
    """The parameters whose module :func:`forward_under_autocast` did not set to ``dtype``
    (none when ``dtype`` is None): a plan with ``torch_autocast`` built for them would train
    them in fp32 unless the program enters ``plan.autocast()`` itself."""
    if dtype is None:
        return []
    return [p for p in params if getattr(p, _PARAM_MARK, None) != dtype]


class _AutocastHooks:
    """The pre- and post-forward hooks of :func:`forward_under_autocast`: the context is
    entered before forward and left after it, per thread (autocast state is thread-local) and
    as a stack, so a re-entrant call leaves in order. A class, not closures, so that a prepared
    model still pickles (``torch.save(model)``)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {"dtype": self.dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["dtype"])  # type: ignore[misc]

    def _stack(self) -> list[contextlib.AbstractContextManager[Any]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def enter(self, module: torch.nn.Module, args: Any) -> None:
        context = autocast_context(self.dtype, module)
        context.__enter__()
        self._stack().append(context)

    def leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        if stack:
            stack.pop().__exit__(None, None, None)
