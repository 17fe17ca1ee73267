"""Adam/AdamW on bf16 master weights and/or low-precision optimizer states in the flat engine.

With ``master_weights.dtype: bf16`` the bf16 parameters are the masters: a master chunk is a
view of the parameter buffer, so no fp32 copy exists (4 bytes per parameter saved). With
``optimizer_states`` other than fp32, each moment is stored as its dtype says
(``state/storage.py``: bf16, or torchao's int8 / fp8 blockwise codes). Either way the update
is computed in fp32, a piece of ``PIECE`` elements at a time, in reused fp32 scratch:

1. load: the master piece (fp32 masters: the chunk itself; bf16: upcast, with Kahan rounding
   plus its compensation), the gradient piece (as it is when fp32, else upcast), and each
   moment (as it is when fp32, else upcast from bf16 or dequantized);
2. update: torch's fused Adam/AdamW on the fp32 pieces, with ``grad_scale`` (the step's clip
   and loss-scale factor) as in ``kernels/torch_adam.py``, so the fp32 math is torch's own, and the
   step uses the fp32 moments it computed (as torchao's optimizers do), not their stored
   rounding;
3. store: a bf16 master rounded as ``plan.master_rounding`` says (``kernels/rounding.py``),
   an fp32 master cast into the parameters' chunk; each moment rounded or quantized back.

bf16 masters with fp32 or bf16 moments on the host skip the pieces: one pass of
``one_pass.adam_one_pass`` (compiled with Inductor, or eager) reads and writes every
element once, with its own fp32 math (not bit-identical to torch's fused kernel; the bound is
in that module) and hashed stochastic-rounding noise. bf16 masters rounded to nearest with bf16
moments and a bf16 accumulator still hand off to torch's fused kernel (its bits).

A master is a flat chunk (ZeRO 0-2, ``flat/engine.py``) or a contiguous local shard of the
parameter's shape (ZeRO-3, ``fsdp2/optimizer.py``); the update reads both flattened. The moments and
the Kahan compensation (``kahan_compensation``, bf16, laid out like the master) live in
``inner.state[master]``. Quantized moments are torchao tensors over the master's
:class:`~dtypeplan.optimizers.state.storage.BlockLayout`: each parameter piece of a flat chunk
(and each stretch of bucket padding) starts on a block boundary and is padded to whole blocks,
so no block holds values of two parameters and a small parameter's moments keep their own
absmax (a ZeRO-3 local shard is one segment). The update goes over the master in pieces of
whole segments (a segment longer than ``PIECE`` alone, in block-aligned parts); a piece of
several segments is gathered from and scattered to its stored blocks. The generic state code
(checkpoints, ``state_dict``, the restoring of parameters without a gradient) cannot slice
such a tensor per parameter: it runs inside :meth:`fp32_view`, which holds every state as fp32
values in the master's own layout while it runs and stores them back after. Quantizing those
values again is not idempotent, so a save also takes each parameter piece's codes and block
scales as they are (:meth:`LowPrecisionAdamUpdate.segment_codes`), and a load into the same
piece restores them after the values (:meth:`LowPrecisionAdamUpdate.load_segment_codes`): a
same-layout round trip through ``state_dict`` or a checkpoint changes no bit.

Stochastic rounding in the pieces (quantized moments, or off the host) draws from one
``torch.Generator`` per device, seeded with ``SEED + shard rank``: at ZeRO-0 every rank updates
every chunk and draws the same bits, so the replicas stay equal; a run is reproducible from the
same seed, and a resumed run draws other bits than an uninterrupted one (the generator is not
checkpointed), which changes nothing in expectation. The one-pass update hashes ``(SEED + shard
rank, master number, step, element)`` instead: reproducible, and a resumed run draws the bits
of the uninterrupted one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dtypeplan._dtypes import DTYPE_NAMES
from dtypeplan.errors import NotSupportedError
from dtypeplan.optimizers.kernels import one_pass as update_kernel
from dtypeplan.optimizers.kernels.rounding import (
    kahan_load,
    kahan_store,
    noise_key,
    round_stochastic,
)
from dtypeplan.optimizers.kernels.torch_adam import (
    CPU_CHUNK,
    FlatAdamUpdate,
    decoupled_weight_decay,
    fused_adam_kernel,
)
from dtypeplan.optimizers.state import storage
from dtypeplan.optimizers.state.keys import KAHAN_COMPENSATION, MOMENTS

if TYPE_CHECKING:
    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = [
    "CODES",
    "LowPrecisionAdamUpdate",
    "PIECE",
    "SCALES",
    "SEED",
    "held_compensations",
    "held_states",
]

PIECE = CPU_CHUNK
"""Elements per fused call (stored values, for quantized moments): bounds the fp32 scratch
(five buffers of 4 MiB, a quantized moment's up to 8 MiB for a piece of several segments)."""

SEED = 0x5EED
"""The stochastic-rounding generator's seed (plus the shard rank)."""


CODES, SCALES = ".codes", ".scales"
"""Suffixes of a state dict entry's quantized moment, stored as is beside its fp32 values
(``exp_avg.codes``, ``exp_avg.scales``): a same-layout load restores them bit for bit."""


def held_compensations(inner: torch.optim.Optimizer) -> tuple[torch.Tensor, ...]:
    """The Kahan compensation buffers in ``inner``'s states (``plan.memory()`` counts them with
    the master weights)."""
    return tuple(
        slot[KAHAN_COMPENSATION] for slot in inner.state.values() if KAHAN_COMPENSATION in slot
    )


def held_states(inner: torch.optim.Optimizer) -> tuple[torch.Tensor, ...]:
    """Every tensor ``inner``'s states hold, quantized moments as their codes, scales and code
    table (the bytes really held)."""
    return tuple(
        t
        for slot in inner.state.values()
        for value in slot.values()
        if torch.is_tensor(value)
        for t in storage.state_tensors(value)
    )


class LowPrecisionAdamUpdate:
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
        self.inner = inner
        self.torch_class = torch_class
        self.rounding = rounding
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        self.seed = SEED + shard_rank
        self._scratch: dict[tuple[torch.device, str], torch.Tensor] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self._fp32_depth = 0
        self._layouts: dict[int, storage.BlockLayout] = {}
        """Each master's block layout for quantized moments, by ``id(master)`` (the masters
        live as long as the optimizer); a master not here is one segment."""
        self._viewed: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, int]] = {}
        """Inside :meth:`fp32_view`: each quantized moment, the fp32 tensor that stands in for
        it, and that tensor's version counter when made (to tell whether it was written)."""
        self._pending_codes: list[tuple[torch.Tensor, str, int, int, torch.Tensor, torch.Tensor]]
        self._pending_codes = []
        self._numbers: dict[int, int] = {}
        """Each master's number (its place in the plan's masters): the stochastic-rounding
        noise of each master is its own."""
        self._kernel = update_kernel.OnePassUpdate()
        """Saved codes to restore once :meth:`fp32_view` has stored the moments back
        (:meth:`load_segment_codes`)."""

    @property
    def quantized(self) -> bool:
        """Whether a moment is stored as torchao codes (then :meth:`fp32_view` matters)."""
        return any(d in storage.QUANTIZED for d in self.moment_dtypes.values())

    def set_segments(
        self, masters: Sequence[torch.Tensor], segments: Sequence[Sequence[int]]
    ) -> None:
        """Lay each master's quantized moments out by its segments (the lengths of its
        parameter pieces and bucket padding, in order): each starts on a block boundary, so no
        block's absmax mixes two parameters. Before any state is made."""
        for master, lengths in zip(masters, segments, strict=True):
            layout = storage.BlockLayout(lengths)
            if layout.numel != master.numel():
                raise ValueError(
                    f"segments of {layout.numel} values for a master of {master.numel()}"
                )
            self._layouts[id(master)] = layout

    def layout(self, master: torch.Tensor) -> storage.BlockLayout:
        """``master``'s block layout: its segments, or one segment."""
        layout = self._layouts.get(id(master))
        if layout is None or layout.numel != master.numel():
            layout = storage.BlockLayout.whole(master.numel())
            self._layouts[id(master)] = layout
        return layout

    def _stored(self, values: torch.Tensor, name: str, master: torch.Tensor) -> torch.Tensor:
        """A plain (fp32 or bf16) state in ``name``'s storage dtype, or in fp32 inside
        :meth:`fp32_view`; plain results keep ``values``' shape."""
        want = "fp32" if self._fp32_depth else self.moment_dtypes[name]
        if storage.state_dtype_name(values) == want:
            return values
        stored = storage.to_storage(
            values.reshape(-1), want, signed=name == "exp_avg", layout=self.layout(master)
        )
        return stored if storage.is_quantized(stored) else stored.view(values.shape)

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
        Refuses an optimizer other than torch's fused Adam/AdamW."""
        states = plan.optimizer_states
        if plan.master_dtype == torch.float32 and states == "fp32":
            return None
        torch_class = plan.optimizer.torch_class
        if not FlatAdamUpdate.supports(inner, torch_class):
            if states != "fp32":
                raise NotSupportedError(
                    f"optimizer_states {states} (exp_avg {plan.exp_avg_dtype}, exp_avg_sq "
                    f"{plan.exp_avg_sq_dtype}) name Adam's two moments, which dtypeplan stores "
                    "in those dtypes around torch's fused Adam/AdamW computed in fp32; "
                    f"{torch_class.__name__} (or amsgrad, maximize, differentiable, or a device "
                    "without fused kernels) keeps other states, which it would update in their "
                    "storage dtype. Use Adam or AdamW, or remove optimizer_states / "
                    "exp_avg_dtype / exp_avg_sq_dtype / bf16_optimizer_states (fp32 states)"
                )
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
            exp_avg_dtype=plan.exp_avg_dtype,
            exp_avg_sq_dtype=plan.exp_avg_sq_dtype,
            shard_rank=shard_rank,
        )
        if segments is not None and update.quantized:
            update.set_segments(masters, segments)
        update.conform(masters)
        update._numbers = {id(master): i for i, master in enumerate(masters)}
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
    def load_master_(
        self,
        master: torch.Tensor,
        values: torch.Tensor,
        compensation: torch.Tensor | None = None,
    ) -> None:
        """Set ``master`` from fp32 ``values``: copied (fp32), rounded to nearest, or with
        Kahan rounding split into the bf16 weights and their compensation (so no bit of
        ``values`` is lost beyond the pair's ~16 mantissa bits).

        ``compensation``: the saved compensation ``values`` include, where known. A value
        halfway between two bf16 numbers is a pair either way (``m + h`` or ``m' - h``), and
        the weights the forward pass sees differ; the saved compensation tells which it was,
        so a checkpoint restores the pair bit for bit."""
        if self.rounding != "kahan" or master.dtype == torch.float32:
            master.copy_(values)
            return
        slot = self.inner.state[master]
        held = slot.setdefault(KAHAN_COMPENSATION, torch.zeros_like(master))
        kahan_store(values.to(torch.float32, copy=True), master, held)
        if compensation is None:
            return
        given = compensation.to(master.dtype).view(master.shape)
        weights = (values.view(master.shape).float() - given.float()).to(master.dtype)
        # The saved pair where it is one: its weights plus compensation give the values exactly.
        exact = weights.float() + given.float() == values.view(master.shape).float()
        master.copy_(torch.where(exact, weights, master))
        held.copy_(torch.where(exact, given, held))

    def slot(self, master: torch.Tensor) -> dict[str, Any]:
        """``master``'s state in the inner optimizer, created (zeroed, step 0) if missing."""
        slot = self.inner.state[master]
        if "exp_avg" not in slot:
            slot["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            for name in MOMENTS:
                dtype = "fp32" if self._fp32_depth else self.moment_dtypes[name]
                state = storage.new_state(
                    dtype,
                    master.numel(),
                    master.device,
                    signed=name == "exp_avg",
                    layout=self.layout(master),
                )
                # Plain states are laid out like the master (a ZeRO-3 shard has its shape).
                slot[name] = state if storage.is_quantized(state) else state.view(master.shape)
        if self.rounding == "kahan" and KAHAN_COMPENSATION not in slot:
            slot[KAHAN_COMPENSATION] = torch.zeros_like(master)
        return slot

    def conform(self, masters: list[torch.Tensor]) -> None:
        """Give every master its states in this update's dtypes (after a reset or a load).

        ``reset_update_state`` makes each state like its master (fp32 or bf16); the moments
        must be in their own dtypes (fp32 inside :meth:`fp32_view`). The Kahan compensation
        exists from the start, so memory is what ``plan.memory()`` says before the first step
        too.
        """
        for master in masters:
            slot = self.inner.state[master]
            for name in MOMENTS:
                value = slot.get(name)
                if value is None:
                    continue
                if storage.is_quantized(value) and self._fp32_depth:
                    values = storage.state_values(value, master.numel(), self.layout(master))
                    values = values.view(master.shape)
                    self._viewed[(id(slot), name)] = (value, values, values._version)
                    slot[name] = values
                elif not storage.is_quantized(value):
                    kept = self._viewed.get((id(slot), name))
                    if kept is not None and kept[1] is value and kept[2] == value._version:
                        # Untouched in the view: the codes it came from, not a re-quantization
                        # (which is not exact: torchao's signed map ends at -0.993, not -1).
                        slot[name] = kept[0]
                    else:
                        slot[name] = self._stored(value, name, master)
            if self.rounding == "kahan" and KAHAN_COMPENSATION not in slot:
                slot[KAHAN_COMPENSATION] = torch.zeros_like(master)
        if not self._fp32_depth:
            self._viewed.clear()
            pending, self._pending_codes = self._pending_codes, []
            for master, name, offset, numel, codes, scale in pending:
                self._restore_codes(master, name, offset, numel, codes, scale)

    def _segment(self, master: torch.Tensor, offset: int, numel: int) -> tuple[int, int] | None:
        """The stored span ``[begin, end)`` of the segment of ``master`` at ``offset`` of
        ``numel`` values, or None where no segment is exactly that."""
        layout = self.layout(master)
        for begin, stored, n in zip(
            layout.starts, layout.stored_starts, layout.lengths, strict=True
        ):
            if begin == offset and n == numel:
                return stored, stored + storage.padded(n)
        return None

    def _quantized_state(self, master: torch.Tensor, name: str) -> torch.Tensor | None:
        """``master``'s quantized moment ``name`` as stored (inside :meth:`fp32_view`: the codes
        its fp32 stand-in came from, if not written since), or None."""
        slot = self.inner.state.get(master, {})
        value = slot.get(name)
        if value is None:
            return None
        if storage.is_quantized(value):
            return value
        kept = self._viewed.get((id(slot), name))
        if kept is not None and kept[1] is value and kept[2] == value._version:
            return kept[0]
        return None

    def codes_like(
        self, master: torch.Tensor, name: str, offset: int, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Empty codes and scales of the shapes and dtypes :meth:`segment_codes` gives for
        that piece in this update's layout and moment dtype, or None (not quantized, or not
        one segment): what a load stages saved codes in."""
        dtype = self.moment_dtypes[name]
        span = self._segment(master, offset, numel) if dtype in storage.QUANTIZED else None
        if span is None:
            return None
        begin, end = span
        codes_dtype = torch.uint8 if dtype == "int8" else torch.float8_e4m3fn
        return (
            torch.empty(end - begin, dtype=codes_dtype, device=master.device),
            torch.empty(
                (end - begin) // storage.QUANTIZED_BLOCK, dtype=torch.float32, device=master.device
            ),
        )

    def segment_codes(
        self, master: torch.Tensor, name: str, offset: int, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Copies of the codes and block scales that hold moment ``name`` of the parameter
        piece at ``offset`` (``numel`` values) of ``master``, or None where that moment is not
        quantized. What a same-layout load restores bit for bit (:meth:`load_segment_codes`),
        where loading the values would quantize them anew, which is not idempotent (torchao's
        signed map ends at -0.993, so a block's absmax, and with it every code, moves)."""
        value = self._quantized_state(master, name)
        span = self._segment(master, offset, numel) if value is not None else None
        if value is None or span is None:
            return None
        quantized: Any = value
        begin, end = span
        scale = quantized.scale[begin // storage.QUANTIZED_BLOCK : end // storage.QUANTIZED_BLOCK]
        return quantized.codes[begin:end].clone(), scale.clone()

    def save_codes(
        self, entry: dict[str, Any], master: torch.Tensor, offset: int, numel: int
    ) -> None:
        """Add the quantized moments' codes and scales of a parameter piece to its state dict
        ``entry`` (:data:`CODES`, :data:`SCALES`)."""
        for name in MOMENTS:
            found = self.segment_codes(master, name, offset, numel)
            if found is not None:
                entry[name + CODES], entry[name + SCALES] = found

    def load_codes(
        self, entry: Mapping[str, Any], master: torch.Tensor, offset: int, numel: int
    ) -> None:
        """Restore the codes and scales :meth:`save_codes` put in ``entry``, if any."""
        for name in MOMENTS:
            codes, scales = entry.get(name + CODES), entry.get(name + SCALES)
            if torch.is_tensor(codes) and torch.is_tensor(scales):
                self.load_segment_codes(master, name, offset, numel, codes, scales)

    def load_segment_codes(
        self,
        master: torch.Tensor,
        name: str,
        offset: int,
        numel: int,
        codes: torch.Tensor,
        scale: torch.Tensor,
    ) -> None:
        """Restore what :meth:`segment_codes` gave, after the piece's values were loaded: at
        once, or inside :meth:`fp32_view` once the moments are stored back. Ignored where the
        moment is not stored in the codes' dtype or the piece is not one segment of the same
        size (another layout: the loaded values are quantized anew)."""
        if self._fp32_depth:
            self._pending_codes.append((master, name, offset, numel, codes, scale))
        else:
            self._restore_codes(master, name, offset, numel, codes, scale)

    def _restore_codes(
        self,
        master: torch.Tensor,
        name: str,
        offset: int,
        numel: int,
        codes: torch.Tensor,
        scale: torch.Tensor,
    ) -> None:
        value = self._quantized_state(master, name)
        span = self._segment(master, offset, numel) if value is not None else None
        if value is None or span is None:
            return
        quantized: Any = value
        begin, end = span
        first, last = begin // storage.QUANTIZED_BLOCK, end // storage.QUANTIZED_BLOCK
        if (
            codes.dtype != quantized.codes.dtype
            or codes.numel() != end - begin
            or scale.numel() != last - first
        ):
            return
        quantized.codes[begin:end].copy_(codes.reshape(-1))
        quantized.scale[first:last].copy_(scale.reshape(-1))

    @contextlib.contextmanager
    def fp32_view(self, masters: list[torch.Tensor]) -> Iterator[None]:
        """Hold every moment as an fp32 tensor laid out like its master while the block runs,
        and store them back in their dtypes after (nests; a no-op without quantized moments).

        For the code that reads or writes states per parameter: checkpoints, ``state_dict``,
        ``full_state`` and the restoring of parameters that got no gradient. A state the block
        does not write gets its own codes back (reading states changes nothing); a written one
        is quantized anew. The cost is a transient fp32 copy of the states.
        """
        if not self.quantized:
            yield
            return
        self._fp32_depth += 1
        try:
            if self._fp32_depth == 1:
                self.conform(masters)
            yield
        finally:
            self._fp32_depth -= 1
            if self._fp32_depth == 0:
                self.conform(masters)

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
                noise = self._scratch_for(device, "noise", n, torch.int32)
                round_stochastic(weights, master[begin:end], self._generator(device), noise)
            else:
                master[begin:end].copy_(weights)
            for name, values in zip(MOMENTS, moments, strict=True):
                scratch = self._scratch_for(device, name, storage.scratch_numel(span))
                storage.store_piece(values, slot[name], span, scratch)

    def one_pass(self, master: torch.Tensor, slot: dict[str, Any]) -> bool:
        """Whether the one-pass update (``kernels/one_pass.py``) serves ``master``: a 16-bit
        master on the host, both moments fp32 or bf16. Quantized moments take the pieces of
        :meth:`bucket`, and so do fp32 masters: with bf16 moments Inductor's vectorized bf16
        conversions cost more than the pieces' fp32 scratch saves (measured 112 ms a step
        against 92 ms for 16.8 M parameters, one thread)."""
        return (
            master.device.type == "cpu"
            and master.dtype != torch.float32
            and all(
                not storage.is_quantized(slot[name])
                and slot[name].dtype in (torch.float32, torch.bfloat16)
                for name in MOMENTS
            )
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
        """:meth:`bucket` by :func:`~dtypeplan.optimizers.kernels.one_pass.adam_one_pass`, a
        piece of ``PIECE`` at a time (bounds the eager path's temporaries; the compiled one
        has none)."""
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
        for begin in range(0, master.numel(), PIECE):
            end = min(begin + PIECE, master.numel())
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
            scratch = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._scratch[(device, name)] = scratch
        return scratch[:numel]
