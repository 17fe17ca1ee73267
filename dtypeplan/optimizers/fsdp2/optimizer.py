"""ZeRO-3 on FSDP2: parameters sharded too, gathered for forward and backward, released after.

FSDP2 (``torch.distributed.fsdp.fully_shard``) owns the parameter life cycle; this optimizer
owns the precision plan around it::

    sharded parameters (fp32)   this rank's shard of every parameter, a DTensor. These are
                                the master weights: nothing else holds an fp32 copy. With
                                bf16 master weights they are bf16, updated in fp32 and
                                rounded back (``update/pieces.py``: to nearest,
                                stochastically, or with a Kahan compensation per shard)
    compute parameters          gathered in the parameter dtype (MixedPrecisionPolicy.param_dtype)
                                before each forward and backward, released after
    accumulator (sharded)       FSDP2 reduce-scatters every micro-batch's gradient in the
                                communication dtype (reduce_dtype) into the sharded ``.grad``.
                                fp32 accumulation: that ``.grad`` (fp32, the sharded
                                parameters' dtype) is the accumulator. 16-bit accumulation: a
                                post-accumulate-grad hook on each sharded parameter (FSDP2 runs
                                it after every reduce-scatter) adds the fp32 shard into a 16-bit
                                accumulator and frees ``.grad``, so the sum is rounded to the
                                accumulation dtype at every micro-batch, as the plan says.
                                ``.grad`` then holds a storage-less placeholder on which torch's
                                ``clip_grad_norm_`` raises (``grads/owned.py``)
                                bf16 masters: FSDP2 casts each reduced shard to the sharded
                                parameters' dtype (bf16); the hook instead reads the
                                reduce-scatter's output as it came off the wire (kept by
                                ``sharding.NamedReduceScatter`` until backward ends) into an
                                accumulator of the accumulation dtype: no extra rounding
    optimizer states (fp32)     a fused ``torch.optim`` instance over the sharded parameters;
                                with ``optimizer_states`` other than fp32, or bf16 masters,
                                ``state/low_precision.py`` keeps each moment of a local shard
                                in its dtype (bf16, or torchao's int8 / fp8 blocks over the
                                flattened shard padded to whole blocks) and computes in fp32

What FSDP2 does not offer and this module adds: accumulation in a dtype other than that of
the sharded parameters (the hook above), and pipeline parallelism with a sharded accumulator:
``torch.distributed.pipelining`` turns gradient sync off for every micro-batch but the last of
a stage module that is an FSDPModule, which would accumulate whole (unsharded) gradients, so
under a pipeline only the stage's children are sharded (each its own FSDP root) and they
reduce-scatter every micro-batch. What it does not do: ``communication_reduction: fp32_sum``
(FSDP2's reduce-scatter sums in the wire dtype); the table marks that NotSupported.

A hybrid layout (``plan.shard_group_size`` ``S`` below the world ``W``: HSDP, see
``fsdp2/sharding.py``) shards all of the above within groups of ``S`` ranks and replicates it
across the ``W / S`` groups: each rank holds what flat ZeRO-3 on ``S`` ranks would. The
replicas hold the same reduced gradient shards, so the squared norm is summed over one replica
(the others add zero into the step's one summary all-reduce); stochastic rounding draws by the
rank within the shard group, so the replicas draw the same bits and stay equal; ``full_state``
gathers within the shard group (``DTensor.full_tensor`` on the 2-D mesh), and checkpoints
save each piece once (DCP drops the replicas' copies). Traffic: FSDP2 all-reduces the reduced
shard across groups after every micro-batch's reduce-scatter, so a step of ``K`` micro-batches
sends ``K`` such all-reduces across groups (ZeRO-2's hybrid layout sends one). FSDP2 could defer
them to the last micro-batch (``set_requires_all_reduce``), but it would then sum the earlier
micro-batches in ``reduce_dtype`` in a buffer of its own, not in the accumulation dtype.

FSDP2 would reduce fp32/bf16 gradients with ``ReduceOp.AVG``, which gloo has been reported to
compute as a sum; off NCCL the model is switched to SUM and an explicit divide
(``set_force_sum_reduction_for_comms``), as every other dtypeplan collective. On NCCL it keeps
the native average (no divide kernel, and the wire carries the mean).

Use: ``model = plan.prepare_model(model)`` (shards it; a no-op at other stages), then
``optimizer = plan.build(model.parameters())``. What ``state_dict`` and the checkpoints read and
write of this optimizer is ``fsdp2/checkpoint_state.py``'s.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtypeplan.comm import Communicator
from dtypeplan.errors import OptimizerUsageError
from dtypeplan.optimizers.buffers.host_offload import HostOffload
from dtypeplan.optimizers.contract.base import (
    HeldTensors,
    WrapPolicy,
    bare_backward_refusal,
    inner_optimizer,
)
from dtypeplan.optimizers.contract.fp8_compute import (
    fp8_all_gather_weights,
    fp8_held,
    precompute_scales,
)
from dtypeplan.optimizers.contract.registry import register
from dtypeplan.optimizers.contract.served import FSDP2
from dtypeplan.optimizers.fsdp2.caches import copies_of
from dtypeplan.optimizers.fsdp2.checkpoint_state import FSDP2State
from dtypeplan.optimizers.fsdp2.host_update import HostUpdate, offloads_optimizer_alone
from dtypeplan.optimizers.fsdp2.shard_update import ShardUpdate
from dtypeplan.optimizers.fsdp2.sharding import (
    BEFORE_REDUCE,
    CLEARS_OWNED,
    REDUCE_SCATTER_OF,
    as_reduced,
    check_sharded_on,
    hybrid_layout,
    mesh_compute_device,
    shard_model,
)
from dtypeplan.optimizers.grads.factor import chunk_sq_norms, sum_sq_norms
from dtypeplan.optimizers.grads.owned import (
    OwnedGradient,
    is_owned_gradient,
    owned_sharded_gradient,
)
from dtypeplan.optimizers.kernels.torch_adam import inner_step_grads, is_unit_factor
from dtypeplan.optimizers.state.low_precision import held_compensations, held_states
from dtypeplan.optimizers.update.pieces import LowPrecisionAdamUpdate

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["FSDP2Optimizer"]

HOST_RESIDENT = frozenset({"params", "accumulator", "master", "optimizer_states"})
"""What CPUOffloadPolicy (``offload_param: cpu``) keeps in host memory: the shards, the gradient
shards and every tensor made like them (16-bit accumulators, Kahan compensations, states)."""


class Applied(NamedTuple):
    """What a step's update did: the factor it applied the gradients with (it unscales and
    clips them: times the loss scale, the clip coefficient), and per gradient (in the order of
    the parameters) whether the update left ``grad * factor`` in the kept gradient."""

    factor: torch.Tensor
    scaled: list[bool]


def _local(tensor: torch.Tensor | None) -> torch.Tensor:
    """The local shard of a sharded parameter's gradient (a DTensor under FSDP2)."""
    return _sharded(tensor).to_local()


def _sharded(tensor: torch.Tensor | None) -> DTensor:
    assert isinstance(tensor, DTensor), "FSDP2 keeps sharded gradients as DTensors"
    return tensor


@register("fsdp2", serves=FSDP2)
class FSDP2Optimizer(FSDP2State):
    """ZeRO-3: master weights, gradients and optimizer states sharded, on FSDP2."""

    takes_sharded_parameters = True

    @classmethod
    def prepare_model(
        cls,
        model: torch.nn.Module,
        *,
        plan: PrecisionPlan,
        process_group: dist.ProcessGroup | None = None,
        wrap: WrapPolicy | None = None,
    ) -> torch.nn.Module:
        """Shard ``model`` with ``fully_shard``, one unit per block, then the root; in place.

        Units: see ``fsdp2/units.py`` (by default each module of a ``ModuleList`` /
        ``ModuleDict`` and each top-level child; ``wrap`` chooses others; tied parameters
        share a unit). The mesh lives on the process group's device (NCCL: the current CUDA
        device; gloo: CPU), and FSDP2 moves each unit there as it shards it, so a model built
        on CPU reaches the GPU one unit at a time. Each unit's trainable parameters become
        fp32 just before it is sharded (they are the master weights), so no rank ever holds
        the whole model in fp32 unsharded; frozen parameters and floating-point buffers are
        cast to ``plan.param_dtype`` first, as at every other stage.
        """
        return shard_model(model, plan=plan, process_group=process_group, wrap=wrap)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        plan: PrecisionPlan,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(params, plan=plan, process_group=process_group)
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not all(isinstance(p, DTensor) for p in trainable) and plan.offload_param != "none":
            raise ValueError(
                "ZeRO-3 with offload_param runs on FSDP2, which needs torch.distributed: "
                "initialize a process group (one rank is enough) and call "
                "model = plan.prepare_model(model) before plan.build(model.parameters())"
            )
        if not all(isinstance(p, DTensor) for p in trainable):
            raise ValueError(
                "ZeRO-3 needs the model sharded before the optimizer is built: call "
                "model = plan.prepare_model(model) and then plan.build(model.parameters())"
            )
        if any(p.dtype != plan.master_dtype for p in trainable):
            raise ValueError(
                "ZeRO-3 expects sharded parameters in the master dtype (they are the master "
                "weights): build on the model plan.prepare_model returned"
            )
        self.comm = Communicator(process_group)
        self.layout = hybrid_layout(process_group, plan)
        """Shard and replica groups of a hybrid layout; None when flat."""
        self._check_ranks_agree(self.comm)
        self._check_mesh(trainable)
        # What clip_grad_norm_ reduced for the coming step: (squared norm, touched flags).
        self._pending: tuple[torch.Tensor, list[bool]] | None = None
        self.sharded = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        # The update runs on the local shards as plain tensors: fused kernels have no DTensor
        # sharding rules (SGD's has none at all), and a local update needs no communication.
        self.shards = [[p.to_local().detach() for p in group] for group in self.sharded]
        """Per param group, the local shards FSDP2 gathers (on the mesh's device, or on the host
        under CPUOffloadPolicy)."""
        self.host_update: HostUpdate | None = None
        """offload_optimizer cpu alone (``fsdp2/host_update.py``): host masters beside the
        device shards, and the update on the host."""
        if offloads_optimizer_alone(plan):
            self.host_update = HostUpdate(self.shards, mesh_compute_device(self._mesh()))
        self.locals = self.host_update.masters if self.host_update is not None else self.shards
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": local}
            for g, local in zip(self.param_groups, self.locals, strict=True)
        ]
        self._inner = inner_optimizer(plan, groups, fused=True)
        # bf16 masters (updated in fp32 and rounded back into the local shards), or moments
        # stored in other dtypes than fp32.
        self._low_precision = LowPrecisionAdamUpdate.for_plan(
            plan,
            self._inner,
            self._locals(),
            self.layout.shard_rank if self.layout is not None else self.comm.rank,
        )
        self._shard_update = (
            None
            if self._low_precision is None
            else ShardUpdate(
                self._low_precision,
                self._inner,
                plan.optimizer.torch_class,
                # Where the shards are (the host under CPUOffloadPolicy), not the mesh's device.
                next((t.device for t in self._locals()), torch.device("cpu")),
            )
        )
        """The step of the local shards with low-precision state (``fsdp2/shard_update.py``)."""
        self._low_precision_masters = plan.master_dtype != torch.float32
        # 16-bit accumulation, or 16-bit masters (whose sharded .grad FSDP2 keeps in their
        # dtype): FSDP2 hands each micro-batch's reduced shard to a hook.
        self.accumulators: list[torch.Tensor] | None = None
        self._fresh: list[bool] = []
        if plan.grad_accum_dtype != torch.float32 or self._low_precision_masters:
            self.accumulators = [
                torch.zeros_like(t, dtype=plan.grad_accum_dtype)
                for group in self.shards
                for t in group
            ]
            self._fresh = [True] * len(self.accumulators)
            for index, param in enumerate(self._params()):
                self.hooks.add(param, _make_fold_hook(weakref.ref(self), index))
                BEFORE_REDUCE[param] = _make_discard_check(weakref.ref(self), index)
        self._filled: list[torch.Tensor] = []
        """Parameters whose missing ``.grad`` the step filled with zeros (set back to None)."""
        self._in_backward = False
        # What holds the weights besides the shards (fsdp2/caches.py): every step and load
        # drops the gathered units and secondary partitions of the parameters' models, and
        # computes the fp8 all-gather's scales from the shards it wrote (one all-reduce).
        self._copies = copies_of(self._params())
        self._fp8_layers = fp8_all_gather_weights(p for group in self.sharded for p in group)
        refusal = bare_backward_refusal(plan)
        if refusal is not None:
            for param in self._params():
                self.hooks.add(param, _make_bare_backward_check(weakref.ref(self), refusal))
        self._take_ownership()

    @property
    def offload(self) -> HostOffload | None:
        """The host side of offload_optimizer cpu alone (None otherwise; under
        CPUOffloadPolicy FSDP2 itself keeps everything in host memory)."""
        return self.host_update.offload if self.host_update is not None else None

    def refresh_params(self) -> None:
        """After a load wrote the master weights: the device shards (offload_optimizer alone),
        and what holds the weights besides them, follow them."""
        super().refresh_params()
        if self.host_update is not None:
            self.host_update.upload(self.shards)
        self._shards_changed()

    def _shards_changed(self) -> None:
        """The shards were written (a step, a load): no unit keeps an older gather or
        secondary partition, and the fp8 all-gather's scales are theirs (collective)."""
        for copies in self._copies:
            copies.reshard()
        precompute_scales(self._fp8_layers)

    def _mesh(self) -> Any:
        trainable = self._params()
        if not trainable:
            return None
        return _sharded(trainable[0]).device_mesh

    def load_full_state(self, state: dict[str, torch.Tensor | float | int]) -> None:
        super().load_full_state(state)
        self.refresh_params()

    def _check_mesh(self, trainable: list[torch.Tensor]) -> None:
        """The model was sharded for this plan's layout (``prepare_model`` with this plan)."""
        layout = self.layout
        want = (layout.replicas, layout.shard_size) if layout else (self.comm.world_size,)
        check_sharded_on(trainable, want, self.plan, self.comm.world_size)

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool = False) -> None:
        self._in_backward = True
        try:
            super().backward(loss, last_micro_batch=last_micro_batch)
        finally:
            self._in_backward = False

    @property
    def inner(self) -> torch.optim.Optimizer:
        """A fused ``torch.optim`` instance over the local shards of the sharded parameters."""
        return self._inner

    def held_tensors(self) -> HeldTensors:
        """Local shards only; the sharded parameters are the master weights.

        So ``master`` is empty (bf16 masters with Kahan rounding: the compensation buffers)
        and ``params`` holds the shards. The gathered compute parameters live only during
        forward and backward and are not listed. fp32 accumulation with fp32 masters: the
        sharded ``.grad`` is the accumulator. Weights gathered in fp8: their values and the
        fp32 scales precomputed for the next gather (``params``).
        """
        shards, scales = fp8_held(self._params(), [t for group in self.shards for t in group])
        sharded_grads = tuple(
            _local(p.grad)
            for p in self._params()
            if p.grad is not None and not is_owned_gradient(p.grad)
        )
        on_host: frozenset[str] = frozenset()
        if self.plan.offload_param != "none":
            on_host = HOST_RESIDENT
        elif self.host_update is not None:
            on_host = frozenset({"master", "optimizer_states"})
        masters = tuple(self._locals()) if self.host_update is not None else ()
        return HeldTensors(
            on_host=on_host,
            params=(*shards, *scales),
            grads=tuple(
                p.grad
                for g in self.param_groups
                for p in g["params"]
                if p.grad is not None and not isinstance(p, DTensor)
            ),
            accumulator=sharded_grads + tuple(self.accumulators or ()),
            master=masters + held_compensations(self.inner),
            optimizer_states=held_states(self.inner),
        )

    def _fold(self, index: int, param: torch.Tensor) -> None:
        """Add this micro-batch's reduced shard into the accumulator (16-bit accumulation, or
        16-bit masters)."""
        assert self.accumulators is not None
        with torch.no_grad():
            shard = _local(param.grad)
            if self._low_precision_masters:
                shard = as_reduced(shard, REDUCE_SCATTER_OF.get(param))
            if self._fresh[index]:
                self.accumulators[index].copy_(shard)
            else:
                self.accumulators[index].add_(shard)
        self._fresh[index] = False
        # A placeholder instead of nothing, so that torch's clip_grad_norm_ raises rather than
        # finding no gradient (a norm of 0); cleared before the unit's next reduce-scatter.
        param.grad = owned_sharded_gradient(_sharded(param.grad)) if param in CLEARS_OWNED else None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self._check_open("step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_grads()
        scale = self.scaler.scale
        applied: list[Applied] = []
        try:
            self._step(applied)
        finally:
            self._keep_gradients(scale, applied[0] if applied else None)
        self._shards_changed()
        return loss

    def _step(self, applied: list[Applied]) -> None:
        """Reduce, check, clip and update; on an update, append to ``applied`` the factor the
        gradients were applied with and which kept gradients the update scaled by it."""
        if self._pending is not None:
            (sq_norm, touched), self._pending = self._pending, None
            local_grads = self._local_gradients()
        else:
            touched = self._touched()
            local_grads = self._local_gradients()
            sq_norm, touched = self._step_summary(local_grads, touched)
        # FSDP2 already divided by the world size; only the loss scale is left.
        factor = self._check_and_clip(sq_norm, self.scaler.scale)
        if factor is None:
            return
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner_group.update({k: v for k, v in group.items() if k != "params"})
        if self._low_precision is not None:
            self._low_precision.check_still_serves(self.plan)
            assert self._shard_update is not None
            scaled = self._shard_update.step(
                self.inner.param_groups, self.locals, local_grads, touched, factor[1]
            )
            applied.append(Applied(factor[0], scaled))
        elif self.host_update is not None:
            # The host steps staged copies of the gradients: the kept ones stay as they are.
            self.host_update.step(self.inner, self.shards, local_grads, touched, factor)
            applied.append(Applied(factor[0], [False] * len(local_grads)))
        else:
            applied.append(Applied(factor[0], self._inner_step(local_grads, touched, factor)))
        self.scaler.update(overflow=False)

    def _inner_step(
        self,
        local_grads: list[torch.Tensor],
        touched: list[bool],
        factor: tuple[torch.Tensor, torch.Tensor],
    ) -> list[bool]:
        """The fused ``torch.optim`` step of the local shards that got a gradient; returns per
        gradient whether it now holds ``grad * factor`` (``inner_step_grads`` hands an fp32
        gradient to the step as it is, scaled in place, by torch's fused kernel or a multiply,
        unless the factor is exactly 1; a 16-bit one is stepped from an fp32 copy)."""
        # torch.optim skips a parameter without a gradient: one no rank gave a gradient keeps
        # its weights and states, as in torch (DeepSpeed would treat the gradient as zero).
        stepped = [
            (local, grad)
            for local, grad, got_one in zip(self._locals(), local_grads, touched, strict=True)
            if got_one
        ]
        # A parameter whose first gradient comes now has no state yet: torch creates it in
        # this step. Stepped apart from those that have one, since torch's fused SGD decides
        # "first step" for a whole call from its first parameter.
        fresh = [pair for pair in stepped if not self.inner.state.get(pair[0])]
        held = [pair for pair in stepped if self.inner.state.get(pair[0])]
        for part in [part for part in (fresh, held) if part]:
            locals_, grads = [local for local, _ in part], [grad for _, grad in part]
            with inner_step_grads(self.inner, locals_, grads, *factor):
                self.inner.step()
        unit = is_unit_factor(factor[0])
        return [
            got_one and grad.dtype == torch.float32 and not unit
            for grad, got_one in zip(local_grads, touched, strict=True)
        ]

    def _keep_gradients(self, scale_before: float, applied: Applied | None) -> None:
        """After the step the gradients stay until ``zero_grad``, as torch keeps ``.grad``: the
        next backward adds to them (FSDP2 into the sharded ``.grad``, the fold into the
        16-bit accumulator), a step without backward applies them again.

        What stays is what torch would keep (the contract of ``step()``, ``contract/base.py``):
        the summed gradient times the step's clip coefficient (``clip_grad_norm_`` and
        ``gradient_clipping``: torch's ``clip_grad_norm_`` clips ``.grad`` in place), in the
        units of the loss scale after the step (fp16). Whatever the update path did to them:
        torch's fused kernel leaves ``grad * factor`` in a gradient it was handed (the factor
        unscales and clips: ``factor * scale`` is the clip coefficient), a path that stepped
        a copy left them as they were. A skipped step changes no gradient, only their scale.
        """
        for param in self._filled:
            param.grad = None
        self._filled = []
        for param in self._params():
            reduce_scatter = REDUCE_SCATTER_OF.get(param)
            if reduce_scatter is not None:
                reduce_scatter.release()
        kept: list[torch.Tensor | None] = (
            list(self.accumulators)
            if self.accumulators is not None
            else [_local(p.grad) if p.grad is not None else None for p in self._params()]
        )
        scale = self.scaler.scale
        if applied is None:
            ratio = scale / scale_before
            held = [t for t in kept if t is not None]
            if ratio != 1.0 and held:
                torch._foreach_mul_(held, ratio)
            return
        scaled = [t for t, s in zip(kept, applied.scaled, strict=True) if t is not None and s]
        if scaled and scale != 1.0:
            torch._foreach_mul_(scaled, scale)
        as_summed = [
            t for t, s in zip(kept, applied.scaled, strict=True) if t is not None and not s
        ]
        if as_summed and not (is_unit_factor(applied.factor) and scale == scale_before):
            multiplier = applied.factor * scale
            for device in {t.device for t in as_summed}:
                torch._foreach_mul_(
                    [t for t in as_summed if t.device == device],
                    multiplier.to(device, non_blocking=True),
                )

    def _check_grads(self) -> None:
        """16-bit accumulation: what the loop did to the placeholders since the last backward
        (``grads/owned.py``); with fp32 accumulation ``.grad`` is FSDP2's and needs no look."""
        if self.accumulators is not None:
            for index, param in enumerate(self._params()):
                self._check_one(index, param)

    def _check_one(self, index: int, param: torch.Tensor) -> None:
        """A placeholder set to None discards the parameter's accumulated gradient (the next
        shard starts it afresh), one zeroed makes it zero; right before the next reduce-scatter
        of its unit and at the step. A rank's accumulator holds the reduced shards, so as
        with DDP every rank must drop alike."""
        assert self.accumulators is not None
        if self._fresh[index] or param not in CLEARS_OWNED:
            return
        grad = param.grad
        if grad is None:
            self._fresh[index] = True
            self._pending = None
        elif is_owned_gradient(grad):
            placeholder = _sharded(grad)._local_tensor
            assert isinstance(placeholder, OwnedGradient)
            if not placeholder.zeroed:
                return
            placeholder.zeroed = False
            self.accumulators[index].zero_()
            self._pending = None

    def _device(self) -> torch.device:
        """Where the step's summary is reduced: the mesh's device, which under CPUOffloadPolicy
        is not where the (host-resident) shards are; NCCL takes device tensors only."""
        mesh = self._mesh()
        return mesh_compute_device(mesh) if mesh is not None else torch.device("cpu")

    def _touched(self) -> list[bool]:
        """Per sharded parameter: got a gradient on this rank since ``zero_grad``."""
        if self.accumulators is None:
            return [p.grad is not None for p in self._params()]
        return [not fresh for fresh in self._fresh]

    def _step_summary(
        self, local_grads: list[torch.Tensor], touched: list[bool]
    ) -> tuple[torch.Tensor, list[bool]]:
        """One all-reduce of ``[squared norm, touched flag per parameter...]``.

        Returns the global squared norm (0-dim, on the device) and per parameter whether some
        rank gave it a gradient. The flags are read on the host (a sync) only by a rank where
        some parameter got none locally, the rare case: one touched here is touched everywhere.
        """
        device = self._device()
        if self.layout is None or self.layout.replica_rank == 0:
            # Empty: zero on the parameters' device, as the all-reduce may be NCCL's.
            sq = sum_sq_norms(chunk_sq_norms(local_grads), device).reshape(1)
        else:
            # The other replicas hold the same reduced shards: they add nothing to the norm
            # (a zero, not a product with zero, which would turn an inf of theirs into nan).
            sq = torch.zeros(1, dtype=torch.float32, device=device)
        check = self.hyperparameter_check
        flags = torch.tensor([float(t) for t in touched] + check.slots(), dtype=torch.float32)
        summary = self.comm.all_reduce_scalars(torch.cat([sq, flags.to(device, non_blocking=True)]))
        if check.numel:
            # The hyperparameters' fingerprint rides on this all-reduce
            # (contract/hyperparameters.py).
            check.post(summary[len(summary) - check.numel :])
            summary = summary[: len(summary) - check.numel]
        # Under a pipeline, the other stages' norms too: one clip factor, one skip decision.
        sq_norm = self._across_pipeline(summary[0], self.scaler.scale)
        if all(touched):
            return sq_norm, touched
        return sq_norm, [count > 0 for count in summary[1:].tolist()]

    def _prepare_grad_norm(self) -> float:
        self._check_grads()
        if self._pending is None:
            touched = self._touched()  # before _local_gradients fills missing ones with zeros
            self._pending = self._step_summary(self._local_gradients(), touched)
        sq_norm = float(self._pending[0])  # clip_grad_norm_ returns it: one sync
        return math.sqrt(sq_norm) / self.scaler.scale if math.isfinite(sq_norm) else math.inf

    def _local_gradients(self) -> list[torch.Tensor]:
        """This rank's shard of each accumulated gradient (fp32 ``.grad`` or 16-bit sums)."""
        params = self._params()
        if self.accumulators is None:
            for param in params:
                if param.grad is None:  # no micro-batch since zero_grad reached it
                    param.grad = torch.zeros_like(param)
                    self._filled.append(param)
            return [_local(p.grad) for p in params]
        for param in params:
            if param.grad is not None and not is_owned_gradient(param.grad):
                raise RuntimeError(
                    "FSDP2 left a gradient that the 16-bit accumulation hook did not take: this "
                    "torch's FSDP2 does not run post-accumulate-grad hooks on sharded parameters. "
                    "Use gradient_accumulation_dtype fp32 at ZeRO-3 with it"
                )
        for index, fresh in enumerate(self._fresh):
            if fresh:  # no micro-batch since zero_grad reached this parameter
                self.accumulators[index].zero_()
        return self.accumulators

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self._params():
            param.grad = None
            reduce_scatter = REDUCE_SCATTER_OF.get(param)
            if reduce_scatter is not None:
                reduce_scatter.release()
        self._fresh = [True] * len(self._fresh)
        self._pending = None
        self._clip_coef = 1.0

    def clear_lp_grads(self) -> None:
        """Clear the compute (low-precision) gradients: FSDP2 already frees them.

        After its reduce-scatter FSDP2 releases the unsharded gradients; only the sharded
        fp32 accumulator, which ``zero_grad`` clears, survives a micro-batch.
        """
        for group in self.param_groups:
            for param in group["params"]:
                if not isinstance(param, DTensor):
                    param.grad = None


def _make_bare_backward_check(
    optimizer: weakref.ReferenceType[FSDP2Optimizer], refusal: str
) -> Callable[[torch.Tensor], None]:
    """A hook that refuses a backward ``opt.backward`` did not begin (fp16 loss scaling)."""

    def check(param: torch.Tensor) -> None:
        owner = optimizer()
        if owner is not None and not owner._in_backward:
            raise OptimizerUsageError(refusal)

    return check


def _make_discard_check(
    optimizer: weakref.ReferenceType[FSDP2Optimizer], index: int
) -> Callable[[torch.Tensor], None]:
    """The check before a unit's reduce-scatter (``sharding.BEFORE_REDUCE``), held weakly."""

    def check(param: torch.Tensor) -> None:
        owner = optimizer()
        if owner is not None and not owner.closed:
            owner._check_one(index, param)

    return check


def _make_fold_hook(
    optimizer: weakref.ReferenceType[FSDP2Optimizer], index: int
) -> Callable[[torch.Tensor], None]:
    """The 16-bit accumulation hook; holds the optimizer weakly (never keeps it alive)."""

    def fold(param: torch.Tensor) -> None:
        owner = optimizer()
        if owner is not None:
            owner._fold(index, param)

    return fold
