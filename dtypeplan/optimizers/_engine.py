"""The flat-buffer mixed-precision optimizer behind ZeRO stages 0, 1 and 2.

Design (one param group shown; every group has its own flat buffer, see ``_layout.py``)::

    model params (param dtype)  = views into FlatGroup.buffer
    accumulator (accum dtype)   whole:   one tensor laid out like the buffer
                                sharded: this rank's chunks only, laid out like its shard
    master weights (fp32)       this rank's chunk of every bucket (all chunks at stage 0);
                                for fp32 parameters they are views of the buffer itself, and
                                so are bf16 master weights (``_low_precision_update.py``)
    optimizer states (fp32)     kept by a fused ``torch.optim`` instance over the master chunks
                                (bf16 with ``bf16_optimizer_states``)
    with offload_optimizer cpu  masters and states in host memory; the update runs there, a
                                bucket chunk at a time, between copies (``_host_offload.py``)

Phases of one step (the backward phase is ``_reduction_scheduler.py``'s, the rest is
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
   picked up first (``_model_sync.py``), and a ``.grad`` set by hand is taken in with the
   accumulator. One small all-reduce carries the step's facts: the squared norm, which
   parameters got a gradient on any rank (the others are not updated, as in ``torch.optim``;
   ``_missing_grads.py``) and, for a sharded accumulator, which buckets hold hand-set
   gradients (those get one extra reduce-scatter, a rare path).
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
   ``clip / (loss_scale * reduction_divisor)`` stays a device tensor (``_clip.py``): no host
   sync unless the step may be skipped (fp16, or the non-finite check), and no scaling pass,
   since torch's fused Adam/AdamW divide by it as their ``grad_scale`` (``_flat_update.py``,
   chunk by chunk, 16-bit accumulators through a reused fp32 scratch). Each bucket's chunk is
   cast to the parameter dtype and its all-gather launched as soon as it is updated, while the
   next buckets update. On CUDA with Triton, Adam and AdamW instead run one kernel launch per
   param group that reads the accumulator as it is (no fp32 copy), updates master and moments
   and writes the 16-bit parameters in a single pass (``_fused_adamw_triton.py``;
   ``DTYPEPLAN_FUSED_KERNEL=0`` turns it off).

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

On one process every collective is skipped and the update is the plain ``torch.optim`` one.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist

from dtypeplan._dtypes import DTYPE_NAMES
from dtypeplan.comm import Communicator
from dtypeplan.comm._levels import levels
from dtypeplan.errors import NotSupportedError, OptimizerUsageError
from dtypeplan.optimizers import _state_keys as keys
from dtypeplan.optimizers._base import (
    HeldTensors,
    MixedPrecisionOptimizer,
    bare_backward_refusal,
    constructor_arguments,
    inner_optimizer,
    is_adam,
)
from dtypeplan.optimizers._clip import chunk_sq_norms, sum_sq_norms
from dtypeplan.optimizers._ddp import wrappers_of
from dtypeplan.optimizers._flat_update import (
    FlatAdamUpdate,
    decoupled_weight_decay,
    inner_step_grads,
)
from dtypeplan.optimizers._group_state import GroupState, ShardPiece
from dtypeplan.optimizers._host_offload import HostOffload, OffloadedChunk
from dtypeplan.optimizers._layout import FlatGroup
from dtypeplan.optimizers._low_precision_update import (
    KAHAN_COMPENSATION,
    LowPrecisionAdamUpdate,
    held_compensations,
    held_states,
)
from dtypeplan.optimizers._master_rounding import kahan_store, round_stochastic
from dtypeplan.optimizers._missing_grads import keep_untouched
from dtypeplan.optimizers._owned_gradient import is_owned_gradient
from dtypeplan.optimizers._model_sync import ModelSync
from dtypeplan.optimizers._own_histories import OwnHistories
from dtypeplan.optimizers._reduction_scheduler import ReductionScheduler
from dtypeplan.optimizers._state_values import (
    element_state_names,
    is_element_state,
    is_scalar_state,
    load_slot,
    placed_scalar,
    same_scalar,
    stateful_scalars,
)

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["DEFAULT_BUCKET_NUMEL", "FlatMixedPrecisionOptimizer"]

DEFAULT_BUCKET_NUMEL = 1 << 22
"""Elements per bucket unless ``zero_optimization.reduce_bucket_size`` says otherwise (16 MiB
of fp32): small enough that the first buckets' reductions overlap the rest of backward."""


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _with_fp32_states(method: _Method) -> _Method:
    """Run ``method`` inside ``self.fp32_states()``: it reads or writes states per parameter."""

    @functools.wraps(method)
    def wrapper(self: FlatMixedPrecisionOptimizer, *args: Any, **kwargs: Any) -> Any:
        with self.fp32_states():
            return method(self, *args, **kwargs)

    return cast(_Method, wrapper)


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


class FlatMixedPrecisionOptimizer(MixedPrecisionOptimizer):
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
        self.offload = self._host_offload(plan)
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
        """The parameter pieces whose state left their chunk's (``_own_histories.py``)."""
        self._fused_kernel: bool | None = None
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
        self._kernel_step: int | None = None  # host copy of the Adam step (Triton path)
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
        self.model_sync = ModelSync(self.groups, self.param_groups, self._inner.state)
        self._prepared: PreparedStep | None = None
        self._take_ownership()

    def _host_offload(self, plan: PrecisionPlan) -> HostOffload | None:
        """The host side of ``offload_optimizer: cpu`` (fp32 masters and states only)."""
        if plan.offload_optimizer == "none":
            return None
        if plan.offload_optimizer != "cpu" or plan.master_dtype != torch.float32:
            raise NotSupportedError(
                f"offload_optimizer {plan.offload_optimizer} with "
                f"{DTYPE_NAMES[plan.master_dtype]} master weights: the flat engine offloads "
                "fp32 master weights and fp32 optimizer states to host memory (device cpu) "
                "only; use offload_optimizer device cpu with fp32 masters and states"
            )
        if plan.optimizer_states != "fp32":
            raise NotSupportedError(
                f"offload_optimizer with {plan.optimizer_states} optimizer states: the host "
                "update keeps fp32 states; remove optimizer_states / exp_avg_dtype / "
                "exp_avg_sq_dtype / bf16_optimizer_states / fp32_optimizer_states: false"
            )
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        return HostOffload(params[0].device if params else torch.device("cpu"))

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

    def shard_pieces(self) -> list[ShardPiece]:
        """Where this rank's master chunks hold each parameter, in ``param.{i}`` numbering.

        A parameter split between ranks has a piece on each; a rank may hold none of a
        parameter. A piece's optimizer state ``name`` is
        ``piece.of(inner.state[piece.master][name])``. This is what a sharded checkpoint reads
        and writes without gathering.
        """
        pieces: list[ShardPiece] = []
        first = 0
        for state in self.groups:
            pieces += state.shard_pieces(first)
            first += len(state.flat.params)
        return pieces

    def master_values(self, master: torch.Tensor) -> torch.Tensor:
        """A master chunk as the fp32 values it stands for: with Kahan-compensated bf16 masters,
        the bf16 weights plus their compensation. What a checkpoint stores, whatever the
        master dtype, so that it loads into any other."""
        if self._low_precision is None:
            return master.float()  # fp32 masters: the chunk itself
        return self._low_precision.master_values(master)

    def fp32_states(self) -> contextlib.AbstractContextManager[None]:
        if self._low_precision is None:
            return contextlib.nullcontext()
        return self._low_precision.fp32_view([m for s in self.groups for m in s.masters])

    @torch.no_grad()
    def load_master_(
        self, master: torch.Tensor, values: torch.Tensor, compensation: torch.Tensor | None = None
    ) -> None:
        """Set a master chunk from fp32 ``values``: copied (fp32), rounded to nearest (bf16),
        or with Kahan masters split into the bf16 weights and their compensation."""
        if self._low_precision is None:
            master.copy_(values)
            return
        self._low_precision.load_master_(master, values, compensation)

    @property
    def low_precision_update(self) -> LowPrecisionAdamUpdate | None:
        return self._low_precision

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
        self.clear_lp_grads()
        self._prepared = None
        self.reductions.abandon()
        self._zero_grads = []
        if not set_to_none:
            with torch.no_grad():
                for param in self.trainable_parameters():
                    param.grad = torch.zeros_like(param)
                    self._zero_grads.append((weakref.ref(param.grad), param.grad._version))

    def _drop_ddp_grads(self) -> None:
        """Drop the ``.grad`` a DDP wrapper wrote at the end of backward (``_ddp.py``): the
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
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None

    # --- step: pick up changes -> reduce -> check/clip -> update -> write back -----------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self._check_open("step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
        if self._prepared is None:
            self._prepared = self._prepare()
        sq_norm = float(self._prepared.sq_norm)  # clip_grad_norm_ returns it: one sync
        divisor = self.scaler.scale * self.levels.reduction_divisor
        return math.sqrt(sq_norm) / divisor if math.isfinite(sq_norm) else math.inf

    def _prepare(self) -> PreparedStep:
        """Everything before the update: model changes, hand-set grads, reduction, summary."""
        self.model_sync.pick_up()
        hand_set = self._take_hand_set_grads()
        for (gi, pi), grad in hand_set.items():
            self.reductions.add_hand_set(gi, pi, grad)
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
                            "the optimizer's first backward: dtypeplan reduces the gradients "
                            "itself and makes DDP's reduction a no-op when it finds the wrapper "
                            "at its first backward; wrap the model before training (or do not "
                            "wrap it: dtypeplan needs no DDP)"
                        )
                    raise OptimizerUsageError(
                        "a .grad set by hand before step() with a sharded accumulator (ZeRO-2, "
                        "or gradient_accumulation_dtype.sharded: true): every rank would have "
                        "to learn of it and reduce-scatter it, which costs every step a host "
                        "sync; produce the gradients with backward(), or use a whole "
                        "accumulator (ZeRO-0/1)"
                    )
                else:
                    found[(gi, pi)] = grad * scale if scale != 1.0 else grad
        for state in self.groups:
            for param in state.flat.params:
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
        if all(all(per_group) for per_group in local):
            return summary[0], [[] for _ in local], True
        counts = summary[replicas:].tolist()  # some parameter got no gradient here: ask
        untouched: list[list[int]] = []
        for per_group in local:
            untouched.append([pi for pi, n in enumerate(counts[: len(per_group)]) if n == 0])
            counts = counts[len(per_group) :]
        total = sum(len(per_group) for per_group in local)
        return summary[0], untouched, sum(len(u) for u in untouched) < total

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

    @staticmethod
    def _flat_grads(grads_by_group: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        return [g for per_bucket in grads_by_group for g in per_bucket]

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
        if self.offload is not None:
            # The host-side update divides by the factor: bring it over once (one wait).
            on_host = self.offload.factor_to_host(torch.stack(factor))
            factor = (on_host[0], on_host[1])
        if any(untouched) or self.own_histories:
            # The rare path: parameters that skip this step, or that keep their own history
            # (_own_histories.py). Quantized moments are restored as fp32 values.
            apart, pending = self.own_histories.held_apart(
                self.groups, self.inner, untouched, grads_by_group, factor[0]
            )
            with self.fp32_states():
                with keep_untouched(self.groups, self.inner, apart):
                    self._apply_update(grads_by_group, factor, gather=False)
                self.own_histories.step(
                    self.inner, pending, self._read_master_piece, self._write_master_piece
                )
            self._kernel_step = None  # the chunks' step counters are read again
            self._write_back(cast=True)
            return
        self._apply_update(grads_by_group, factor, gather=True)

    def _read_master_piece(self, master: torch.Tensor, where: slice) -> torch.Tensor:
        """A piece of a master chunk as fp32 weights to update in place: the chunk's own view
        (fp32 masters), else a copy of the values it stands for (16-bit masters)."""
        if master.dtype == torch.float32:
            return master[where]
        return self.master_values(master)[where]

    def _write_master_piece(self, master: torch.Tensor, where: slice, values: torch.Tensor) -> None:
        """Store fp32 ``values`` into a piece of a 16-bit master chunk, rounded as the plan
        says (Kahan-compensated, stochastic or to nearest), as the chunk's update does."""
        if master.dtype == torch.float32:
            return  # updated in place
        compensation = self.inner.state.get(master, {}).get(KAHAN_COMPENSATION)
        if compensation is not None:
            kahan_store(values, master[where], compensation[where])
        elif self.plan.master_rounding == "stochastic":
            assert self._low_precision is not None, "16-bit masters have a low-precision update"
            generator = self._low_precision._generator(master.device)
            round_stochastic(values.clone(), master[where], generator)
        else:
            master[where].copy_(values)

    def _apply_update(
        self,
        grads_by_group: list[list[torch.Tensor]],
        factor: tuple[torch.Tensor, torch.Tensor],
        gather: bool,
    ) -> None:
        """The update on the fastest path that serves the optimizer; ``gather``: also write
        the parameters and all-gather them (else the caller writes back)."""
        if self.offload is not None:
            self._offloaded_update(grads_by_group, factor, gather)
        elif self._use_fused_kernel():
            self._fused_kernel_update(grads_by_group, factor[0], gather)
        elif FlatAdamUpdate.supports(self.inner, self.plan.optimizer.torch_class):
            self._torch_update(grads_by_group, factor[1], gather)
        else:
            masters = [m for state in self.groups for m in state.masters]
            with inner_step_grads(self.inner, masters, self._flat_grads(grads_by_group), *factor):
                self.inner.step()
            if gather:
                self._write_back(cast=True)

    def _offloaded_update(
        self,
        grads_by_group: list[list[torch.Tensor]],
        factor: tuple[torch.Tensor, torch.Tensor],
        gather: bool,
    ) -> None:
        """The update on the host (``_host_offload.py``); ``factor`` is already there.

        Adam/AdamW step each bucket chunk with torch's fused CPU kernel as its gradient arrives
        (the next chunk's copy runs meanwhile), and each chunk's parameters go back and are
        all-gathered at once. Other optimizers step once over every chunk on the host (their
        ``inner.step()``), after all gradients have arrived.
        """
        assert self.offload is not None
        offload = self.offload
        if not FlatAdamUpdate.supports(self.inner, self.plan.optimizer.torch_class):
            masters = [m for state in self.groups for m in state.masters]
            grads = offload.gradients_to_host(self._flat_grads(grads_by_group))
            with inner_step_grads(self.inner, masters, grads, *factor):
                self.inner.step()
            if gather:
                self._write_back(cast=True)
            return
        chunks: list[OffloadedChunk] = []
        places: list[tuple[GroupState, dict[str, Any], Any]] = []
        for state, group, per_bucket in zip(
            self.groups, self.inner.param_groups, grads_by_group, strict=True
        ):
            flat = state.flat
            for bucket, master, grad in zip(flat.buckets, state.masters, per_bucket, strict=True):
                param = flat.chunk_view(flat.buffer, bucket, self.shard_rank)
                chunks.append(OffloadedChunk(grad=grad, master=master, param=param))
                places.append((state, group, bucket))
        gathers: list[Callable[[], None]] = []

        def update(k: int, host_grad: torch.Tensor) -> None:
            _, group, _ = places[k]
            self._adam_update.bucket(group, chunks[k].master, host_grad, None, factor[1])

        def written(k: int) -> None:
            state, _, bucket = places[k]
            gathers.append(self._start_gather(state, bucket))

        offload.step(chunks, update, written, upload=gather)
        for finish in gathers:
            finish()

    def _torch_update(
        self, grads_by_group: list[list[torch.Tensor]], grad_scale: torch.Tensor, gather: bool
    ) -> None:
        """torch's fused Adam/AdamW per bucket chunk, on the gradients over ``grad_scale``."""
        gathers: list[Callable[[], None]] = []
        for state, group, per_bucket in zip(
            self.groups, self.inner.param_groups, grads_by_group, strict=True
        ):
            for bucket, master, grad in zip(
                state.flat.buckets, state.masters, per_bucket, strict=True
            ):
                chunk = state.flat.chunk_view(state.flat.buffer, bucket, self.shard_rank)
                aliased = chunk.data_ptr() == master.data_ptr()
                self._adam_update.bucket(
                    group, master, grad, None if aliased else chunk, grad_scale
                )
                if gather:
                    gathers.append(self._start_gather(state, bucket))
        for finish in gathers:
            finish()

    def _use_fused_kernel(self) -> bool:
        """The one-pass Triton AdamW (CUDA) applies to Adam/AdamW without amsgrad or maximize."""
        if self._fused_kernel is None:
            from dtypeplan.optimizers import _fused_adamw_triton as kernel

            device = self.device
            # Per-group settings count too: a param group may turn amsgrad on for itself.
            unsupported = any(
                g.get("amsgrad", False) or g.get("maximize", False) for g in self.param_groups
            )
            self._fused_kernel = (
                os.environ.get("DTYPEPLAN_FUSED_KERNEL", "1") != "0"
                and self._low_precision is None  # the kernel keeps fp32 masters
                and self.offload is None  # the kernel runs on the device
                and is_adam(self.plan.optimizer.torch_class)
                and not unsupported
                and kernel.fused_kernel_available(device)
            )
        return self._fused_kernel

    def _fused_kernel_update(
        self, grads_by_group: list[list[torch.Tensor]], factor: torch.Tensor, gather: bool
    ) -> None:
        """Read each accumulator chunk as it is, update master and moments, write the params.

        One kernel launch per param group covers all of its bucket chunks. The moments live
        in ``self.inner.state`` under torch's names, so ``state_dict``, ``full_state`` and
        checkpoints do not know which path ran. The factor is read from device memory, and
        the bias corrections come from a host copy of the step counter (read once after a
        load), so nothing waits for the device.
        """
        from dtypeplan.optimizers._fused_adamw_triton import fused_mixed_adamw_multi_

        step = self._host_step() + 1
        gathers: list[Callable[[], None]] = []
        for state, group, grads in zip(
            self.groups, self.inner.param_groups, grads_by_group, strict=True
        ):
            if not state.masters:
                continue
            slots = [self._adam_update.slot(master) for master in state.masters]
            torch._foreach_add_([slot["step"] for slot in slots], 1.0)
            flat = state.flat
            chunks = [flat.chunk_view(flat.buffer, b, self.shard_rank) for b in flat.buckets]
            aliased = chunks[0].data_ptr() == state.masters[0].data_ptr()
            beta1, beta2 = group["betas"]
            fused_mixed_adamw_multi_(
                state.masters,
                [slot["exp_avg"] for slot in slots],
                [slot["exp_avg_sq"] for slot in slots],
                grads,
                None if aliased else chunks,
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                step=step,
                grad_factor=factor,
                adam_w_mode=decoupled_weight_decay(self.plan.optimizer.torch_class, group),
            )
            if gather:
                # The group's all-gathers run while the next groups' kernels do.
                gathers += [self._start_gather(state, bucket) for bucket in flat.buckets]
        self._kernel_step = step
        for finish in gathers:
            finish()

    def _host_step(self) -> int:
        """The Adam step counter as of the last step, kept on the host (synced once if unknown)."""
        if self._kernel_step is None:
            self._kernel_step = self.step_count()
        return self._kernel_step

    def reset_update_state(
        self, names: Iterable[str], scalars: Sequence[Mapping[str, Any]] = ()
    ) -> None:
        super().reset_update_state(names, scalars)
        self.own_histories.clear()
        self._kernel_step = None
        if self._low_precision is not None:
            self._low_precision.conform([m for s in self.groups for m in s.masters])

    def _own_param_scalars(self) -> Iterator[tuple[int, int, dict[str, Any] | None]]:
        first = 0
        for gi, group_state in enumerate(self.groups):
            for index, _, _, bucket, _ in group_state._pieces():
                apart, own = self.own_histories.of(gi, index)
                if apart:
                    yield first + index, gi, own
                else:
                    slot = self.inner.state.get(group_state.masters[bucket])
                    yield first + index, gi, stateful_scalars(slot)
            first += len(group_state.flat.params)

    def _load_param_scalars(self, found: Mapping[int, dict[str, Any] | None]) -> None:
        # A piece with scalars of its own leaves its chunk's history (_own_histories.py); its
        # per-element states are the chunk's, loaded already.
        first = 0
        for gi, group_state in enumerate(self.groups):
            on_device = _on_device(self.inner, gi)
            for index, _, _, bucket, _ in group_state._pieces():
                if first + index not in found:
                    continue
                given = found[first + index]
                master = group_state.masters[bucket]
                own = (
                    None
                    if given is None
                    else {n: placed_scalar(n, v, master, on_device) for n, v in given.items()}
                )
                self.own_histories.set(gi, index, own)
            first += len(group_state.flat.params)

    def _sync_hyperparameters(self) -> None:
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in group.items():
                if key != "params":
                    inner_group[key] = value

    def _write_back(self, cast: bool = True) -> None:
        """Cast the master chunks into the parameters (unless done) and all-gather them."""
        gathers: list[Callable[[], None]] = []
        for state in self.groups:
            flat = state.flat
            for bucket, master in zip(flat.buckets, state.masters, strict=True):
                chunk = flat.chunk_view(flat.buffer, bucket, self.shard_rank)
                if cast and master.data_ptr() != chunk.data_ptr():
                    chunk.copy_(master)
                gathers.append(self._start_gather(state, bucket))
        for finish in gathers:
            finish()

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

    # --- state --------------------------------------------------------------------------------
    def _layout_facts(self) -> dict[str, Any]:
        return {
            "world_size": self.comm.world_size,
            "shards": self.shards,
            "rank": self.shard_rank,
            "numels": [[b.numel for b in s.flat.buckets] for s in self.groups],
        }

    STATE_FORMAT = "dtypeplan.flat/2"

    @_with_fp32_states
    def _param_state(self, index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
        """This rank's piece of each parameter: ``elements`` (begin, end of the flattened
        parameter), ``master`` and each state over those elements, and its scalar states
        (its chunk's, or its own: ``_own_histories.py``; none before its first gradient)."""
        state: dict[int, dict[str, Any]] = {}
        for gi, group_state in enumerate(self.groups):
            params = group_state.flat.params
            for index, begin, end, bucket, offset in group_state._pieces():
                master = group_state.masters[bucket]
                where = slice(offset, offset + end - begin)
                entry: dict[str, Any] = {"elements": (begin, end)}
                entry[keys.MASTER] = master[where].detach().clone()
                apart, own = self.own_histories.of(gi, index)
                if not (apart and own is None):
                    for name, value in self.inner.state.get(master, {}).items():
                        if is_scalar_state(value) and not apart:
                            entry[name] = value.clone() if torch.is_tensor(value) else value
                        elif is_element_state(value, master):
                            entry[name] = value[where].clone()
                    for name, value in (own or {}).items():
                        entry[name] = value.clone() if torch.is_tensor(value) else value
                    if self._low_precision is not None:
                        self._low_precision.save_codes(entry, master, offset, end - begin)
                state[index_of[id(params[index])]] = entry
        return state

    @_with_fp32_states
    def _load_param_state(self, state: dict[int, dict[str, Any]], index_of: dict[int, int]) -> None:
        self._kernel_step = None  # the loaded step counter is re-read at the next kernel step
        for gi, group_state in enumerate(self.groups):
            params = group_state.flat.params
            for index, begin, end, bucket, offset in group_state._pieces():
                entry = state[index_of[id(params[index])]]
                assert tuple(entry["elements"]) == (begin, end), "layout checked by the caller"
                master = group_state.masters[bucket]
                where = slice(offset, offset + end - begin)
                master[where].copy_(entry[keys.MASTER])
                slot = self.inner.state.get(master, {})
                given = {n: v for n, v in entry.items() if n not in ("elements", keys.MASTER)}
                if slot and not given:
                    self.own_histories.set(gi, index, None)  # saved before its first gradient
                    continue
                scalars = {n: v for n, v in given.items() if is_scalar_state(v)}
                ours = {n: v for n, v in slot.items() if is_scalar_state(v)}
                if scalars.keys() == ours.keys() and all(
                    same_scalar(scalars[n], ours[n]) for n in scalars
                ):
                    load_slot(slot, entry, where)
                else:
                    # A piece with its own history: its scalars stay out of the chunk's.
                    load_slot(slot, {n: v for n, v in given.items() if n not in scalars}, where)
                    on_device = _on_device(self.inner, gi)
                    own = {n: placed_scalar(n, v, master, on_device) for n, v in scalars.items()}
                    self.own_histories.set(gi, index, own)
                if self._low_precision is not None:
                    self._low_precision.load_codes(entry, master, offset, end - begin)
        self.refresh_params()

    @_with_fp32_states
    def state_names(self) -> list[str]:
        """``master`` and the names of the optimizer states laid out like the master chunks.

        The names the ``param.{i}.{name}`` keys of :meth:`full_state` take (the step counter
        is a scalar, ``scalar.step``).
        """
        return element_state_names(self.inner, (m for s in self.groups for m in s.masters))

    def _gather_full(self, state: GroupState, chunks: list[torch.Tensor]) -> torch.Tensor:
        flat = state.flat
        full = torch.zeros(flat.numel, dtype=torch.float32, device=flat.buffer.device)
        for bucket, chunk in zip(flat.buckets, chunks, strict=True):
            target = flat.bucket_view(full, bucket)
            if self.shards > 1:
                # An offloaded chunk lives on the host; the collective runs on the device.
                self.shard_comm.all_gather(
                    target, chunk.to(target.device, torch.float32).contiguous(), torch.float32
                )
            else:
                target.copy_(chunk)
        return full

    @torch.no_grad()
    @_with_fp32_states
    def full_state(self) -> dict[str, torch.Tensor | float | int]:
        result: dict[str, torch.Tensor | float | int] = {}
        names = self.state_names()
        first = 0
        for state in self.groups:
            for name in names:
                if name == keys.MASTER:
                    chunks = [self.master_values(m) for m in state.masters]
                else:
                    chunks = [
                        self.inner.state[m][name]
                        if name in self.inner.state.get(m, {})
                        else torch.zeros_like(m)
                        for m in state.masters
                    ]
                full = self._gather_full(state, chunks)
                for index, view in enumerate(state.flat.param_views(full)):
                    result[keys.param_key(first + index, name)] = view.clone()
            first += len(state.flat.params)
        result.update(self._scalar_state())
        if self.shards > 1 and self.shard_comm.active:
            # A parameter's own scalar states are read where its pieces are: every rank's of
            # the shard group (the other groups hold the same pieces).
            parts: list[Any] = [None] * self.shard_comm.world_size
            dist.all_gather_object(parts, self.param_scalar_state(), group=self.shard_comm.group)
            for part in parts:
                result.update(part)
        return result

    @torch.no_grad()
    @_with_fp32_states
    def load_full_state(self, state: dict[str, torch.Tensor | float | int]) -> None:
        names = keys.param_state_names(state)
        # States absent from the input must not survive from before the load.
        self.reset_update_state(
            [n for n in names if n != keys.MASTER], self.group_scalars_from(state)
        )
        first = 0
        for group_state in self.groups:
            flat = group_state.flat
            for name in names:
                full = torch.zeros(flat.numel, dtype=torch.float32, device=flat.buffer.device)
                for index, view in enumerate(flat.param_views(full)):
                    value = state[keys.param_key(first + index, name)]
                    assert isinstance(value, torch.Tensor), "checked by the caller's manifest"
                    view.copy_(value)
                chunks = [flat.chunk_view(full, b, self.shard_rank) for b in flat.buckets]
                for master, chunk in zip(group_state.masters, chunks, strict=True):
                    if name == keys.MASTER:
                        self.load_master_(master, chunk)
                    else:
                        self.inner.state[master][name].copy_(chunk)
            first += len(flat.params)
        self.load_param_scalars(state)
        self._load_scalar_state(state)
        self.refresh_params()


def _on_device(inner: torch.optim.Optimizer, group: int) -> bool:
    """Whether ``torch.optim`` keeps group ``group``'s step counters on the master's device."""
    settings = inner.param_groups[group]
    return bool(settings.get("fused") or settings.get("capturable"))


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
