"""What an optimizer gives to a checkpoint and takes from it, as :class:`Flat` pieces.

Two adapters. :class:`FlatAdapter` reads and writes, in place, the pieces of each parameter
that this rank's shard holds: the flat-buffer optimizers' master chunks (ZeRO 0-2), and
ZeRO-3's local FSDP2 shards (one contiguous piece per parameter, as FSDP2 shards on dim 0), so
no rank ever gathers a parameter. :class:`FullStateAdapter` goes through any other
optimizer's layout-free ``full_state()``.

An adapter lists the trainable parameters' shapes and state names, and which tensors it stores
of each parameter with their shapes (:data:`Tensors`, the manifest's ``tensors``), hands out
the pieces to save, allocates staging pieces to load into, and commits them into the optimizer
at the end (so a load that fails before then leaves the optimizer as it was). Every tensor is
keyed ``param.{i}.{name}``, 1-D, of its own shape's ``numel``; so each adapter reads what
another wrote. The flat and FSDP2 optimizers keep every state laid out like its parameter; the
whole-tensor one (:class:`WholeStateAdapter`) keeps each parameter's own (Adafactor's row and
column statistics; Muon's momentum on matrices, AdamW's moments on the rest), and refuses
tensors its class would not keep. The inner optimizer's scalar states (``step``,
``mu_product``...) are one per param group, in the manifest's ``scalars.group_states``
(:func:`encode_group_states`), and one per parameter where a parameter's own differ from its
group's (``torch.optim``'s lifecycle: a first gradient after the group's first step, a skipped
step), or where it has no state yet while its group has one, in ``scalars.param_states``
(:func:`encode_param_states`); the whole-tensor optimizer's are all per parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtypeplan.checkpoint._errors import CheckpointError
from dtypeplan.checkpoint._planners import Flat
from dtypeplan.optimizers.contract import MixedPrecisionOptimizer
from dtypeplan.optimizers.flat import FlatMixedPrecisionOptimizer
from dtypeplan.optimizers.fsdp2 import FSDP2Optimizer
from dtypeplan.optimizers.state import (
    KAHAN_COMPENSATION,
    LOSS_SCALE,
    MASTER,
    SKIPPED_STEPS,
    STEP,
    SavedCodes,
    ShardPiece,
    param_key,
    param_state_names,
    parse_group_scalar_key,
    parse_param_key,
    parse_param_scalar_key,
    scalar_key,
    scaler_key,
    scaler_state,
)
from dtypeplan.optimizers.whole import WholeTensorOptimizer

Tensors = list[dict[str, list[int]]]
"""Per trainable parameter, the tensors stored of it (``master`` and its states) and the shape
of each: the manifest's ``tensors`` (version 3)."""

ShardedOptimizer = FlatMixedPrecisionOptimizer | FSDP2Optimizer
"""The optimizers whose shards a checkpoint reads in place: both give ``shard_pieces()``,
``state_names()``, ``reset_update_state()``, ``param_scalar_state()``, ``load_param_scalars()``
and ``refresh_params()``."""

__all__ = [
    "CODES_PREFIX",
    "GROUP_STATES",
    "PARAM_STATES",
    "Adapter",
    "FlatAdapter",
    "FullStateAdapter",
    "Tensors",
    "WholeStateAdapter",
    "adapter_for",
    "elementwise_tensors",
    "decode_group_states",
    "encode_group_states",
    "encode_param_states",
    "merge_group_states",
]

CODES_PREFIX = "codes."
"""The keys of quantized moments stored as they are, beside their fp32 values:
``codes.{i}.{name}.{begin}-{end}.{tag}.codes`` (the codes' bytes, as uint8) and ``...scales``
(one per block) for the piece ``[begin, end)`` of parameter ``i``, ``tag`` the state format's
own (``StateFormat.tag``: ``int8``, ``fp8``), never read off the codes' dtype (two formats may
share one). The manifest's ``codes`` lists them. A load whose piece of that parameter is the
same and whose moment is stored in the format of the same tag restores them bit for bit; any
other load quantizes the fp32 values anew in its own format."""

GROUP_STATES = "group_states"
"""The manifest's ``scalars`` entry holding the inner optimizer's per-group scalar states."""


PARAM_STATES = "param_states"
"""The manifest's ``scalars`` entry holding the parameters' own scalar states, where they differ
from their group's (absent in a version-1 manifest: every parameter follows its group)."""


def encode_group_states(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``scalar.group.*`` entries of ``state`` as JSON: ``{"value": x, "dtype": "float32"}``
    for a 0-dim tensor (a float32 or float64 value is exact as a JSON number), ``{"value": x}``
    for a Python number."""
    return _encode(state, parse_group_scalar_key)


def encode_param_states(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``scalar.param.*`` entries of ``state`` as JSON, as :func:`encode_group_states`
    (``scalar.param.{i}.no_state`` is ``{"value": 1}``)."""
    return _encode(state, parse_param_scalar_key)


def _encode(
    state: dict[str, Any], parse: Callable[[str], tuple[int, str] | None]
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        if parse(key) is None:
            continue
        if torch.is_tensor(value):
            out[key] = {"value": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
        else:
            out[key] = {"value": value}
    return out


def decode_group_states(encoded: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Inverse of :func:`encode_group_states` (CPU tensors of the saved dtype)."""
    return {
        key: torch.tensor(entry["value"], dtype=getattr(torch, entry["dtype"]))
        if "dtype" in entry
        else entry["value"]
        for key, entry in encoded.items()
    }


def merge_group_states(per_rank: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every rank's encoded scalar states (per group, or per parameter) in one: they must agree
    wherever two ranks hold one (a group's chunks step together; a parameter's pieces have one
    history), else :class:`CheckpointError`."""
    merged: dict[str, dict[str, Any]] = {}
    for rank, states in enumerate(per_rank):
        for key, entry in states.items():
            if key in merged and merged[key] != entry:
                raise CheckpointError(
                    f"the optimizer's scalar state {key} differs between ranks ({merged[key]} "
                    f"and, on rank {rank}, {entry}): the pieces it stands for did not step "
                    "together"
                )
            merged.setdefault(key, entry)
    if any(parse_param_scalar_key(key) for key in merged):
        # A parameter's pieces on other ranks share its history: all its names or none.
        names: dict[int, set[str]] = {}
        for key in merged:
            parsed = parse_param_scalar_key(key)
            if parsed is not None:
                names.setdefault(parsed[0], set()).add(parsed[1])
        for rank, states in enumerate(per_rank):
            for index, found in names.items():
                held = {
                    parsed[1]
                    for parsed in map(parse_param_scalar_key, states)
                    if parsed is not None and parsed[0] == index
                }
                if held and held != found:
                    raise CheckpointError(
                        f"parameter {index}'s own scalar states differ between ranks: rank "
                        f"{rank} holds {sorted(held)}, the ranks together {sorted(found)}"
                    )
    return merged


def _numel(shape: list[int]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def elementwise_tensors(names: list[str], shapes: list[list[int]]) -> Tensors:
    """Every state of ``names`` for every parameter, laid out like it (the only layout before
    manifest version 3, and the flat and FSDP2 optimizers' own)."""
    return [{name: list(shape) for name in names} for shape in shapes]


def _empty_flats(tensors: Tensors, skip: tuple[str, ...] = ()) -> dict[str, Flat]:
    """A :class:`Flat` without pieces for every stored tensor (but those named in ``skip``)."""
    return {
        param_key(i, name): Flat(_numel(shape))
        for i, stored in enumerate(tensors)
        for name, shape in stored.items()
        if name not in skip
    }


def _elementwise_problems(tensors: Tensors, shapes: list[list[int]], names: list[str]) -> list[str]:
    """Why ``tensors`` is not ``names`` laid out like each parameter, one line each."""
    out = []
    for i, (stored, shape) in enumerate(zip(tensors, shapes, strict=False)):
        other = sorted(n for n, s in stored.items() if s != shape) + sorted(
            set(names) - set(stored)
        )
        if other:
            out.append(
                f"parameter {i}: the checkpoint's {other} are not states laid out like the "
                f"parameter ({shape}), the only kind this optimizer keeps; load it into the "
                "optimizer class that saved it"
            )
    return out[:5]


def _piece_of(piece: ShardPiece, tensor: torch.Tensor) -> torch.Tensor:
    """The 1-D view of ``tensor`` (the piece's master or a state laid out like it) it covers.

    A flat master chunk is 1-D already; a ZeRO-3 local shard has the parameter's shape.
    """
    return tensor.view(-1)[piece.offset : piece.offset + piece.end - piece.begin]


class FlatAdapter:
    """Per-rank pieces of a sharded optimizer's shard (sharded I/O): ZeRO 0-2 and ZeRO-3."""

    layout = "sharded"

    def __init__(self, opt: ShardedOptimizer) -> None:
        self.opt = opt
        self._codes: list[tuple[ShardPiece, str, SavedCodes]] = []
        """The saved codes staged by :meth:`load_targets`: piece, moment, codes."""

    def shapes(self) -> list[list[int]]:
        return [list(p.shape) for p in self.opt.trainable_parameters()]

    def state_names(self) -> list[str]:
        names = self.opt.state_names()
        # Kahan masters: the compensation is saved too (the master's values include it), so
        # that a pair halfway between two bf16 weights comes back as the same pair.
        if any(KAHAN_COMPENSATION in slot for slot in self.opt.inner.state.values()):
            names.append(KAHAN_COMPENSATION)
        return names

    def tensors(self, names: list[str]) -> Tensors:
        return elementwise_tensors(names, self.shapes())

    def problems(self, tensors: Tensors, names: list[str]) -> list[str]:
        return _elementwise_problems(tensors, self.shapes(), names)

    def _saved_pieces(self) -> list[ShardPiece]:
        """The pieces this rank writes: its shard's, except in a hybrid layout outside the
        first shard group, whose ranks hold the same pieces as the first group's (each piece
        is written once; a load reads it into every group)."""
        opt = self.opt
        if isinstance(opt, FlatMixedPrecisionOptimizer) and opt.replica_rank != 0:
            return []
        return opt.shard_pieces()

    def save_pieces(self, names: list[str]) -> dict[str, Flat]:
        # Quantized moments are saved as the fp32 values they stand for, and as their codes
        # and scales besides, tagged with their format (for a load into the same layout and
        # format).
        with self.opt.fp32_states():
            flats = self._save_pieces(names)
            flats.update(self._code_pieces(names))
            return flats

    def _code_pieces(self, names: list[str]) -> dict[str, Flat]:
        update = self.opt.low_precision_update
        flats: dict[str, Flat] = {}
        if update is None:
            return flats
        for piece in self._saved_pieces():
            for name in update.names:
                if name not in names:
                    continue
                found = update.segment_codes(
                    piece.master, name, piece.offset, piece.end - piece.begin
                )
                if found is None:
                    continue
                key = _codes_key(piece, name, found.tag)
                codes = found.codes.view(torch.uint8)
                flats[key + ".codes"] = Flat(codes.numel(), [(0, codes)])
                flats[key + ".scales"] = Flat(found.scales.numel(), [(0, found.scales)])
        return flats

    def _save_pieces(self, names: list[str]) -> dict[str, Flat]:
        flats = _empty_flats(self.tensors(names))
        values: dict[int, torch.Tensor] = {}  # each master chunk's fp32 values, made once
        for piece in self._saved_pieces():
            slot = self.opt.inner.state.get(piece.master, {})
            for name in names:
                if name == MASTER:
                    key = id(piece.master)
                    if key not in values:
                        values[key] = self.opt.master_values(piece.master)
                    source = values[key]
                elif name == KAHAN_COMPENSATION and name in slot:
                    key = -id(piece.master)
                    if key not in values:
                        values[key] = slot[name].float()  # bf16 values: exact in fp32
                    source = values[key]
                elif name in slot:
                    source = slot[name]
                else:
                    # A state this rank has not created yet is still zero (as in full_state).
                    source = torch.zeros_like(piece.master)
                flats[param_key(piece.index, name)].pieces.append(
                    (piece.begin, _piece_of(piece, source))
                )
        return flats

    def scalars(self) -> dict[str, Any]:
        # A step's hyperparameter check still in flight (accelerators) is done before saving.
        self.opt.hyperparameter_check.flush()
        return {
            "step": self.opt.step_count(),
            "loss_scale": float(self.opt.scaler.scale),
            "skipped_steps": int(self.opt.skipped_steps),
            "scaler_enabled": bool(self.opt.scaler.enabled),
            "scaler": dict(self.opt.scaler.state_dict()),
            GROUP_STATES: encode_group_states(self.opt.group_scalar_state()),
            PARAM_STATES: encode_param_states(self.opt.param_scalar_state()),
        }

    def load_targets(
        self,
        names: list[str],
        shapes: list[list[int]],
        codes: Sequence[str] = (),
        tensors: Tensors | None = None,
    ) -> dict[str, Flat]:
        """Staging for ``names`` of this rank's pieces (``tensors``: the checkpoint's, which
        :meth:`problems` found laid out like the parameters of ``shapes``), and for the saved
        ``codes`` (the manifest's) of pieces that are this rank's own and stored in the same
        format."""
        flats = _empty_flats(tensors if tensors is not None else elementwise_tensors(names, shapes))
        for piece in self.opt.shard_pieces():
            for name in names:
                staging = torch.empty(
                    piece.end - piece.begin, dtype=torch.float32, device=piece.master.device
                )
                flats[param_key(piece.index, name)].pieces.append((piece.begin, staging))
        self._codes = []
        update = self.opt.low_precision_update
        if update is None or not codes:
            return flats
        saved = set(codes)
        for piece in self.opt.shard_pieces():
            for name in update.names:
                staged = update.codes_like(
                    piece.master, name, piece.offset, piece.end - piece.begin
                )
                if staged is None:
                    continue
                key = _codes_key(piece, name, staged.tag)
                if key + ".codes" not in saved or key + ".scales" not in saved:
                    continue
                codes_bytes = staged.codes.view(torch.uint8)
                flats[key + ".codes"] = Flat(codes_bytes.numel(), [(0, codes_bytes)])
                flats[key + ".scales"] = Flat(staged.scales.numel(), [(0, staged.scales)])
                self._codes.append((piece, name, staged))
        return flats

    @torch.no_grad()
    def commit(self, flats: dict[str, Flat], names: list[str], scalars: dict[str, Any]) -> None:
        # States load as fp32 values, then are stored in this optimizer's dtypes (rounded to
        # bf16, or quantized to int8 / fp8) when the context ends.
        with self.opt.fp32_states():
            self._commit(flats, names, scalars)
        # After the per-element states: a parameter without a state yet (ZeRO-3) drops its
        # zeroed ones, outside the fp32 view that would store them back.
        self.opt.load_param_scalars(_scalar_entries(scalars))

    def _commit(self, flats: dict[str, Flat], names: list[str], scalars: dict[str, Any]) -> None:
        opt = self.opt
        update = opt.low_precision_update
        kahan = update is not None and update.rounding == "kahan"
        opt.reset_update_state(
            [n for n in names if n not in (MASTER, KAHAN_COMPENSATION)],
            opt.group_scalars_from(_scalar_entries(scalars)),
        )
        compensations: dict[int, torch.Tensor] = {}
        pieces = {key: dict(flat.pieces) for key, flat in flats.items()}
        # Masters are filled as fp32 values first, then set through the optimizer (which
        # rounds them into bf16 masters, or splits them into weights and Kahan compensation).
        masters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for piece in opt.shard_pieces():
            for name in names:
                if name == MASTER:
                    key = id(piece.master)
                    if key not in masters:
                        masters[key] = (piece.master, opt.master_values(piece.master))
                    target = masters[key][1]
                elif name == KAHAN_COMPENSATION:
                    if not kahan:
                        continue  # folded into the master's values already
                    key = id(piece.master)
                    if key not in compensations:
                        compensations[key] = torch.zeros(
                            piece.master.shape, dtype=torch.float32, device=piece.master.device
                        )
                    target = compensations[key]
                else:
                    target = opt.inner.state[piece.master][name]
                _piece_of(piece, target).copy_(pieces[param_key(piece.index, name)][piece.begin])
        for key, (master, values) in masters.items():
            opt.load_master_(master, values, compensations.get(key))
        for piece, name, staged in self._codes:
            assert update is not None  # staged only where there is one
            # Applied once the fp32 values are stored back (quantized anew) at the end.
            update.load_segment_codes(
                piece.master, name, piece.offset, piece.end - piece.begin, staged
            )
        opt.skipped_steps = int(scalars["skipped_steps"])
        if opt.scaler.enabled and scalars.get("scaler_enabled"):
            opt.scaler.load_state_dict(scalars["scaler"])
        opt.refresh_params()


class FullStateAdapter:
    """Any :class:`MixedPrecisionOptimizer`, through its layout-free full state."""

    layout = "full"
    skipped: tuple[str, ...] = (KAHAN_COMPENSATION,)
    """Saved tensors a load leaves out: the full state of the flat and FSDP2 optimizers keeps
    no compensation of its own (the master's values include it)."""

    def __init__(self, opt: MixedPrecisionOptimizer) -> None:
        self.opt = opt
        self._full: dict[str, Any] | None = None
        self._shapes: list[list[int]] | None = None
        self._loaded: Tensors = []
        """The checkpoint's tensors, staged by :meth:`load_targets`."""

    def _state(self) -> dict[str, Any]:
        if self._full is None:
            self._full = self.opt.full_state()
        return self._full

    def shapes(self) -> list[list[int]]:
        if self._shapes is None:
            template = self._full if self._full is not None else self.opt.full_state_template()
            masters = [parse_param_key(key) for key in template]
            count = sum(1 for parsed in masters if parsed is not None and parsed[1] == MASTER)
            self._shapes = [
                list(_tensor(template[param_key(i, MASTER)]).shape) for i in range(count)
            ]
        return self._shapes

    def state_names(self) -> list[str]:
        found = param_state_names(self._state())
        return [MASTER] + [name for name in found if name != MASTER]

    def tensors(self, names: list[str]) -> Tensors:
        """The tensors of the full state, each of its own shape (``names``: every rank's)."""
        state = self._state()
        out: Tensors = [{} for _ in self.shapes()]
        for key, value in state.items():
            parsed = parse_param_key(key)
            if parsed is not None and parsed[1] in names:
                out[parsed[0]][parsed[1]] = list(_tensor(value).shape)
        return out

    def problems(self, tensors: Tensors, names: list[str]) -> list[str]:
        # The full state of the flat and FSDP2 optimizers (and of any built on its contract)
        # holds states laid out like the parameters.
        return _elementwise_problems(tensors, self.shapes(), names)

    def save_pieces(self, names: list[str]) -> dict[str, Flat]:
        state = self._state()
        flats = _empty_flats(self.tensors(names))
        for key, flat in flats.items():
            flat.pieces.append((0, state[key].detach().float().reshape(-1)))
        return flats

    def scalars(self) -> dict[str, Any]:
        state = self._state()
        return {
            "step": int(state.get(scalar_key(STEP), 0)),
            "loss_scale": float(state.get(scalar_key(LOSS_SCALE), 1.0)),
            "skipped_steps": int(state.get(scalar_key(SKIPPED_STEPS), 0)),
            "scaler_enabled": self.opt.plan.param_dtype == torch.float16,
            "scaler": scaler_state(state),
            GROUP_STATES: encode_group_states(state),
            PARAM_STATES: encode_param_states(state),
        }

    def load_targets(
        self,
        names: list[str],
        shapes: list[list[int]],
        codes: Sequence[str] = (),
        tensors: Tensors | None = None,
    ) -> dict[str, Flat]:
        """Staging for the checkpoint's ``tensors`` (default: ``names`` laid out like the
        parameters of ``shapes``); no codes (the full state's states are loaded as values)."""
        if tensors is None:
            tensors = elementwise_tensors(names, shapes)
        self._loaded = tensors
        flats = _empty_flats(tensors, skip=self.skipped)
        for flat in flats.values():
            flat.pieces.append((0, torch.empty(flat.numel)))
        return flats

    def commit(self, flats: dict[str, Flat], names: list[str], scalars: dict[str, Any]) -> None:
        state: dict[str, Any] = {}
        for key, flat in flats.items():
            parsed = parse_param_key(key)
            assert parsed is not None  # the keys of load_targets
            state[key] = flat.pieces[0][1].view(self._loaded[parsed[0]][parsed[1]])
        state.update(_scalar_entries(scalars))
        state[scalar_key(SKIPPED_STEPS)] = int(scalars["skipped_steps"])
        if scalars.get("scaler_enabled") and self.opt.plan.param_dtype == torch.float16:
            state[scalar_key(LOSS_SCALE)] = float(scalars["loss_scale"])
            for field, value in scalars["scaler"].items():
                state[scaler_key(field)] = value
        self.opt.load_full_state(state)


class WholeStateAdapter(FullStateAdapter):
    """The whole-tensor optimizer (``optimizers/whole``), through its full state: each
    parameter keeps the states its class keeps for it, of their own shapes and names."""

    opt: WholeTensorOptimizer
    skipped = ()
    """A Kahan compensation is loaded: with bf16 parameters the forward runs on the bf16
    master, so a resumed run needs the very (weight, compensation) pair, not only its sum."""

    def __init__(self, opt: WholeTensorOptimizer) -> None:
        super().__init__(opt)

    def problems(self, tensors: Tensors, names: list[str]) -> list[str]:
        """Parameters whose saved states are not the ones this optimizer's class keeps for
        them (a parameter that Muon steps in the checkpoint and AdamW here): loaded, they
        would be dropped or misread, so the load is refused. A parameter saved without states
        (no gradient yet) fits any."""
        out = []
        for i, stored in enumerate(tensors):
            saved = {n: s for n, s in stored.items() if n not in (MASTER, KAHAN_COMPENSATION)}
            if not saved:
                continue
            kept = self.opt.kept_states(i)
            if kept is not None and kept != saved:
                out.append(
                    f"parameter {i}: the checkpoint holds the states {_described(saved)}, but "
                    f"this optimizer's {self.opt.optimizer_class_name()} keeps "
                    f"{_described(kept)} for it (another class or another split of the "
                    "parameters, such as DeepSpeed's Muon's use_muon tags); build the "
                    "optimizer as the checkpoint's run did, or load only the model's weights"
                )
        return out[:5]


def _described(states: dict[str, list[int]]) -> str:
    return ", ".join(f"{name} {shape}" for name, shape in sorted(states.items())) or "none"


def _codes_key(piece: ShardPiece, name: str, tag: str) -> str:
    """The key of a piece's codes in the format tagged ``tag`` (``StateFormat.tag``)."""
    return f"{CODES_PREFIX}{piece.index}.{name}.{piece.begin}-{piece.end}.{tag}"


def _scalar_entries(scalars: dict[str, Any]) -> dict[str, Any]:
    """The manifest's step counters as ``full_state`` keys: ``scalar.step`` and, in a
    checkpoint written since they are kept, the ``scalar.group.*`` states and (version 2) the
    ``scalar.param.*`` ones."""
    entries = decode_group_states(scalars.get(GROUP_STATES, {}))
    entries.update(decode_group_states(scalars.get(PARAM_STATES, {})))
    entries[scalar_key(STEP)] = int(scalars["step"])
    return entries


Adapter = FlatAdapter | FullStateAdapter


def adapter_for(opt: MixedPrecisionOptimizer) -> Adapter:
    if isinstance(opt, (FlatMixedPrecisionOptimizer, FSDP2Optimizer)):
        return FlatAdapter(opt)
    if isinstance(opt, WholeTensorOptimizer):
        return WholeStateAdapter(opt)
    return FullStateAdapter(opt)


def _tensor(value: object) -> torch.Tensor:
    """A ``param.{i}.{name}`` entry of a full state: always a tensor (scalars are ``scalar.*``)."""
    assert isinstance(value, torch.Tensor)
    return value
