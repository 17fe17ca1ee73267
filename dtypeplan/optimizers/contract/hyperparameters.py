"""Hyperparameters that stay the same on every rank after build, checked at every step.

Build checks that every rank was given the same param groups (``_check_ranks_agree``). After
that, a hyperparameter set on one rank only (an LR scheduler that one rank steps, a warm-up
written under ``if rank == 0``) would train the replicas apart without a word: each rank updates
its masters, or its shard of them, with its own ``lr``. So every step folds a fingerprint of
each param group's hyperparameters into the step's one summary all-reduce (the squared norm and
the touched flags, ``flat/engine.py`` / ``fsdp2/optimizer.py``): no collective is added, only
``world_size + 4 * keys * groups`` fp32 values.

The fingerprint (the hyperparameters are the torch class's arguments, the param groups' keys
at build: ``lr``, ``betas``, ``weight_decay``...; keys added later, such as a scheduler's
``initial_lr``, do not enter the update and are not compared):

* ``world_size`` slots: this rank writes a 24-bit digest of every group's hyperparameters
  into its own slot and zero into the others, so the sum holds every rank's digest exactly
  (integers below 2**24 are exact in fp32): which ranks differ, by rank.
* per param group and hyperparameter, two pairs ``d, d * d`` for small digests ``d`` of its
  value (in ``[1, 2**b]``, ``b`` chosen so the sums stay exact in fp32 whatever the world
  size): the sums satisfy ``world * sum(d*d) == sum(d)**2`` exactly when every rank has the
  same ``d`` (Cauchy-Schwarz), so every rank can name the group and hyperparameter.

Each group's values are hashed again only when one changed (compared by value; tensors by
identity).

Reading the sums never waits for the device: on the CPU they are there when the all-reduce
returns, and the step raises before its update, on every rank alike (every rank reads the same
sums). On an accelerator they are copied to pinned host memory after an event and checked when
the copy has completed (a later step), as the non-finite norm is (``factor.NormProbe``): the
error then comes a step or so late, and a rank that is still inside a collective when its peer
raises fails with the collective's timeout; a checkpoint save or ``state_dict()`` checks what
is still pending first. A tensor-valued hyperparameter (``lr`` as a
tensor) cannot be read on the host without a sync: its value is left out of the per-step
fingerprint (build compares it; a checkpoint saves each rank's own).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import torch

from dtypeplan.errors import RankMismatchError

__all__ = ["HyperparameterCheck"]

_EXACT = 1 << 24
"""fp32 holds every integer below this exactly: sums of the slots must stay below it."""

_DIGITS = 2
"""Independent digits per hyperparameter (from other bits of its digest): a differing value
goes unnamed only if every digit collides (2**-22 on 2 ranks, 2**-12 on 4096)."""


def _digest(value: Any) -> int:
    """A stable 64-bit digest of a hyperparameter value (floats by their exact repr)."""
    if torch.is_tensor(value):
        text = "tensor"  # read only with a sync: left out (module docstring)
    elif isinstance(value, (list, tuple)):
        text = "(" + ",".join(repr(v) for v in value) + ")"
    else:
        text = repr(value)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _ranges(ranks: list[int]) -> str:
    """``0, 1`` or, for runs of three or more, ``0-998`` (a large group stays readable)."""
    parts: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        if previous - start >= 2:
            parts.append(f"{start}-{previous}")
        else:
            parts += [str(r) for r in range(start, previous + 1)]
        if rank is not None:
            start = previous = rank
    return ", ".join(parts)


def _same(a: Any, b: Any) -> bool:
    """Whether a hyperparameter still has the value last fingerprinted (tensors: the same
    object; comparing their values would read them)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return a is b
    return type(a) is type(b) and bool(a == b)


def _describe(value: Any) -> str:
    return "a tensor" if torch.is_tensor(value) else repr(value)


class HyperparameterCheck:
    """Each step's fingerprint slots of the param groups, and the check of their sums."""

    def __init__(
        self,
        param_groups: Sequence[dict[str, Any]],
        keys: Sequence[str],
        world_size: int,
        rank: int,
    ) -> None:
        self.param_groups = param_groups
        self.keys = sorted(keys)
        self.world_size = world_size
        self.rank = rank
        self.active = world_size > 1
        self.enabled = True
        """Off: no slots are sent (a test that counts host reads turns it off, as it does the
        non-finite probe: on the CPU reading the sums waits for nothing)."""
        # Per-hyperparameter digits: world * (2**b)**2 must stay below 2**24.
        self._bits = max(1, (24 - math.ceil(math.log2(max(world_size, 2)))) // 2)
        self._pending: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._cache: list[tuple[list[Any], list[int]]] = []
        """Per group: the values last fingerprinted and their digests (hashed again only when
        a value changes: a scheduler changes ``lr``, the rest stay)."""

    @property
    def numel(self) -> int:
        """Slots this check adds to the summary (0 on one rank, or when off)."""
        if not (self.active and self.enabled):
            return 0
        return self.world_size + len(self.param_groups) * len(self.keys) * 2 * _DIGITS

    def _digests(self, index: int, group: dict[str, Any]) -> list[int]:
        values = [group.get(key) for key in self.keys]
        if index < len(self._cache):
            cached, digests = self._cache[index]
            if all(_same(a, b) for a, b in zip(values, cached, strict=True)):
                return digests
        digests = [_digest((key, value)) for key, value in zip(self.keys, values, strict=True)]
        # A list changed in place must not look unchanged: keep a copy.
        entry = ([list(v) if isinstance(v, list) else v for v in values], digests)
        if index < len(self._cache):
            self._cache[index] = entry
        else:
            self._cache.append(entry)
        return digests

    def slots(self) -> list[float]:
        """This rank's slots, in the summary's order (host floats, sent with the flags):
        ``world_size`` slots (this rank's digest of every group in its own, zeros elsewhere),
        then per group, per hyperparameter, ``_DIGITS`` pairs ``d, d * d``."""
        if not self.numel:
            return []
        per_group = [self._digests(i, group) for i, group in enumerate(self.param_groups)]
        mine = [0.0] * self.world_size
        mine[self.rank] = float(_digest(tuple(map(tuple, per_group))) % (_EXACT - 1) + 1)
        out = mine
        mask = (1 << self._bits) - 1
        for digests in per_group:
            for digest in digests:
                for digit in range(_DIGITS):
                    d = (digest >> (digit * 16)) & mask
                    out += [float(d + 1), float((d + 1) * (d + 1))]
        return out

    def post(self, reduced: torch.Tensor) -> None:
        """Take the step's reduced slots (a device tensor); check them now on the CPU, else
        when their copy to the host has completed. Raises :class:`RankMismatchError`."""
        if not self.numel:
            return
        if reduced.device.type == "cpu":
            self._pending.append((reduced, None))
        else:
            host = torch.empty(reduced.shape, dtype=reduced.dtype, pin_memory=True)
            host.copy_(reduced, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((host, event))
        while self._pending:
            values, copied = self._pending[0]
            if copied is not None and not copied.query():
                return
            self._pending.pop(0)
            self._check(values.tolist())

    def flush(self) -> None:
        """Check every posted step's sums now, waiting for their copies (a checkpoint save,
        which syncs anyway, calls it: no step's difference goes unreported into a save)."""
        pending, self._pending = self._pending, []
        for values, copied in pending:
            if copied is not None:
                copied.synchronize()
            self._check(values.tolist())

    def _check(self, sums: list[float]) -> None:
        by_rank = [round(v) for v in sums[: self.world_size]]
        if len(set(by_rank)) <= 1:
            return
        ranks: dict[int, list[int]] = {}
        for rank, digest in enumerate(by_rank):
            ranks.setdefault(digest, []).append(rank)
        sets = " | ".join(
            ("ranks " if len(members) > 1 else "rank ") + _ranges(members)
            for members in sorted(ranks.values())
        )
        digits = [round(v) for v in sums[self.world_size :]]
        per_key = 2 * _DIGITS
        problems = []
        for index, group in enumerate(self.param_groups):
            differing = []
            for k, key in enumerate(self.keys):
                at = (index * len(self.keys) + k) * per_key
                pairs = digits[at : at + per_key]
                # Cauchy-Schwarz: world * sum(d*d) == sum(d)**2 only when every d is the same.
                if any(
                    self.world_size * pairs[j + 1] != pairs[j] ** 2 for j in range(0, per_key, 2)
                ):
                    differing.append(key)
            if differing:
                mine = ", ".join(f"{key}={_describe(group.get(key))}" for key in differing)
                problems.append(
                    f"param group {index}: {', '.join(differing)} differs "
                    f"(rank {self.rank} has {mine})"
                )
        found = (
            "; ".join(problems)
            if problems
            else (
                "a hyperparameter of some param group (its per-value fingerprints collided; "
                "compare the param groups' values on these ranks)"
            )
        )
        raise RankMismatchError(
            "hyperparameters changed after build differ between the ranks of the data-parallel "
            f"group, which would train the replicas apart: {found}; the ranks hold these sets "
            f"of values: {sets}. Set them alike on every rank (step every LR scheduler on every "
            "rank; do not change param_groups under a rank condition)"
        )
