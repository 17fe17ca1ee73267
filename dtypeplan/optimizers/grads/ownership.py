"""Which live optimizer owns each parameter, and the hooks that belong to its lifetime.

An optimizer of the flat engine (and ZeRO-3 under 16-bit accumulation) consumes ``.grad`` in a
``post_accumulate_grad`` hook on every parameter. Those hooks must not outlive the optimizer:
a second optimizer built on the same parameters would get no gradient (the first one's hooks
fire first and free ``.grad``), and hooks that held the optimizer kept it and its buffers
alive. So:

* hooks hold their optimizer weakly (see :class:`HookSet`) and are removed by ``close()`` or,
  through ``weakref.finalize``, when the optimizer is collected;
* a module-level registry maps each parameter to the optimizer that owns it. Building a new
  optimizer on a parameter that a live one owns *replaces* the old one: it is closed, with a
  warning naming how many parameters moved, as ``torch.optim`` users expect a fresh optimizer
  to take over.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "HookSet",
    "ParamWeakMap",
    "claim",
    "owner_of",
    "release",
    "user_stacklevel",
    "version",
    "weak_key",
]


class _Closable(Protocol):
    def close(self) -> None: ...


def weak_key(param: torch.Tensor) -> torch.Tensor:
    """The tensor a weak map keys ``param`` by: a DTensor parameter's local shard.

    ``model.to(...)`` on an FSDP2 model (ZeRO-3) swaps each DTensor parameter with
    ``torch.utils.swap_tensors``, which refuses a tensor that any weak reference points to;
    frameworks call it on every model they receive. The local shard is never swapped by it.
    """
    local = getattr(param, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else param


class ParamWeakMap:
    """Parameter -> value, holding neither (keyed by identity through :func:`weak_key`)."""

    def __init__(self) -> None:
        # By identity: a tensor's == is elementwise, so WeakKeyDictionary cannot hold tensors.
        self._map: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def get(self, param: torch.Tensor, default: Any = None) -> Any:
        return self._map.get(weak_key(param), default)

    def __getitem__(self, param: torch.Tensor) -> Any:
        return self._map[weak_key(param)]

    def __contains__(self, param: object) -> bool:
        return isinstance(param, torch.Tensor) and weak_key(param) in self._map

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        self._map[weak_key(param)] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        del self._map[weak_key(param)]


_OWNERS = ParamWeakMap()
_VERSION = 0


def version() -> int:
    """A number that changes whenever the owner of any parameter may have changed: a claim, a
    release, an owner collected. An answer derived from ownership stays right while it stays
    (``grads/ddp.py`` asks per forward whether a wrapper's parameters are all owned)."""
    return _VERSION


def _changed(_: object = None) -> None:
    global _VERSION
    _VERSION += 1


def claim(owner: _Closable, params: Iterable[torch.Tensor]) -> None:
    """Record ``owner`` as the optimizer of ``params``, closing any live optimizer replaced."""
    params = list(params)
    replaced: dict[int, tuple[_Closable, int]] = {}
    for param in params:
        previous = _OWNERS.get(param)
        old = previous() if previous is not None else None
        if old is not None and old is not owner:
            _, moved = replaced.get(id(old), (old, 0))
            replaced[id(old)] = (old, moved + 1)
    for old, moved in replaced.values():
        warnings.warn(
            f"a new optimizer was built on {moved} parameter(s) that {type(old).__name__} "
            f"at 0x{id(old):x} owned: the old optimizer is closed (its gradient hooks removed, "
            "any later step() raises) so that the new one receives the gradients",
            stacklevel=user_stacklevel(),
        )
        old.close()
    ref = weakref.ref(owner, _changed)  # the callback: the owner collected, never closed
    for param in params:
        _OWNERS[param] = ref
    _changed()


def owner_of(param: torch.Tensor) -> object | None:
    """The live optimizer that owns ``param``, if any."""
    ref = _OWNERS.get(param)
    return ref() if ref is not None else None


def user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside dtypeplan (the user's ``plan.build``)."""
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("dtypeplan"):
        level, frame = level + 1, frame.f_back
    return level


def release(owner: _Closable, params: Iterable[torch.Tensor]) -> None:
    """Forget ``owner`` as the optimizer of ``params`` (those it still owns)."""
    for param in params:
        current = _OWNERS.get(param)
        if current is not None and current() in (owner, None):
            del _OWNERS[param]
    _changed()


class HookSet:
    """The gradient hooks of one optimizer: removed together, once, by close or collection.

    ``finalize_with(owner)`` ties them to ``owner``'s lifetime; the finalizer holds only the
    handles, never the owner.
    """

    def __init__(self) -> None:
        self.handles: list[RemovableHandle] = []
        self._finalizer: weakref.finalize | None = None

    def add(self, param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
        self.handles.append(param.register_post_accumulate_grad_hook(hook))

    def add_pre(self, param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
        """A hook on the gradient before autograd accumulates it into ``param.grad``."""
        self.handles.append(param.register_hook(hook))

    def finalize_with(self, owner: object) -> None:
        if self._finalizer is None:
            self._finalizer = weakref.finalize(owner, _remove_all, self.handles)

    def remove(self) -> None:
        _remove_all(self.handles)
        if self._finalizer is not None:
            self._finalizer.detach()


def _remove_all(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
