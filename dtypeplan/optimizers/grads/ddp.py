"""Cooperation with ``torch.nn.parallel.DistributedDataParallel`` around parameters we own.

Accelerate's defaults, Lightning's ``32-true`` and the HF Trainer wrap the model in DDP. DDP's
reducer has hooks of its own on every parameter, which run right after the optimizer's
``post_accumulate_grad`` hook: by then the optimizer has taken ``.grad`` in and freed it. Left
alone, DDP would copy every gradient into its buckets, all-reduce them (a second reduction on
the wire, besides the optimizer's own in ``comm_dtype``) and at the end of backward write a
``.grad`` per parameter (the whole model's bytes), which ``step()`` would take for a gradient
set by hand. Letting DDP reduce instead is not an option: it reduces every micro-batch in the
parameter dtype, where the plan reduces once per step in ``comm_dtype``, sharded or not.

DDP leaves no mark on the parameters it wraps, so :func:`watch_for_wrappers` records each
wrapper whose forward runs while some optimizer has yet to run its first backward (a global
forward pre-hook, held only that long: no walk over the live objects, which is slow in a large
program and runs code on some of them), and hooks that wrapper's forwards from then on
(:func:`_before_forward`, :func:`_after_forward`). A wrapper whose forward ran only before the
optimizer was built and not since is not found. A found wrapper is handled in two layers:

* **Quiet**: before each forward of a wrapper whose every parameter that DDP reduces
  (``requires_grad``, not in its ignore list) a live dtypeplan optimizer owns, its
  ``require_backward_grad_sync`` is turned off for that forward, which is what ``no_sync()``
  does: DDP's forward does not arm its reducer, whose hooks then return at once. No bucket
  copy, no collective (not even ``find_unused_parameters``' map of used parameters), no
  ``.grad`` written. It starts with the first forward the watching hook sees, so even the
  first iteration is quiet. The flag is put back right after the forward (a forward hook that
  runs on an error as well), and ``require_forward_param_sync`` set as DDP would have set it
  had it synchronized: so the program's own ``no_sync()`` and flag keep their meaning, and DDP
  broadcasts its buffers from rank 0 exactly as often as without dtypeplan (that is DDP's
  meaning for buffers). "All owned?" is asked per forward (the answer cached until ownership
  changes, ``ownership.version``): once the optimizer is closed or collected, the wrapper's
  next forward arms DDP again and it reduces as usual. Nothing of DDP's is changed between
  forwards, so nothing needs restoring.
* **Fallback**, for a wrapper whose parameters dtypeplan owns only in part, a reducer armed
  anyway (a framework calling ``reducer.prepare_for_backward`` itself: Accelerate's
  ``trigger_sync_in_backward``) and ``static_graph``'s first iteration (DDP queues its
  delayed all-reduce of every bucket whatever the flag, and asserts an armed reducer): the
  first forward of a wrapper around any parameter dtypeplan owns registers
  :func:`_reduced_by_dtypeplan` as its communication hook (so before its first backward, as
  DDP's contract asks: without a hook DDP divides each gradient by the world size as it copies
  it into the bucket, with one it leaves that to the hook; the optimizer's first backward
  registers it, :func:`cooperate_with_ddp`, only on a wrapper whose parameters it came to own
  after that forward). A bucket whose parameters a live dtypeplan optimizer all owns goes
  nowhere (the completed future DDP's documentation calls a no-op hook); any other bucket is
  all-reduced as DDP would (mean), so parameters outside dtypeplan keep DDP's meaning. Right
  after DDP has written its zeros into ``.grad`` (an autograd callback queued behind DDP's
  own), the optimizer drops them (:class:`ReductionScheduler` calls the engine back), so that
  after backward ``.grad`` is None as without DDP, and a ``.grad`` found at ``step()`` is one
  the program set. The callback runs after every backward of a found wrapper, quiet or not
  (a pass over the optimizer's parameters that finds nothing to drop when DDP was quiet).

Every DDP option keeps that meaning: ``gradient_as_bucket_view`` (quiet: DDP never points
``.grad`` at its bucket; fallback: the view is dropped the same way and DDP zeroes it next
time), ``find_unused_parameters``, ``static_graph`` (quiet from its second iteration),
``no_sync()`` (DDP takes no part at all). A wrapper that already has a communication hook of
its own is refused (at the first forward that registers dtypeplan's): dtypeplan reduces, and
two reductions cannot both be right.

The limit: DDP's constructor allocates its buckets (as many bytes as the gradients it would
reduce: 14 GB for 7B parameters in bf16) before dtypeplan can see the wrapper, and they stay
allocated, unused, while it is quiet; with ``find_unused_parameters`` its forward still passes
the outputs through its ``_DDPSink`` (a copy of each). No public way frees or skips them. The
way out is not to wrap: dtypeplan needs no wrapper, and the integrations (HF Trainer,
Accelerate, Lightning) keep their framework from wrapping.
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
_STATE = "_dtypeplan_ownership"
"""Attribute holding the :class:`_Ownership` of a wrapper whose forwards dtypeplan hooks."""

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
        if not hasattr(module, _STATE):
            _hook_forwards(module)  # type: ignore[arg-type]


def _owned(param: torch.Tensor) -> bool:
    return ownership.owner_of(param) is not None


class _Ownership:
    """What live dtypeplan optimizers own of the parameters a wrapper's DDP reduces
    (``requires_grad`` and not in its ignore list), as of ``ownership.version``; and whether
    the running forward turned DDP's sync off."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        ignored = ddp.parameters_to_ignore
        self.reduced = [
            p
            for name, p in ddp.module.named_parameters()
            if p.requires_grad and name not in ignored
        ]
        self.version = -1
        self.any_owned = False
        self.all_owned = False
        self.silenced = False

    def refresh(self) -> None:
        version = ownership.version()
        if version != self.version:
            self.version = version
            owned = [_owned(p) for p in self.reduced]
            self.any_owned, self.all_owned = any(owned), bool(owned) and all(owned)


def _hook_forwards(ddp: DistributedDataParallel) -> None:
    """Hook :func:`_before_forward` and :func:`_after_forward` around every forward of
    ``ddp`` from now on.

    Called from the global pre-hook of ``ddp``'s own forward: the wrapper's pre-hooks of this
    call were read before, so :func:`_before_forward` runs here once; its forward hooks are
    read after the forward, so :func:`_after_forward` runs for this call too."""
    setattr(ddp, _STATE, _Ownership(ddp))
    ddp.register_forward_pre_hook(_before_forward)
    ddp.register_forward_hook(_after_forward, always_call=True)
    _before_forward(ddp, ())


def _before_forward(ddp: DistributedDataParallel, args: Any) -> None:
    """Before DDP's forward: dtypeplan's communication hook on a wrapper around parameters it
    owns (before any backward: DDP divides a gradient as it copies it into its bucket when no
    hook is registered, and leaves the division to the hook otherwise, so a hook registered
    mid-backward divides twice what was copied before it); no backward sync for this forward
    when dtypeplan owns all that DDP would reduce (what ``no_sync()`` does; the program's own
    ``no_sync()`` already did)."""
    state: _Ownership = getattr(ddp, _STATE)
    state.refresh()
    if state.any_owned:
        _cooperate(ddp)
    if not (state.all_owned and ddp.require_backward_grad_sync):
        return
    if ddp.static_graph and not getattr(ddp, "_static_graph_delay_allreduce_enqueued", False):
        # static_graph's first backward reduces every bucket whatever the flag, on a reducer
        # that must be armed (DDP asserts so): armed, it goes through the communication hook.
        return
    ddp.require_backward_grad_sync = False
    state.silenced = True


def _after_forward(ddp: DistributedDataParallel, args: Any, output: Any) -> None:
    """After DDP's forward: its flags as if it had synchronized, so that its next forward
    broadcasts the buffers as it would have, and the program reads back the flag it set. After
    an error in forward as well (then the next forward broadcasts, which DDP's first does)."""
    state: _Ownership = getattr(ddp, _STATE)
    if state.silenced:
        state.silenced = False
        ddp.require_backward_grad_sync = True
        ddp.require_forward_param_sync = torch.is_grad_enabled()


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
    """Register dtypeplan's communication hook on every DDP wrapper around ``params`` (done
    already by the wrapper's forward, unless the parameters were owned only after it).

    Returns whether there is any such wrapper (then DDP writes ``.grad`` at the end of each
    backward it was armed for, and the caller drops what it wrote).
    """
    found = wrappers_of(params)
    for ddp in found:
        _cooperate(ddp)
    return bool(found)


def _cooperate(ddp: DistributedDataParallel) -> None:
    """Register :func:`_reduced_by_dtypeplan` on ``ddp`` once; refuse a hook of its own."""
    if getattr(ddp, _COOPERATING, False):
        return
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
