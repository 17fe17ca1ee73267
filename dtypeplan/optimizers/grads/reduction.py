"""The backward-time scheduler of gradient reductions for the flat engine.

It owns everything between autograd producing a gradient and ``step()`` reading this rank's
reduced chunk: the ``post_accumulate_grad`` hooks, the bucket bookkeeping, the asynchronous
collectives in flight, the flush at the end of backward and the step's reduction of a whole
accumulator (started early, inside the last backward, under ``last_micro_batch=True``).

Its life cycle is one :class:`Phase`::

    EMPTY --hook / backward()--> BACKWARD --end of backward--> ACCUMULATED --> BACKWARD ...
      ^                             |   (last_micro_batch, whole accumulator)
      |                             +--end of backward--> REDUCING
      |        reduced_grads() (step, or clip_grad_norm_) from any idle phase: REDUCED
      +-------- end_step() / zero_grad() -------------------------+

``backward()`` enters ``ARMED`` before autograd runs, so that a micro-batch whose loss reaches
no parameter (no hook fires) is still seen and still takes part in the reductions.

Besides the gradients, it records which parameters got one in the accumulation window
(``window_touched``, across micro-batches), so that ``step()`` can leave the others alone as
``torch.optim`` does, and it takes in ``.grad`` set by hand before a step into a whole accumulator
(:meth:`add_hand_set`).

The hooks hold the scheduler weakly and belong to the optimizer's :class:`HookSet`, so they
never keep the optimizer or its buffers alive and go away with it.

Knowing the boundary without being told: given ``accumulation_steps`` (DeepSpeed's
``gradient_accumulation_steps``), the scheduler counts backward passes since the last step and
treats the last one as ``last_micro_batch=True``, so that a pipeline schedule's or a training
loop's bare ``loss.backward()`` gets the same overlap as ``opt.backward(loss,
last_micro_batch=True)``.

Known, the boundary also takes the clipping norm off the step: each chunk final in the
boundary backward (a whole accumulator's bucket once its step reduction is finished, a
sharded accumulator's chunk once the last reduce-scatter is added in) has its squared norm
taken at once (``final_sq_norms``), and the step takes only the others'. The values are the
ones the step would compute, bit for bit. A pass after the one counted last (a sharded
accumulator allows it) drops the norms of the chunks it changes.

A hybrid layout (``across``, ``dtypeplan.comm._levels``) adds a second level: each chunk
reduce-scattered within the shard group is all-reduced across the replica group, a whole
accumulator's bucket as part of its step reduction, a sharded accumulator's chunks once per
step in :meth:`reduced_grads` (their boundary norms, taken before, are then dropped).

Rules that keep ranks paired: buckets are issued in one fixed order on every rank (a complete
bucket waits for its predecessors), and whatever is left is issued at the end of backward,
with zeros for parameters that got no gradient.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import torch

from dtypeplan.comm import Communicator
from dtypeplan.comm._levels import AcrossGroups
from dtypeplan.errors import OptimizerUsageError
from dtypeplan.optimizers.buffers.group_state import GroupState
from dtypeplan.optimizers.grads.ddp import cooperate_with_ddp, watch_for_wrappers
from dtypeplan.optimizers.grads.factor import chunk_sq_norms
from dtypeplan.optimizers.grads.owned import OwnedGradient
from dtypeplan.optimizers.grads.ownership import HookSet

__all__ = ["MAX_IN_FLIGHT", "InFlightReduction", "Phase", "ReductionScheduler", "accumulate_"]

MAX_IN_FLIGHT = 2
"""Bucket reductions that may run while backward goes on: reduce-scatters of a sharded
accumulator (each holds its bucket's staging buffer until it completes), and the step's
reductions that ``last_micro_batch=True`` starts (each may hold a wire-dtype copy of its
bucket), so that their temporaries stay a few buckets' worth, not the accumulator's size."""
_UPCAST_CHUNK = 1 << 20


def accumulate_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` without a full-size temporary when the dtypes differ.

    A mixed-dtype ``add_`` materializes ``src`` in ``dst``'s dtype first on CPU; chunking bounds
    that temporary to ``_UPCAST_CHUNK`` elements. A GPU kernel converts as it reads (no
    temporary), and chunks there would only multiply the launches.
    """
    if dst.dtype == src.dtype or dst.numel() <= _UPCAST_CHUNK or dst.device.type != "cpu":
        dst.add_(src)
        return
    flat_dst, flat_src = dst.view(-1), src.reshape(-1)
    for begin in range(0, flat_dst.numel(), _UPCAST_CHUNK):
        end = begin + _UPCAST_CHUNK
        flat_dst[begin:end].add_(flat_src[begin:end])


class Phase(enum.Enum):
    """Where the accumulation of one step stands."""

    EMPTY = "empty"
    """No gradient since ``zero_grad()`` / ``step()``: the next backward writes, not adds."""
    ARMED = "armed"
    """``backward()`` has begun a micro-batch; autograd has reached no parameter yet."""
    BACKWARD = "backward"
    """Hooks are firing; the end-of-backward callback is queued."""
    ACCUMULATED = "accumulated"
    """The accumulator holds the sum of whole micro-batches."""
    REDUCING = "reducing"
    """The last micro-batch has started the step's reductions: only step or zero_grad next."""
    REDUCED = "reduced"
    """The step's gradients are reduced (step, or clip_grad_norm_): only step or zero_grad."""


class BackwardPass(NamedTuple):
    """How the running micro-batch's gradients are taken in."""

    onto_empty: bool
    """The accumulator held nothing: gradients are copied, untouched parameters zeroed."""
    last_micro_batch: bool
    """A whole accumulator starts the step's reduction bucket by bucket during this pass."""
    boundary: bool
    """The last pass before the step, as far as the scheduler knows (``last_micro_batch=True``
    or ``accumulation_steps``): a chunk final after it gets its squared norm taken at once."""


class InFlightReduction(NamedTuple):
    """A micro-batch reduce-scatter of a sharded accumulator that has been started."""

    finish: Callable[[], None]
    """Waits for the collective (and finishes its reduction); call exactly once."""
    chunk: torch.Tensor
    """This rank's chunk of the accumulator, which the result ends up in."""
    target: torch.Tensor
    """Where the collective writes: ``chunk`` itself (first micro-batch) or a temporary."""
    staging: torch.Tensor
    """The bucket's staging buffer, kept alive until the collective completes."""
    pooled: torch.Tensor | None = None
    """The pool buffer ``staging`` is a view of (back to the pool once the collective is done);
    None: ``staging`` is its own buffer."""
    key: tuple[int, int] = (0, 0)
    """(param group, bucket) of the chunk."""
    boundary: bool = False
    """Started by the boundary pass: the chunk is final once this reduction is added in."""


class StepReduction(NamedTuple):
    """The step's reduction of one bucket of a whole accumulator, started."""

    finish: Callable[[], None]
    """Waits for the collective; :meth:`run` calls it once."""
    result: torch.Tensor
    """This rank's reduced chunk once ``finish`` ran."""
    done: list[bool]
    """Whether ``finish`` ran already (a one-element list: the tuple itself is immutable)."""

    def run(self) -> None:
        """Finish the collective unless done already."""
        if not self.done[0]:
            self.done[0] = True
            self.finish()


class ReductionScheduler:
    """Hooks, bucket bookkeeping and collectives in flight for the flat engine's groups."""

    def __init__(
        self,
        groups: list[GroupState],
        comm: Communicator,
        *,
        comm_dtype: torch.dtype,
        comm_method: str,
        sharded_accumulator: bool,
        hooks: HookSet,
        across: AcrossGroups | None = None,
        accumulation_steps: int | None = None,
        accumulation_source: str = "gradient_accumulation_steps",
        bare_backward_refusal: str | None = None,
    ) -> None:
        self.groups = groups
        self.bare_backward_refusal = bare_backward_refusal
        """Why a backward that ``opt.backward`` did not begin is refused (None: allowed)."""
        self.accumulation_steps = accumulation_steps
        """Backward passes per step, where known: the last one starts the step's reduction."""
        self.accumulation_source = accumulation_source
        """Where ``accumulation_steps`` came from, for the error of a backward after the last."""
        self._passes = 0
        self.comm = comm
        """The shard group: the reduce-scatters (the whole data-parallel group when flat)."""
        self.across = across
        """The second level of a hybrid layout (None: flat, one level)."""
        self.comm_dtype = comm_dtype
        self.comm_method = comm_method
        self.sharded_accumulator = sharded_accumulator
        self.phase = Phase.EMPTY
        self._pass: BackwardPass | None = None
        # The order in which every rank issues its bucket reductions.
        self._bucket_order = [(gi, b.index) for gi, s in enumerate(groups) for b in s.flat.buckets]
        self._position = {bucket: i for i, bucket in enumerate(self._bucket_order)}
        self._next_bucket = 0
        self._pending: list[list[int]] = []
        self._touched: list[list[bool]] = []
        self.window_touched: list[list[bool]] = [[False] * len(s.flat.params) for s in groups]
        """Per group and parameter: got a gradient since the accumulation window began."""
        self._staging: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in groups]
        # Staging buffers whose reduce-scatter is done, reused by the next buckets of the same
        # backward (dropped at its end, so that nothing is held between micro-batches).
        self._free_staging: list[torch.Tensor] = []
        self._staging_numel = max((b.numel for s in groups for b in s.flat.buckets), default=0)
        self._in_flight: list[InFlightReduction] = []
        self._step_reductions: dict[tuple[int, int], StepReduction] = {}
        self.final_sq_norms: dict[tuple[int, int], torch.Tensor] = {}
        """Per (param group, bucket): the squared norm of this rank's reduced chunk, taken
        inside the boundary backward as soon as the chunk was final (while it is still in
        cache, and off the step's critical path). The step takes the norms of the others."""
        self._look_for_wrappers = True
        # DDP wrappers whose forward runs before the first backward are recorded; the
        # watching ends there (or with this object).
        self._stop_watching = watch_for_wrappers()
        weakref.finalize(self, self._stop_watching)
        self.ddp_wrapped = False
        """A DDP wrapper holds the parameters (found at the first backward, ``grads/ddp.py``)."""
        self.after_wrapped_backward: Callable[[], None] | None = None
        """Run after DDP's end of backward (which writes ``.grad``), when ``ddp_wrapped``."""
        self.after_step = False
        """The last ``step()`` used the gradients up; the placeholders in ``.grad`` are what it
        used (issue 29: torch would use them again), until ``zero_grad`` clears them."""
        self.check_grads: Callable[[], None] | None = None
        """Called before the first gradient of each backward is accumulated (and by the step):
        the optimizer looks at what the loop did to ``.grad`` since the last backward."""
        self._grads_checked = False
        for gi, state in enumerate(groups):
            for pi, param in enumerate(state.flat.params):
                hooks.add(param, _make_hook(weakref.ref(self), gi, pi))
                hooks.add_pre(param, _make_clear_placeholder(weakref.ref(self), weakref.ref(param)))
        self._reset_bookkeeping()

    def buffers(self) -> list[torch.Tensor]:
        """The staging buffers held right now (bucket gradients not yet reduce-scattered).

        Not listed: the fp32 chunks that the step's early reduce-scatters (stage 1, whole
        accumulator, ``last_micro_batch=True``) write into. They live from the last backward
        to ``step()`` only, as the chunks a plain ``step()`` allocates do, and ``plan.memory()``
        leaves both out.
        """
        held = [pooled for per_group in self._staging for _, pooled in per_group.values()]
        held += [work.staging if work.pooled is None else work.pooled for work in self._in_flight]
        return held + self._free_staging

    # --- one micro-batch ----------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch(self, *, last_micro_batch: bool) -> Iterator[None]:
        """Around ``loss.backward()`` run by the optimizer's ``backward``.

        A micro-batch that reaches no parameter fires no hook; it still ends here, so it takes
        part in the sharded reductions (with zeros) and the ranks stay paired.
        """
        self._refuse_after_last()
        self._pass = self._begin_pass(last_micro_batch)
        self.phase = Phase.ARMED
        try:
            yield
        except BaseException:
            self.abandon(after_error=True)
            raise
        if self.phase is Phase.ARMED:
            self._finish_backward()

    def _begin_pass(self, last_micro_batch: bool) -> BackwardPass:
        """Count one backward pass; the one that completes ``accumulation_steps`` is the last."""
        self._passes += 1
        at_boundary = bool(self.accumulation_steps) and self._passes == self.accumulation_steps
        return BackwardPass(
            onto_empty=self.phase is Phase.EMPTY,
            # A sharded accumulator is reduced every micro-batch anyway; a whole one can start
            # its boundary reduction bucket by bucket while the last backward goes on.
            last_micro_batch=(last_micro_batch or at_boundary) and not self.sharded_accumulator,
            boundary=last_micro_batch or at_boundary,
        )

    def _refuse_after_last(self) -> None:
        if self.phase is Phase.REDUCING:
            told = (
                f"the {self.accumulation_steps} micro-batches of {self.accumulation_source}"
                if self.accumulation_steps
                else "the micro-batch marked last_micro_batch=True"
            )
            fix = (
                "; if the loop runs more backward calls per step, set "
                "gradient_accumulation_steps to that number"
                if self.accumulation_steps
                else ""
            )
            raise RuntimeError(
                f"a backward after {told}: the step's gradient reduction has started already; "
                f"call step() (or zero_grad()) first{fix}"
            )
        if self.phase is Phase.REDUCED:
            raise OptimizerUsageError(
                "a backward after clip_grad_norm_(): the step's gradients are reduced already; "
                "call step() (or zero_grad()) first"
            )

    def _on_grad(self, gi: int, pi: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if self.phase is not Phase.BACKWARD:
            self._open_pass()
        assert self._pass is not None
        state = self.groups[gi]
        bucket = state.flat.bucket_of[pi]
        # A second gradient in one backward (a parameter used inside and outside a reentrant
        # torch.utils.checkpoint region): added to the first; only its bucket must not have
        # been sent yet, and it must not count towards the bucket twice.
        again = self._touched[gi][pi]
        if again and self._position[(gi, bucket)] < self._next_bucket:
            raise OptimizerUsageError(
                f"parameter {pi} of param group {gi} got a second gradient in one backward after "
                "its bucket's reduction had started (a parameter used both inside and outside "
                "torch.utils.checkpoint(..., use_reentrant=True)?): use use_reentrant=False, "
                "which gives each parameter one gradient per backward"
            )
        with torch.no_grad():
            if self.sharded_accumulator:
                flat = state.flat
                staging, _ = self._staging_of(gi, bucket)
                offset = flat.offsets[pi] - flat.buckets[bucket].start
                target = staging[offset : offset + grad.numel()]
                if again:
                    target.add_(grad.reshape(-1))
                else:
                    target.copy_(grad.reshape(-1))
            else:
                view = state.acc_param_views[pi]
                if self._pass.onto_empty and not again:
                    view.copy_(grad)
                else:
                    accumulate_(view, grad)
            self._touched[gi][pi] = True
            self.window_touched[gi][pi] = True
            if not again and (self.sharded_accumulator or self._pass.last_micro_batch):
                self._pending[gi][bucket] -= 1
                if self.sharded_accumulator:
                    self._issue_micro_batch_reductions(complete_only=True)
                else:
                    self._issue_step_reductions(complete_only=True)
        param.grad = None

    def _open_pass(self) -> None:
        """The first hook of a backward: queue the end-of-backward flush."""
        if self._look_for_wrappers:
            # Before DDP's own hook on this parameter runs, so before any bucket of DDP's is
            # reduced: its communication hook is in place for the first one (the wrapper's
            # forward registered it already, unless these parameters were owned only later).
            self._look_for_wrappers = False
            self.ddp_wrapped = cooperate_with_ddp(p for s in self.groups for p in s.flat.params)
            self._stop_watching()
        if self.phase is not Phase.ARMED:
            # A bare loss.backward() (a pipeline schedule): no backward() call began it.
            if self.bare_backward_refusal is not None:
                raise OptimizerUsageError(self.bare_backward_refusal)
            self._refuse_after_last()
            self._pass = self._begin_pass(last_micro_batch=False)
        self.phase = Phase.BACKWARD
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_graph_task)

    def _end_of_graph_task(self) -> None:
        """The end of the autograd run that fired the pass's first hook: the end of backward,
        unless that run was nested in another (a reentrant ``torch.utils.checkpoint`` region
        runs its own backward inside the outer one, and the first hooks may fire in there).
        Then the pass goes on: a post-hook on the outer node being executed queues this
        callback again in the outer run, so that one backward is one pass, counted once."""
        outer = torch._C._current_autograd_node()
        if outer is None:
            self._finish_backward()
            if self.ddp_wrapped and self.after_wrapped_backward is not None:
                # Queued now, it runs after every callback queued during backward, DDP's end
                # of backward (which writes .grad) among them.
                torch.autograd.Variable._execution_engine.queue_callback(
                    self.after_wrapped_backward
                )
            return
        handles: list[torch.utils.hooks.RemovableHandle] = []

        def requeue(*_: object) -> None:
            handles.pop().remove()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_graph_task)

        handles.append(outer.register_hook(requeue))

    def _finish_backward(self) -> None:
        assert self._pass is not None
        with torch.no_grad():
            if self.sharded_accumulator:
                self._issue_micro_batch_reductions(complete_only=False)
                while self._in_flight:
                    self._complete_oldest()
                self._free_staging.clear()
            elif self._pass.last_micro_batch:
                self._issue_step_reductions(complete_only=False)
            elif self._pass.onto_empty:
                for state, touched in zip(self.groups, self._touched, strict=True):
                    for pi, was_touched in enumerate(touched):
                        if not was_touched:
                            state.acc_param_views[pi].zero_()
        self.phase = Phase.REDUCING if self._pass.last_micro_batch else Phase.ACCUMULATED
        self._pass = None
        self._grads_checked = False
        self._reset_bookkeeping()
        if not self.ddp_wrapped:  # else after DDP has written .grad (after_wrapped_backward)
            self.leave_placeholders()

    def leave_placeholders(self) -> None:
        """Put an :class:`OwnedGradient` in the ``.grad`` of every parameter whose gradient
        the accumulator holds in this window, so that code reading ``.grad`` (torch's
        ``clip_grad_norm_``) fails loudly instead of finding nothing (``grads/owned.py``)."""
        for state, touched in zip(self.groups, self.window_touched, strict=True):
            for param, was_touched in zip(state.flat.params, touched, strict=True):
                if was_touched and param.grad is None:
                    # Made now: the parameter's dtype may have changed since build (an error
                    # the step reports); assigning a .grad of another dtype would raise here.
                    param.grad = OwnedGradient(param)

    def _reset_bookkeeping(self) -> None:
        self._touched = [[False] * len(s.flat.params) for s in self.groups]
        self._pending = [[len(b.params) for b in s.flat.buckets] for s in self.groups]
        self._next_bucket = 0

    # --- sharded accumulator: a reduce-scatter per bucket and micro-batch ---------------------
    def _staging_of(self, gi: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's staging view and the pool buffer it is cut from.

        Taken from the pool (or allocated once) uninitialized: every parameter's range is
        written by its gradient or zeroed at the flush, and only the bucket's padding tail is
        zeroed here, so no full-size memset runs per bucket and micro-batch.
        """
        staging = self._staging[gi]
        if bucket not in staging:
            flat = self.groups[gi].flat
            info = flat.buckets[bucket]
            if self._free_staging:
                pooled = self._free_staging.pop()
            else:
                pooled = torch.empty(
                    self._staging_numel, dtype=self.comm_dtype, device=flat.buffer.device
                )
            view = pooled[: info.numel]
            last = info.params[-1]
            used = flat.offsets[last] + flat.params[last].numel() - info.start
            view[used:].zero_()
            staging[bucket] = (view, pooled)
        return staging[bucket]

    def _ready_buckets(self, complete_only: bool) -> Iterator[tuple[int, int, GroupState]]:
        """The buckets to send now, in the one order every rank follows: every bucket left, or
        (``complete_only``) those before the first one still waiting for a gradient."""
        while self._next_bucket < len(self._bucket_order):
            gi, bucket = self._bucket_order[self._next_bucket]
            if complete_only and self._pending[gi][bucket] > 0:
                return
            yield gi, bucket, self.groups[gi]
            self._next_bucket += 1

    def _issue_micro_batch_reductions(self, complete_only: bool) -> None:
        """Reduce-scatter staged buckets in the fixed order, stopping at an incomplete one."""
        assert self._pass is not None
        for gi, bucket, state in self._ready_buckets(complete_only):
            staging, _ = self._staging_of(gi, bucket)
            if not complete_only:
                # Parameters that got no gradient this micro-batch contribute zeros.
                flat = state.flat
                for pi in flat.buckets[bucket].params:
                    if not self._touched[gi][pi]:
                        offset = flat.offsets[pi] - flat.buckets[bucket].start
                        staging[offset : offset + flat.params[pi].numel()].zero_()
            chunk = state.acc_chunks[bucket]
            # The first micro-batch writes the reduced chunk in place; later ones add it.
            target = chunk if self._pass.onto_empty else torch.empty_like(chunk)
            finish = self.comm.start_reduce_scatter_mean(
                target, staging, self.comm_dtype, self.comm_method
            )
            self._in_flight.append(
                InFlightReduction(
                    finish,
                    chunk,
                    target,
                    *self._staging[gi].pop(bucket),
                    key=(gi, bucket),
                    boundary=self._pass.boundary,
                )
            )
            while len(self._in_flight) > MAX_IN_FLIGHT:
                self._complete_oldest()

    def _complete_oldest(self) -> None:
        work = self._in_flight.pop(0)
        work.finish()
        if work.target is not work.chunk:
            accumulate_(work.chunk, work.target)
        if work.boundary:
            self.final_sq_norms[work.key] = chunk_sq_norms([work.chunk])[0]
        else:  # a pass after the one thought last: the chunk changed
            self.final_sq_norms.pop(work.key, None)
        if work.pooled is not None:
            self._free_staging.append(work.pooled)

    # --- whole accumulator: the step's reduction, per bucket ----------------------------------
    def _issue_step_reductions(self, complete_only: bool) -> None:
        """Start the step's reduction of complete buckets, in the fixed order on every rank."""
        assert self._pass is not None
        for gi, bucket, state in self._ready_buckets(complete_only):
            if self._pass.onto_empty:
                for pi in state.flat.buckets[bucket].params:
                    if not self._touched[gi][pi]:
                        state.acc_param_views[pi].zero_()
            self._step_reductions[(gi, bucket)] = self._start_step_reduction(state, bucket)
            self._bound_step_reductions()

    def _bound_step_reductions(self) -> None:
        """Finish the oldest step reductions beyond ``MAX_IN_FLIGHT`` (their wire copies go),
        and take their chunks' squared norms. Without a group (one process) nothing is in
        flight: each is finished at once."""
        unfinished = [key for key, work in self._step_reductions.items() if not work.done[0]]
        allowed = MAX_IN_FLIGHT if self.comm.active else 0
        for key in unfinished[: max(0, len(unfinished) - allowed)]:
            work = self._step_reductions[key]
            work.run()
            self.final_sq_norms[key] = chunk_sq_norms([work.result])[0]

    def _start_step_reduction(self, state: GroupState, bucket: int) -> StepReduction:
        """Launch the reduction of one bucket of a whole accumulator.

        Its result is the accumulator's own bucket (all-reduce, stage 0) or a new fp32 chunk
        (reduce-scatter).
        """
        flat = state.flat
        full = flat.bucket_view(state.accumulator, flat.buckets[bucket])
        if flat.shards == 1:
            finish = self.comm.start_all_reduce_mean(full, self.comm_dtype, self.comm_method)
            return StepReduction(self._then_across(finish, full), full, [False])
        chunk = torch.empty(
            flat.buckets[bucket].chunk_numel(flat.shards),
            dtype=torch.float32,
            device=flat.buffer.device,
        )
        finish = self.comm.start_reduce_scatter_mean(chunk, full, self.comm_dtype, self.comm_method)
        return StepReduction(self._then_across(finish, chunk), chunk, [False])

    def _then_across(self, within: Callable[[], None], chunk: torch.Tensor) -> Callable[[], None]:
        """``within`` (the shard group's reduction of a bucket), followed in a hybrid layout by
        the all-reduce of this rank's ``chunk`` of it across the replica group. Ranks finish
        their step reductions in one order, so the second level pairs up as the first does."""
        across = self.across
        if across is None:
            return within

        def finish() -> None:
            within()
            across.start(chunk)()

        return finish

    def _reduce_across(self, chunks: list[tuple[tuple[int, int], torch.Tensor]]) -> None:
        """A sharded accumulator's chunks, summed within the shard group during backward:
        all-reduced across the replica group once per step, at most ``MAX_IN_FLIGHT`` at once
        (each may hold a wire-dtype copy of its chunk). The norms taken in the boundary
        backward were of the group's sums, not the world's: dropped, the step takes them."""
        assert self.across is not None
        in_flight: list[Callable[[], None]] = []
        for key, chunk in chunks:
            in_flight.append(self.across.start(chunk))
            self.final_sq_norms.pop(key, None)
            while len(in_flight) > MAX_IN_FLIGHT:
                in_flight.pop(0)()
        for finish in in_flight:
            finish()

    # --- .grad set by hand --------------------------------------------------------------------
    def add_hand_set(self, grads: Mapping[tuple[int, int], torch.Tensor]) -> None:
        """Whole accumulator: take the ``.grad`` found at ``step()`` (by ``(group, parameter)``)
        into their views, before the reduction (every rank reduces the whole accumulator
        anyway).

        Onto an accumulator that no backward wrote since ``zero_grad`` (stale data, not zeros)
        each gradient is copied and only what none covers is zeroed, as a backward's first
        micro-batch copies: one write per element, not a zeroing, a read and a write. The same
        values as adding onto zeros (``0 + x`` rounds as ``x``), but for the sign of a -0.0.
        """
        if not grads:
            return
        assert not self.sharded_accumulator
        if self.phase is Phase.REDUCING:
            raise OptimizerUsageError(
                "a .grad set by hand after backward(..., last_micro_batch=True): that "
                "backward started the step's reduction already; set .grad before it, or do "
                "not mark the micro-batch last"
            )
        onto_empty = self.phase is Phase.EMPTY
        with torch.no_grad():
            if onto_empty:
                for gi, state in enumerate(self.groups):
                    _zero_uncovered(state, [pi for g, pi in grads if g == gi])
                self.phase = Phase.ACCUMULATED
            for (gi, pi), grad in grads.items():
                view = self.groups[gi].acc_param_views[pi]
                if onto_empty:
                    view.copy_(grad)
                else:
                    accumulate_(view, grad)
                self.window_touched[gi][pi] = True
                self.final_sq_norms.pop((gi, self.groups[gi].flat.bucket_of[pi]), None)

    # --- the step -----------------------------------------------------------------------------
    def reduced_grads(self) -> list[list[torch.Tensor]]:
        """Per group, per bucket: this rank's chunk of the group-summed gradient.

        In the accumulation dtype (fp32 where a whole accumulator is reduce-scattered), not
        yet divided by ``comm.reduction_divisor`` (1 where the wire averaged) or the loss
        scale. The step's accumulation is over (phase REDUCED): only :meth:`end_step` or
        :meth:`abandon` come next.
        """
        if self.phase in (Phase.ARMED, Phase.BACKWARD):
            raise RuntimeError("step() was called while a backward pass is still running")
        if self.phase is Phase.REDUCED:
            raise RuntimeError("reduced_grads() twice in one step")
        if self.phase is Phase.EMPTY:
            # step() with no backward since zero_grad: the gradient is zero, not stale data.
            for state in self.groups:
                state.accumulator.zero_()
        if self.sharded_accumulator and self.across is not None:
            self._reduce_across(
                [
                    ((gi, b.index), state.acc_chunks[b.index])
                    for gi, state in enumerate(self.groups)
                    for b in state.flat.buckets
                ]
            )
        grads: list[list[torch.Tensor]] = []
        for gi, state in enumerate(self.groups):
            per_bucket = []
            for bucket in state.flat.buckets:
                if self.sharded_accumulator:
                    per_bucket.append(state.acc_chunks[bucket.index])
                    continue
                started = self._step_reductions.pop((gi, bucket.index), None)
                work = started or self._start_step_reduction(state, bucket.index)
                work.run()
                per_bucket.append(work.result)
            grads.append(per_bucket)
        self.phase = Phase.REDUCED
        return grads

    def end_step(self) -> None:
        """The step is done: the next backward starts a new accumulation window.

        The gradients the step used stay visible as placeholders in ``.grad`` (torch keeps
        ``.grad`` after its step), and :attr:`after_step` says they are used up.
        """
        self.leave_placeholders()
        self.after_step = any(any(touched) for touched in self.window_touched)
        self.phase = Phase.EMPTY
        self._passes = 0
        self._grads_checked = False
        self._reset_window()

    def restart(self) -> None:
        """:meth:`abandon`, but a backward that has begun (``ARMED``: ``opt.backward`` is
        running, no gradient taken yet) stays begun, now onto an empty accumulator."""
        armed = self._pass if self.phase is Phase.ARMED else None
        passes = self._passes
        self.abandon()
        if armed is not None:
            self._pass, self._passes = armed._replace(onto_empty=True), passes
            self.phase = Phase.ARMED
            self._grads_checked = True

    def drop_accumulated(self, gi: int, pi: int) -> None:
        """Forget what this window accumulated for parameter ``pi`` of group ``gi`` (its
        ``.grad`` was set to None, zeroed or replaced between backward passes): zero its part
        of the accumulator (a sharded one: of this rank's chunk), between backward passes."""
        assert self.phase in (Phase.ACCUMULATED, Phase.ARMED)
        state = self.groups[gi]
        flat = state.flat
        bucket = flat.bucket_of[pi]
        with torch.no_grad():
            if not self.sharded_accumulator:
                state.acc_param_views[pi].zero_()
            else:
                info = flat.buckets[bucket]
                size = info.chunk_numel(flat.shards)
                chunk_begin = info.start + state.shard_rank * size
                begin = max(flat.offsets[pi], chunk_begin)
                end = min(flat.offsets[pi] + flat.params[pi].numel(), chunk_begin + size)
                if begin < end:
                    state.acc_chunks[bucket][begin - chunk_begin : end - chunk_begin].zero_()
        self.final_sq_norms.pop((gi, bucket), None)

    def _reset_window(self) -> None:
        self.final_sq_norms.clear()
        for touched in self.window_touched:
            touched[:] = [False] * len(touched)

    def abandon(self, *, after_error: bool = False) -> None:
        """Forget the step's accumulation: a backward that raised, or ``zero_grad()``.

        The collectives in flight are waited for first, so that none still writes into the
        accumulator or a staging buffer once they are reused. After an error their own
        failures are suppressed: the error being raised is the one to report.
        """
        pending = [work.finish for work in self._in_flight]
        pending += [work.run for work in self._step_reductions.values()]
        self._in_flight.clear()
        self._step_reductions.clear()
        for finish in pending:
            if after_error:
                with contextlib.suppress(Exception):
                    finish()
            else:
                finish()
        for staging in self._staging:
            staging.clear()
        self._free_staging.clear()
        self._pass = None
        self.phase = Phase.EMPTY
        self._passes = 0
        self._grads_checked = False
        if not after_error:
            self.after_step = False
        self._reset_bookkeeping()
        self._reset_window()


def _zero_uncovered(state: GroupState, covered: list[int]) -> None:
    """Zero ``state``'s whole accumulator except the views of parameters ``covered``."""
    flat = state.flat
    spans = sorted((flat.offsets[pi], flat.offsets[pi] + flat.params[pi].numel()) for pi in covered)
    begin = 0
    for start, end in [*spans, (state.accumulator.numel(), state.accumulator.numel())]:
        if start > begin:
            state.accumulator[begin:start].zero_()
        begin = max(begin, end)


def _make_clear_placeholder(
    scheduler: weakref.ReferenceType[ReductionScheduler],
    param_ref: weakref.ref[torch.Tensor],
) -> Callable[[torch.Tensor], None]:
    """The gradient pre-hook: the first of a backward lets the optimizer look at ``.grad``
    (``check_grads``); then the next gradient replaces the placeholder, never adds to it."""

    def clear(_: torch.Tensor) -> None:
        owner = scheduler()
        if owner is not None and not owner._grads_checked:
            owner._grads_checked = True
            if owner.check_grads is not None:
                try:
                    owner.check_grads()
                except BaseException:
                    owner._grads_checked = False  # nothing was taken in: the next one looks
                    raise
                # Checked for this whole backward, even where the check restarted the window
                # (model.zero_grad() before a bare loss.backward()): looking again at a later
                # parameter's pre-hook would take the gradients this backward has already
                # taken in (their .grad freed) for dropped ones and restart mid-pass.
                owner._grads_checked = True
        param = param_ref()
        if param is not None and type(param.grad) is OwnedGradient:
            param.grad = None

    return clear


def _make_hook(
    scheduler: weakref.ReferenceType[ReductionScheduler], gi: int, pi: int
) -> Callable[[torch.Tensor], None]:
    """A hook that holds its scheduler weakly: it never keeps the optimizer alive."""

    def hook(param: torch.Tensor) -> None:
        owner = scheduler()
        if owner is not None:
            owner._on_grad(gi, pi, param)

    return hook
