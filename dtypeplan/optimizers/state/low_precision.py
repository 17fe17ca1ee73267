"""bf16 master weights and low-precision moments: how their state is held (the state half).

With ``master_weights.dtype: bf16`` the bf16 parameters are the masters: a master chunk is a
view of the parameter buffer, so no fp32 copy exists (4 bytes per parameter saved). With
``optimizer_states`` other than fp32, each moment is stored as its dtype says
(``state/storage.py``: bf16, or torchao's int8 / fp8 blockwise codes). The update of such state
is ``update/pieces.py``'s (:class:`~dtypeplan.optimizers.update.pieces.LowPrecisionAdamUpdate`,
a :class:`LowPrecisionState`); this module holds what every state call needs of it: the
moments' slots in their dtypes, a master's fp32 values and their loading (Kahan pairs included),
the quantized moments' block layout and codes, and the fp32 view of them.

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
scales as they are (:meth:`LowPrecisionState.segment_codes`), and a load into the same
piece restores them after the values (:meth:`LowPrecisionState.load_segment_codes`): a
same-layout round trip through ``state_dict`` or a checkpoint changes no bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from dtypeplan._formats import QuantizedFormat, state_format
from dtypeplan.optimizers.kernels.rounding import kahan_store
from dtypeplan.optimizers.state import storage
from dtypeplan.optimizers.state.keys import (
    KAHAN_COMPENSATION,
    MOMENTS,
    SIGNED_STATES,
)

__all__ = [
    "CODES",
    "SCALES",
    "LowPrecisionState",
    "SavedCodes",
    "codes_keys",
    "held_compensations",
    "held_states",
]


CODES, SCALES = ".codes", ".scales"
"""Suffixes of a state dict entry's quantized moment, stored as is beside its fp32 values
under its format's tag (``exp_avg.int8.codes``, ``exp_avg.int8.scales``): a same-layout load
into a state of the same format restores them bit for bit."""


def codes_keys(name: str, tag: str) -> tuple[str, str]:
    """The state dict entry's keys of state ``name``'s codes and scales in the format tagged
    ``tag``."""
    return f"{name}.{tag}{CODES}", f"{name}.{tag}{SCALES}"


class SavedCodes(NamedTuple):
    """A piece's codes and block scales as stored, and the tag of the format they are codes
    of (``StateFormat.tag``): they load only into a state of that format."""

    tag: str
    codes: torch.Tensor
    scales: torch.Tensor


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


class LowPrecisionState:
    """The optimizer state of 16-bit masters or low-precision moments: the moments in their
    dtypes, the masters' fp32 values, quantized moments' layouts and codes."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        rounding: str,
        exp_avg_dtype: str,
        exp_avg_sq_dtype: str,
        names: tuple[str, ...] = MOMENTS,
    ) -> None:
        self.inner = inner
        self.rounding = rounding
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        self.names = names
        self.signed: tuple[str, ...] = SIGNED_STATES
        """The per-element states stored as ``exp_avg_dtype`` says (signed codes)."""
        """The per-element states this update stores in their dtypes (Adam's moments, or
        every per-element state of the ``torch.optim`` classes: ``keys.ELEMENT_STATES``)."""
        self.block = storage.layout_block((exp_avg_dtype, exp_avg_sq_dtype))
        """The block the quantized moments' layouts pad each segment to (a multiple of each
        format's own)."""
        self._fp32_depth = 0
        self._layouts: dict[int, storage.BlockLayout] = {}
        """Each master's block layout for quantized moments, by ``id(master)`` (the masters
        live as long as the optimizer); a master not here is one segment."""
        self._viewed: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, int]] = {}
        """Inside :meth:`fp32_view`: each quantized moment, the fp32 tensor that stands in for
        it, and that tensor's version counter when made (to tell whether it was written)."""
        self._pending_codes: list[tuple[torch.Tensor, str, int, int, SavedCodes]] = []
        """Saved codes to restore once :meth:`fp32_view` has stored the moments back
        (:meth:`load_segment_codes`)."""

    def dtype_of(self, name: str) -> str:
        """The storage dtype of per-element state ``name``: the signed states
        (``keys.SIGNED_STATES``) as ``exp_avg_dtype`` says, the non-negative ones as
        ``exp_avg_sq_dtype``."""
        role = "exp_avg" if name in self.signed else "exp_avg_sq"
        return self.moment_dtypes[role]

    @property
    def quantized(self) -> bool:
        """Whether a state is stored as codes (then :meth:`fp32_view` matters)."""
        return any(state_format(self.dtype_of(name)).quantized for name in self.names)

    def set_segments(
        self, masters: Sequence[torch.Tensor], segments: Sequence[Sequence[int]]
    ) -> None:
        """Lay each master's quantized moments out by its segments (the lengths of its
        parameter pieces and bucket padding, in order): each starts on a block boundary, so no
        block's absmax mixes two parameters. Before any state is made."""
        for master, lengths in zip(masters, segments, strict=True):
            layout = storage.BlockLayout(lengths, block=self.block)
            if layout.numel != master.numel():
                raise ValueError(
                    f"segments of {layout.numel} values for a master of {master.numel()}"
                )
            self._layouts[id(master)] = layout

    def layout(self, master: torch.Tensor) -> storage.BlockLayout:
        """``master``'s block layout: its segments, or one segment."""
        layout = self._layouts.get(id(master))
        if layout is None or layout.numel != master.numel():
            layout = storage.BlockLayout.whole(master.numel(), block=self.block)
            self._layouts[id(master)] = layout
        return layout

    def _stored(self, values: torch.Tensor, name: str, master: torch.Tensor) -> torch.Tensor:
        """A plain (fp32 or bf16) state in ``name``'s storage dtype, or in fp32 inside
        :meth:`fp32_view`; plain results keep ``values``' shape."""
        want = "fp32" if self._fp32_depth else self.dtype_of(name)
        if state_format(want).holds(values):
            return values
        stored = storage.to_storage(
            values.reshape(-1), want, signed=name in self.signed, layout=self.layout(master)
        )
        return stored if storage.is_quantized(stored) else stored.view(values.shape)

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
                dtype = "fp32" if self._fp32_depth else self.dtype_of(name)
                state = storage.new_state(
                    dtype,
                    master.numel(),
                    master.device,
                    signed=name in self.signed,
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
            for name in self.names:
                value = slot.get(name)
                if not torch.is_tensor(value):
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
            for master, name, offset, numel, saved in pending:
                self._restore_codes(master, name, offset, numel, saved)

    def _segment(self, master: torch.Tensor, offset: int, numel: int) -> tuple[int, int] | None:
        """The stored span ``[begin, end)`` of the segment of ``master`` at ``offset`` of
        ``numel`` values, or None where no segment is exactly that."""
        layout = self.layout(master)
        for begin, stored, n in zip(
            layout.starts, layout.stored_starts, layout.lengths, strict=True
        ):
            if begin == offset and n == numel:
                return stored, stored + layout.padded(n)
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

    def _format(self, name: str) -> QuantizedFormat | None:
        fmt = state_format(self.dtype_of(name))
        return fmt if isinstance(fmt, QuantizedFormat) else None

    def codes_like(
        self, master: torch.Tensor, name: str, offset: int, numel: int
    ) -> SavedCodes | None:
        """Empty codes and scales of the shapes and dtypes :meth:`segment_codes` gives for
        that piece in this update's layout and moment format, with its tag, or None (not
        quantized, or not one segment): what a load stages saved codes in."""
        fmt = self._format(name)
        span = self._segment(master, offset, numel) if fmt is not None else None
        if fmt is None or span is None or fmt.scale_dtype is None:
            return None
        at_codes, at_scales = fmt.spans(*span)
        device = master.device
        return SavedCodes(
            fmt.tag,
            torch.empty(at_codes.stop - at_codes.start, dtype=fmt.storage_dtype, device=device),
            torch.empty(at_scales.stop - at_scales.start, dtype=fmt.scale_dtype, device=device),
        )

    def segment_codes(
        self, master: torch.Tensor, name: str, offset: int, numel: int
    ) -> SavedCodes | None:
        """Copies of the codes and block scales that hold moment ``name`` of the parameter
        piece at ``offset`` (``numel`` values) of ``master``, with its format's tag, or None
        where that moment is not quantized. What a same-layout load restores bit for bit
        (:meth:`load_segment_codes`), where loading the values would quantize them anew,
        which is not idempotent (torchao's signed map ends at -0.993, so a block's absmax, and
        with it every code, moves)."""
        value = self._quantized_state(master, name)
        fmt = self._format(name)
        span = self._segment(master, offset, numel) if value is not None else None
        if value is None or span is None or fmt is None:
            return None
        codes, scales, _ = fmt.parts(value)
        at_codes, at_scales = fmt.spans(*span)
        return SavedCodes(fmt.tag, codes[at_codes].clone(), scales[at_scales].clone())

    def save_codes(
        self, entry: dict[str, Any], master: torch.Tensor, offset: int, numel: int
    ) -> None:
        """Add the quantized moments' codes and scales of a parameter piece to its state dict
        ``entry``, under their format's tag (:func:`codes_keys`)."""
        for name in self.names:
            found = self.segment_codes(master, name, offset, numel)
            if found is not None:
                codes_key, scales_key = codes_keys(name, found.tag)
                entry[codes_key], entry[scales_key] = found.codes, found.scales

    def load_codes(
        self, entry: Mapping[str, Any], master: torch.Tensor, offset: int, numel: int
    ) -> None:
        """Restore the codes and scales :meth:`save_codes` put in ``entry`` where they are
        codes of the format this update stores that moment in (the same tag); codes of
        another format are left out (the moment's values, loaded already, are quantized
        anew). A state dict written before the tags holds ``exp_avg.codes``: int8's codes if
        uint8, fp8's if e4m3 (``StateFormat.reads_untagged_codes``)."""
        for name in self.names:
            fmt = self._format(name)
            if fmt is None:
                continue
            codes_key, scales_key = codes_keys(name, fmt.tag)
            codes, scales = entry.get(codes_key), entry.get(scales_key)
            if codes is None and fmt.reads_untagged_codes:
                codes, scales = entry.get(name + CODES), entry.get(name + SCALES)
                if torch.is_tensor(codes) and codes.dtype != fmt.storage_dtype:
                    continue
            if torch.is_tensor(codes) and torch.is_tensor(scales):
                self.load_segment_codes(
                    master, name, offset, numel, SavedCodes(fmt.tag, codes, scales)
                )

    def load_segment_codes(
        self, master: torch.Tensor, name: str, offset: int, numel: int, saved: SavedCodes
    ) -> None:
        """Restore what :meth:`segment_codes` gave, after the piece's values were loaded: at
        once, or inside :meth:`fp32_view` once the moments are stored back. Ignored where the
        moment is not stored in the format ``saved`` is tagged with, or the piece is not one
        segment of the same size (another layout: the loaded values are quantized anew)."""
        if self._fp32_depth:
            self._pending_codes.append((master, name, offset, numel, saved))
        else:
            self._restore_codes(master, name, offset, numel, saved)

    def _restore_codes(
        self, master: torch.Tensor, name: str, offset: int, numel: int, saved: SavedCodes
    ) -> None:
        value = self._quantized_state(master, name)
        fmt = self._format(name)
        span = self._segment(master, offset, numel) if value is not None else None
        if value is None or span is None or fmt is None or saved.tag != fmt.tag:
            return
        codes, scales, _ = fmt.parts(value)
        at_codes, at_scales = fmt.spans(*span)
        if (
            saved.codes.dtype != codes.dtype
            or saved.codes.numel() != at_codes.stop - at_codes.start
            or saved.scales.numel() != at_scales.stop - at_scales.start
        ):
            return
        codes[at_codes].copy_(saved.codes.reshape(-1))
        scales[at_scales].copy_(saved.scales.reshape(-1))

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
