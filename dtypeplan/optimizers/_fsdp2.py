"""ZeRO-3 on FSDP2: parameters sharded too, gathered for forward and backward, released after.

FSDP2 (``torch.distributed.fsdp.fully_shard``) owns the parameter life cycle; this optimizer
owns the precision plan around it::

    sharded parameters (fp32)   this rank's shard of every parameter, a DTensor. These are
                                the master weights: nothing else holds an fp32 copy
    compute parameters          gathered in the parameter dtype (MixedPrecisionPolicy.param_dtype)
                                before each forward and backward, released after
    accumulator (sharded)       FSDP2 reduce-scatters every micro-batch's gradient in the
                                communication dtype (reduce_dtype) into the sharded ``.grad``.
                                fp32 accumulation: that ``.grad`` (fp32, the sharded
                                parameters' dtype) is the accumulator. 16-bit accumulation: a
                                post-accumulate-grad hook on each sharded parameter (FSDP2 runs
                                it after every reduce-scatter) adds the fp32 shard into a 16-bit
                                accumulator and frees ``.grad``, so the sum is rounded to the
                                accumulation dtype at every micro-batch, as the plan says
    optimizer states (fp32)     a fused ``torch.optim`` instance over the sharded parameters

What FSDP2 does not offer and this module adds: accumulation in a dtype other than that of
the sharded parameters (the hook above), and pipeline parallelism with a sharded accumulator:
``torch.distributed.pipelining`` turns gradient sync off for every micro-batch but the last of
a stage module that is an FSDPModule, which would accumulate whole (unsharded) gradients, so
under a pipeline only the stage's children are sharded (each its own FSDP root) and they
reduce-scatter every micro-batch. What it does not do: ``communication_reduction: fp32_sum``
(FSDP2's reduce-scatter sums in the wire dtype); the table marks that NotSupported.

FSDP2 would reduce fp32/bf16 gradients with ``ReduceOp.AVG``, which gloo has been reported to
compute as a sum; off NCCL the model is switched to SUM and an explicit divide
(``set_force_sum_reduction_for_comms``), as every other dtypeplan collective. On NCCL it keeps
the native average (no divide kernel, and the wire carries the mean).

Use: ``model = plan.prepare_model(model)`` (shards it; a no-op at other stages), then
``optimizer = plan.build(model.parameters())``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from dtypeplan.comm import Communicator
from dtypeplan.optimizers import _state_keys as keys
from dtypeplan.optimizers._base import HeldTensors, MixedPrecisionOptimizer
from dtypeplan.optimizers._registry import register

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["FSDP2Optimizer"]


@register("fsdp2")
class FSDP2Optimizer(MixedPrecisionOptimizer):
    """ZeRO-3: master weights, gradients and optimizer states sharded, on FSDP2."""

    @classmethod
    def prepare_model(
        cls,
        model: torch.nn.Module,
        *,
        plan: PrecisionPlan,
        process_group: dist.ProcessGroup | None = None,
    ) -> torch.nn.Module:
        """Shard ``model`` with ``fully_shard``: every child with parameters, then the root."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not (dist.is_available() and dist.is_initialized()):
            return model  # one process: nothing to shard (see __new__)
        group = process_group or dist.group.WORLD
        device = next(model.parameters()).device
        mesh = DeviceMesh.from_group(group, device_type=device.type)
        policy = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.comm_dtype)
        model.to(torch.float32)
        for child in model.children():
            if any(p.requires_grad for p in child.parameters()):
                fully_shard(child, mesh=mesh, mp_policy=policy)
        own = [name for name, p in model.named_parameters(recurse=False) if p.requires_grad]
        if plan.pipeline_parallel and own:
            raise ValueError(
                f"under pipeline parallelism ZeRO-3 shards the stage module's children, but the "
                f"stage module holds parameters of its own ({', '.join(own)}); wrap it, e.g. "
                "torch.nn.Sequential(stage_module), before plan.prepare_model"
            )
        if not plan.pipeline_parallel:
            # Under torch.distributed.pipelining the stage module itself stays unwrapped: the
            # schedule turns gradient sync off for all but the last micro-batch of a module
            # that is an FSDPModule, which would accumulate whole gradients; the children,
            # each its own FSDP root, reduce-scatter every micro-batch as the plan says.
            fully_shard(model, mesh=mesh, mp_policy=policy)
        if dist.get_backend(group) != "nccl":
            # NCCL averages natively (no divide kernel); elsewhere SUM and an explicit divide.
            for module in model.modules():
                if hasattr(module, "set_force_sum_reduction_for_comms"):
                    module.set_force_sum_reduction_for_comms(True)
        return model

    def __new__(
        cls,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        plan: PrecisionPlan,
        process_group: dist.ProcessGroup | None = None,
    ) -> MixedPrecisionOptimizer:
        if not (dist.is_available() and dist.is_initialized()):
            # Without torch.distributed there is one process and nothing to shard: the flat
            # sharded optimizer with a world of one keeps the same plan (fp32 master weights,
            # sharded fp32 accumulator) without FSDP2, which needs a process group.
            from dtypeplan.optimizers._implementations import ShardedOptimizer

            return ShardedOptimizer(params, plan=plan, process_group=process_group)
        return super().__new__(cls)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        plan: PrecisionPlan,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(params, plan=plan, process_group=process_group)
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not all(isinstance(p, DTensor) for p in trainable):
            raise ValueError(
                "ZeRO-3 needs the model sharded before the optimizer is built: call "
                "model = plan.prepare_model(model) and then plan.build(model.parameters())"
            )
        if any(p.dtype != torch.float32 for p in trainable):
            raise ValueError("ZeRO-3 expects fp32 sharded parameters (they are the master weights)")
        self.comm = Communicator(process_group)
        self._check_ranks_agree(self.comm)
        self.sharded = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        # The update runs on the local shards as plain tensors: fused kernels have no DTensor
        # sharding rules (SGD's has none at all), and a local update needs no communication.
        self.locals = [[p.to_local().detach() for p in group] for group in self.sharded]
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": local}
            for g, local in zip(self.param_groups, self.locals, strict=True)
        ]
        self._inner = plan.optimizer.torch_class(groups, fused=True)
        # 16-bit accumulation: FSDP2 hands each micro-batch's fp32 shard to a hook.
        self.accumulators: list[torch.Tensor] | None = None
        self._fresh: list[bool] = []
        if plan.grad_accum_dtype != torch.float32:
            self.accumulators = [
                torch.zeros_like(t, dtype=plan.grad_accum_dtype) for t in self._locals()
            ]
            self._fresh = [True] * len(self.accumulators)
            self._hooks = [
                param.register_post_accumulate_grad_hook(self._make_hook(index))
                for index, param in enumerate(self._params())
            ]

    @property
    def inner(self) -> torch.optim.Optimizer:
        """A fused ``torch.optim`` instance over the local shards of the sharded parameters."""
        return self._inner

    def held_tensors(self) -> HeldTensors:
        """Local shards only; the sharded fp32 parameters are the master weights.

        So ``master`` is empty and ``params`` holds the shards. The gathered compute
        parameters live only during forward and backward and are not listed. fp32
        accumulation: the sharded ``.grad`` is the accumulator.
        """
        sharded_grads = tuple(p.grad.to_local() for p in self._params() if p.grad is not None)
        return HeldTensors(
            params=tuple(self._locals()),
            grads=tuple(
                p.grad
                for g in self.param_groups
                for p in g["params"]
                if p.grad is not None and not isinstance(p, DTensor)
            ),
            accumulator=sharded_grads + tuple(self.accumulators or ()),
            master=(),
            optimizer_states=tuple(
                v for slot in self.inner.state.values() for v in slot.values() if torch.is_tensor(v)
            ),
        )

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def fold(param: torch.Tensor) -> None:
            assert self.accumulators is not None
            with torch.no_grad():
                shard = param.grad.to_local()
                if self._fresh[index]:
                    self.accumulators[index].copy_(shard)
                else:
                    self.accumulators[index].add_(shard)
            self._fresh[index] = False
            param.grad = None

        return fold

    def _params(self) -> list[DTensor]:
        return [p for group in self.sharded for p in group]

    def _locals(self) -> list[torch.Tensor]:
        return [t for group in self.locals for t in group]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        local_grads = self._local_gradients()
        norms = torch._foreach_norm(local_grads, 2.0, dtype=torch.float32) if local_grads else []
        if norms:
            sq = torch.stack(norms).double().square().sum().float().reshape(1)
        else:  # on the parameters' device: the all-reduce may be NCCL's
            device = self._locals()[0].device if self._locals() else torch.device("cpu")
            sq = torch.zeros(1, device=device)
        sq_norm = float(self.comm.all_reduce_scalars(sq)[0])
        # FSDP2 already divided by the world size; only the loss scale is left.
        factor = self._gradient_factor(sq_norm, self.scaler.scale)
        if factor is None:
            self.zero_grad()
            return loss
        local_grads = [g if g.dtype == torch.float32 else g.float() for g in local_grads]
        if factor != 1.0:
            torch._foreach_mul_(local_grads, factor)
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner_group.update({k: v for k, v in group.items() if k != "params"})
        for local, grad in zip(self._locals(), local_grads, strict=True):
            local.grad = grad
        self.inner.step()
        for local in self._locals():
            local.grad = None
        self.zero_grad()
        self.scaler.update(overflow=False)
        return loss

    def _local_gradients(self) -> list[torch.Tensor]:
        """This rank's shard of each accumulated gradient (fp32 ``.grad`` or 16-bit sums)."""
        params = self._params()
        if self.accumulators is None:
            for param in params:
                if param.grad is None:  # no micro-batch since zero_grad reached it
                    param.grad = torch.zeros_like(param)
            return [p.grad.to_local() for p in params]
        for param in params:
            if param.grad is not None:
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
        self._fresh = [True] * len(self._fresh)

    def clear_lp_grads(self) -> None:
        """Clear the compute (low-precision) gradients: FSDP2 already frees them.

        After its reduce-scatter FSDP2 releases the unsharded gradients; only the sharded
        fp32 accumulator, which ``zero_grad`` clears, survives a micro-batch.
        """
        for group in self.param_groups:
            for param in group["params"]:
                if not isinstance(param, DTensor):
                    param.grad = None

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "format": "dtypeplan.fsdp2/1",
            "world_size": self.comm.world_size,
            "masters": [t.clone() for t in self._locals()],
            **self._update_state(),
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if (
            state_dict.get("format") != "dtypeplan.fsdp2/1"
            or state_dict["world_size"] != self.comm.world_size
        ):
            raise ValueError(
                "state dict was not saved by a ZeRO-3 optimizer on this world size; use "
                "dtypeplan.checkpoint to load across world sizes or ZeRO stages"
            )
        for local, saved in zip(self._locals(), state_dict["masters"], strict=True):
            local.copy_(saved)
        self._load_update_state(state_dict)

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor | float | int]:
        result: dict[str, torch.Tensor | float | int] = {}
        for index, (param, local) in enumerate(zip(self._params(), self._locals(), strict=True)):
            result[keys.param_key(index, keys.MASTER)] = param.full_tensor().float()
            for name, value in self.inner.state.get(local, {}).items():
                if name != keys.STEP and torch.is_tensor(value) and value.shape == local.shape:
                    whole = DTensor.from_local(
                        value,
                        param.device_mesh,
                        param.placements,
                        shape=param.shape,
                        stride=param.stride(),
                    )
                    result[keys.param_key(index, name)] = whole.full_tensor().float()
        result.update(self._scalar_state())
        return result

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor | float | int]) -> None:
        names = keys.param_state_names(state)
        self.reset_update_state(
            [n for n in names if n != keys.MASTER], int(state.get(keys.scalar_key(keys.STEP), 0))
        )
        for index, (param, local) in enumerate(zip(self._params(), self._locals(), strict=True)):
            for name in names:
                full = state[keys.param_key(index, name)].to(param.device, torch.float32)
                shard = distribute_tensor(full, param.device_mesh, param.placements).to_local()
                target = local if name == keys.MASTER else self.inner.state[local][name]
                target.copy_(shard)
        self._load_scalar_state(state)
