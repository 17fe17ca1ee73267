"""Adam/AdamW on bf16 master weights (and bf16 optimizer states) in the flat engine.

With ``master_weights.dtype: bf16`` the bf16 parameters are the masters: a master chunk is a
view of the parameter buffer, so no fp32 copy exists (4 bytes per parameter saved). The update
is still computed in fp32, a piece of ``PIECE`` elements at a time, in reused fp32 scratch:

1. load: the master piece upcast to fp32 (with Kahan rounding, plus its compensation), the
   gradient piece (as it is when fp32, else upcast), and the moments (as they are when fp32,
   else upcast from bf16);
2. update: torch's fused Adam/AdamW on the fp32 pieces, with ``grad_scale`` (the step's clip
   and loss-scale factor) as in ``_flat_update.py``, so the fp32 math is torch's own;
3. store: the master rounded as ``plan.master_rounding`` says (``_master_rounding.py``), bf16
   moments rounded to nearest (DeepSpeed's ``bf16_optimizer_states``).

A master is a flat chunk (ZeRO 0-2, ``_engine.py``) or a contiguous local shard of the
parameter's shape (ZeRO-3, ``_fsdp2.py``); the update reads both flattened. The moments and
the Kahan compensation (``kahan_compensation``, bf16, laid out like the master) live in
``inner.state[master]``, so checkpoints, ``full_state()`` and the restoring of
parameters without a gradient treat them like any other state. Stochastic rounding draws from
one ``torch.Generator`` per device, seeded with ``SEED + shard rank``: at ZeRO-0 every rank
updates every chunk and draws the same bits, so the replicas stay equal; a run is reproducible
from the same seed, and a resumed run draws other bits than an uninterrupted one (the
generator is not checkpointed), which changes nothing in expectation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dtypeplan._dtypes import DTYPE_NAMES
from dtypeplan.errors import NotSupportedError
from dtypeplan.optimizers._flat_update import CPU_CHUNK, FlatAdamUpdate, fused_adam_kernel
from dtypeplan.optimizers._master_rounding import kahan_load, kahan_store, round_stochastic

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = ["KAHAN_COMPENSATION", "LowPrecisionAdamUpdate", "PIECE", "SEED"]

KAHAN_COMPENSATION = "kahan_compensation"
"""The state name of the Kahan compensation buffer (bf16, laid out like the master chunk)."""

PIECE = CPU_CHUNK
"""Elements per fused call: bounds the fp32 scratch (five buffers of 4 MiB) on any device."""

SEED = 0x5EED
"""The stochastic-rounding generator's seed (plus the shard rank)."""


class LowPrecisionAdamUpdate:
    """Adam/AdamW over 16-bit master chunks, computed in fp32 and rounded back."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        torch_class: type[torch.optim.Optimizer],
        *,
        rounding: str,
        states_dtype: torch.dtype,
        shard_rank: int,
    ) -> None:
        self.inner = inner
        self.torch_class = torch_class
        self.rounding = rounding
        self.states_dtype = states_dtype
        self.seed = SEED + shard_rank
        self._scratch: dict[tuple[torch.device, str], torch.Tensor] = {}
        self._generators: dict[torch.device, torch.Generator] = {}

    @classmethod
    def for_plan(
        cls,
        plan: PrecisionPlan,
        inner: torch.optim.Optimizer,
        masters: list[torch.Tensor],
        shard_rank: int,
    ) -> LowPrecisionAdamUpdate | None:
        """The update of ``plan``'s 16-bit ``masters`` (keys of ``inner``), their states made;
        None for fp32 masters. Refuses an optimizer other than torch's fused Adam/AdamW."""
        if plan.master_dtype == torch.float32:
            return None
        torch_class = plan.optimizer.torch_class
        if not FlatAdamUpdate.supports(inner, torch_class):
            raise NotSupportedError(
                f"{DTYPE_NAMES[plan.master_dtype]} master weights are updated by torch's "
                f"fused Adam/AdamW computed in fp32 and rounded back; {torch_class.__name__} "
                "(or amsgrad, maximize, differentiable, or a device without fused kernels) "
                "would run its own update in the master dtype. Use Adam or AdamW, or fp32 "
                "master weights (remove master_weights / bf16_master_weights_and_grads)"
            )
        update = cls(
            inner,
            torch_class,
            rounding=plan.master_rounding,
            states_dtype=plan.optimizer_states_dtype,
            shard_rank=shard_rank,
        )
        update.conform(masters)
        return update

    def master_values(self, master: torch.Tensor) -> torch.Tensor:
        """``master`` as the fp32 values it stands for: with Kahan rounding, the bf16 weights
        plus their compensation. What a checkpoint stores, so that it loads into any master
        dtype."""
        slot = self.inner.state.get(master, {})
        values = master.to(torch.float32, copy=True)
        if KAHAN_COMPENSATION in slot:
            values.add_(slot[KAHAN_COMPENSATION])
        return values

    @torch.no_grad()
    def load_master_(self, master: torch.Tensor, values: torch.Tensor) -> None:
        """Set ``master`` from fp32 ``values``: rounded to nearest, or with Kahan rounding
        split into the bf16 weights and their compensation (so no bit of ``values`` is lost
        beyond the pair's ~16 mantissa bits)."""
        if self.rounding != "kahan":
            master.copy_(values)
            return
        slot = self.inner.state[master]
        compensation = slot.setdefault(KAHAN_COMPENSATION, torch.zeros_like(master))
        kahan_store(values.to(torch.float32, copy=True), master, compensation)

    def slot(self, master: torch.Tensor) -> dict[str, Any]:
        """``master``'s state in the inner optimizer, created (zeroed, step 0) if missing."""
        slot = self.inner.state[master]
        if "exp_avg" not in slot:
            slot["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            slot["exp_avg"] = torch.zeros_like(master, dtype=self.states_dtype)
            slot["exp_avg_sq"] = torch.zeros_like(master, dtype=self.states_dtype)
        if self.rounding == "kahan" and KAHAN_COMPENSATION not in slot:
            slot[KAHAN_COMPENSATION] = torch.zeros_like(master)
        return slot

    def conform(self, masters: list[torch.Tensor]) -> None:
        """Give every master its states in this update's dtypes (after a reset or a load).

        ``reset_update_state`` makes each state like its master (bf16); fp32 moments must stay
        fp32. The Kahan compensation exists from the start, so memory is what
        ``plan.memory()`` says before the first step too.
        """
        for master in masters:
            slot = self.inner.state[master]
            for name in ("exp_avg", "exp_avg_sq"):
                value = slot.get(name)
                if value is not None and value.dtype != self.states_dtype:
                    slot[name] = value.to(self.states_dtype)
            if self.rounding == "kahan" and KAHAN_COMPENSATION not in slot:
                slot[KAHAN_COMPENSATION] = torch.zeros_like(master)

    def bucket(
        self,
        group: dict[str, Any],
        master: torch.Tensor,
        grad: torch.Tensor,
        param_chunk: torch.Tensor | None,
        grad_scale: torch.Tensor,
    ) -> None:
        """Update one bf16 master (chunk or local shard) from ``grad / grad_scale``.

        ``grad`` is laid out like ``master``; ``param_chunk`` must be None (the master is the
        parameters' own memory).
        """
        assert param_chunk is None, "bf16 master chunks are views of the parameter buffer"
        slot = self.slot(master)
        step = slot["step"]
        step += 1
        fused, kwargs = fused_adam_kernel(self.torch_class, group, grad_scale)
        device = master.device
        fp32_states = self.states_dtype == torch.float32
        # Flat views (no copies: chunks are 1-D, local shards contiguous); the state slot stays
        # keyed by the master itself.
        master, grad = master.view(-1), grad.reshape(-1)
        slot = {
            name: value.view(-1) if torch.is_tensor(value) and value.dim() else value
            for name, value in slot.items()
        }
        for begin in range(0, master.numel(), PIECE):
            end = min(begin + PIECE, master.numel())
            n = end - begin
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
            for name in ("exp_avg", "exp_avg_sq"):
                stored = slot[name][begin:end]
                if fp32_states:
                    moments.append(stored)
                else:
                    scratch = self._scratch_for(device, name, n)
                    scratch.copy_(stored)
                    moments.append(scratch)
            fused([weights], [piece], [moments[0]], [moments[1]], [], [step], **kwargs)
            if self.rounding == "kahan":
                kahan_store(weights, master[begin:end], slot[KAHAN_COMPENSATION][begin:end])
            elif self.rounding == "stochastic":
                noise = self._scratch_for(device, "noise", n, torch.int32)
                round_stochastic(weights, master[begin:end], self._generator(device), noise)
            else:
                master[begin:end].copy_(weights)
            if not fp32_states:
                slot["exp_avg"][begin:end].copy_(moments[0])
                slot["exp_avg_sq"][begin:end].copy_(moments[1])

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
            self._generators[device] = generator
        return generator

    def release_scratch(self) -> None:
        """Drop the fp32 working copies at the end of a step: between steps (where
        ``plan.memory()`` counts) the optimizer holds none of them."""
        self._scratch.clear()

    def _scratch_for(
        self, device: torch.device, name: str, numel: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        scratch = self._scratch.get((device, name))
        if scratch is None or scratch.numel() < numel:
            scratch = torch.empty(min(PIECE, max(numel, 1)), dtype=dtype, device=device)
            self._scratch[(device, name)] = scratch
        return scratch[:numel]
