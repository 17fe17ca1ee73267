"""What an optimizer gives to a checkpoint and takes from it, as :class:`Flat` pieces.

An adapter lists the trainable parameters' shapes and state names, hands out the pieces to
save, allocates staging pieces to load into, and commits them into the optimizer at the end
(so a load that fails before then leaves the optimizer as it was). Both adapters key every
tensor ``param.{i}.{name}``, 1-D, of the parameter's ``numel``; so either reads what the
other wrote.
"""

from __future__ import annotations

from typing import Any

import torch

from dtypeplan.checkpoint._planners import Flat
from dtypeplan.optimizers._base import MixedPrecisionOptimizer
from dtypeplan.optimizers._engine import FlatMixedPrecisionOptimizer

__all__ = ["Adapter", "FlatAdapter", "FullStateAdapter", "adapter_for"]


def _numel(shape: list[int]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def _empty_flats(names: list[str], shapes: list[list[int]]) -> dict[str, Flat]:
    """A :class:`Flat` without pieces for every state ``name`` of every parameter."""
    return {
        f"param.{i}.{name}": Flat(_numel(shape)) for name in names for i, shape in enumerate(shapes)
    }


def _is_adam(opt: MixedPrecisionOptimizer) -> bool:
    return issubclass(opt.plan.optimizer.torch_class, (torch.optim.Adam, torch.optim.AdamW))


class FlatAdapter:
    """Per-rank pieces of a :class:`FlatMixedPrecisionOptimizer`'s shard (sharded I/O)."""

    layout = "sharded"

    def __init__(self, opt: FlatMixedPrecisionOptimizer) -> None:
        self.opt = opt

    def _walk(self) -> list[tuple[int, int, torch.Tensor, int, int]]:
        """``(global index, offset in the flat parameter, master chunk, offset in it, length)``."""
        out = []
        first = 0
        for state in self.opt.groups:
            flat = state.flat
            shard_offsets = flat.shard_offsets()
            for index in range(len(flat.params)):
                where = flat.param_chunk_ranges(index, self.opt.shard_rank)
                if where is not None:
                    begin, end, shard_offset = where
                    bucket = flat.bucket_of[index]
                    local = shard_offset - shard_offsets[bucket]
                    out.append((first + index, begin, state.masters[bucket], local, end - begin))
            first += len(flat.params)
        return out

    def shapes(self) -> list[list[int]]:
        return [list(p.shape) for state in self.opt.groups for p in state.flat.params]

    def state_names(self) -> list[str]:
        names = ["master"]
        for state in self.opt.groups:
            for master in state.masters:
                for key, value in self.opt.inner.state.get(master, {}).items():
                    if (
                        key != "step"
                        and torch.is_tensor(value)
                        and value.numel() == master.numel()
                        and key not in names
                    ):
                        names.append(key)
        return names

    def save_pieces(self, names: list[str]) -> dict[str, Flat]:
        flats = _empty_flats(names, self.shapes())
        for index, begin, master, local, length in self._walk():
            slot = self.opt.inner.state.get(master, {})
            for name in names:
                if name == "master":
                    source = master
                elif name in slot:
                    source = slot[name]
                else:
                    # A state this rank has not created yet is still zero (as in full_state).
                    source = torch.zeros_like(master)
                flats[f"param.{index}.{name}"].pieces.append(
                    (begin, source[local : local + length])
                )
        return flats

    def scalars(self) -> dict[str, Any]:
        steps = [v["step"] for v in self.opt.inner.state.values() if "step" in v]
        return {
            "step": int(steps[0].item()) if steps else 0,
            "loss_scale": float(self.opt.scaler.scale),
            "skipped_steps": int(self.opt.skipped_steps),
            "scaler_enabled": bool(self.opt.scaler.enabled),
            "scaler": dict(self.opt.scaler.state_dict()),
        }

    def load_targets(self, names: list[str], shapes: list[list[int]]) -> dict[str, Flat]:
        flats = _empty_flats(names, shapes)
        for index, begin, master, _local, length in self._walk():
            for name in names:
                staging = torch.empty(length, dtype=torch.float32, device=master.device)
                flats[f"param.{index}.{name}"].pieces.append((begin, staging))
        return flats

    @torch.no_grad()
    def commit(self, flats: dict[str, Flat], names: list[str], scalars: dict[str, Any]) -> None:
        opt = self.opt
        inner = opt.inner
        step = int(scalars["step"])
        stateful = [name for name in names if name != "master"]
        for state, group in zip(opt.groups, inner.param_groups, strict=True):
            on_device = bool(group.get("fused") or group.get("capturable"))
            for master in state.masters:
                inner.state.pop(master, None)
                if not stateful:
                    continue
                slot = inner.state[master]
                for name in stateful:
                    slot[name] = torch.zeros_like(master)
                if _is_adam(opt):
                    device = master.device if on_device else torch.device("cpu")
                    slot["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)
        pieces = {key: dict(flat.pieces) for key, flat in flats.items()}
        for index, begin, master, local, length in self._walk():
            for name in names:
                target = master if name == "master" else inner.state[master][name]
                target[local : local + length].copy_(pieces[f"param.{index}.{name}"][begin])
        opt.skipped_steps = int(scalars["skipped_steps"])
        if opt.scaler.enabled and scalars.get("scaler_enabled"):
            opt.scaler.load_state_dict(scalars["scaler"])
        opt._write_back()


class FullStateAdapter:
    """Any :class:`MixedPrecisionOptimizer`, through its layout-free full state."""

    layout = "full"

    def __init__(self, opt: MixedPrecisionOptimizer) -> None:
        self.opt = opt
        self._full: dict[str, Any] | None = None
        self._shapes: list[list[int]] | None = None

    def _state(self) -> dict[str, Any]:
        if self._full is None:
            self._full = self.opt.full_state()
        return self._full

    def shapes(self) -> list[list[int]]:
        if self._shapes is None:
            template = self._full if self._full is not None else self.opt.full_state_template()
            count = sum(
                1 for key in template if key.startswith("param.") and key.endswith(".master")
            )
            self._shapes = [list(template[f"param.{i}.master"].shape) for i in range(count)]
        return self._shapes

    def state_names(self) -> list[str]:
        names = ["master"]
        for key in self._state():
            if key.startswith("param."):
                name = key.split(".", 2)[2]
                if name not in names:
                    names.append(name)
        return names

    def save_pieces(self, names: list[str]) -> dict[str, Flat]:
        state = self._state()
        flats = _empty_flats(names, self.shapes())
        for key, flat in flats.items():
            flat.pieces.append((0, state[key].detach().float().reshape(-1)))
        return flats

    def scalars(self) -> dict[str, Any]:
        state = self._state()
        scaler = {
            k[len("scalar.scaler.") :]: v
            for k, v in state.items()
            if k.startswith("scalar.scaler.")
        }
        return {
            "step": int(state.get("scalar.step", 0)),
            "loss_scale": float(state.get("scalar.loss_scale", 1.0)),
            "skipped_steps": int(state.get("scalar.skipped_steps", 0)),
            "scaler_enabled": self.opt.plan.param_dtype == torch.float16,
            "scaler": scaler,
        }

    def load_targets(self, names: list[str], shapes: list[list[int]]) -> dict[str, Flat]:
        flats = _empty_flats(names, shapes)
        for flat in flats.values():
            flat.pieces.append((0, torch.empty(flat.numel)))
        return flats

    def commit(self, flats: dict[str, Flat], names: list[str], scalars: dict[str, Any]) -> None:
        shapes = self.shapes()
        state: dict[str, Any] = {}
        for key, flat in flats.items():
            index = int(key.split(".", 2)[1])
            state[key] = flat.pieces[0][1].view(shapes[index])
        state["scalar.step"] = int(scalars["step"])
        state["scalar.skipped_steps"] = int(scalars["skipped_steps"])
        if scalars.get("scaler_enabled") and self.opt.plan.param_dtype == torch.float16:
            state["scalar.loss_scale"] = float(scalars["loss_scale"])
            for key, value in scalars["scaler"].items():
                state[f"scalar.scaler.{key}"] = value
        self.opt.load_full_state(state)


Adapter = FlatAdapter | FullStateAdapter


def adapter_for(opt: MixedPrecisionOptimizer) -> Adapter:
    if isinstance(opt, FlatMixedPrecisionOptimizer):
        return FlatAdapter(opt)
    return FullStateAdapter(opt)
