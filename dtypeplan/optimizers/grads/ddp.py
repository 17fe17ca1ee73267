"""Cooperation with ``torch.nn.parallel.DistributedDataParallel`` around parameters we own.

Accelerate's defaults, Lightning's ``32-true`` and the HF Trainer wrap the model in DDP. DDP's
reducer has hooks of its own on every parameter, which run right after the optimizer's
``post_accumulate_grad`` hook: by then the optimizer has taken ``.grad`` in and freed it, so
DDP reads no gradient, all-reduces a bucket of zeros (a second reduction on the wire, besides
the optimizer's own in ``comm_dtype``), and at the end of backward writes the zeros back into
``.grad``, which ``step()`` then took for a gradient set by hand. Letting DDP reduce instead
is not an option: it reduces every micro-batch in the parameter dtype, where the plan reduces
once per step in ``comm_dtype``, sharded or not.

So the optimizer cooperates, at its first backward (the wrapper exists by then: frameworks
wrap before training; DDP's own contract is that a communication hook is registered before
its buckets are reduced, and the first one is reduced after the optimizer's first hook):

* it finds the DDP wrappers around its parameters (:func:`wrappers_of`, once per optimizer)
  among the wrappers whose forward ran since it was built (DDP leaves no mark on the
  parameters it wraps, so :func:`watch_for_wrappers` records each wrapper's forward through
  a global forward pre-hook, held only while some optimizer has yet to run its first
  backward: no walk over the live objects, which is slow in a large program and runs code
  on some of them) and registers :func:`_reduced_by_dtypeplan` as their communication
  hook: a bucket whose parameters a live dtypeplan optimizer all owns goes nowhere (the
  completed future DDP's documentation calls a no-op hook); any other bucket is all-reduced
  as DDP would (mean), so parameters outside dtypeplan keep DDP's meaning. A wrapper whose
  forward ran only before the optimizer was built and not since is not found;
* right after DDP has written its zeros into ``.grad`` (an autograd callback queued behind
  DDP's own), it drops them (:meth:`ReductionScheduler` calls the engine back), so that after
  backward ``.grad`` is None as without DDP, and a ``.grad`` found at ``step()`` is one the
  program set.

Every DDP option keeps that meaning: ``gradient_as_bucket_view`` (``.grad`` is a view of the
bucket: dropped the same way; the next backward finds none and DDP zeroes its view),
``find_unused_parameters`` (DDP's small all-reduce of which parameters were used stays; the
buckets do not travel), ``static_graph`` (the first iteration's delayed reduction also goes
through the hook), and ``no_sync()`` (DDP takes no part at all). A wrapper that already has a
communication hook of its own is refused: dtypeplan reduces, and two reductions cannot both
be right.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from dtypeplan.errors import OptimizerUsageError
from dtypeplan.optimizers.grads import ownership

__all__ = ["cooperate_with_ddp", "watch_for_wrappers", "wrappers_of"]

_COOPERATING = "_dtypeplan_reduces"
"""Attribute set on a DDP wrapper whose communication hook is dtypeplan's."""

_SEEN: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()
"""The DDP wrappers whose forward ran while some optimizer watched (held weakly)."""
_WATCHERS: set[int] = set()
"""The tokens of the optimizers watching (:func:`watch_for_wrappers`)."""
_TOKENS = itertools.count()
_HOOK: list[RemovableHandle] = []
"""The global forward pre-hook, while any optimizer watches."""


def _record(module: torch.nn.Module, args: Any) -> None:
    # The type, not isinstance: the hook runs for every module's forward.
    if issubclass(type(module), DistributedDataParallel):
        _SEEN.add(module)  # type: ignore[arg-type]


def watch_for_wrappers() -> Callable[[], None]:
    """Record every DDP wrapper whose forward runs from now on, until the function returned
    is called (an optimizer calls it at its first backward, or when it is collected).

    A global module forward pre-hook does the recording while any optimizer watches; it is
    removed with the last watcher, so that training after the first backward pays nothing.
    """
    token = next(_TOKENS)
    _WATCHERS.add(token)
    if not _HOOK:
        _HOOK.append(torch.nn.modules.module.register_module_forward_pre_hook(_record))

    def stop() -> None:
        _WATCHERS.discard(token)
        if not _WATCHERS and _HOOK:
            _HOOK.pop().remove()

    return stop


def wrappers_of(params: Iterable[torch.Tensor]) -> list[DistributedDataParallel]:
    """The DDP wrappers whose module holds any of ``params``, among those whose forward ran
    while an optimizer watched (:func:`watch_for_wrappers`); none without a process group
    (DDP needs one)."""
    if not dist.is_available() or not dist.is_initialized():
        return []
    ids = {id(p) for p in params}
    if not ids:
        return []
    return [ddp for ddp in list(_SEEN) if any(id(p) in ids for p in ddp.module.parameters())]


def cooperate_with_ddp(params: Iterable[torch.Tensor]) -> bool:
    """Register dtypeplan's communication hook on every DDP wrapper around ``params``.

    Returns whether there is any such wrapper (then DDP writes ``.grad`` at the end of each
    synchronized backward, and the caller drops what it wrote).
    """
    found = wrappers_of(params)
    for ddp in found:
        if getattr(ddp, _COOPERATING, False):
            continue
        if getattr(ddp, "_comm_hooks", None):
            raise OptimizerUsageError(
                "the model is wrapped in DistributedDataParallel with a communication hook of "
                "its own, while a dtypeplan optimizer reduces these gradients itself (in the "
                "plan's communication_data_type, once per step): two reductions cannot both "
                "be right. Remove the hook (or do not wrap the model in DDP: dtypeplan needs "
                "no wrapper)"
            )
        try:
            ddp.register_comm_hook(ddp.process_group, _reduced_by_dtypeplan)
        except RuntimeError as exc:  # a built-in hook (fp16 compression) registered before
            raise OptimizerUsageError(
                "the model is wrapped in DistributedDataParallel with a built-in communication "
                f"hook ({exc}), while a dtypeplan optimizer reduces these gradients itself: "
                "remove the hook, or do not wrap the model in DDP (dtypeplan needs no wrapper)"
            ) from exc
        setattr(ddp, _COOPERATING, True)
    return bool(found)


def _owned(param: torch.Tensor) -> bool:
    return ownership.owner_of(param) is not None


def _reduced_by_dtypeplan(
    process_group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook: nothing on the wire for buckets dtypeplan reduces.

    Ownership is the same on every rank (each builds the same optimizer on the same model),
    so every rank makes the same choice per bucket and the collectives stay paired.
    """
    if all(_owned(p) for p in bucket.parameters()):
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(process_group, bucket)


# DDP checks the hook's annotations as objects; this module's are strings (postponed).
_reduced_by_dtypeplan.__annotations__.update(
    bucket=dist.GradBucket, process_group=dist.ProcessGroup
)
_reduced_by_dtypeplan.__annotations__["return"] = torch.futures.Future[torch.Tensor]
