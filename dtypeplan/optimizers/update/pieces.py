"""The update of bf16 master weights and low-precision moments in fp32 (the update half).

The state is :class:`~dtypeplan.optimizers.state.low_precision.LowPrecisionState`'s
(``state/low_precision.py``: slots, master values, codes, the fp32 view); this module is how a
step updates it, used by the flat engine's update kernels (``update/``) and by ZeRO-3
(``fsdp2/optimizer.py``). The update is computed in fp32, a piece of ``PIECE`` elements at a
time, in reused fp32 scratch:

1. load: the master piece (fp32 masters: the chunk itself; bf16: upcast, with Kahan rounding
   plus its compensation), the gradient piece (as it is when fp32, else upcast), and each
   moment (as it is when fp32, else upcast from bf16 or dequantized);
2. update: torch's fused Adam/AdamW on the fp32 pieces, with ``grad_scale`` (the step's clip
   and loss-scale factor) as in ``kernels/torch_adam.py``, so the fp32 math is torch's own, and the
   step uses the fp32 moments it computed (as torchao's optimizers do), not their stored
   rounding;
3. store: a bf16 master rounded as ``plan.master_rounding`` says (``kernels/rounding.py``),
   an fp32 master cast into the parameters' chunk; each moment rounded or quantized back.

Masters with fp32 or bf16 moments on the host (bf16 masters, and fp32 masters with a bf16
moment) skip the pieces: one pass of
``one_pass.adam_one_pass`` (compiled with Inductor, or eager) reads and writes every
element once, with its own fp32 math (not bit-identical to torch's fused kernel; the bound is
in that module) and hashed stochastic-rounding noise. bf16 masters rounded to nearest with bf16
moments and a bf16 accumulator still hand off to torch's fused kernel (its bits).

Stochastic rounding hashes ``(SEED + shard rank, master number, step, element)``
(``rounding.step_noise_key``) on every path: the pieces, the one-pass update, torch's own step
of a class that counts steps, and a piece with its own history (a parameter that skipped a
step, keyed by its own count). A class that keeps no step count (SGD) gets one of its own: the
master's (or piece's) ``rounding_step`` scalar state (``keys.ROUNDING_STEP``) counts its
roundings. The counts are checkpointed with the other scalar states, so a resumed run draws the
bits of the uninterrupted one; at ZeRO-0 every rank draws the same bits and the replicas stay
equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from dtypeplan import _update_path as update_path
from dtypeplan._dtypes import DTYPE_NAMES
from dtypeplan.errors import NotSupportedError
from dtypeplan.optimizers.kernels import one_pass as update_kernel
from dtypeplan.optimizers.kernels.rounding import (
    kahan_load,
    kahan_store,
    noise_key,
    round_stochastic_keyed,
    step_noise_key,
)
from dtypeplan.optimizers.kernels.torch_adam import (
    CPU_CHUNK,
    FlatAdamUpdate,
    decoupled_weight_decay,
    fused_adam_kernel,
    kernel_grad_scale,
)
from dtypeplan.optimizers.state import storage
from dtypeplan.optimizers.state.keys import (
    ELEMENT_STATES,
    KAHAN_COMPENSATION,
    MOMENTS,
    ROUNDING_STEP,
    STEP,
)
from dtypeplan.optimizers.state.low_precision import LowPrecisionState

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["LowPrecisionAdamUpdate", "PIECE", "SEED", "TorchClassUpdate"]

PIECE = CPU_CHUNK
"""Elements per fused call (stored values, for quantized moments): bounds the fp32 scratch
(five buffers of 4 MiB, a quantized moment's up to 8 MiB for a piece of several segments)."""

SEED = 0x5EED
"""The seed of the stochastic-rounding noise keys (plus the shard rank: ``rounding.noise_key``)."""


class LowPrecisionAdamUpdate(LowPrecisionState):
    """Adam/AdamW with 16-bit masters or low-precision moments, computed in fp32."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        torch_class: type[torch.optim.Optimizer],
        *,
        rounding: str,
        exp_avg_dtype: str,
        exp_avg_sq_dtype: str,
        shard_rank: int,
    ) -> None:
        super().__init__(
            inner,
            rounding=rounding,
            exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype,
        )
        self.torch_class = torch_class
        self.seed = SEED + shard_rank
        self._scratch: dict[tuple[torch.device, str], torch.Tensor] = {}
        self._numbers: dict[int, int] = {}
        """Each master's number (its place in the plan's masters): the stochastic-rounding
        noise of each master is its own."""
        self._kernel = update_kernel.OnePassUpdate()

    def refusal(self, plan: PrecisionPlan) -> str | None:
        """Why this update can no longer serve ``plan``'s 16-bit masters or low-precision
        moments with ``inner``'s param groups as they are now (None: it can). Built on torch's
        fused Adam/AdamW, it cannot follow a group changed after build (``maximize``,
        ``amsgrad`` or ``differentiable`` set on it): ``build`` would have chosen torch's own
        step of the class (:class:`TorchClassUpdate`) for such groups."""
        torch_class = plan.optimizer.torch_class
        if FlatAdamUpdate.supports(self.inner, torch_class):
            return None
        return (
            f"the {DTYPE_NAMES[plan.master_dtype]} masters and {plan.optimizer_states} states "
            f"were built on torch's fused {torch_class.__name__} computed in fp32 and rounded "
            "back, which does not take maximize, amsgrad or differentiable. Set them on the "
            "param groups before build (build then runs torch's own step of the class on fp32 "
            "copies of the masters and states)"
        )

    def check_still_serves(self, plan: PrecisionPlan) -> None:
        """At a step: refuse, with the reason, param groups changed since build into what this
        update cannot serve (``maximize=True`` set on a group), before any number moves;
        torch's generic path would fail inside torch on the 16-bit tensors."""
        why = self.refusal(plan)
        if why is not None:
            raise NotSupportedError(
                "a param group was changed after build into what the plan cannot serve "
                f"(maximize, amsgrad or differentiable set on it): {why}"
            )

    @classmethod
    def for_plan(
        cls,
        plan: PrecisionPlan,
        inner: torch.optim.Optimizer,
        masters: list[torch.Tensor],
        shard_rank: int,
        segments: Sequence[Sequence[int]] | None = None,
    ) -> LowPrecisionAdamUpdate | None:
        """The update of ``plan``'s ``masters`` (keys of ``inner``), their states made, for
        16-bit masters or moments other than fp32; None for fp32 masters with fp32 moments.
        ``segments``: per master, the lengths of its parameter pieces (and padding) in order
        (:meth:`set_segments`); None: each master holds one parameter (ZeRO-3 local shards).
        Adam/AdamW on torch's fused path get this class; any other elementwise class (or
        Adam with amsgrad, maximize...) gets :class:`TorchClassUpdate`."""
        states = plan.optimizer_states
        if plan.master_dtype == torch.float32 and states == "fp32":
            return None
        torch_class = plan.optimizer.torch_class
        if not FlatAdamUpdate.supports(inner, torch_class):
            # Any other elementwise class (SGD, Adagrad, ..., Adam with amsgrad): torch's own
            # step on fp32 copies of the master and every per-element state.
            cls = TorchClassUpdate
        update = cls(
            inner,
            plan.optimizer.torch_class,
            rounding=plan.master_rounding,
            exp_avg_dtype=plan.exp_avg_dtype,
            exp_avg_sq_dtype=plan.exp_avg_sq_dtype,
            shard_rank=shard_rank,
        )
        registered = plan.optimizer.registered
        if registered is not None and not registered.declared and states != "fp32":
            raise NotSupportedError(
                f"{torch_class.__name__} was registered without its per-element states, so "
                f"dtypeplan cannot store them as {states}: declare them "
                "(dtypeplan.register_optimizer(cls, kind='elementwise', signed_states=..., "
                "non_negative_states=...)) or use fp32 states"
            )
        if registered is not None and registered.declared and isinstance(update, TorchClassUpdate):
            # A class registered with dtypeplan.register_optimizer: its declared states too.
            update.names = (*ELEMENT_STATES, *registered.states)
            update.signed = (*update.signed, *(registered.signed_states or ()))
        if segments is not None and update.quantized:
            update.set_segments(masters, segments)
        update.conform(masters)
        update._numbers = {id(master): i for i, master in enumerate(masters)}
        return update

    def bucket(
        self,
        group: dict[str, Any],
        master: torch.Tensor,
        grad: torch.Tensor,
        param_chunk: torch.Tensor | None,
        grad_scale: torch.Tensor,
    ) -> None:
        """Update one master (chunk or local shard) from ``grad / grad_scale``, laid out like
        it; cast an fp32 master into ``param_chunk`` (None where the master is the
        parameters' own memory)."""
        slot = self.slot(master)
        if self._fp32_depth:
            # Inside fp32_view this update writes the fp32 moments, so they must be quantized
            # anew on exit; torch's fused kernels write in place without bumping the version
            # counter that tells an untouched view from a written one.
            for name in MOMENTS:
                self._viewed.pop((id(slot), name), None)
        step = slot["step"]
        step += 1
        fused, kwargs = fused_adam_kernel(self.torch_class, group, grad_scale)
        if self._torch_runs_it(master, grad, slot):
            # bf16 weights, gradient and moments rounded to nearest: torch's fused kernel on
            # bf16 tensors computes in fp32 and rounds each back, the same bits as the pieces
            # below (tests/test_master_rounding.py), in one pass and no scratch.
            moments = [slot[name].view(-1) for name in MOMENTS]
            fused(
                [master.view(-1)],
                [grad.reshape(-1)],
                [moments[0]],
                [moments[1]],
                [],
                [step],
                **kwargs,
            )
            return
        if self.one_pass(master, slot):
            self._one_pass_bucket(group, master, grad, param_chunk, grad_scale, slot)
            return
        device = master.device
        fp32_master = master.dtype == torch.float32
        layout = self.layout(master)
        key = self.noise_key(master, step)
        # Flat views (no copies: chunks are 1-D, local shards contiguous); the state slot stays
        # keyed by the master itself. Quantized states are flat already.
        master, grad = master.view(-1), grad.reshape(-1)
        slot = {
            name: value.view(-1)
            if torch.is_tensor(value) and value.dim() and not storage.is_quantized(value)
            else value
            for name, value in slot.items()
        }
        # Pieces of whole segments (a long one alone, in parts): a quantized moment's piece is
        # then whole blocks of its own storage, whose values belong to this piece only.
        for span in layout.pieces(PIECE):
            begin, end = span.begin, span.end
            n = end - begin
            if fp32_master:
                weights = master[begin:end]
            else:
                weights = self._scratch_for(device, "weights", n)
                if self.rounding == "kahan":
                    kahan_load(master[begin:end], slot[KAHAN_COMPENSATION][begin:end], weights)
                else:
                    weights.copy_(master[begin:end])
            piece = grad[begin:end]
            if piece.dtype != torch.float32:
                piece = self._scratch_for(device, "grad", n)
                piece.copy_(grad[begin:end])
            moments = []
            for name in MOMENTS:
                scratch = self._scratch_for(device, name, storage.scratch_numel(span))
                moments.append(storage.load_piece(slot[name], span, scratch))
            fused([weights], [piece], [moments[0]], [moments[1]], [], [step], **kwargs)
            if fp32_master:
                if param_chunk is not None:
                    param_chunk[begin:end].copy_(weights)
            elif self.rounding == "kahan":
                kahan_store(weights, master[begin:end], slot[KAHAN_COMPENSATION][begin:end])
            elif self.rounding == "stochastic":
                round_stochastic_keyed(weights, master[begin:end], key, begin)
            else:
                master[begin:end].copy_(weights)
            for name, values in zip(MOMENTS, moments, strict=True):
                scratch = self._scratch_for(device, name, storage.scratch_numel(span))
                storage.store_piece(values, slot[name], span, scratch)

    def one_pass(self, master: torch.Tensor, slot: dict[str, Any]) -> bool:
        """Whether the one-pass update (``kernels/one_pass.py``) serves ``master``: a master
        on the host, both moments fp32 or bf16 (not both fp32 with an fp32 master: that plan
        is torch's fused kernel's, ``kernels/torch_adam.py``). Quantized moments take the
        pieces of :meth:`bucket`. An fp32 master with bf16 moments took the pieces until the
        kernel was tiled by bf16 (``one_pass._tiled_by``): 16.8 M parameters, one AMD EPYC
        core, 13.6 ms a step against the pieces' 28.8 ms."""
        return master.device.type == "cpu" and all(
            not storage.is_quantized(slot[name])
            and slot[name].dtype in (torch.float32, torch.bfloat16)
            for name in MOMENTS
        )

    def _one_pass_bucket(
        self,
        group: dict[str, Any],
        master: torch.Tensor,
        grad: torch.Tensor,
        param_chunk: torch.Tensor | None,
        grad_scale: torch.Tensor,
        slot: dict[str, Any],
    ) -> None:
        """:meth:`bucket` by :func:`~dtypeplan.optimizers.kernels.one_pass.adam_one_pass`: in
        one call compiled (it holds no temporaries; each call costs the host about 0.3 ms,
        a third of a compiled 1 M-value piece's time), a piece of ``PIECE`` at a time eagerly
        (bounds its temporaries). The noise counter of an element is its index either way."""
        step = int(slot["step"].item())  # a host tensor: no device sync
        decoupled = decoupled_weight_decay(self.torch_class, group)
        hyper = update_kernel.hyperparameters(group, step, decoupled, master.device)
        number = self._numbers.get(id(master), 0)
        key = torch.tensor(noise_key(self.seed, number, step), dtype=torch.int64)
        scale = grad_scale.to(device=master.device, dtype=torch.float32).reshape(())
        flat = [master.view(-1), grad.reshape(-1)]
        flat += [slot[name].view(-1) for name in MOMENTS]
        compensation = slot[KAHAN_COMPENSATION].view(-1) if self.rounding == "kahan" else None
        weight_decay = float(group["weight_decay"]) != 0.0
        piece = master.numel() if update_path.path() == "compiled" else PIECE
        for begin in range(0, master.numel(), max(piece, 1)):
            end = min(begin + piece, master.numel())
            self._kernel(
                *(t[begin:end] for t in flat),
                None if compensation is None else compensation[begin:end],
                None if param_chunk is None else param_chunk.view(-1)[begin:end],
                hyper,
                scale,
                key,
                torch.tensor(begin, dtype=torch.int64),
                decoupled=decoupled,
                weight_decay=weight_decay,
                rounding=self.rounding,
            )

    def unscales_in_place(
        self, master: torch.Tensor, grad: torch.Tensor, grad_scale: torch.Tensor
    ) -> bool:
        """Whether :meth:`bucket` of ``master`` (stepped already) left ``grad / grad_scale``
        in ``grad``: torch's fused kernel unscales the gradient it is handed in place, which
        is ``grad`` itself where torch runs the update or a piece of fp32 ``grad`` is stepped
        as it is; the one-pass update reads it. ZeRO-3 keeps the gradient after the step."""
        if kernel_grad_scale(grad_scale) is None:
            return False
        slot = self.inner.state[master]
        if self._torch_runs_it(master, grad, slot):
            return True
        return grad.dtype == torch.float32 and not self.one_pass(master, slot)

    def _torch_runs_it(
        self, master: torch.Tensor, grad: torch.Tensor, slot: dict[str, Any]
    ) -> bool:
        """Whether torch's fused kernel does this update exactly as it is: 16-bit master,
        gradient and moments all of one dtype, rounded to nearest (no Kahan, no noise)."""
        return (
            self.rounding == "nearest"
            and master.dtype != torch.float32
            and grad.dtype == master.dtype
            and all(
                not storage.is_quantized(slot[name]) and slot[name].dtype == master.dtype
                for name in MOMENTS
            )
        )

    def noise_key(self, master: torch.Tensor, step: Any) -> torch.Tensor:
        """The stochastic-rounding key of ``master`` at its step count ``step`` (the count
        after this update, a checkpointed state): the one-pass update's key, so every path
        draws the same hashed noise for the same master, step and element."""
        number = self._numbers.get(id(master), 0)
        count = step if torch.is_tensor(step) else torch.tensor(step)
        return step_noise_key(self.seed, number, count)

    @staticmethod
    def noise_step(state: dict[str, Any], master: torch.Tensor) -> Any:
        """The count that keys this update's stochastic-rounding noise of ``master`` (or of a
        piece of it), whose state after the update is ``state``: torch's ``step``; for a class
        that keeps none (SGD), ``state``'s ``rounding_step`` (``keys.ROUNDING_STEP``), made at
        its first rounding and advanced here, once per rounding (a checkpointed scalar state,
        not a generator's hidden one)."""
        step = state.get(STEP)
        if step is not None:
            return step
        count = state.get(ROUNDING_STEP)
        if count is None:
            count = torch.zeros((), dtype=torch.int64, device=master.device)
            state[ROUNDING_STEP] = count
        count += 1
        return count

    def release_scratch(self) -> None:
        """Drop the fp32 working copies at the end of a step: between steps (where
        ``plan.memory()`` counts) the optimizer holds none of them."""
        self._scratch.clear()

    def _scratch_for(
        self, device: torch.device, name: str, numel: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        scratch = self._scratch.get((device, name))
        if scratch is None or scratch.numel() < numel:
            scratch = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._scratch[(device, name)] = scratch
        return scratch[:numel]


class TorchClassUpdate(LowPrecisionAdamUpdate):
    """Any elementwise ``torch.optim`` class with 16-bit masters or low-precision states:
    torch's own step on fp32 copies, per master.

    For each master (a flat chunk, or a ZeRO-3 local shard): the master is loaded into fp32
    (a bf16 one upcast, with its Kahan compensation where kept), every per-element state
    (``keys.ELEMENT_STATES``: SGD's ``momentum_buffer``, Adagrad's ``sum``, amsgrad's
    ``max_exp_avg_sq``...) decoded into fp32 (an fp32 one used in place), and one step of a
    private instance of the optimizer's class, with the param group's own settings, runs on
    them: the fp32 math is torch's for that class, whatever it is. Then the master is rounded
    back as ``plan.master_rounding`` says and each state stored in its dtype again (signed
    states as ``exp_avg_dtype`` says, non-negative ones as ``exp_avg_sq_dtype``). Scalar states
    (``step``, NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``) stay torch's tensors. The
    fp32 copies live for one master's update only.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        torch_class: type[torch.optim.Optimizer],
        *,
        rounding: str,
        exp_avg_dtype: str,
        exp_avg_sq_dtype: str,
        shard_rank: int,
    ) -> None:
        super().__init__(
            inner,
            torch_class,
            rounding=rounding,
            exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype,
            shard_rank=shard_rank,
        )
        self.names = ELEMENT_STATES
        self._stepper: torch.optim.Optimizer | None = None

    def refusal(self, plan: PrecisionPlan) -> str | None:
        """None: torch's own step of the class serves whatever the param groups say now."""
        return None

    def unscales_in_place(
        self, master: torch.Tensor, grad: torch.Tensor, grad_scale: torch.Tensor
    ) -> bool:
        """Never: the step reads an fp32 copy of the gradient, divided by ``grad_scale``."""
        return False

    def _step_fp32(
        self, group: dict[str, Any], weights: torch.Tensor, state: dict[str, Any]
    ) -> dict[str, Any]:
        """One step of the optimizer's class on ``weights`` (fp32, its ``.grad`` set) with
        ``state``, under ``group``'s settings; the state after it."""
        stepper = self._stepper
        if stepper is None:
            stepper = self.torch_class([torch.zeros(1)])  # type: ignore[call-arg]
            self._stepper = stepper
        stepper.param_groups[0] = {**group, "params": [weights]}
        stepper.state.clear()
        stepper.state[weights] = state
        try:
            stepper.step()
            return stepper.state[weights]
        finally:
            stepper.state.clear()
            stepper.param_groups[0] = {**group, "params": []}

    @torch.no_grad()
    def bucket(
        self,
        group: dict[str, Any],
        master: torch.Tensor,
        grad: torch.Tensor,
        param_chunk: torch.Tensor | None,
        grad_scale: torch.Tensor,
    ) -> None:
        slot = self.inner.state[master]
        if self._fp32_depth:
            for name in self.names:
                self._viewed.pop((id(slot), name), None)
        device = master.device
        numel = master.numel()
        flat = master.view(-1)
        layout = self.layout(master)
        fp32_master = master.dtype == torch.float32
        if fp32_master:
            weights = flat
        else:
            weights = torch.empty(numel, dtype=torch.float32, device=device)
            if self.rounding == "kahan":
                kahan_load(flat, slot[KAHAN_COMPENSATION].view(-1), weights)
            else:
                weights.copy_(flat)
        state: dict[str, Any] = {}
        for name, value in slot.items():
            if name == KAHAN_COMPENSATION:
                continue
            if name in self.names and torch.is_tensor(value):
                plain32 = not storage.is_quantized(value) and value.dtype == torch.float32
                # An fp32 state is updated in place; any other is decoded into a copy.
                state[name] = (
                    value.view(-1) if plain32 else storage.state_values(value, numel, layout)
                ).view(-1)
            else:
                state[name] = value
        weights.grad = grad.reshape(-1).to(torch.float32).div(grad_scale)
        try:
            after = self._step_fp32(group, weights, state)
        finally:
            weights.grad = None
        for name, value in after.items():
            if name in self.names and torch.is_tensor(value):
                held = slot.get(name)
                if held is not None and held.data_ptr() == value.data_ptr():
                    continue  # an fp32 state, updated in place
                if torch.is_tensor(held) and not storage.is_quantized(held):
                    if held.dtype == torch.float32 and self.dtype_of(name) == "fp32":
                        held.view(-1).copy_(value)
                        continue
                slot[name] = self._stored(value.view(master.shape), name, master)
            else:
                slot[name] = value
        if fp32_master:
            if param_chunk is not None:
                param_chunk.view(-1).copy_(weights)
        elif self.rounding == "kahan":
            kahan_store(weights, flat, slot[KAHAN_COMPENSATION].view(-1))
        elif self.rounding == "stochastic":
            step = self.noise_step(slot, master)
            round_stochastic_keyed(weights, flat, self.noise_key(master, step), 0)
        else:
            flat.copy_(weights)
