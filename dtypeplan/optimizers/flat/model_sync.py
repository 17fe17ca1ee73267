"""Picking up changes made to the model after the optimizer was built (flat engine).

The parameters are views of their group's flat buffer, and at 16-bit the fp32 master chunks
hold the values the next step starts from. Users change models behind the optimizer's back
in two ways, and ``torch.optim`` follows both, because it reads the parameters at every step:

* **rebinding**: ``param.data = t``, or ``model.float(); model.bfloat16()``, makes the
  parameter stop viewing the buffer. At ``step()`` a parameter of the same dtype and device is
  re-adopted: its values are copied into its view and ``param.data`` points back at the view.
  Another dtype or device cannot join the buffer: a clear error says how to rebuild.
* **in-place writes**: ``model.load_state_dict(...)``, ``p.copy_(...)`` write the buffer but not
  the masters, which the next step would write back over them. Each parameter's version
  counter (its own: ``param.data = view`` does not share the buffer's) moves with every
  in-place write through the parameter, and never with the optimizer's writes into the
  buffer. Where it moved (or the parameter was re-adopted), that parameter's masters are
  refreshed *elementwise*, where the parameter differs from the master rounded to the
  parameter dtype, so untouched elements keep their fp32 precision. fp32 parameters are
  their own masters: nothing to do. Where the parameters are the masters (bf16 master
  weights), a write replaces the master itself; its Kahan compensation belonged to the old
  value and is dropped, elementwise where the bits the compensation belongs to are known.

After a load (``optimizer.load_state_dict``, ``dtypeplan.checkpoint.load``) the masters, the
parameters and every compensation are the loaded ones, whatever the user wrote into the
parameters before: :meth:`ModelSync.after_load` takes the parameters' version counters anew
(torch's usual resume, ``model.load_state_dict`` first, then changes nothing) and keeps the
loaded bits until the next step, so a ``model.load_state_dict`` after the optimizer's load
drops a restored compensation only where it really changes a weight.

Also checked here, at the same host loop: a parameter that was frozen when the optimizer was
built (so it has no place in any flat buffer) and now trains raises a clear error.
"""

from __future__ import annotations

from typing import Any

import torch

from dtypeplan.errors import OptimizerUsageError
from dtypeplan.optimizers.buffers.group_state import GroupState
from dtypeplan.optimizers.state.keys import KAHAN_COMPENSATION

__all__ = ["ModelSync"]


class ModelSync:
    """Watches the flat groups' parameters and buffers between steps."""

    def __init__(
        self,
        groups: list[GroupState],
        param_groups: list[dict[str, Any]],
        optimizer_state: dict[torch.Tensor, dict[str, Any]] | None = None,
    ) -> None:
        self.groups = groups
        self.optimizer_state = optimizer_state if optimizer_state is not None else {}
        self.param_groups = param_groups
        self._in_buffers = {id(p) for s in groups for p in s.flat.params}
        self._versions = [[p._version for p in s.flat.params] for s in groups]
        # Views of the buffers never change: made once, not per step.
        self._views = [s.flat.param_views(s.flat.buffer) for s in groups]
        self._loaded_bits: list[list[torch.Tensor] | None] | None = None
        """Per group, per bucket: the aliased masters' bits as the last load left them (with
        Kahan compensation only), kept from a load to the next step's :meth:`pick_up`."""

    @torch.no_grad()
    def pick_up(self) -> None:
        """Before a step: re-adopt rebound parameters and refresh masters from written ones."""
        self._refuse_unfrozen()
        for gi, state in enumerate(self.groups):
            flat = state.flat
            versions = self._versions[gi]
            changed: set[int] = set()
            for index, (param, view) in enumerate(zip(flat.params, self._views[gi], strict=True)):
                if param.data_ptr() != view.data_ptr() or param.shape != view.shape:
                    self._readopt(gi, index, param, view)
                    changed.add(index)
                if param._version != versions[index]:
                    changed.add(index)
                    versions[index] = param._version
            if changed:
                loaded = self._loaded_bits[gi] if self._loaded_bits is not None else None
                self._refresh_masters(state, changed, self.optimizer_state, loaded)
        self._loaded_bits = None

    @torch.no_grad()
    def after_load(self) -> None:
        """After a load wrote the masters (and through them the parameters): they are the
        parameters' values now, so what was written into the parameters before is no change.

        A parameter rebound before the load points back at its view (the load's values are
        there); the version counters are taken anew. With Kahan-compensated masters that are
        the parameters, the loaded bits are kept (one copy of this rank's 16-bit masters) until
        the next step, to tell a later write of the same weights from a real change.
        """
        bits: list[list[torch.Tensor] | None] = []
        for gi, state in enumerate(self.groups):
            params = state.flat.params
            for index, (param, view) in enumerate(zip(params, self._views[gi], strict=True)):
                rebound = param.data_ptr() != view.data_ptr() or param.shape != view.shape
                if rebound and (param.dtype, param.device, param.shape) == (
                    view.dtype,
                    view.device,
                    view.shape,
                ):
                    param.data = view
                self._versions[gi][index] = param._version
            compensated = any(
                KAHAN_COMPENSATION in self.optimizer_state.get(master, {})
                for master in state.masters
            )
            bits.append([m.detach().clone() for m in state.masters] if compensated else None)
        self._loaded_bits = bits

    def _refuse_unfrozen(self) -> None:
        for gi, group in enumerate(self.param_groups):
            for position, param in enumerate(group["params"]):
                if param.requires_grad and id(param) not in self._in_buffers:
                    raise OptimizerUsageError(
                        f"parameter {position} of param group {gi} (shape "
                        f"{tuple(param.shape)}) was frozen when the optimizer was built, so it "
                        "has no place in the optimizer's flat buffers; build a new optimizer "
                        "after changing requires_grad"
                    )

    def _readopt(self, gi: int, index: int, param: torch.Tensor, view: torch.Tensor) -> None:
        flat = self.groups[gi].flat
        if param.dtype != flat.dtype or param.device != view.device or param.shape != view.shape:
            raise OptimizerUsageError(
                f"parameter {index} of param group {gi} was replaced after build by a "
                f"{param.dtype} tensor of shape {tuple(param.shape)} on {param.device}, but "
                f"the plan runs it as {flat.dtype} of shape {tuple(view.shape)} on "
                f"{view.device} (model.float(), .to(), param.data = ...); cast the model back, "
                "call plan.prepare_model(model) again or build a new optimizer"
            )
        view.copy_(param.data)
        param.data = view

    @staticmethod
    def _refresh_masters(
        state: GroupState,
        changed: set[int],
        optimizer_state: dict[torch.Tensor, dict[str, Any]],
        loaded: list[torch.Tensor] | None = None,
    ) -> None:
        """Take the parameters' values into this rank's masters where they differ.

        ``loaded``: per bucket, the masters' bits as a load left them (:meth:`after_load`), or
        None: where the parameters are the masters, a compensation is then kept where the
        bits are still the loaded ones, else it is dropped whole."""
        flat = state.flat
        for index, begin, end, bucket, offset in state._pieces():
            master = state.masters[bucket]
            if index not in changed:
                continue
            piece = master[offset : offset + end - begin]
            if master.untyped_storage().data_ptr() == flat.buffer.untyped_storage().data_ptr():
                # The parameters are the masters (fp32, or bf16 master weights); a Kahan
                # compensation belonged to the old values and is dropped with them.
                compensation = optimizer_state.get(master, {}).get(KAHAN_COMPENSATION)
                if compensation is None:
                    continue
                where = compensation[offset : offset + end - begin]
                if loaded is None:
                    where.zero_()
                    continue
                # Bits, not values: -0.0 and NaN payloads count as the weights they are.
                before = loaded[bucket][offset : offset + end - begin]
                differs = piece.view(torch.int16) != before.view(torch.int16)
                where.masked_fill_(differs, 0)
                continue
            # An offloaded master lives on the host: compare there.
            value = flat.params[index].detach().reshape(-1)[begin:end].to(piece.device)
            differs = value != piece.to(value.dtype)
            piece.copy_(torch.where(differs, value.float(), piece))
