"""Per-parameter optimizer state inside flat master chunks: torch's lifecycle, whatever the layout.

``torch.optim`` creates a parameter's state at its first gradient and advances its scalar
states (``step``, NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``) only in the steps where it
has a gradient, so a head that joins at the third step starts Adam's bias correction at 1. The
flat engine keeps one inner-optimizer state per master chunk (a bucket holds many parameters),
which is that lifecycle only while every parameter of the chunk steps together.

So a parameter's piece leaves its chunk's history the first time the chunk steps without it:
it keeps the chunk's scalar states as they were (or none, where the chunk had no state yet, as
a parameter that never had a gradient has none in torch). From then on the chunk's update
leaves the piece as it was (``missing.keep_untouched``), and the piece is stepped on its
own, by a ``torch.optim`` instance of the same class and arguments over views of its master
and of the chunk's per-element states: torch itself creates the state at the piece's first
gradient and counts its steps. Its per-element states stay in the chunk's tensors, where
``state_dict``, ``full_state`` and checkpoints read them; its scalar states are saved per
parameter (``param_scalar_state``), and a load gives them back to a piece that has left, in
whatever layout it loads (``_load_param_scalars``). A piece that has left stays on its own (a
small optimizer call per step for that parameter: the rare path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from dtypeplan.optimizers.buffers.group_state import GroupState
from dtypeplan.optimizers.state.keys import KAHAN_COMPENSATION
from dtypeplan.optimizers.state.values import is_element_state, is_scalar_state

__all__ = ["OwnHistories", "PendingPieces"]

PieceKey = tuple[int, int]
"""``(param group, parameter number in the group)``."""


class PendingPieces:
    """The pieces with their own history that get a gradient in this step, and their
    gradients, taken before the chunk update (fused kernels overwrite the gradients)."""

    def __init__(self) -> None:
        self.by_group: dict[int, list[tuple[int, torch.Tensor, slice, torch.Tensor]]] = {}
        """Per group: ``(parameter number, master chunk, where in it, scaled fp32 grad)``."""


class OwnHistories:
    """The pieces of this rank's master chunks whose state no longer follows their chunk's."""

    def __init__(self, torch_class: type[torch.optim.Optimizer], arguments: dict[str, Any]):
        self.torch_class = torch_class
        self.arguments = arguments
        """The inner optimizer's constructor arguments (Adagrad fills its state from them)."""
        self.scalars: dict[PieceKey, dict[str, Any] | None] = {}
        """Each piece's own scalar states; None where it has no state yet (no gradient)."""

    def __bool__(self) -> bool:
        return bool(self.scalars)

    def clear(self) -> None:
        """Every piece follows its chunk again (a load restores one state per chunk)."""
        self.scalars.clear()

    def of(self, group: int, index: int) -> tuple[bool, dict[str, Any] | None]:
        """Whether the piece has its own history, and its scalar states if so."""
        key = (group, index)
        return key in self.scalars, self.scalars.get(key)

    def set(self, group: int, index: int, scalars: dict[str, Any] | None) -> None:
        self.scalars[(group, index)] = scalars

    def held_apart(
        self,
        groups: list[GroupState],
        inner: torch.optim.Optimizer,
        untouched: list[list[int]],
        grads_by_group: list[list[torch.Tensor]],
        factor: torch.Tensor,
    ) -> tuple[list[list[int]], PendingPieces]:
        """Before the chunk update: the pieces it must leave as they are, per group.

        Pieces that still follow their chunk and get no gradient now leave its history with
        its scalar states as they are. Every piece with its own history is held apart; those
        with a gradient are returned with it (``grads * factor`` in fp32) for :meth:`step`.
        """
        pending = PendingPieces()
        apart: list[list[int]] = []
        for gi, (state, skipped) in enumerate(zip(groups, untouched, strict=True)):
            skipped_set = set(skipped)
            held: list[int] = []
            for index, begin, end, bucket, offset in state._pieces():
                key = (gi, index)
                if key not in self.scalars and index not in skipped_set:
                    continue
                held.append(index)
                master = state.masters[bucket]
                if key not in self.scalars:
                    # A Kahan compensation is the master's, not a state torch would create.
                    slot = inner.state.get(master, {})
                    stepped = any(n != KAHAN_COMPENSATION for n in slot)
                    self.scalars[key] = (
                        {n: _copy(v) for n, v in slot.items() if is_scalar_state(v)}
                        if stepped
                        else None
                    )
                if index in skipped_set:
                    continue
                where = slice(offset, offset + end - begin)
                grad = grads_by_group[gi][bucket][where]
                scaled = grad.to(master.device, torch.float32) * factor.to(master.device)
                pending.by_group.setdefault(gi, []).append((index, master, where, scaled))
            apart.append(held)
        return apart, pending

    @torch.no_grad()
    def step(
        self,
        inner: torch.optim.Optimizer,
        pending: PendingPieces,
        read: Callable[[torch.Tensor, slice], torch.Tensor],
        write: Callable[[torch.Tensor, slice, torch.Tensor, dict[str, Any]], None],
    ) -> None:
        """Step each pending piece on its own history (after the chunk update).

        ``read(master, where)``: the piece's weights in fp32 to update (a view of an fp32
        master, a copy of a 16-bit one); ``write(master, where, values, state)`` stores them
        back (``state``: the piece's own state after this step; stochastic rounding keys its
        noise on its ``step``, or adds and advances a ``rounding_step`` where the class keeps
        no step count, which then stays among the piece's scalar states).
        """
        for (gi, _), pieces in self._calls(pending).items():
            hyper = {k: v for k, v in inner.param_groups[gi].items() if k != "params"}
            views = [read(master, where) for _, master, where, _ in pieces]
            optimizer = self.torch_class([{**hyper, "params": views}], **self.arguments)
            for view, (index, master, where, grad) in zip(views, pieces, strict=True):
                view.grad = grad
                own = self.scalars[(gi, index)]
                if own is None:
                    continue  # torch creates the state at this first gradient
                state = {n: _copy(v) for n, v in own.items()}
                for name, value in inner.state.get(master, {}).items():
                    if is_element_state(value, master) and name != KAHAN_COMPENSATION:
                        # torch computes in fp32; 16-bit moments are stored back rounded.
                        state[name] = value[where].float()
                optimizer.state[view] = state
            optimizer.step()
            for view, (index, master, where, _) in zip(views, pieces, strict=True):
                view.grad = None
                write(master, where, view, optimizer.state[view])
                slot = inner.state[master]
                scalars: dict[str, Any] = {}
                for name, value in optimizer.state[view].items():
                    if is_element_state(value, view):
                        if name not in slot:
                            slot[name] = torch.zeros_like(master)
                        slot[name][where].copy_(value)
                    elif is_scalar_state(value):
                        scalars[name] = value
                self.scalars[(gi, index)] = scalars

    def _calls(
        self, pending: PendingPieces
    ) -> dict[tuple[int, bool], list[tuple[int, torch.Tensor, slice, torch.Tensor]]]:
        """The pending pieces by group and by whether they have a state yet: one optimizer
        call each (torch's fused SGD decides "first step" for a whole call from its first
        parameter)."""
        calls: dict[tuple[int, bool], list[tuple[int, torch.Tensor, slice, torch.Tensor]]] = {}
        for gi, pieces in pending.by_group.items():
            for piece in pieces:
                fresh = self.scalars[(gi, piece[0])] is None
                calls.setdefault((gi, fresh), []).append(piece)
        return calls

    def items(self) -> Iterator[tuple[PieceKey, Mapping[str, Any] | None]]:
        return iter(self.scalars.items())


def _copy(value: Any) -> Any:
    return value.detach().clone() if torch.is_tensor(value) else value
