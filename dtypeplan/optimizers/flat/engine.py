"""The flat-buffer mixed-precision optimizer behind ZeRO stages 0, 1 and 2.

Design (one param group shown; every group has its own flat buffer, see ``buffers/layout.py``)::

    model params (param dtype)  = views into FlatGroup.buffer
    accumulator (accum dtype)   whole:   one tensor laid out like the buffer
                                sharded: this rank's chunks only, laid out like its shard
    master weights (fp32)       this rank's chunk of every bucket (all chunks at stage 0);
                                for fp32 parameters they are views of the buffer itself, and
                                so are bf16 master weights (``state/low_precision.py``)
    optimizer states (fp32)     kept by a fused ``torch.optim`` instance over the master chunks
                                (bf16 with ``bf16_optimizer_states``)
    with offload_optimizer cpu  masters and states in host memory; the update runs there, a
                                bucket chunk at a time, between copies (``buffers/host_offload.py``)

Phases of one step (the backward phase is ``grads/reduction.py``'s, the rest is
``step()``'s, one method each):

1. backward, per micro-batch. A ``post_accumulate_grad`` hook on every parameter consumes
   ``.grad`` as soon as autograd has produced it, and frees it:
   * whole accumulator: the gradient is added into the parameter's view of the accumulator
     (the first micro-batch after ``zero_grad`` copies, so nothing is ever memset);
   * sharded accumulator: the gradient is copied into its bucket's staging buffer (in the
     communication dtype); when a bucket is complete it is reduce-scattered and this rank's
     chunk is added into the accumulator. The reduce-scatters run asynchronously (at most
     ``MAX_IN_FLIGHT`` at once) while backward goes on, and are all complete when backward
     returns. Buckets are issued in a fixed order on every rank
     (a complete bucket waits for its predecessors) and the rest are flushed by a callback at
     the end of backward, so ranks never pair different collectives.
   Because the hooks fire inside autograd, ``loss.backward()`` run by a pipeline schedule takes
   the same path as ``opt.backward(loss)``. One difference: a micro-batch whose loss reaches
   no parameter fires no hook; ``opt.backward`` notices and still takes part in the sharded
   reductions (with zeros), a bare ``loss.backward()`` cannot.
2. ``step()`` at the accumulation boundary: pick up model changes -> reduce -> check/clip ->
   update -> write back.
   Model changes made after build (``model.load_state_dict``, ``param.data = ...``) are
   picked up first (``flat/model_sync.py``), and a ``.grad`` set by hand is taken in with a whole
   accumulator (copied onto an empty one; a sharded accumulator refuses it: every rank would
   have to learn of it). One small all-reduce carries the step's facts: the squared norm and
   which parameters got a gradient on any rank (the others are not updated, as in
   ``torch.optim``; ``grads/missing.py``).
   The accumulator is reduced over the group in the
   communication dtype (stage 0: all-reduce; stage 1 whole: reduce-scatter; sharded: already
   done). A whole accumulator starts that reduction earlier, bucket by bucket inside the last
   backward, when the caller marks it (``opt.backward(loss, last_micro_batch=True)``) or the
   plan's ``gradient_accumulation_steps`` says which backward is the last. NCCL averages on
   the wire; gloo sums and leaves ``comm.reduction_divisor`` to divide. Then the gradients are
   checked and clipped through one scalar all-reduce of the squared norm (a non-finite sum
   means some rank overflowed). A backward that knows it is the boundary takes the squared norm
   of each chunk it finishes reducing right then, while the chunk is in cache, so the step
   reads the gradients once, not twice (``ReductionScheduler.final_sq_norms``). The factor
   ``clip / (loss_scale * reduction_divisor)`` stays a device tensor (``grads/factor.py``): no host
   sync unless the step may be skipped (fp16, or the non-finite check), and no scaling pass,
   since torch's fused Adam/AdamW divide by it as their ``grad_scale`` (``kernels/torch_adam.py``).
   The update itself is the optimizer's update kernel's (``update/``): the first of
   its registry that serves the plan, device and optimizer class (host offload, the one-pass
   Triton AdamW on CUDA, torch's fused Adam/AdamW on fp32 or on 16-bit tensors, the
   low-precision and quantized families, or ``inner.step()``), chosen once. It is handed the
   reduced chunks, the factor and :meth:`_start_gather`: each bucket's chunk is written in the
   parameter dtype and its all-gather launched as soon as it is updated, while the next
   buckets update.

Hybrid layout (ZeRO-1/2 with ``plan.shard_group_size`` S < W; ``dtypeplan.comm._levels``):
"this rank's chunk" above is its chunk among the S ranks of its shard group (``shard_comm``:
the reduce-scatters and all-gathers), and the W/S shard groups hold the same chunks. A
bucket's reduction is the reduce-scatter within the group, then the all-reduce of this rank's
chunk across the replica group in ``plan.wire_across_groups``: with a whole accumulator as
each reduce-scatter finishes; with a sharded one once per step, at the boundary, on the chunk
accumulated over the micro-batches (a sum of sums: the same total, and traffic across groups
once per step; the wire across then carries the step's sum where the flat wire carries a
micro-batch's, so an fp16 wire may overflow there once more: caught as any overflow, the loss
scale backs off). ``comm`` stays the whole group (the step summary, whose squared norm gets one
slot per shard group so that each element counts once). Stage 0 has nothing to shard and
stays flat.

On one process every collective is skipped and the update is the plain ``torch.optim`` one. What
``state_dict`` and the checkpoints read and write of this engine is
``flat/checkpoint_state.py``'s.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from dtypeplan.comm import Communicator
from dtypeplan.comm._levels import levels
from dtypeplan.errors import OptimizerUsageError
from dtypeplan.optimizers.buffers.group_state import GroupState
from dtypeplan.optimizers.buffers.layout import FlatGroup
from dtypeplan.optimizers.contract.base import (
    HeldTensors,
    bare_backward_refusal,
    constructor_arguments,
    inner_optimizer,
)
from dtypeplan.optimizers.flat.checkpoint_state import FlatState
from dtypeplan.optimizers.flat.model_sync import ModelSync
from dtypeplan.optimizers.flat.own_histories import OwnHistories
from dtypeplan.optimizers.grads.ddp import wrappers_of
from dtypeplan.optimizers.grads.factor import chunk_sq_norms, sum_sq_norms
from dtypeplan.optimizers.grads.lifecycle import look_at_grads
from dtypeplan.optimizers.grads.missing import keep_untouched
from dtypeplan.optimizers.grads.owned import is_owned_gradient
from dtypeplan.optimizers.grads.reduction import ReductionScheduler
from dtypeplan.optimizers.kernels.torch_adam import FlatAdamUpdate
from dtypeplan.optimizers.state.low_precision import held_compensations, held_states
from dtypeplan.optimizers.update import UpdateKernel, choice_key, choose, write_params
from dtypeplan.optimizers.update.host_offload import host_offload_for
from dtypeplan.optimizers.update.pieces import LowPrecisionAdamUpdate
from dtypeplan.resolver._traffic import DEFAULT_BUCKET_NUMEL

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["DEFAULT_BUCKET_NUMEL", "FlatMixedPrecisionOptimizer"]


class PreparedStep(NamedTuple):
    """A step's gradients, reduced and summarized over the group, ready for the update."""

    grads: list[list[torch.Tensor]]
    """Per group, per bucket: this rank's chunk of the summed gradient."""
    sq_norm: torch.Tensor
    """The global squared norm of the summed (still scaled) gradient: 0-dim, on the device."""
    untouched: list[list[int]]
    """Per group: the parameters no rank gave a gradient in this window (not updated)."""
    any_touched: bool
    """Some rank gave some parameter a gradient (else the update is skipped altogether)."""


class FlatMixedPrecisionOptimizer(FlatState):
    """Mixed-precision data parallelism on flat buffers; ZeRO-1/2 when ``shard_state`` is set."""

    shard_state: bool = False
    """Whether master weights and optimizer states are sharded (ZeRO >= 1)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        plan: PrecisionPlan,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(params, plan=plan, process_group=process_group)
        self.comm = Communicator(process_group)
        """The whole data-parallel group: the step summary, consistency checks."""
        # Before the subgroups are made: ranks that disagree on the shard group size would
        # otherwise create different subgroups (a collective) and hang.
        self._check_ranks_agree(self.comm)
        self.levels = levels(
            self.comm,
            plan.shard_group_size,
            sharded=self.shard_state,
            comm_dtype=plan.comm_dtype,
            method=plan.comm_reduction,
            wire_across_groups=plan.wire_across_groups,
        )
        """The communicator per link level; a hybrid layout shards within ``shard_comm``."""
        self.shard_comm = self.levels.shard
        """The shard group (``comm`` itself when flat): reduce-scatters and all-gathers."""
        self.replica_rank = self.levels.replica_rank
        self.shards = self.shard_comm.world_size if self.shard_state else 1
        self.shard_rank = self.shard_comm.rank if self.shard_state else 0
        self.param_dtype = plan.param_dtype
        sharded_accumulator = plan.accumulator_sharded and self.shards > 1
        bucket_numel = plan.reduce_bucket_size or DEFAULT_BUCKET_NUMEL
        self._make_replicas_equal(self.comm)
        self.offload = host_offload_for(
            plan, [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        )
        self.groups: list[GroupState] = []
        for group in self.param_groups:
            trainable = [p for p in group["params"] if p.requires_grad]
            with torch.no_grad():
                # Frozen parameters are not the optimizer's, but the model must run in one dtype.
                for param in group["params"]:
                    if not param.requires_grad and param.is_floating_point():
                        param.data = param.data.to(self.param_dtype)
            flat = FlatGroup(
                trainable, self.param_dtype, self.shards, bucket_numel, self.comm.world_size
            )
            self.groups.append(
                GroupState(
                    flat,
                    shard_rank=self.shard_rank,
                    accum_dtype=plan.grad_accum_dtype,
                    sharded_accumulator=sharded_accumulator,
                    master_dtype=plan.master_dtype,
                    offload=self.offload,
                )
            )
        self._inner = self._build_inner_optimizer()
        self.own_histories = OwnHistories(plan.optimizer.torch_class, constructor_arguments(plan))
        """The parameter pieces whose state left their chunk's (``flat/own_histories.py``)."""
        self._adam_update: FlatAdamUpdate | LowPrecisionAdamUpdate = FlatAdamUpdate(
            self._inner, plan.optimizer.torch_class
        )
        self._low_precision = LowPrecisionAdamUpdate.for_plan(
            plan,
            self._inner,
            [m for s in self.groups for m in s.masters],
            self.shard_rank,
            segments=[lengths for s in self.groups for lengths in s.master_segments()],
        )
        if self._low_precision is not None:
            self._adam_update = self._low_precision
        self._kernel: UpdateKernel | None = None
        """The update of the master chunks, chosen at its first use (:attr:`update_kernel`)."""
        self._kernel_key: tuple[Any, ...] = ()
        """The param-group switches it was chosen for (``registry.choice_key``)."""
        self._zero_grads: list[tuple[weakref.ref[torch.Tensor], int]] = []
        """The zero ``.grad`` of ``zero_grad(set_to_none=False)`` (not set by hand)."""
        self.reductions = ReductionScheduler(
            self.groups,
            self.shard_comm,
            comm_dtype=plan.comm_dtype,
            comm_method=plan.comm_reduction,
            sharded_accumulator=sharded_accumulator,
            hooks=self.hooks,
            across=self.levels.across,
            # DeepSpeed's gradient_accumulation_steps: the boundary reduction starts inside the
            # last backward of a step without the caller marking it.
            accumulation_steps=self.accumulation.micro_batches if self.accumulation else None,
            accumulation_source=(
                self.accumulation.source if self.accumulation else "gradient_accumulation_steps"
            ),
            bare_backward_refusal=bare_backward_refusal(plan),
        )
        self.reductions.after_wrapped_backward = _call_weakly(self._drop_ddp_grads)
        self.reductions.check_grads = _call_weakly(self._check_grads)
        self.model_sync = ModelSync(self.groups, self.param_groups, self._inner.state)
        self._prepared: PreparedStep | None = None
        self._take_ownership()

    def _build_inner_optimizer(self) -> torch.optim.Optimizer:
        groups = []
        for group, state in zip(self.param_groups, self.groups, strict=True):
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({"params": state.masters, **hyper})
        fused = all(m.device.type in ("cpu", "cuda") for s in self.groups for m in s.masters)
        return inner_optimizer(self.plan, groups, fused=fused)

    @property
    def inner(self) -> torch.optim.Optimizer:
        """A fused ``torch.optim`` instance over the master chunks, one group per param group."""
        return self._inner

    @property
    def device(self) -> torch.device:
        """Where the parameters live (CPU for an optimizer without trainable parameters)."""
        for state in self.groups:
            if state.flat.params:
                return state.flat.buffer.device
        return torch.device("cpu")

    # --- the public view of the tensors -------------------------------------------------------
    def held_tensors(self) -> HeldTensors:
        return HeldTensors(
            # Offloaded: the masters and every state live in host memory.
            on_host=frozenset(("master", "optimizer_states") if self.offload else ()),
            params=tuple(state.flat.buffer for state in self.groups),
            grads=tuple(
                p.grad
                for g in self.param_groups
                for p in g["params"]
                if p.grad is not None and not is_owned_gradient(p.grad)
            ),
            accumulator=tuple(state.accumulator for state in self.groups)
            + tuple(self.reductions.buffers()),
            # With bf16 masters these are the parameters (counted there) and the Kahan
            # compensation, which plan.memory() counts as part of the master weights.
            master=tuple(m for state in self.groups for m in state.masters)
            + held_compensations(self.inner),
            optimizer_states=held_states(self.inner),
        )

    @torch.no_grad()
    def refresh_params(self) -> None:
        """Write the master weights into the parameters on every rank (cast, all-gather).

        Call it after changing the master weights in place (a checkpoint load does); the call
        is collective. What was written into the parameters before is then no change to pick
        up at the next step (``ModelSync.after_load``): the masters hold the values now.
        """
        self._write_back(cast=True)
        self.model_sync.after_load()

    # --- backward -----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool = False) -> None:
        self._check_open("backward()")
        with self.reductions.micro_batch(last_micro_batch=last_micro_batch):
            super().backward(loss)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the accumulator; ``set_to_none=False`` leaves zero ``.grad`` as torch does.

        A zero ``.grad`` is added into by the next backward (the hooks then take the sum) and,
        on a parameter that gets no gradient in the window, counts as a gradient (of zero), so
        that parameter is updated, as ``torch.optim`` would.
        """
        for param in (param for group in self.param_groups for param in group["params"]):
            param.grad = None
        self._restart_window([] if set_to_none else list(self.trainable_parameters()))

    def _restart_window(self, zeroed: Sequence[torch.Tensor]) -> None:
        """Drop the step's accumulation; ``zeroed`` get a zero ``.grad`` (a gradient of zero)."""
        self._prepared = None
        self._clip_coef = 1.0
        self.reductions.restart()
        self._zero_grads = []
        with torch.no_grad():
            for param in zeroed:
                param.grad = torch.zeros_like(param)
                self._zero_grads.append((weakref.ref(param.grad), param.grad._version))

    def _check_grads(self, call: str = "a backward") -> None:
        """What the loop did to ``.grad`` since the last backward (``grads/lifecycle.py``)."""
        zeros = [grad for ref, _ in self._zero_grads if (grad := ref()) is not None]
        outcome = look_at_grads(self.reductions, self.groups, zeros, call)
        if outcome.restart is not None:
            self._restart_window(outcome.restart)
        self._prepared = None if outcome.changed else self._prepared

    def _drop_ddp_grads(self) -> None:
        """Drop the ``.grad`` a DDP wrapper wrote at the end of backward (``grads/ddp.py``): the
        zeros of a bucket that went nowhere. ``zero_grad(set_to_none=False)``'s zeros that
        nothing wrote into stay (a gradient of zero, as without DDP)."""
        zeros = {
            id(grad)
            for ref, version in self._zero_grads
            if (grad := ref()) is not None and grad._version == version
        }
        for param in self.trainable_parameters():
            if param.grad is not None and id(param.grad) not in zeros:
                param.grad = None
        self.reductions.leave_placeholders()

    def clear_lp_grads(self) -> None:
        """The parameters' own ``.grad``; the placeholders of what the accumulator holds stay."""
        for group in self.param_groups:
            for param in group["params"]:
                if not is_owned_gradient(param.grad):
                    param.grad = None

    # --- step: pick up changes -> reduce -> check/clip -> update -> write back -----------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self._check_open("step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_grads("step()")
        prepared, self._prepared = self._prepared or self._prepare(), None
        try:
            divisor = self.scaler.scale * self.levels.reduction_divisor
            factor = self._check_and_clip(prepared.sq_norm, divisor)
            if factor is None:
                return loss
            if prepared.any_touched:
                self._update(prepared.grads, factor, prepared.untouched)
            # else no parameter got a gradient: torch.optim would not touch any, nor its states
            self.scaler.update(overflow=False)
        finally:
            self.reductions.end_step()
            # Working copies live only inside the step, so that what the rank holds between
            # steps is what plan.memory() says (the allocator may keep the memory cached).
            self._adam_update.release_scratch()
            if self.offload is not None:
                self.offload.release()
        return loss

    def _prepare_grad_norm(self) -> float:
        self._check_grads("clip_grad_norm_()")
        if self._prepared is None:
            self._prepared = self._prepare()
        sq_norm = float(self._prepared.sq_norm)  # clip_grad_norm_ returns it: one sync
        divisor = self.scaler.scale * self.levels.reduction_divisor
        return math.sqrt(sq_norm) / divisor if math.isfinite(sq_norm) else math.inf

    def _prepare(self) -> PreparedStep:
        """Everything before the update: model changes, hand-set grads, reduction, summary."""
        self.model_sync.pick_up()
        self.reductions.add_hand_set(self._take_hand_set_grads())
        self.reductions.leave_placeholders()  # what it holds stays visible until zero_grad
        grads = self.reductions.reduced_grads()
        sq_norm, untouched, any_touched = self._step_summary(grads)
        return PreparedStep(grads, sq_norm, untouched, any_touched)

    def _take_hand_set_grads(self) -> dict[tuple[int, int], torch.Tensor]:
        """The ``.grad`` found on parameters at step (set by hand: the hooks take the rest).

        Scaled by the loss scale, as the accumulator holds scaled gradients; ``.grad`` is
        freed as the hooks free it.
        """
        # Still zero_grad's zeros: the same tensor, never written since (a backward's in-place
        # add is taken by the hooks, which free .grad; a user's grad.copy_ bumps the version).
        zeros = {
            id(grad)
            for ref, version in self._zero_grads
            if (grad := ref()) is not None and grad._version == version
        }
        self._zero_grads = []
        found: dict[tuple[int, int], torch.Tensor] = {}
        scale = self.scaler.scale
        for gi, state in enumerate(self.groups):
            for pi, param in enumerate(state.flat.params):
                grad = param.grad
                if grad is None or is_owned_gradient(grad):
                    continue
                if id(grad) in zeros:
                    # zero_grad(set_to_none=False)'s zeros, never reached by a backward: a
                    # gradient of zero, so the parameter is updated as torch.optim would.
                    self.reductions.window_touched[gi][pi] = True
                elif self.reductions.sharded_accumulator:
                    if wrappers_of([param]):
                        raise OptimizerUsageError(
                            "a .grad written by a DistributedDataParallel wrapper made after "
                            "the optimizer's first backward (dtypeplan reduces the gradients, "
                            "DDP's reduction a no-op): wrap the model before training"
                        )
                    raise OptimizerUsageError(
                        "a .grad set by hand before step() with a sharded accumulator (ZeRO-2, "
                        "or gradient_accumulation_dtype.sharded: true): every rank would have "
                        "to learn of it and reduce-scatter it, which costs every step a host "
                        "sync; produce the gradients with backward(), or use a whole "
                        "accumulator (ZeRO-0/1). A DistributedDataParallel wrapper writes "
                        ".grad too when the optimizer did not see its forward between its "
                        "build and its first backward: build the optimizer before that forward"
                    )
                else:
                    found[(gi, pi)] = grad * scale if scale != 1.0 else grad
        for state in self.groups:
            for param in state.flat.params:
                if not is_owned_gradient(param.grad):
                    param.grad = None
        return found

    def _step_summary(
        self, grads_by_group: list[list[torch.Tensor]]
    ) -> tuple[torch.Tensor, list[list[int]], bool]:
        """The step's one all-reduce: ``[squared norm, touched flag per parameter...]`` (a
        hybrid layout: one squared-norm slot per shard group, ``levels.replicas`` of them).

        The norm slot is summed only where ranks hold different chunks (sharded states). The
        flags say which parameters some rank gave a gradient in this window; they are read on
        the host (a sync) only by a rank where some parameter got none locally, the rare case:
        a parameter touched here is touched everywhere. Returns the global squared norm (a
        device tensor), per group the parameters no rank touched, and whether any was.
        """
        local = self.reductions.window_touched
        check = self.hyperparameter_check
        flags = torch.tensor(
            [float(t) for per_group in local for t in per_group] + check.slots(),
            dtype=torch.float32,
        ).to(self.device, non_blocking=True)
        norm = self._local_sq_norm(grads_by_group).reshape(1)
        # One norm slot per shard group: each rank adds its chunks' norm into its group's slot,
        # so that slot 0 counts every element once (the other groups hold the same chunks, and
        # every rank reads the same bits). Flat: one slot.
        replicas, mine = self.levels.replicas, self.replica_rank
        if replicas > 1:
            norm = torch.cat([norm.new_zeros(mine), norm, norm.new_zeros(replicas - 1 - mine)])
        summary = torch.cat([norm, flags])
        if self.shards > 1 or replicas > 1:
            summary = self.comm.all_reduce_scalars(summary)
        elif len(summary) > 1:
            # Stage 0: every rank reduced the whole gradient; only the flags need summing.
            self.comm.all_reduce_scalars(summary[1:])
        if check.numel:
            # The hyperparameters' fingerprint rides on this all-reduce; raises where ranks
            # differ (before the update on the CPU, a step later on an accelerator).
            check.post(summary[len(summary) - check.numel :])
            summary = summary[: len(summary) - check.numel]
        # Under a pipeline, the other stages' norms too: one clip factor, one skip decision.
        sq_norm = self._across_pipeline(
            summary[0], self.scaler.scale * self.levels.reduction_divisor
        )
        if all(all(per_group) for per_group in local):
            return sq_norm, [[] for _ in local], True
        counts = summary[replicas:].tolist()  # some parameter got no gradient here: ask
        untouched: list[list[int]] = []
        for per_group in local:
            untouched.append([pi for pi, n in enumerate(counts[: len(per_group)]) if n == 0])
            counts = counts[len(per_group) :]
        total = sum(len(per_group) for per_group in local)
        return sq_norm, untouched, sum(len(u) for u in untouched) < total

    def _local_sq_norm(self, grads_by_group: list[list[torch.Tensor]]) -> torch.Tensor:
        """The squared norm of this rank's reduced chunks: those the boundary backward already
        took (``ReductionScheduler.final_sq_norms``) and, in one pass, the rest."""
        known = self.reductions.final_sq_norms
        chunks = [
            (gi, b) for gi, per_bucket in enumerate(grads_by_group) for b in range(len(per_bucket))
        ]
        missing = iter(
            chunk_sq_norms([grads_by_group[gi][b] for gi, b in chunks if (gi, b) not in known])
        )
        squares = [known[chunk] if chunk in known else next(missing) for chunk in chunks]
        return sum_sq_norms(squares, self.device)

    def _update(
        self,
        grads_by_group: list[list[torch.Tensor]],
        factor: tuple[torch.Tensor, torch.Tensor],
        untouched: list[list[int]],
    ) -> None:
        """Update the master weights and write them into the parameters on every rank.

        Bucket by bucket where the update allows it: each bucket's all-gather is launched as
        soon as its chunk is written, and runs while the next buckets update. Parameters in
        ``untouched`` (no rank gave them a gradient) keep their masters and states, as
        ``torch.optim`` skips them: the rare case, where the masters are restored after the
        update and only then written back.
        """
        self._sync_hyperparameters()
        if self._low_precision is not None:
            self._low_precision.check_still_serves(self.plan)
        if self.offload is not None:
            # The host-side update divides by the factor: bring it over once (one wait).
            on_host = self.offload.factor_to_host(torch.stack(factor))
            factor = (on_host[0], on_host[1])
        if any(untouched) or self.own_histories:
            # The rare path: parameters that skip this step, or that keep their own history
            # (flat/own_histories.py). Quantized moments are restored as fp32 values.
            apart, pending = self.own_histories.held_apart(
                self.groups, self.inner, untouched, grads_by_group, factor[0]
            )
            with self.fp32_states():
                with keep_untouched(self.groups, self.inner, apart):
                    self.update_kernel.update(grads_by_group, factor, None)
                self.own_histories.step(
                    self.inner, pending, self._read_master_piece, self._write_master_piece
                )
            self._state_changed()  # the chunks' step counters are read again
            self._write_back(cast=True)
            return
        self.update_kernel.update(grads_by_group, factor, self._start_gather)

    @property
    def update_kernel(self) -> UpdateKernel:
        """The update of this optimizer's master chunks (``update/``): the first of the
        registry that serves its plan, device and optimizer class, chosen at its first use,
        and again only if a param group turns amsgrad or maximize on or off."""
        key = choice_key(self)
        if self._kernel is None or key != self._kernel_key:
            self._kernel, self._kernel_key = choose(self), key
        return self._kernel

    def _use_fused_kernel(self) -> bool:
        """Whether the one-pass Triton AdamW (CUDA) runs this optimizer's update."""
        return self.update_kernel.name == "triton"

    def _state_changed(self) -> None:
        if self._kernel is not None:
            self._kernel.state_changed()

    def _sync_hyperparameters(self) -> None:
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in group.items():
                if key != "params":
                    inner_group[key] = value

    def _write_back(self, cast: bool = True) -> None:
        """Cast the master chunks into the parameters (unless done) and all-gather them."""
        write_params(self.groups, self.shard_rank, self._start_gather, cast)

    def _start_gather(self, state: GroupState, bucket: Any) -> Callable[[], None]:
        """Launch the all-gather of one bucket of parameters from this rank's written chunk."""
        if self.shards == 1:
            return _nothing
        flat = state.flat
        chunk = flat.chunk_view(flat.buffer, bucket, self.shard_rank)
        # In place: the input is this rank's slice of the output (gloo, NCCL allow it).
        return self.shard_comm.start_all_gather(
            flat.bucket_view(flat.buffer, bucket), chunk, self.param_dtype
        )


def _call_weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` called through a weak reference (the scheduler must not keep its optimizer)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def _nothing() -> None:
    """The finisher of an all-gather that had nothing to send (one shard)."""
