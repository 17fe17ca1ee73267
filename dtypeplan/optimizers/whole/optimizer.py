"""WholeTensorOptimizer: each parameter updated whole, by the torch class that needs its shape.

``torch.optim.Muon`` orthogonalizes each matrix's update and ``torch.optim.Adafactor`` factors
its second moment by rows and columns: neither can run on the flat engine's shards of many
parameters. Here each trainable parameter keeps its shape and its own fp32 master:

* ZeRO 0 (``owners`` is None): every rank sums its micro-batches' gradients, all-reduces them
  in ``comm_dtype`` and runs the class on every parameter (replicated, no owner).
* ZeRO 1 and 2: each parameter is owned whole by one rank (``owners.py``: balanced by size).
  Only the owner keeps its master and states and runs the class on it. Its gradient is reduced
  to the owner in ``comm_dtype`` (a SUM, then divided by the ranks: gloo's AVG is not reliable)
  once per step where the accumulator is whole (ZeRO-1), or at each micro-batch's backward where
  it is sharded (ZeRO-2: only the owner keeps a sum). The updated parameter is broadcast back
  from its owner in the parameter dtype.
* ZeRO 3: FSDP2 shards the parameters (``fsdp2/``'s ``prepare_model``) and reduce-scatters each
  micro-batch's gradient into the shards (the mean); each parameter is owned as at ZeRO 1-2,
  with a whole fp32 master on its owner. At the step the owner gets the full gradient from the
  shards (``sharded.py``: an all-gather), updates the whole parameter, and broadcasts it; each
  rank copies its shard of it into FSDP2's sharded parameter.

Shard groups (``zero_optimization.shard_group_size`` ``S`` below the world ``W``, ZeRO 1-3):
each parameter has one owner in each shard group, at the same index in every group
(``owners.py``). ZeRO 1-2 reduce each gradient to its owner within the shard group, as above,
then the owners of the parameter (one replica group) all-reduce it across the groups in
``comm_dtype``, once per step, and divide by ``W``; the updated parameter is broadcast within
each shard group. ZeRO-3 shards on FSDP2's HSDP mesh, whose reduction leaves every rank the
shard of the mean already: the whole gradient is gathered, and the shards written back,
within the shard group.

The global norm is one all-reduce of the owners' squared norms (with shard groups, the first
group's: the others hold the same gradients); clipping, the non-finite check
and the step's factor are the base class's (``contract/base.py``). A parameter that got no
gradient on any rank since ``zero_grad`` is not updated (its ``.grad`` stays None for the
class), as in ``torch.optim``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtypeplan.comm import Communicator
from dtypeplan.muon import MuonWithAuxAdamW, tag_muon_parameters
from dtypeplan.optimizers.contract.base import MixedPrecisionOptimizer, WrapPolicy, inner_optimizer
from dtypeplan.optimizers.contract.param_groups import refuse_sharded_parameters
from dtypeplan.optimizers.fsdp2 import FSDP2Optimizer
from dtypeplan.optimizers.fsdp2.sharding import BEFORE_REDUCE, CLEARS_OWNED, check_sharded_on
from dtypeplan.optimizers.grads.owned import (
    OwnedGradient,
    is_owned_gradient,
    owned_sharded_gradient,
)
from dtypeplan.optimizers.state import HeldTensors, keys
from dtypeplan.optimizers.whole.full_state import kept_states, restored_slot, split_payload
from dtypeplan.optimizers.whole.low_precision import WholeLowPrecisionStep
from dtypeplan.optimizers.whole.owners import OwnerLayout, Owners, owner_layout
from dtypeplan.optimizers.whole.sharded import full_from_shards, write_shards
from dtypeplan.resolver import PrecisionPlan

__all__ = ["WholeTensorOptimizer"]


class WholeTensorOptimizer(MixedPrecisionOptimizer):
    """ZeRO 0-3 for optimizers that need each parameter whole (Muon, Adafactor, DeepSpeed's
    Muon)."""

    takes_sharded_parameters = True
    """At ZeRO-3 (on a process group) FSDP2's sharded parameters; elsewhere refused."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        plan: PrecisionPlan,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(params, plan=plan, process_group=process_group)
        self.comm = Communicator(process_group)
        self.fsdp2 = plan.zero_stage == 3 and self.comm.distributed
        """ZeRO-3: the parameters are FSDP2's shards (``sharded.py``)."""
        if not self.fsdp2:
            refuse_sharded_parameters(self.param_groups, plan, type(self).__name__)
        if self.comm.active:
            self._check_ranks_agree(self.comm)
            if not self.fsdp2:
                self._make_replicas_equal(self.comm)
        self.params = self.trainable_parameters()
        sizes = [p.numel() for p in self.params]
        self.layout: OwnerLayout | None = (
            owner_layout(sizes, self.comm, plan.shard_group_size) if plan.zero_stage >= 1 else None
        )
        """The owners and their groups (``owners.py``); None at ZeRO 0."""
        self.owners: Owners | None = self.layout.owners if self.layout is not None else None
        """Each parameter's owning rank (within each shard group); None at ZeRO 0 (every rank
        updates everything)."""
        if self.fsdp2:
            self._check_mesh()
        self.reduce_each_micro_batch = (
            plan.accumulator_sharded and self.owners is not None and not self.fsdp2
        )
        # What the summed gradients are still to be divided by: FSDP2 averaged them already.
        self.divisor = 1 if self.fsdp2 else self.comm.world_size
        self.masters: dict[int, torch.Tensor] = {}
        """The master of each parameter this rank owns, by its number (``master_dtype``)."""
        with torch.no_grad():
            for index, param in enumerate(self.params):
                whole = param.detach()
                if self.fsdp2:  # every rank takes part in the gather; the owner keeps it
                    whole = full_from_shards(param, _local(param))
                if self._owns(index):
                    master = whole.to(plan.master_dtype, copy=True)
                    if hasattr(param, "use_muon"):  # DeepSpeed's tag (dtypeplan/muon.py)
                        master.use_muon = param.use_muon  # type: ignore[attr-defined]
                    self.masters[index] = master
                if not self.fsdp2:  # ZeRO-3 keeps the sharded parameters in fp32
                    param.data = param.data.to(plan.param_dtype)
        number = {id(p): i for i, p in enumerate(self.params)}
        groups = [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [
                    self.masters[number[id(p)]]
                    for p in group["params"]
                    if id(p) in number and number[id(p)] in self.masters
                ],
            }
            for group in self.param_groups
        ]
        self._inner = inner_optimizer(plan, groups, fused=False)
        self.low_precision: WholeLowPrecisionStep | None = None
        """bf16 masters or bf16 states: each step in fp32 on upcast copies."""
        if plan.master_dtype != torch.float32 or plan.optimizer_states != "fp32":
            self.low_precision = WholeLowPrecisionStep(
                plan.optimizer.torch_class,
                rounding=plan.master_rounding,
                exp_avg_dtype=plan.exp_avg_dtype,
                exp_avg_sq_dtype=plan.exp_avg_sq_dtype,
            )
        self.accumulators: dict[int, torch.Tensor] = {}
        """Each parameter's sum of micro-batch gradients in ``grad_accum_dtype`` since
        ``zero_grad`` (ZeRO-2: reduced already, on the owner only)."""
        self.touched: set[int] = set()
        """The parameters that got a gradient on this rank since ``zero_grad``."""
        self._pending: tuple[dict[int, torch.Tensor], torch.Tensor] | None = None
        this = weakref.ref(self)
        for index, param in enumerate(self.params):
            self.hooks.add(param, _accumulate_hook(this, index))
            if self.fsdp2:  # FSDP2 reduces into .grad: look right before its reduce-scatter
                BEFORE_REDUCE[param] = _before_gradient_hook(this, index)
            else:
                self.hooks.add_pre(param, _before_gradient_hook(this, index))
        self._take_ownership()

    @classmethod
    def prepare_model(
        cls,
        model: torch.nn.Module,
        *,
        plan: PrecisionPlan,
        process_group: dist.ProcessGroup | None = None,
        wrap: WrapPolicy | None = None,
    ) -> torch.nn.Module:
        """As the base class; for DeepSpeed's ``"Muon"`` also tag each parameter ``use_muon``
        by its name and shape, as ``deepspeed.initialize`` does (a tag already set stays)."""
        if plan.optimizer.torch_class is MuonWithAuxAdamW:
            tag_muon_parameters(model, keep=True)
        if plan.zero_stage == 3 and dist.is_available() and dist.is_initialized():
            # ZeRO-3: sharded by FSDP2 as the fsdp2 implementation shards it. FSDP2 replaces
            # each parameter with a sharded one, which has none of the old one's attributes:
            # the tags are carried over by name (else every matrix, the embedding too, would
            # take Muon).
            tags = {
                name: param.use_muon
                for name, param in model.named_parameters()
                if hasattr(param, "use_muon")
            }
            prepared = FSDP2Optimizer.prepare_model(
                model, plan=plan, process_group=process_group, wrap=wrap
            )
            for name, param in prepared.named_parameters():
                if name in tags:
                    param.use_muon = tags[name]  # type: ignore[attr-defined]
            return prepared
        return super().prepare_model(model, plan=plan, process_group=process_group, wrap=wrap)

    # --- layout --------------------------------------------------------------------------------
    def _owns(self, index: int) -> bool:
        return self.layout is None or self.layout.owns(index)

    def _owner_global_rank(self, index: int) -> int:
        """The global rank of parameter ``index``'s owner in this rank's shard group."""
        assert self.layout is not None
        return self.layout.owner(index)

    def _shard_group(self) -> dist.ProcessGroup | None:
        """Where each gradient goes to its owner and the parameter comes back from it."""
        assert self.layout is not None
        return self.layout.shard

    def _check_mesh(self) -> None:
        """ZeRO-3: the model was sharded on this plan's mesh (its shard groups: FSDP2's HSDP),
        which the owners' gathers and broadcasts assume."""
        assert self.layout is not None
        size = len(self.layout.shard_ranks)
        want = (self.comm.world_size // size, size) if self.layout.replicated else (size,)
        check_sharded_on(self.params, want, self.plan, self.comm.world_size)

    @property
    def inner(self) -> torch.optim.Optimizer:
        return self._inner

    # --- backward -------------------------------------------------------------------------------
    @torch.no_grad()
    def _before_gradient(self, index: int, param: torch.Tensor) -> None:
        """Before a backward's gradient reaches ``param`` (ZeRO-3: right before its FSDP2
        unit's reduce-scatter) and at the step: the placeholder this optimizer left in
        ``.grad`` is still there (cleared, so the next gradient starts afresh), or the program
        discarded what was accumulated since (``model.zero_grad()``, ``.grad = None``, the
        placeholder zeroed, a gradient set by hand), and so does this optimizer, as torch
        would (each rank runs the same loop: at ZeRO-2 the owner drops the sum it holds)."""
        if self.fsdp2 and param not in CLEARS_OWNED:
            return  # no placeholder there (this torch's FSDP2 lays its state out otherwise)
        grad = param.grad
        if is_owned_gradient(grad):
            param.grad = None
            placeholder = grad._local_tensor if isinstance(grad, DTensor) else grad
            if not placeholder.zeroed:  # type: ignore[union-attr]
                return
        if index in self.touched:
            self.accumulators.pop(index, None)
            self.touched.discard(index)
            self._pending = None

    def _accumulate(self, index: int, param: torch.Tensor) -> None:
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        # What model.zero_grad() clears, so that the next backward can tell. ZeRO-3: FSDP2
        # adds each new shard into a .grad it finds, so there the placeholder is left only
        # where the sharding clears it before the unit's next reduce-scatter.
        if not self.fsdp2:
            param.grad = OwnedGradient(grad)
        elif isinstance(grad, DTensor) and param in CLEARS_OWNED:
            param.grad = owned_sharded_gradient(grad)
        self.touched.add(index)
        if isinstance(grad, DTensor):  # ZeRO-3: FSDP2's reduced shard
            grad = grad.to_local()
        if self.reduce_each_micro_batch:
            wire = self._reduce_to_owner(index, grad)
            if wire is None:
                return
            grad = wire
        accumulator = self.accumulators.get(index)
        if accumulator is None:
            self.accumulators[index] = grad.to(self.plan.grad_accum_dtype, copy=True)
        else:
            accumulator.add_(grad.to(accumulator.dtype))

    def _reduce_to_owner(self, index: int, grad: torch.Tensor) -> torch.Tensor | None:
        """``grad`` summed over the shard group's ranks in ``comm_dtype``, on the owner (None
        elsewhere)."""
        wire = grad.to(self.plan.comm_dtype, copy=True)
        if self.comm.active:
            dist.reduce(wire, dst=self._owner_global_rank(index), group=self._shard_group())
        return wire if self._owns(index) else None

    def _sum_across_groups(self, grad: torch.Tensor) -> torch.Tensor:
        """An owner's gradient, summed over its shard group, summed with the other shard
        groups' owners of the parameter (its replica group) in ``comm_dtype``; fp32."""
        if self.layout is None or not self.layout.replicated:
            return grad.float()
        wire = grad.to(self.plan.comm_dtype, copy=True)
        dist.all_reduce(wire, group=self.layout.replica)
        return wire.float()

    # --- step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def _reduce(self) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """The step's gradients of the parameters this rank updates (fp32, summed over the
        ranks, not yet divided) and the global squared norm (0-dim)."""
        touched = torch.zeros(len(self.params))
        touched[list(self.touched)] = 1.0
        if self.comm.active:
            dist.all_reduce(touched, op=dist.ReduceOp.MAX, group=self.comm.group)
        grads: dict[int, torch.Tensor] = {}
        for index, param in enumerate(self.params):
            if not touched[index]:
                continue
            summed = self.accumulators.get(index)
            if self.reduce_each_micro_batch:
                if summed is not None:  # the owner: reduced at each backward
                    grads[index] = self._sum_across_groups(summed)
                elif self._owns(index):
                    zeros = torch.zeros_like(param, dtype=torch.float32)
                    grads[index] = self._sum_across_groups(zeros)
                continue
            if self.fsdp2:
                local = summed if summed is not None else torch.zeros_like(_local(param))
                whole = full_from_shards(param, local.detach())
                if self._owns(index):
                    grads[index] = whole.float()
                continue
            local = summed if summed is not None else torch.zeros_like(param)
            if self.owners is None:
                wire = local.to(self.plan.comm_dtype, copy=True)
                if self.comm.active:
                    dist.all_reduce(wire, group=self.comm.group)
                grads[index] = wire.float()
            else:
                reduced = self._reduce_to_owner(index, local)
                if reduced is not None:
                    grads[index] = self._sum_across_groups(reduced)
        sq_norm = torch.zeros((), dtype=torch.float32)
        # Every shard group's owners hold the same gradients: the first group's count once.
        if self.layout is None or self.layout.replica_rank == 0:
            for grad in grads.values():
                sq_norm += grad.pow(2).sum()
        if self.owners is not None and self.comm.active:
            dist.all_reduce(sq_norm, group=self.comm.group)
        return grads, self._across_pipeline(sq_norm, self.divisor * self.loss_scale)

    def _prepare_grad_norm(self) -> float:
        if self._pending is None:
            self._pending = self._reduce()
        sq_norm = float(self._pending[1])
        divisor = self.divisor * self.loss_scale
        return (
            sq_norm**0.5 / divisor
            if sq_norm == sq_norm and sq_norm != float("inf")
            else float("inf")
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self._check_open("step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.hyperparameter_check.flush()
        self._sync_hyperparameters()
        for index, param in enumerate(self.params):  # a discard after the last backward
            self._before_gradient(index, param)
        grads, sq_norm = self._pending if self._pending is not None else self._reduce()
        self._pending = None
        factors = self._check_and_clip(sq_norm, self.divisor * self.loss_scale)
        if factors is not None:
            factor = factors[0]
            if self.low_precision is not None:
                self._step_low_precision(grads, factor)
            else:
                for index, master in self.masters.items():
                    grad = grads.get(index)
                    master.grad = None if grad is None else grad.mul_(factor)
                self._inner.step()
                for master in self.masters.values():
                    master.grad = None
            self.scaler.update(overflow=False)
            self._write_parameters()
        self.zero_grad()
        return loss

    def _step_low_precision(self, grads: dict[int, torch.Tensor], factor: torch.Tensor) -> None:
        """Each owned parameter with a gradient, stepped in fp32 and stored back in its
        dtypes (``low_precision.py``)."""
        assert self.low_precision is not None
        number = {id(master): index for index, master in self.masters.items()}
        for group in self._inner.param_groups:
            for master in group["params"]:
                index = number[id(master)]
                grad = grads.get(index)
                if grad is None:
                    continue  # torch.optim skips a parameter without a gradient
                state = self._inner.state.get(master, {})
                self._inner.state[master] = self.low_precision.step(
                    group, master, grad.mul_(factor), state, index
                )

    def _sync_hyperparameters(self) -> None:
        """The param groups' hyperparameters (an LR scheduler's) into the inner groups."""
        for group, inner in zip(self.param_groups, self._inner.param_groups, strict=True):
            inner.update({k: v for k, v in group.items() if k != "params"})

    @torch.no_grad()
    def _write_parameters(self) -> None:
        """Each master into its parameter, broadcast from its owner in the parameter dtype."""
        for index, param in enumerate(self.params):
            if self.fsdp2:
                source = self._owner_global_rank(index)
                write_shards(param, self.masters.get(index), source, self._shard_group())
                continue
            if index in self.masters:
                param.data.copy_(self.masters[index])
            if self.owners is not None and self.comm.active:
                dist.broadcast(
                    param.data, src=self._owner_global_rank(index), group=self._shard_group()
                )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.accumulators = {}
        self.touched = set()
        self._pending = None
        for param in self.params:
            param.grad = None

    def clear_lp_grads(self) -> None:
        for param in self.params:
            param.grad = None

    # --- state ----------------------------------------------------------------------------------
    def held_tensors(self) -> HeldTensors:
        # Kahan's compensation is half of the master (as the flat layouts and plan.memory()
        # count it), not a state of the optimizer.
        slots = list(self._inner.state.values())
        states = tuple(
            value
            for slot in slots
            for name, value in slot.items()
            if torch.is_tensor(value) and name != keys.KAHAN_COMPENSATION
        )
        compensations = tuple(
            slot[keys.KAHAN_COMPENSATION] for slot in slots if keys.KAHAN_COMPENSATION in slot
        )
        return HeldTensors(
            params=tuple(p.to_local() if isinstance(p, DTensor) else p.data for p in self.params),
            grads=tuple(
                p.grad for p in self.params if p.grad is not None and not is_owned_gradient(p.grad)
            ),
            accumulator=tuple(self.accumulators.values()),
            master=(*self.masters.values(), *compensations),
            optimizer_states=states,
        )

    def _layout_facts(self) -> dict[str, Any]:
        facts = {
            "implementation": "whole",
            "world_size": self.comm.world_size,
            "owners": list(self.owners.ranks) if self.owners is not None else None,
        }
        if self.layout is not None and self.layout.replicated:
            facts["shard_group_size"] = len(self.layout.shard_ranks)
        return facts

    def state_names(self) -> list[str]:
        names = {
            name
            for slot in self._inner.state.values()
            for name, value in slot.items()
            if torch.is_tensor(value) and value.dim() > 0
        }
        return [keys.MASTER, *sorted(names)]

    def _param_state(self, index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
        return {
            index_of[id(self.params[index])]: {
                keys.MASTER: master,
                **self._inner.state.get(master, {}),
            }
            for index, master in self.masters.items()
        }

    @torch.no_grad()
    def _load_param_state(self, state: dict[int, dict[str, Any]], index_of: dict[int, int]) -> None:
        for index, master in self.masters.items():
            entry = state.get(index_of[id(self.params[index])], {})
            if keys.MASTER in entry:
                master.copy_(entry[keys.MASTER])
            slot = self._inner.state[master]
            slot.clear()
            for name, value in entry.items():
                if name != keys.MASTER:
                    slot[name] = value.clone() if torch.is_tensor(value) else value
            if not slot:
                del self._inner.state[master]
        self._write_parameters()

    def _owner_payload(self, index: int) -> dict[str, Any]:
        """Parameter ``index``'s master and states (CPU), from its owner to every rank."""
        payload: list[Any] = [None]
        if index in self.masters:
            master = self.masters[index]
            slot = self._inner.state.get(master, {})
            compensation = slot.get(keys.KAHAN_COMPENSATION)
            values = master.float() if compensation is None else master.float() + compensation
            payload[0] = {
                keys.MASTER: values.detach().cpu().clone(),
                **{
                    n: v.detach().cpu().clone() if torch.is_tensor(v) else v
                    for n, v in slot.items()
                },
            }
        if self.owners is not None and self.comm.active:
            dist.broadcast_object_list(
                payload, src=self._owner_global_rank(index), group=self._shard_group()
            )
        return payload[0]

    def full_state(self) -> dict[str, torch.Tensor | float | int]:
        """Every parameter's master and states from its owner (collective at ZeRO 1-3): each
        state of its own shape, each parameter's scalar states its own (``full_state.py``)."""
        state: dict[str, torch.Tensor | float | int] = {}
        scalars: dict[str, Any] = {}
        for index in range(len(self.params)):
            tensors, own = split_payload(index, self._owner_payload(index))
            state.update(tensors)
            scalars.update(own)
        # The scalars not per parameter; the step count of the first parameter that has one
        # (the ranks own different ones).
        for key, value in self._scalar_state().items():
            if (
                keys.parse_group_scalar_key(key) is None
                and keys.parse_param_scalar_key(key) is None
            ):
                state[key] = value
        steps = [v for k, v in scalars.items() if k.endswith("." + keys.STEP)]
        state[keys.scalar_key(keys.STEP)] = int(steps[0]) if steps else 0
        state.update(scalars)
        return state

    def full_state_template(self) -> dict[str, torch.Tensor | float | int]:
        """The masters' shapes (meta tensors), without communication."""
        return {
            keys.param_key(index, keys.MASTER): torch.empty(param.shape, device="meta")
            for index, param in enumerate(self.params)
        }

    def kept_states(self, index: int) -> dict[str, list[int]] | None:
        """The states this optimizer's class keeps for parameter ``index`` and their shapes
        (``full_state.kept_states``); None where that cannot be told."""
        param = self.params[index]
        group = next(
            g
            for g, entry in enumerate(self.param_groups)
            if any(p is param for p in entry["params"])
        )
        hyper = {k: v for k, v in self._inner.param_groups[group].items() if k != "params"}
        return kept_states(self.plan.optimizer.torch_class, hyper, param)

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor | float | int]) -> None:
        """Inverse of :meth:`full_state` (a checkpoint's, which ``dtypeplan.checkpoint`` found
        to hold the states this class keeps): each owned master, its states in the plan's
        dtypes, its scalar states; then the parameters."""
        groups = keys.group_scalars(state)
        index_of = {id(master): index for index, master in self.masters.items()}
        stored = self.low_precision.stored_dtype if self.low_precision is not None else _fp32
        self._inner.state.clear()
        for group_index, group in enumerate(self._inner.param_groups):
            for master in group["params"]:
                index = index_of[id(master)]
                values = torch.as_tensor(state[keys.param_key(index, keys.MASTER)])
                slot = restored_slot(index, master, state, groups.get(group_index, {}), stored)
                compensation = state.get(keys.param_key(index, keys.KAHAN_COMPENSATION))
                if self.plan.master_rounding != "kahan" or master.dtype == torch.float32:
                    master.copy_(values)
                elif torch.is_tensor(compensation):
                    # The saved pair itself (values: its sum, exact in fp32): the bf16 weight
                    # is the forward's, and a pair at a rounding tie has two forms.
                    compensation = compensation.to(master.device, master.dtype)
                    master.copy_(values.to(master.device) - compensation.float())
                    slot[keys.KAHAN_COMPENSATION] = compensation
                else:
                    # The fp32 value split into the bf16 weight and its compensation (none
                    # for a parameter that has not stepped and rounds exactly).
                    master.copy_(values)
                    error = values.to(master.device) - master.float()
                    if slot or bool(error.any()):
                        slot[keys.KAHAN_COMPENSATION] = error.to(master.dtype)
                if slot:
                    self._inner.state[master] = slot
        self._load_scalar_state(dict(state))
        self._write_parameters()


def _fp32(name: str) -> torch.dtype:
    return torch.float32


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ZeRO-3 parameter (FSDP2's DTensor), detached."""
    assert isinstance(param, DTensor)
    return param.to_local().detach()


def _before_gradient_hook(
    this: weakref.ref[WholeTensorOptimizer], index: int
) -> Callable[[torch.Tensor], None]:
    """The discard check: a gradient pre-hook (ZeRO 0-2), or run with the parameter right
    before its unit's reduce-scatter (ZeRO-3, ``sharding.BEFORE_REDUCE``)."""

    def hook(_: torch.Tensor) -> None:
        optimizer = this()
        if optimizer is not None and not optimizer.closed:
            optimizer._before_gradient(index, optimizer.params[index])

    return hook


def _accumulate_hook(
    this: weakref.ref[WholeTensorOptimizer], index: int
) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        optimizer = this()
        if optimizer is not None and not optimizer.closed:
            optimizer._accumulate(index, param)

    return hook
