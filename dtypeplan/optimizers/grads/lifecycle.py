"""What a training loop did to ``.grad`` between backward passes, read as torch would (ZeRO 0-2).

The flat engine holds each gradient in its accumulator and leaves a placeholder in ``.grad``
(``grads/owned.py``). A loop still clears ``.grad`` as in torch: ``model.zero_grad()`` or
``p.grad = None`` to drop a micro-batch whose loss is NaN, ``zero_grad(set_to_none=False)``
(which zeroes the placeholder, the one operation it allows), or a ``.grad`` set by hand in its
place. Each discards what was accumulated for that parameter. Before the first gradient of
every backward (a gradient pre-hook) and at ``step()`` / ``clip_grad_norm_``,
:func:`look_at_grads` compares ``.grad`` with what the accumulator holds:

* every held gradient dropped (None) or zeroed: the window restarts, as ``optimizer.zero_grad``
  would (any layout, any phase);
* some: their part of the accumulator is zeroed (``ReductionScheduler.drop_accumulated``;
  a sharded accumulator's part of this rank's chunk, so every rank must drop alike, as with
  DDP); after the backward that started the step's reduction that is refused, as the
  reduction has summed them over the ranks already.

After a step the placeholders are the gradients the step used up: where torch would use them
again (a backward adds to them, a step applies them again) the call is refused until
``zero_grad`` (README: departures from torch.optim).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from dtypeplan.errors import OptimizerUsageError
from dtypeplan.optimizers.buffers.group_state import GroupState
from dtypeplan.optimizers.grads.owned import OwnedGradient, is_owned_gradient
from dtypeplan.optimizers.grads.reduction import Phase, ReductionScheduler

__all__ = ["GradsLook", "look_at_grads"]


class GradsLook(NamedTuple):
    """What :func:`look_at_grads` found."""

    restart: list[torch.Tensor] | None
    """Every held gradient was dropped: restart the window, these parameters with a zero
    ``.grad`` (they were zeroed); None: no restart."""
    changed: bool
    """Some parameters' accumulation was dropped (a prepared step is stale)."""


def look_at_grads(
    reductions: ReductionScheduler,
    groups: Sequence[GroupState],
    zero_grads: Sequence[torch.Tensor],
    call: str,
) -> GradsLook:
    """Read ``.grad`` against what ``reductions`` holds (see the module's docstring); drops
    partial discards itself, refuses ``call`` where torch would reuse a step's gradients.
    ``zero_grads``: ``zero_grad(set_to_none=False)``'s zeros, still gradients of zero."""
    if reductions.after_step:
        used_up: list[torch.Tensor] = [
            p for s in groups for p in s.flat.params if is_owned_gradient(p.grad)
        ]
        zeroed_all = [p for p in used_up if type(p.grad) is OwnedGradient and p.grad.zeroed]
        if used_up and len(zeroed_all) == len(used_up):
            # model.zero_grad(set_to_none=False) after the step: torch's .grad are zeros now,
            # as optimizer.zero_grad(set_to_none=False) leaves them.
            reductions.after_step = False
            return GradsLook(zeroed_all, True)
        if used_up:
            raise OptimizerUsageError(
                f"{call} after step() without zero_grad(): dtypeplan's step() uses the "
                "gradients up at ZeRO 0-2 (as DeepSpeed's), where torch.optim keeps them in "
                ".grad, so that the next backward adds to them and a step() without backward "
                "applies them again; that would change the numbers, so it is refused. Call "
                "optimizer.zero_grad() (or model.zero_grad()) after each step() (README: "
                "departures from torch.optim)"
            )
        reductions.after_step = False
    nothing = GradsLook(None, False)
    if reductions.phase is Phase.EMPTY:
        return nothing
    dropped: list[tuple[int, int]] = []
    zeroed: list[tuple[int, int]] = []
    held = 0
    for gi, state in enumerate(groups):
        for pi, param in enumerate(state.flat.params):
            if not reductions.window_touched[gi][pi]:
                continue
            held += 1
            grad = param.grad
            if type(grad) is OwnedGradient:
                if grad.zeroed:
                    zeroed.append((gi, pi))
            elif not any(z is grad for z in zero_grads):
                dropped.append((gi, pi))  # None, or a .grad set by hand in its place
    if not dropped and not zeroed:
        return nothing
    if len(dropped) + len(zeroed) == held and all(
        groups[gi].flat.params[pi].grad is None for gi, pi in dropped
    ):
        return GradsLook([groups[gi].flat.params[pi] for gi, pi in zeroed], True)
    if reductions.phase not in (Phase.ACCUMULATED, Phase.ARMED):
        raise OptimizerUsageError(
            "some parameters' .grad were set to None, zeroed or replaced after the backward "
            "that started the step's gradient reduction (last_micro_batch=True, "
            "gradient_accumulation_steps, or clip_grad_norm_): that reduction has summed them "
            "over the ranks already. Drop them before that backward, or drop every gradient "
            "(model.zero_grad() / optimizer.zero_grad())"
        )
    for gi, pi in dropped + zeroed:
        reductions.drop_accumulated(gi, pi)
    for gi, pi in dropped:
        reductions.window_touched[gi][pi] = False
    for gi, pi in zeroed:
        placeholder = groups[gi].flat.params[pi].grad
        assert type(placeholder) is OwnedGradient
        placeholder.zeroed = False  # now a zero gradient the accumulator holds
    return GradsLook(None, True)
