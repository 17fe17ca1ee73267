"""The flat-buffer mixed-precision optimizer behind ZeRO stages 0, 1 and 2.

Design (one param group shown; every group has its own flat buffer, see ``_layout.py``)::

    model params (param dtype)  = views into FlatGroup.buffer
    accumulator (accum dtype)   whole:   one tensor laid out like the buffer
                                sharded: this rank's chunks only, laid out like its shard
    master weights (fp32)       this rank's chunk of every bucket (all chunks at stage 0);
                                for fp32 parameters they are views of the buffer itself
    optimizer states (fp32)     kept by a fused ``torch.optim`` instance over the master chunks

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
   backward, when the caller marks it: ``opt.backward(loss, last_micro_batch=True)``. Then it
   is viewed as fp32, checked and clipped through one scalar all-reduce of the squared
   norm (a non-finite sum means some rank overflowed), scaled once by
   ``clip / (loss_scale * world_size)``, handed to one fused optimizer call, cast to the
   parameter dtype and all-gathered into the buffer. On CUDA with Triton, Adam and AdamW
   instead run one kernel per chunk that reads the accumulator as it is (no fp32 copy),
   updates master and moments and writes the 16-bit parameters in a single pass
   (``_fused_adamw_triton.py``; ``DTYPEPLAN_FUSED_KERNEL=0`` turns it off).

On one process every collective is skipped and the update is the plain ``torch.optim`` one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from dtypeplan.comm import Communicator
from dtypeplan.optimizers import _state_keys as keys
from dtypeplan.optimizers._base import (
    HeldTensors,
    MixedPrecisionOptimizer,
    inner_optimizer,
    is_adam,
    is_element_state,
    is_scalar_state,
    load_slot,
)
from dtypeplan.optimizers._group_state import GroupState, ShardPiece
from dtypeplan.optimizers._layout import FlatGroup
from dtypeplan.optimizers._missing_grads import keep_untouched
from dtypeplan.optimizers._model_sync import ModelSync
from dtypeplan.optimizers._reduction_scheduler import ReductionScheduler

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["DEFAULT_BUCKET_NUMEL", "FlatMixedPrecisionOptimizer"]

DEFAULT_BUCKET_NUMEL = 1 << 22
"""Elements per bucket unless ``zero_optimization.reduce_bucket_size`` says otherwise (16 MiB
of fp32): small enough that the first buckets' reductions overlap the rest of backward."""


class PreparedStep(NamedTuple):
    """A step's gradients, reduced and summarized over the group, ready for the update."""

    grads: list[list[torch.Tensor]]
    """Per group, per bucket: this rank's chunk of the summed gradient."""
    sq_norm: float
    """The global squared norm of the summed (still scaled) gradient."""
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
        self.shards = self.comm.world_size if self.shard_state else 1
        self.shard_rank = self.comm.rank if self.shard_state else 0
        self.param_dtype = plan.param_dtype
        sharded_accumulator = plan.accumulator_sharded and self.shards > 1
        bucket_numel = plan.reduce_bucket_size or DEFAULT_BUCKET_NUMEL
        self._check_ranks_agree(self.comm)
        self._make_replicas_equal(self.comm)
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
                )
            )
        self._inner = self._build_inner_optimizer()
        self._fused_kernel: bool | None = None
        self.reductions = ReductionScheduler(
            self.groups,
            self.comm,
            comm_dtype=plan.comm_dtype,
            comm_method=plan.comm_reduction,
            sharded_accumulator=sharded_accumulator,
            hooks=self.hooks,
        )
        self.model_sync = ModelSync(self.groups, self.param_groups)
        self._prepared: PreparedStep | None = None
        self._take_ownership()

    def _build_inner_optimizer(self) -> torch.optim.Optimizer:
        torch_class = self.plan.optimizer.torch_class
        groups = []
        for group, state in zip(self.param_groups, self.groups, strict=True):
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({"params": state.masters, **hyper})
        fused = all(m.device.type in ("cpu", "cuda") for s in self.groups for m in s.masters)
        return inner_optimizer(torch_class, groups, fused=fused)

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
            params=tuple(state.flat.buffer for state in self.groups),
            grads=tuple(
                p.grad for g in self.param_groups for p in g["params"] if p.grad is not None
            ),
            accumulator=tuple(state.accumulator for state in self.groups)
            + tuple(self.reductions.buffers()),
            master=tuple(m for state in self.groups for m in state.masters),
            optimizer_states=tuple(
                v for slot in self.inner.state.values() for v in slot.values() if torch.is_tensor(v)
            ),
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

    @torch.no_grad()
    def refresh_params(self) -> None:
        """Write the master weights into the parameters on every rank (cast, all-gather).

        Call it after changing the master weights in place (a checkpoint load does); the call
        is collective.
        """
        self._write_back(cast=True)

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
        if not set_to_none:
            with torch.no_grad():
                for param in self.trainable_parameters():
                    param.grad = torch.zeros_like(param)

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
            factor = self._gradient_factor(
                prepared.sq_norm, self.scaler.scale * self.comm.world_size
            )
            if factor is None:
                return loss
            if prepared.any_touched:
                fused, kept = self._update(prepared.grads, factor, prepared.untouched)
                self._write_back(cast=not fused or kept)
            # else no parameter got a gradient: torch.optim would not touch any, nor its states
            self.scaler.update(overflow=False)
        finally:
            self.reductions.end_step()
        return loss

    def _prepare_grad_norm(self) -> float:
        if self._prepared is None:
            self._prepared = self._prepare()
        sq_norm = self._prepared.sq_norm
        divisor = self.scaler.scale * self.comm.world_size
        return math.sqrt(sq_norm) / divisor if math.isfinite(sq_norm) else math.inf

    def _prepare(self) -> PreparedStep:
        """Everything before the update: model changes, hand-set grads, reduction, summary."""
        self.model_sync.pick_up()
        hand_set = self._take_hand_set_grads()
        if not self.reductions.sharded_accumulator:
            for (gi, pi), grad in hand_set.items():
                self.reductions.add_hand_set(gi, pi, grad)
        grads = self.reductions.reduced_grads()
        sq_norm, touched, hand_set_buckets = self._step_summary(grads, hand_set)
        if hand_set_buckets:
            self.reductions.reduce_hand_set(hand_set, hand_set_buckets)
            sq_norm = self._global_sq_norm(grads)
        untouched = [[pi for pi, t in enumerate(per_group) if not t] for per_group in touched]
        any_touched = any(any(per_group) for per_group in touched)
        return PreparedStep(grads, sq_norm, untouched, any_touched)

    def _take_hand_set_grads(self) -> dict[tuple[int, int], torch.Tensor]:
        """The ``.grad`` found on parameters at step (set by hand: the hooks take the rest).

        Scaled by the loss scale, as the accumulator holds scaled gradients; ``.grad`` is
        freed as the hooks free it.
        """
        found: dict[tuple[int, int], torch.Tensor] = {}
        scale = self.scaler.scale
        for gi, state in enumerate(self.groups):
            for pi, param in enumerate(state.flat.params):
                if param.grad is not None:
                    grad = param.grad
                    found[(gi, pi)] = grad * scale if scale != 1.0 else grad
                    param.grad = None
        return found

    def _step_summary(
        self, grads_by_group: list[list[torch.Tensor]], hand_set: dict[tuple[int, int], Any]
    ) -> tuple[float, list[list[bool]], set[tuple[int, int]]]:
        """The step's one all-reduce: squared norm, who got gradients, hand-set buckets.

        ``[squared norm, touched flag per parameter..., hand-set flag per bucket...]``; the
        norm slot is summed only where ranks hold different chunks (sharded states), and the
        bucket flags exist only for a sharded accumulator. Returns the global squared norm,
        per group and parameter whether any rank gave it a gradient, and the buckets where
        some rank has a hand-set gradient.
        """
        touched = [list(per_group) for per_group in self.reductions.window_touched]
        for gi, pi in hand_set:
            touched[gi][pi] = True
        flags = [float(t) for per_group in touched for t in per_group]
        buckets = [(gi, b.index) for gi, s in enumerate(self.groups) for b in s.flat.buckets]
        if self.reductions.sharded_accumulator:
            held = {(gi, self.groups[gi].flat.bucket_of[pi]) for gi, pi in hand_set}
            flags += [float(bucket in held) for bucket in buckets]
        summary = torch.cat(
            [self._local_sq_norm(grads_by_group).reshape(1), torch.tensor(flags).to(self.device)]
        )
        if self.shards > 1:
            self.comm.all_reduce_scalars(summary)
        elif len(summary) > 1:
            # Stage 0: every rank reduced the whole gradient; only the flags need summing.
            self.comm.all_reduce_scalars(summary[1:])
        values = summary.tolist()
        sq_norm, rest = values[0], values[1:]
        global_touched = []
        for per_group in touched:
            global_touched.append([flag > 0 for flag in rest[: len(per_group)]])
            rest = rest[len(per_group) :]
        hand_set_buckets = {b for b, flag in zip(buckets, rest, strict=False) if flag > 0}
        return sq_norm, global_touched, hand_set_buckets

    def _local_sq_norm(self, grads_by_group: list[list[torch.Tensor]]) -> torch.Tensor:
        grads = [g for per_bucket in grads_by_group for g in per_bucket]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        return torch.stack(norms).double().square().sum().float()

    def _global_sq_norm(self, grads_by_group: list[list[torch.Tensor]]) -> float:
        local = self._local_sq_norm(grads_by_group)
        if self.shards > 1:
            local = self.comm.all_reduce_scalars(local.reshape(1))[0]
        return float(local)

    def _update(
        self, grads_by_group: list[list[torch.Tensor]], factor: float, untouched: list[list[int]]
    ) -> tuple[bool, bool]:
        """Update the master weights, leaving ``untouched`` parameters as they were.

        Returns whether the fused kernel also wrote the parameters, and whether some were
        kept (restored after the update: the parameters must be written from the masters).
        """
        self._sync_hyperparameters()
        fused = self._use_fused_kernel()
        with keep_untouched(self.groups, self.inner, untouched) as kept:
            if fused:
                self._fused_kernel_update(grads_by_group, factor)
            else:
                self._torch_update(grads_by_group, factor)
        return fused, kept

    def _torch_update(self, grads_by_group: list[list[torch.Tensor]], factor: float) -> None:
        """One fused ``torch.optim`` call over every master chunk, with fp32 gradients."""
        fp32 = [
            [g if g.dtype == torch.float32 else g.float() for g in per] for per in grads_by_group
        ]
        torch._foreach_mul_([g for per in fp32 for g in per], factor)
        for state, per_bucket in zip(self.groups, fp32, strict=True):
            for master, grad in zip(state.masters, per_bucket, strict=True):
                master.grad = grad
        self.inner.step()
        for state in self.groups:
            for master in state.masters:
                master.grad = None

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
                and is_adam(self.plan.optimizer.torch_class)
                and not unsupported
                and kernel.fused_kernel_available(device)
            )
        return self._fused_kernel

    def _fused_kernel_update(self, grads_by_group: list[list[torch.Tensor]], factor: float) -> None:
        """Read each accumulator chunk as it is, update master and moments, write the params.

        The moments live in ``self.inner.state`` under torch's names, so ``state_dict``,
        ``full_state`` and checkpoints do not know which path ran.
        """
        from dtypeplan.optimizers._fused_adamw_triton import fused_mixed_adamw_

        for state, group, per_bucket in zip(
            self.groups, self.inner.param_groups, grads_by_group, strict=True
        ):
            beta1, beta2 = group["betas"]
            for bucket, master, grad in zip(
                state.flat.buckets, state.masters, per_bucket, strict=True
            ):
                slot = self.inner.state[master]
                if "exp_avg" not in slot:
                    slot["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
                    slot["exp_avg"] = torch.zeros_like(master)
                    slot["exp_avg_sq"] = torch.zeros_like(master)
                slot["step"] += 1
                param_chunk = state.flat.chunk_view(state.flat.buffer, bucket, self.shard_rank)
                fused_mixed_adamw_(
                    master,
                    slot["exp_avg"],
                    slot["exp_avg_sq"],
                    grad,
                    None if param_chunk.data_ptr() == master.data_ptr() else param_chunk,
                    lr=float(group["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=int(slot["step"].item()),
                    grad_factor=factor,
                    # Adam(decoupled_weight_decay=True) is AdamW; torch's AdamW groups say so too.
                    adam_w_mode=bool(group.get("decoupled_weight_decay", False))
                    or self.plan.optimizer.type == "AdamW",
                )

    def _sync_hyperparameters(self) -> None:
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in group.items():
                if key != "params":
                    inner_group[key] = value

    def _write_back(self, cast: bool = True) -> None:
        """Cast the master chunks into the parameters (unless done) and all-gather them."""
        for state in self.groups:
            flat = state.flat
            for bucket, master in zip(flat.buckets, state.masters, strict=True):
                chunk = flat.chunk_view(flat.buffer, bucket, self.shard_rank)
                if cast and master.data_ptr() != chunk.data_ptr():
                    chunk.copy_(master)
                if self.shards > 1:
                    # In place: the input is this rank's slice of the output (gloo, NCCL allow it).
                    self.comm.all_gather(
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

    def _param_state(self, index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
        """This rank's piece of each parameter: ``elements`` (begin, end of the flattened
        parameter), ``master`` and each state over those elements, and Adam's ``step``."""
        state: dict[int, dict[str, Any]] = {}
        for group_state in self.groups:
            params = group_state.flat.params
            for index, begin, end, bucket, offset in group_state._pieces():
                master = group_state.masters[bucket]
                where = slice(offset, offset + end - begin)
                entry: dict[str, Any] = {"elements": (begin, end)}
                entry[keys.MASTER] = master[where].detach().clone()
                for name, value in self.inner.state.get(master, {}).items():
                    if is_scalar_state(value):
                        entry[name] = value.clone() if torch.is_tensor(value) else value
                    elif is_element_state(value, master):
                        entry[name] = value[where].clone()
                state[index_of[id(params[index])]] = entry
        return state

    def _load_param_state(self, state: dict[int, dict[str, Any]], index_of: dict[int, int]) -> None:
        for group_state in self.groups:
            params = group_state.flat.params
            for index, begin, end, bucket, offset in group_state._pieces():
                entry = state[index_of[id(params[index])]]
                assert tuple(entry["elements"]) == (begin, end), "layout checked by the caller"
                master = group_state.masters[bucket]
                where = slice(offset, offset + end - begin)
                master[where].copy_(entry[keys.MASTER])
                load_slot(self.inner.state.get(master, {}), entry, where)
        self._write_back()

    def state_names(self) -> list[str]:
        """``master`` and the names of the optimizer states laid out like the master chunks.

        The names the ``param.{i}.{name}`` keys of :meth:`full_state` take (the step counter
        is a scalar, ``scalar.step``).
        """
        names = [keys.MASTER]
        for state in self.groups:
            for master in state.masters:
                for name, value in self.inner.state.get(master, {}).items():
                    if is_element_state(value, master) and name not in names:
                        names.append(name)
        return names

    def _gather_full(self, state: GroupState, chunks: list[torch.Tensor]) -> torch.Tensor:
        flat = state.flat
        full = torch.zeros(flat.numel, dtype=torch.float32, device=flat.buffer.device)
        for bucket, chunk in zip(flat.buckets, chunks, strict=True):
            target = flat.bucket_view(full, bucket)
            if self.shards > 1:
                self.comm.all_gather(target, chunk.float().contiguous(), torch.float32)
            else:
                target.copy_(chunk)
        return full

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor | float | int]:
        result: dict[str, torch.Tensor | float | int] = {}
        names = self.state_names()
        first = 0
        for state in self.groups:
            for name in names:
                if name == keys.MASTER:
                    chunks = state.masters
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
        return result

    @torch.no_grad()
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
                    view.copy_(state[keys.param_key(first + index, name)])
                chunks = [flat.chunk_view(full, b, self.shard_rank) for b in flat.buckets]
                for master, chunk in zip(group_state.masters, chunks, strict=True):
                    target = master if name == keys.MASTER else self.inner.state[master][name]
                    target.copy_(chunk)
            first += len(flat.params)
        self._load_scalar_state(state)
        self._write_back()
