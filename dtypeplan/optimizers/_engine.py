"""The flat-buffer mixed-precision optimizer behind ZeRO stages 0, 1 and 2.

Design (one param group shown; every group has its own flat buffer, see ``_layout.py``)::

    model params (param dtype)  = views into FlatGroup.buffer
    accumulator (accum dtype)   whole:   one tensor laid out like the buffer
                                sharded: this rank's chunks only, laid out like its shard
    master weights (fp32)       this rank's chunk of every bucket (all chunks at stage 0);
                                for fp32 parameters they are views of the buffer itself
    optimizer states (fp32)     kept by a fused ``torch.optim`` instance over the master chunks

Phases of one step:

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
2. ``step()`` at the accumulation boundary: the accumulator is reduced over the group in the
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

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dtypeplan.comm import Communicator
from dtypeplan.optimizers._base import MixedPrecisionOptimizer
from dtypeplan.optimizers._layout import FlatGroup

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["FlatMixedPrecisionOptimizer", "accumulate_"]

DEFAULT_BUCKET_NUMEL = 1 << 22
"""Elements per bucket unless ``zero_optimization.reduce_bucket_size`` says otherwise (16 MiB
of fp32): small enough that the first buckets' reductions overlap the rest of backward."""
MAX_IN_FLIGHT = 2
"""Reduce-scatters of a sharded accumulator that may run while backward goes on; each holds
its bucket's staging buffer until it completes."""
_UPCAST_CHUNK = 1 << 20


def accumulate_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` without a full-size temporary when the dtypes differ.

    A mixed-dtype ``add_`` materializes ``src`` in ``dst``'s dtype first; chunking bounds that
    temporary to ``_UPCAST_CHUNK`` elements.
    """
    if dst.dtype == src.dtype or dst.numel() <= _UPCAST_CHUNK:
        dst.add_(src)
        return
    flat_dst, flat_src = dst.view(-1), src.reshape(-1)
    for begin in range(0, flat_dst.numel(), _UPCAST_CHUNK):
        end = begin + _UPCAST_CHUNK
        flat_dst[begin:end].add_(flat_src[begin:end])


class _GroupState:
    """Per param group: the flat buffer, accumulator, master chunks and backward bookkeeping."""

    def __init__(self, flat: FlatGroup) -> None:
        self.flat = flat
        self.accumulator: torch.Tensor
        self.acc_param_views: list[torch.Tensor] = []
        self.acc_chunks: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        self.staging: dict[int, torch.Tensor] = {}
        self.pending: list[int] = []
        self.touched: list[bool] = []


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
        self.accum_dtype = plan.grad_accum_dtype
        self.comm_dtype = plan.comm_dtype
        self.comm_method = plan.comm_reduction
        self.sharded_accumulator = plan.accumulator_sharded and self.shards > 1
        bucket_numel = plan.reduce_bucket_size or DEFAULT_BUCKET_NUMEL
        self._check_ranks_agree(self.comm)
        self.groups: list[_GroupState] = []
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
            self.groups.append(self._build_group(flat))
        self.inner = self._build_inner_optimizer()
        # The order in which every rank issues its bucket reductions.
        self._bucket_order = [
            (gi, b.index) for gi, s in enumerate(self.groups) for b in s.flat.buckets
        ]
        self._fresh = True
        self._backward_open = False
        self._fused_kernel: bool | None = None
        self._grads_seen = False
        self._boundary = False
        self._early: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor]] = {}
        self._in_flight: list[
            tuple[Callable[[], None], torch.Tensor, torch.Tensor, torch.Tensor]
        ] = []
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._make_hook(gi, pi))
            for gi, state in enumerate(self.groups)
            for pi, param in enumerate(state.flat.params)
        ]
        self._reset_backward_bookkeeping()

    # --- construction -------------------------------------------------------------------------
    def _build_group(self, flat: FlatGroup) -> _GroupState:
        state = _GroupState(flat)
        alias_master = self.param_dtype == torch.float32
        if not alias_master:
            # Master chunks take the parameters' values before they are cast down.
            for bucket in flat.buckets:
                state.masters.append(
                    torch.zeros(
                        bucket.chunk_numel(self.shards),
                        dtype=torch.float32,
                        device=flat.buffer.device,
                    )
                )
            shard_offsets = flat.shard_offsets()
            for index, param in enumerate(flat.params):
                where = flat.param_chunk_ranges(index, self.shard_rank)
                if where is None:
                    continue
                begin, end, shard_offset = where
                bucket = flat.bucket_of[index]
                local = shard_offset - shard_offsets[bucket]
                state.masters[bucket][local : local + end - begin].copy_(
                    param.detach().reshape(-1)[begin:end]
                )
        flat.adopt_parameters()
        if alias_master:
            state.masters = [flat.chunk_view(flat.buffer, b, self.shard_rank) for b in flat.buckets]
        device = flat.buffer.device
        if self.sharded_accumulator:
            state.accumulator = torch.zeros(flat.shard_numel, dtype=self.accum_dtype, device=device)
            offsets = flat.shard_offsets()
            state.acc_chunks = [
                state.accumulator[off : off + b.chunk_numel(self.shards)]
                for off, b in zip(offsets, flat.buckets, strict=True)
            ]
        else:
            state.accumulator = torch.zeros(flat.numel, dtype=self.accum_dtype, device=device)
            state.acc_param_views = flat.param_views(state.accumulator)
        return state

    def _build_inner_optimizer(self) -> torch.optim.Optimizer:
        torch_class = self.plan.optimizer.torch_class
        groups = []
        for group, state in zip(self.param_groups, self.groups, strict=True):
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({"params": state.masters, **hyper})
        fused = all(m.device.type in ("cpu", "cuda") for s in self.groups for m in s.masters)
        return torch_class(groups, fused=fused)

    # --- backward -----------------------------------------------------------------------------
    def _reset_backward_bookkeeping(self) -> None:
        for state in self.groups:
            state.touched = [False] * len(state.flat.params)
            state.pending = [len(b.params) for b in state.flat.buckets]
        self._next_bucket = 0

    def _make_hook(self, group_index: int, param_index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad(group_index, param_index, param)

        return hook

    def _on_grad(self, gi: int, pi: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        self._grads_seen = True
        if self._early and not self._boundary:
            raise RuntimeError(
                "a backward after the micro-batch marked last_micro_batch=True: its gradient "
                "reduction has started already; call step() (or zero_grad()) first"
            )
        if not self._backward_open:
            self._backward_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        state = self.groups[gi]
        with torch.no_grad():
            if self.sharded_accumulator:
                flat = state.flat
                bucket = flat.bucket_of[pi]
                staging = self._staging(state, bucket)
                offset = flat.offsets[pi] - flat.buckets[bucket].start
                staging[offset : offset + grad.numel()].copy_(grad.reshape(-1))
                state.pending[bucket] -= 1
                state.touched[pi] = True
                self._drain(complete_only=True)
            else:
                view = state.acc_param_views[pi]
                if self._fresh and not state.touched[pi]:
                    view.copy_(grad)
                else:
                    accumulate_(view, grad)
                state.touched[pi] = True
                if self._boundary:
                    state.pending[state.flat.bucket_of[pi]] -= 1
                    self._start_boundary_reductions(complete_only=True)
        param.grad = None

    def _staging(self, state: _GroupState, bucket: int) -> torch.Tensor:
        if bucket not in state.staging:
            numel = state.flat.buckets[bucket].numel
            state.staging[bucket] = torch.zeros(
                numel, dtype=self.comm_dtype, device=state.flat.buffer.device
            )
        return state.staging[bucket]

    def _drain(self, complete_only: bool) -> None:
        """Reduce-scatter staged buckets in the fixed order, stopping at an incomplete one."""
        while self._next_bucket < len(self._bucket_order):
            gi, bucket = self._bucket_order[self._next_bucket]
            state = self.groups[gi]
            if complete_only and state.pending[bucket] > 0:
                return
            staging = self._staging(state, bucket)
            if not complete_only:
                # Parameters that got no gradient this micro-batch contribute zeros.
                flat = state.flat
                for pi in flat.buckets[bucket].params:
                    if not state.touched[pi]:
                        offset = flat.offsets[pi] - flat.buckets[bucket].start
                        staging[offset : offset + flat.params[pi].numel()].zero_()
            chunk = state.acc_chunks[bucket]
            # The first micro-batch writes the reduced chunk in place; later ones add it.
            target = chunk if self._fresh else torch.empty_like(chunk)
            finish = self.comm.start_reduce_scatter_sum(
                target, staging, self.comm_dtype, self.comm_method
            )
            self._in_flight.append((finish, chunk, target, state.staging.pop(bucket)))
            self._next_bucket += 1
            while len(self._in_flight) > MAX_IN_FLIGHT:
                self._complete_oldest()

    def _complete_oldest(self) -> None:
        finish, chunk, target, _staging = self._in_flight.pop(0)
        finish()
        if target is not chunk:
            accumulate_(chunk, target)

    def _start_boundary_reductions(self, complete_only: bool) -> None:
        """Start the step's reduction of complete buckets, in the fixed order on every rank."""
        while self._next_bucket < len(self._bucket_order):
            gi, bucket = self._bucket_order[self._next_bucket]
            state = self.groups[gi]
            if complete_only and state.pending[bucket] > 0:
                return
            if self._fresh:
                for pi in state.flat.buckets[bucket].params:
                    if not state.touched[pi]:
                        state.acc_param_views[pi].zero_()
            self._early[(gi, bucket)] = self._start_bucket_reduction(state, bucket)
            self._next_bucket += 1

    def _start_bucket_reduction(
        self, state: _GroupState, bucket: int
    ) -> tuple[Callable[[], None], torch.Tensor]:
        """Launch the reduction of one bucket of a whole accumulator.

        Returns the finisher and the tensor that holds this rank's reduced chunk once it ran:
        the accumulator's own bucket (all-reduce, stage 0) or a new fp32 chunk (reduce-scatter).
        """
        flat = state.flat
        full = flat.bucket_view(state.accumulator, flat.buckets[bucket])
        if self.shards == 1:
            return self.comm.start_all_reduce_sum(full, self.comm_dtype, self.comm_method), full
        chunk = torch.empty(
            flat.buckets[bucket].chunk_numel(self.shards),
            dtype=torch.float32,
            device=flat.buffer.device,
        )
        finish = self.comm.start_reduce_scatter_sum(chunk, full, self.comm_dtype, self.comm_method)
        return finish, chunk

    def _finish_backward(self) -> None:
        with torch.no_grad():
            if self.sharded_accumulator:
                self._drain(complete_only=False)
                while self._in_flight:
                    self._complete_oldest()
            elif self._boundary:
                self._start_boundary_reductions(complete_only=False)
            elif self._fresh:
                for state in self.groups:
                    for pi, touched in enumerate(state.touched):
                        if not touched:
                            state.acc_param_views[pi].zero_()
        self._fresh = False
        self._backward_open = False
        self._reset_backward_bookkeeping()

    # --- step ---------------------------------------------------------------------------------
    def _reduced_grads(self) -> list[list[torch.Tensor]]:
        """Per group, per bucket: this rank's chunk of the group-summed gradient.

        In the accumulation dtype (fp32 where stage 1 reduce-scatters a whole accumulator),
        not yet divided by the world size or the loss scale.
        """
        if self._fresh:
            # step() with no backward since zero_grad: the gradient is zero, not stale data.
            for state in self.groups:
                state.accumulator.zero_()
        grads: list[list[torch.Tensor]] = []
        for gi, state in enumerate(self.groups):
            flat = state.flat
            per_bucket = []
            for bucket in flat.buckets:
                if self.sharded_accumulator:
                    chunk = state.acc_chunks[bucket.index]
                else:
                    early = self._early.pop((gi, bucket.index), None)
                    finish, chunk = early or self._start_bucket_reduction(state, bucket.index)
                    finish()
                per_bucket.append(chunk)
            grads.append(per_bucket)
        return grads

    def _global_sq_norm(self, grads: list[torch.Tensor]) -> float:
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32) if grads else []
        local = torch.stack(norms).double().square().sum().float() if norms else torch.zeros(())
        if self.shards > 1:
            local = self.comm.all_reduce_scalars(local.reshape(1))[0]
        return float(local)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._backward_open:
            raise RuntimeError("step() was called while a backward pass is still running")
        grads_by_group = self._reduced_grads()
        grads = [g for per_bucket in grads_by_group for g in per_bucket]
        factor = self._gradient_factor(
            self._global_sq_norm(grads), self.scaler.scale * self.comm.world_size
        )
        if factor is None:
            self._fresh = True
            return loss
        self._sync_hyperparameters()
        fused = self._use_fused_kernel()
        if fused:
            self._fused_kernel_update(grads_by_group, factor)
        else:
            self._torch_update(grads_by_group, factor)
        self._write_back(cast=not fused)
        self._fresh = True
        self.scaler.update(overflow=False)
        return loss

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

            device = self.groups[0].flat.buffer.device
            # Per-group settings count too: a param group may turn amsgrad on for itself.
            unsupported = any(
                g.get("amsgrad", False) or g.get("maximize", False) for g in self.param_groups
            )
            self._fused_kernel = (
                os.environ.get("DTYPEPLAN_FUSED_KERNEL", "1") != "0"
                and self.plan.optimizer.type in ("Adam", "AdamW")
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

        adam_w = self.plan.optimizer.type == "AdamW"
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
                    adam_w_mode=adam_w,
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

    # --- gradients ----------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.clear_lp_grads()
        self._abandon_backward()
        self._fresh = True

    def _abandon_backward(self) -> None:
        """Forget a backward pass that raised before its end-of-backward callback ran."""
        self._backward_open = False
        self._in_flight.clear()
        self._early.clear()
        for state in self.groups:
            state.staging.clear()
        self._reset_backward_bookkeeping()

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool = False) -> None:
        self._grads_seen = False
        # A sharded accumulator is reduced every micro-batch anyway; a whole one can start its
        # boundary reduction bucket by bucket while the last backward goes on.
        self._boundary = last_micro_batch and not self.sharded_accumulator
        try:
            super().backward(loss)
        except BaseException:
            self._abandon_backward()
            raise
        finally:
            self._boundary = False
        if not self._grads_seen:
            # The micro-batch reached no parameter (no hook fired): it still takes part in the
            # reductions, with zeros, or the ranks would pair different collectives.
            self._finish_backward()

    def clear_lp_grads(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None

    # --- state --------------------------------------------------------------------------------
    def _layout_facts(self) -> dict[str, Any]:
        return {
            "world_size": self.comm.world_size,
            "shards": self.shards,
            "rank": self.shard_rank,
            "numels": [[b.numel for b in s.flat.buckets] for s in self.groups],
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": "dtypeplan.flat/1",
            "layout": self._layout_facts(),
            "masters": [[m.detach().clone() for m in s.masters] for s in self.groups],
            **self._update_state(),
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("format") != "dtypeplan.flat/1":
            raise ValueError("not a dtypeplan flat-optimizer state dict")
        if state_dict["layout"] != self._layout_facts():
            raise ValueError(
                f"state dict was saved with layout {state_dict['layout']} but this optimizer has "
                f"{self._layout_facts()}; use dtypeplan.checkpoint to load across world sizes "
                "or ZeRO stages"
            )
        for state, masters in zip(self.groups, state_dict["masters"], strict=True):
            for mine, saved in zip(state.masters, masters, strict=True):
                mine.copy_(saved)
        self._load_update_state(state_dict)
        self._write_back()

    def _state_names(self) -> list[str]:
        names = ["master"]
        for state in self.groups:
            for master in state.masters:
                for key, value in self.inner.state.get(master, {}).items():
                    if (
                        torch.is_tensor(value)
                        and value.numel() == master.numel()
                        and key not in names
                    ):
                        names.append(key)
        return names

    def _gather_full(self, state: _GroupState, chunks: list[torch.Tensor]) -> torch.Tensor:
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
        names = self._state_names()
        first = 0
        for state in self.groups:
            for name in names:
                if name == "master":
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
                    result[f"param.{first + index}.{name}"] = view.clone()
            first += len(state.flat.params)
        steps = [v["step"] for v in self.inner.state.values() if "step" in v]
        result["scalar.step"] = int(steps[0].item()) if steps else 0
        result.update(self._scalar_state())
        return result

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor | float | int]) -> None:
        names = sorted({key.split(".", 2)[2] for key in state if key.startswith("param.")})
        # States absent from the input must not survive from before the load.
        self.inner.state.clear()
        first = 0
        step = int(state.get("scalar.step", 0))
        for group_state in self.groups:
            flat = group_state.flat
            for name in names:
                full = torch.zeros(flat.numel, dtype=torch.float32, device=flat.buffer.device)
                for index, view in enumerate(flat.param_views(full)):
                    view.copy_(state[f"param.{first + index}.{name}"])
                chunks = [flat.chunk_view(full, b, self.shard_rank) for b in flat.buckets]
                for master, chunk in zip(group_state.masters, chunks, strict=True):
                    if name == "master":
                        master.copy_(chunk)
                    else:
                        slot = self.inner.state[master]
                        slot[name] = chunk.clone()
                        if self.plan.optimizer.type in ("Adam", "AdamW"):
                            slot["step"] = torch.tensor(float(step), device=master.device)
            first += len(flat.params)
        self._load_scalar_state(state)
        self._write_back()
