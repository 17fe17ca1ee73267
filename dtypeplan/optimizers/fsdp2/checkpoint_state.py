"""The state half of the ZeRO-3 optimizer: its ``state_dict``, shard pieces and full state.

:class:`FSDP2State` is what ``state_dict``, :meth:`full_state` and ``dtypeplan.checkpoint``
read and write of ``FSDP2Optimizer`` (``fsdp2/optimizer.py``, the step half), as
``flat/checkpoint_state.py`` is the flat engine's. The master weights are the sharded
parameters themselves: each local shard is one master and the inner optimizer's key for its
states, so a parameter's state is one contiguous piece of its flattened values on each rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dtypeplan.comm import Communicator
from dtypeplan.errors import NotSupportedError
from dtypeplan.optimizers.contract.base import MixedPrecisionOptimizer
from dtypeplan.optimizers.fsdp2.sharding import HybridGroups, gatherable, mesh_compute_device
from dtypeplan.optimizers.state import keys
from dtypeplan.optimizers.state.keys import KAHAN_COMPENSATION
from dtypeplan.optimizers.state.values import (
    ShardPiece,
    element_state_names,
    is_element_state,
    is_scalar_state,
    load_slot,
    placed_scalar,
    stateful_scalars,
)
from dtypeplan.optimizers.update.pieces import LowPrecisionAdamUpdate

__all__ = ["FSDP2State"]


def _row_numel(shape: torch.Size) -> int:
    """Elements in one index of dim 0 of a tensor of ``shape``."""
    numel = 1
    for size in shape[1:]:
        numel *= size
    return numel


class FSDP2State(MixedPrecisionOptimizer):
    """The state half of ZeRO-3 on FSDP2 (``FSDP2Optimizer`` is the step half)."""

    comm: Communicator
    layout: HybridGroups | None
    sharded: list[list[DTensor]]
    """Per param group, its trainable sharded parameters (DTensors)."""
    locals: list[list[torch.Tensor]]
    """Per param group, the masters the inner optimizer updates: the local shards, or with
    the optimizer alone offloaded their fp32 host copies (same shapes)."""
    _low_precision: LowPrecisionAdamUpdate | None

    def _params(self) -> list[DTensor]:
        return [p for group in self.sharded for p in group]

    def _locals(self) -> list[torch.Tensor]:
        return [t for group in self.locals for t in group]

    # --- state --------------------------------------------------------------------------------
    STATE_FORMAT = "dtypeplan.fsdp2/2"

    def _layout_facts(self) -> dict[str, Any]:
        facts = {"world_size": self.comm.world_size, "rank": self.comm.rank}
        if self.layout is not None:
            facts["shard_group_size"] = self.layout.shard_size
        return facts

    def fp32_states(self) -> contextlib.AbstractContextManager[None]:
        """Quantized (int8 / fp8) moments held as fp32 values shaped like their local shards
        while the block runs, stored back in their dtypes after (untouched ones keep their
        codes): what the per-parameter state code below and the checkpoint adapters read."""
        if self._low_precision is None:
            return contextlib.nullcontext()
        return self._low_precision.fp32_view(self._locals())

    def _param_state(self, index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
        """This rank's shard of each parameter: ``master`` and each state, and ``step``."""
        with self.fp32_states():
            return self._param_state_fp32(index_of)

    def _param_state_fp32(self, index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
        state: dict[int, dict[str, Any]] = {}
        for param, local in zip(self._params(), self._locals(), strict=True):
            entry: dict[str, Any] = {keys.MASTER: local.detach().clone()}
            for name, value in self.inner.state.get(local, {}).items():
                entry[name] = value.clone() if torch.is_tensor(value) else value
            if self._low_precision is not None:
                self._low_precision.save_codes(entry, local, 0, local.numel())
            state[index_of[id(param)]] = entry
        return state

    def _load_param_state(self, state: dict[int, dict[str, Any]], index_of: dict[int, int]) -> None:
        with self.fp32_states():
            for param, local in zip(self._params(), self._locals(), strict=True):
                entry = state[index_of[id(param)]]
                local.copy_(entry[keys.MASTER])
                load_slot(self.inner.state.get(local, {}), entry)
                if self._low_precision is not None:
                    self._low_precision.load_codes(entry, local, 0, local.numel())
        self.refresh_params()

    # --- sharded state, for checkpoints that never gather ---------------------------------------
    def shard_pieces(self) -> list[ShardPiece]:
        """Where this rank's local shards hold each parameter, in ``param.{i}`` numbering.

        FSDP2 shards every parameter on dim 0, so a local shard is one contiguous range of the
        flattened parameter: one piece per parameter, ``master`` the local shard (the inner
        optimizer's key for its states; use ``master.view(-1)`` for flat indexing). A rank
        may hold an empty piece of a small parameter. This is what a ZeRO-3 checkpoint saves
        and loads without gathering (``dtypeplan.checkpoint``).
        """
        pieces = []
        for index, (param, local) in enumerate(zip(self._params(), self._locals(), strict=True)):
            # Hybrid: (Replicate(), Shard(0)); the replicas hold the same pieces.
            if any(not (pl.is_shard(dim=0) or pl.is_replicate()) for pl in param.placements):
                raise NotSupportedError(
                    f"ZeRO-3 parameter {index} is not sharded on dim 0 ({param.placements}); "
                    "dtypeplan's sharded checkpoint reads FSDP2's default dim-0 sharding only"
                )
            local_shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements
            )
            assert tuple(local_shape) == tuple(local.shape) and local.is_contiguous()
            begin = offset[0] * _row_numel(param.shape) if param.dim() else 0
            pieces.append(ShardPiece(index, begin, begin + local.numel(), local, 0))
        return pieces

    def state_names(self) -> list[str]:
        """``master`` and the optimizer states laid out like the local shards (``exp_avg``...).

        A Kahan compensation is no name of its own: it is folded into the master's values.
        """
        with self.fp32_states():  # a quantized moment is laid out like its shard in there
            return element_state_names(self.inner, self._locals())

    def reset_update_state(
        self, names: Iterable[str], scalars: Sequence[Mapping[str, Any]] = ()
    ) -> None:
        super().reset_update_state(names, scalars)
        if self._low_precision is not None:
            self._low_precision.conform(self._locals())

    def _own_param_scalars(self) -> Iterator[tuple[int, int, dict[str, Any] | None]]:
        # Each local shard is its own master: torch.optim counts each parameter's steps.
        index = 0
        for gi, group in enumerate(self.locals):
            for local in group:
                yield index, gi, stateful_scalars(self.inner.state.get(local))
                index += 1

    def _load_param_scalars(self, found: Mapping[int, dict[str, Any] | None]) -> None:
        index = 0
        for gi, group in enumerate(self.locals):
            settings = self.inner.param_groups[gi]
            on_device = bool(settings.get("fused") or settings.get("capturable"))
            for local in group:
                if index in found:
                    given = found[index]
                    slot = self.inner.state[local]
                    # No state yet: torch creates it at the first gradient. A Kahan
                    # compensation is the master's, not the optimizer's: it stays.
                    for name in [n for n in slot if n != KAHAN_COMPENSATION]:
                        if given is None or is_scalar_state(slot[name]):
                            del slot[name]
                    for name, value in (given or {}).items():
                        slot[name] = placed_scalar(name, value, local, on_device)
                    if not slot:
                        del self.inner.state[local]
                index += 1

    def refresh_params(self) -> None:
        """Nothing to write here: the sharded parameters are the master weights (FSDP2 gathers
        them), or, with the optimizer alone offloaded, the step half copies the host masters
        into them."""

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor | float | int]:
        """The full state on every rank (collective), gathered one tensor at a time to CPU.

        Each tensor is gathered on the device and moved to host memory before the next one,
        so a GPU holds the local shards plus one full tensor. ``dtypeplan.checkpoint`` does
        not call this at ZeRO-3: it saves the local shards (:meth:`shard_pieces`).
        """
        with self.fp32_states():
            return self._full_state_fp32()

    def _full_state_fp32(self) -> dict[str, torch.Tensor | float | int]:
        result: dict[str, torch.Tensor | float | int] = {}
        for index, (param, local) in enumerate(zip(self._params(), self._locals(), strict=True)):
            values = {keys.MASTER: self.master_values(local)}
            for name, value in self.inner.state.get(local, {}).items():
                if is_element_state(value, local) and name != KAHAN_COMPENSATION:
                    values[name] = value
            for name, value in values.items():
                whole = DTensor.from_local(
                    value,
                    param.device_mesh,
                    param.placements,
                    shape=param.shape,
                    stride=param.stride(),
                )
                gathered = gatherable(whole).full_tensor()
                result[keys.param_key(index, name)] = gathered.float().cpu()
        result.update(self._scalar_state())
        return result

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor | float | int]) -> None:
        with self.fp32_states():
            self._load_full_state_fp32(state)
        # Outside the fp32 view: a parameter without a state yet loses its zeroed moments.
        self.load_param_scalars(state)

    def _load_full_state_fp32(self, state: dict[str, torch.Tensor | float | int]) -> None:
        names = keys.param_state_names(state)
        self.reset_update_state(
            [n for n in names if n != keys.MASTER], self.group_scalars_from(state)
        )
        for index, (param, local) in enumerate(zip(self._params(), self._locals(), strict=True)):
            for name in names:
                saved = state[keys.param_key(index, name)]
                assert isinstance(saved, torch.Tensor), "full_state holds tensors per parameter"
                mesh = param.device_mesh
                # reshape: a former scalar is held as a 1-element parameter (sharding.py).
                full = saved.to(mesh_compute_device(mesh), torch.float32).reshape(param.shape)
                shard = distribute_tensor(full, mesh, param.placements).to_local()
                shard = shard.to(local.device)  # host memory under CPUOffloadPolicy
                if name == keys.MASTER:
                    self.load_master_(local, shard)
                else:
                    self.inner.state[local][name].copy_(shard)
        self._load_scalar_state(state)
