"""Parameters without a gradient in a step are not updated, as in ``torch.optim``.

``torch.optim`` skips a parameter whose ``.grad`` is None: weight decay and momentum do not
move it, its states stay as they were. (DeepSpeed instead treats a missing gradient as zero,
so AdamW still decays it and momentum still carries it.) The flat engine updates whole master
chunks with one fused call, so it cannot leave a parameter out of the call; instead, for the
parameters that got no gradient in the accumulation window on *any* rank, it saves this
rank's elements of the master and of every optimizer state before the update and puts them
back after. That is the rare path; when every parameter got a gradient nothing is copied.

The optimizer's state is one per master chunk (a bucket holds many parameters), so a
parameter that skips a step leaves its chunk's history there: ``flat/own_histories.py`` keeps its
own scalar states (``step``...) from then on, or none where it never had a gradient, and
steps it on its own, so that its state is created at its first gradient and counts its own
steps, as in ``torch.optim``. The pieces held apart here are those and the untouched ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dtypeplan.optimizers.buffers.group_state import GroupState
from dtypeplan.optimizers.state.values import is_element_state

__all__ = ["keep_untouched"]


@contextlib.contextmanager
def keep_untouched(
    groups: list[GroupState],
    inner: torch.optim.Optimizer,
    untouched: list[list[int]],
) -> Iterator[bool]:
    """Around the update: restore the pieces of the ``untouched`` parameters (per group).

    Yields whether anything is kept (then the parameters must be written from the masters
    again, as the fused kernel wrote them from the updated ones).
    """
    saved: list[tuple[torch.Tensor, str | None, slice, torch.Tensor]] = []
    fresh: list[tuple[torch.Tensor, slice]] = []
    for state, indices in zip(groups, untouched, strict=True):
        if not indices:
            continue
        wanted = set(indices)
        for index, begin, end, bucket, offset in state._pieces():
            if index not in wanted:
                continue
            master = state.masters[bucket]
            where = slice(offset, offset + end - begin)
            saved.append((master, None, where, master[where].clone()))
            slot = inner.state.get(master, {})
            if not slot:
                fresh.append((master, where))
            for name, value in slot.items():
                if is_element_state(value, master):
                    saved.append((master, name, where, value[where].clone()))
    yield bool(saved)
    with torch.no_grad():
        for master, name, where, value in saved:
            (master if name is None else inner.state[master][name])[where].copy_(value)
        # States the step created: a parameter that never had a gradient has none, which
        # zero stands for (moments, momentum buffers).
        for master, where in fresh:
            for value in inner.state.get(master, {}).values():
                if is_element_state(value, master):
                    value[where].zero_()
