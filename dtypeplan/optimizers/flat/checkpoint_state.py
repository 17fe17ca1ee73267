"""The flat engine's state: master chunks and optimizer states saved, loaded and gathered.

What ``state_dict`` / ``load_state_dict`` (per parameter piece: ``_param_state``), the
resharding checkpoints (``full_state`` / ``load_full_state``: every parameter whole, gathered
over the group) and a sharded checkpoint (``shard_pieces``) read and write of the flat engine
(``flat/engine.py``), and the master chunks as the fp32 values they stand for (16-bit masters with
their Kahan compensation, quantized moments as fp32 values inside :meth:`fp32_states`). The
step's phases are the engine's; this layer only reads and writes what they leave.
"""

from __future__ import annotations

import abc
import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from dtypeplan.comm import Communicator
from dtypeplan.optimizers.buffers.group_state import GroupState
from dtypeplan.optimizers.contract.base import MixedPrecisionOptimizer
from dtypeplan.optimizers.flat.own_histories import OwnHistories
from dtypeplan.optimizers.kernels.rounding import kahan_store, round_stochastic_keyed
from dtypeplan.optimizers.state import keys
from dtypeplan.optimizers.state.keys import KAHAN_COMPENSATION
from dtypeplan.optimizers.state.values import (
    ShardPiece,
    element_state_names,
    is_element_state,
    is_scalar_state,
    load_slot,
    placed_scalar,
    same_scalar,
    stateful_scalars,
)
from dtypeplan.optimizers.update.pieces import LowPrecisionAdamUpdate

__all__ = ["FlatState"]

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _with_fp32_states(method: _Method) -> _Method:
    """Run ``method`` inside ``self.fp32_states()``: it reads or writes states per parameter."""

    @functools.wraps(method)
    def wrapper(self: FlatState, *args: Any, **kwargs: Any) -> Any:
        with self.fp32_states():
            return method(self, *args, **kwargs)

    return cast(_Method, wrapper)


class FlatState(MixedPrecisionOptimizer):
    """The state half of the flat engine (``FlatMixedPrecisionOptimizer`` is the step half)."""

    groups: list[GroupState]
    """Per param group: its flat buffer, accumulator and this rank's master chunks."""
    comm: Communicator
    shard_comm: Communicator
    shards: int
    shard_rank: int
    own_histories: OwnHistories
    _low_precision: LowPrecisionAdamUpdate | None

    @abc.abstractmethod
    def refresh_params(self) -> None:
        """Write the master weights into the parameters on every rank (collective)."""

    @abc.abstractmethod
    def _state_changed(self) -> None:
        """The optimizer states were replaced: the update drops any host copy of them."""

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

    def fp32_states(self) -> contextlib.AbstractContextManager[None]:
        if self._low_precision is None:
            return contextlib.nullcontext()
        return self._low_precision.fp32_view([m for s in self.groups for m in s.masters])

    def _read_master_piece(self, master: torch.Tensor, where: slice) -> torch.Tensor:
        """A piece of a master chunk as fp32 weights to update in place: the chunk's own view
        (fp32 masters), else a copy of the values it stands for (16-bit masters)."""
        if master.dtype == torch.float32:
            return master[where]
        return self.master_values(master)[where]

    def _write_master_piece(
        self, master: torch.Tensor, where: slice, values: torch.Tensor, state: dict[str, Any]
    ) -> None:
        """Store fp32 ``values`` into a piece of a 16-bit master chunk, rounded as the plan
        says (Kahan-compensated, stochastic or to nearest), as the chunk's update does.
        Stochastic: the hashed noise of the chunk's elements under the piece's own count
        (``state``: the piece's own state after its step; its ``step``, or for a class without
        one its ``rounding_step``, advanced here), checkpointed with its scalar states."""
        if master.dtype == torch.float32:
            return  # updated in place
        compensation = self.inner.state.get(master, {}).get(KAHAN_COMPENSATION)
        if compensation is not None:
            kahan_store(values, master[where], compensation[where])
        elif self.plan.master_rounding == "stochastic":
            assert self._low_precision is not None, "16-bit masters have a low-precision update"
            step = self._low_precision.noise_step(state, master)
            key = self._low_precision.noise_key(master, step)
            round_stochastic_keyed(values.clone(), master[where], key, where.start or 0)
        else:
            master[where].copy_(values)

    def reset_update_state(
        self, names: Iterable[str], scalars: Sequence[Mapping[str, Any]] = ()
    ) -> None:
        super().reset_update_state(names, scalars)
        self.own_histories.clear()
        self._state_changed()
        if self._low_precision is not None:
            self._low_precision.conform([m for s in self.groups for m in s.masters])

    def _own_param_scalars(self) -> Iterator[tuple[int, int, dict[str, Any] | None]]:
        first = 0
        for gi, group_state in enumerate(self.groups):
            for index, _, _, bucket, _ in group_state._pieces():
                apart, own = self.own_histories.of(gi, index)
                if apart:
                    yield first + index, gi, own
                else:
                    slot = self.inner.state.get(group_state.masters[bucket])
                    yield first + index, gi, stateful_scalars(slot)
            first += len(group_state.flat.params)

    def _load_param_scalars(self, found: Mapping[int, dict[str, Any] | None]) -> None:
        # A piece with scalars of its own leaves its chunk's history (flat/own_histories.py); its
        # per-element states are the chunk's, loaded already.
        first = 0
        for gi, group_state in enumerate(self.groups):
            on_device = _on_device(self.inner, gi)
            for index, _, _, bucket, _ in group_state._pieces():
                if first + index not in found:
                    continue
                given = found[first + index]
                master = group_state.masters[bucket]
                own = (
                    None
                    if given is None
                    else {n: placed_scalar(n, v, master, on_device) for n, v in given.items()}
                )
                self.own_histories.set(gi, index, own)
            first += len(group_state.flat.params)

    # --- state --------------------------------------------------------------------------------
    def _layout_facts(self) -> dict[str, Any]:
        return {
            "world_size": self.comm.world_size,
            "shards": self.shards,
            "rank": self.shard_rank,
            "numels": [[b.numel for b in s.flat.buckets] for s in self.groups],
        }

    STATE_FORMAT = "dtypeplan.flat/2"

    @_with_fp32_states
    def _param_state(self, index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
        """This rank's piece of each parameter: ``elements`` (begin, end of the flattened
        parameter), ``master`` and each state over those elements, and its scalar states
        (its chunk's, or its own: ``flat/own_histories.py``; none before its first gradient)."""
        state: dict[int, dict[str, Any]] = {}
        for gi, group_state in enumerate(self.groups):
            params = group_state.flat.params
            for index, begin, end, bucket, offset in group_state._pieces():
                master = group_state.masters[bucket]
                where = slice(offset, offset + end - begin)
                entry: dict[str, Any] = {"elements": (begin, end)}
                entry[keys.MASTER] = master[where].detach().clone()
                apart, own = self.own_histories.of(gi, index)
                if not (apart and own is None):
                    for name, value in self.inner.state.get(master, {}).items():
                        if is_scalar_state(value) and not apart:
                            entry[name] = value.clone() if torch.is_tensor(value) else value
                        elif is_element_state(value, master):
                            entry[name] = value[where].clone()
                    for name, value in (own or {}).items():
                        entry[name] = value.clone() if torch.is_tensor(value) else value
                    if self._low_precision is not None:
                        self._low_precision.save_codes(entry, master, offset, end - begin)
                state[index_of[id(params[index])]] = entry
        return state

    @_with_fp32_states
    def _load_param_state(self, state: dict[int, dict[str, Any]], index_of: dict[int, int]) -> None:
        self._state_changed()  # the loaded step counter is re-read at the next step
        for gi, group_state in enumerate(self.groups):
            params = group_state.flat.params
            for index, begin, end, bucket, offset in group_state._pieces():
                entry = state[index_of[id(params[index])]]
                assert tuple(entry["elements"]) == (begin, end), "layout checked by the caller"
                master = group_state.masters[bucket]
                where = slice(offset, offset + end - begin)
                master[where].copy_(entry[keys.MASTER])
                slot = self.inner.state.get(master, {})
                given = {n: v for n, v in entry.items() if n not in ("elements", keys.MASTER)}
                if slot and not given:
                    self.own_histories.set(gi, index, None)  # saved before its first gradient
                    continue
                scalars = {n: v for n, v in given.items() if is_scalar_state(v)}
                ours = {n: v for n, v in slot.items() if is_scalar_state(v)}
                if scalars.keys() == ours.keys() and all(
                    same_scalar(scalars[n], ours[n]) for n in scalars
                ):
                    load_slot(slot, entry, where)
                else:
                    # A piece with its own history: its scalars stay out of the chunk's.
                    load_slot(slot, {n: v for n, v in given.items() if n not in scalars}, where)
                    on_device = _on_device(self.inner, gi)
                    own = {n: placed_scalar(n, v, master, on_device) for n, v in scalars.items()}
                    self.own_histories.set(gi, index, own)
                if self._low_precision is not None:
                    self._low_precision.load_codes(entry, master, offset, end - begin)
        self.refresh_params()

    @_with_fp32_states
    def state_names(self) -> list[str]:
        """``master`` and the names of the optimizer states laid out like the master chunks.

        The names the ``param.{i}.{name}`` keys of :meth:`full_state` take (the step counter
        is a scalar, ``scalar.step``).
        """
        return element_state_names(self.inner, (m for s in self.groups for m in s.masters))

    def _gather_full(self, state: GroupState, chunks: list[torch.Tensor]) -> torch.Tensor:
        flat = state.flat
        full = torch.zeros(flat.numel, dtype=torch.float32, device=flat.buffer.device)
        for bucket, chunk in zip(flat.buckets, chunks, strict=True):
            target = flat.bucket_view(full, bucket)
            if self.shards > 1:
                # An offloaded chunk lives on the host; the collective runs on the device.
                self.shard_comm.all_gather(
                    target, chunk.to(target.device, torch.float32).contiguous(), torch.float32
                )
            else:
                target.copy_(chunk)
        return full

    @torch.no_grad()
    @_with_fp32_states
    def full_state(self) -> dict[str, torch.Tensor | float | int]:
        result: dict[str, torch.Tensor | float | int] = {}
        names = self.state_names()
        first = 0
        for state in self.groups:
            for name in names:
                if name == keys.MASTER:
                    chunks = [self.master_values(m) for m in state.masters]
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
        if self.shards > 1 and self.shard_comm.active:
            # A parameter's own scalar states are read where its pieces are: every rank's of
            # the shard group (the other groups hold the same pieces).
            parts: list[Any] = [None] * self.shard_comm.world_size
            dist.all_gather_object(parts, self.param_scalar_state(), group=self.shard_comm.group)
            for part in parts:
                result.update(part)
        return result

    @torch.no_grad()
    @_with_fp32_states
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
                    value = state[keys.param_key(first + index, name)]
                    assert isinstance(value, torch.Tensor), "checked by the caller's manifest"
                    view.copy_(value)
                chunks = [flat.chunk_view(full, b, self.shard_rank) for b in flat.buckets]
                for master, chunk in zip(group_state.masters, chunks, strict=True):
                    if name == keys.MASTER:
                        self.load_master_(master, chunk)
                    else:
                        self.inner.state[master][name].copy_(chunk)
            first += len(flat.params)
        self.load_param_scalars(state)
        self._load_scalar_state(state)
        self.refresh_params()


def _on_device(inner: torch.optim.Optimizer, group: int) -> bool:
    """Whether ``torch.optim`` keeps group ``group``'s step counters on the master's device."""
    settings = inner.param_groups[group]
    return bool(settings.get("fused") or settings.get("capturable"))
