"""Every OK combination of the table within the values a user chooses.

The space a user chooses from is the product of the choice dimensions (:data:`CHOICES`: the
stage, the dtypes of parameters, accumulator, wire and masters with their rounding, the states,
autocast, the layout with its wire across, offload, fp8 and its recipe, ...), with the optimizer
class fixing the ``optimizer`` and ``state_kind`` dimensions. That product has tens of millions
of points and :meth:`RuleTable.lookup` takes about 10 us, so the points are not looked up one
by one. The table decides a point by a walk that reads a few of its dimensions, and the rule it
reaches decides every point that agrees on the values read. :func:`ok_points` therefore looks
up one point, records which free dimensions the lookup read (:class:`_ReadRecorder`), and then
branches only on those: for the ``i``-th dimension read, each of its other values, with the
values read before it fixed (a depth-first walk of the table's own decision tree, seen from
outside through ``lookup``). Each lookup yields one *box* of points: the values read are fixed,
every other dimension is free. Only the OK boxes are kept.

Two steps of ``lookup`` copy the point rather than read it, and the copies are not recorded:
the *core* of the point (the core dimensions with every feature unused, whose Error overrules
any feature) and a deferring rule's point (``decide_as``: fp8 compute decided as without it).
The core dimensions are therefore fixed in an outer loop (432 cores, Error cores dropped with
one lookup each), and a deferral is followed by a recorded lookup of the point it defers to.
``tests/test_planner.py`` checks the boxes against a lookup of every point of a sub-space.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dtypeplan.resolver import DIMENSIONS, RuleTable, Status
from dtypeplan.resolver._dimensions import CORE_DIMENSIONS, FEATURES_UNUSED

__all__ = ["CHOICES", "Box", "choice_space", "ok_points"]

_NOT_CHOSEN = {
    "pipeline": "the caller's parallelism (resolve(pipeline_parallel=...)), not a config value",
    "params": "fp16+bf16 is a contradiction, never a choice",
    "fp8_execution": "fixed to native: the fleet's GPUs run the recipe's kernels",
    "optimizer": "fixed by the optimizer class",
    "state_kind": "fixed by the optimizer class",
    "param_access": "fixed by the optimizer class",
}
"""Dimensions not enumerated over all their values, and why."""


def _choices() -> dict[str, tuple[Any, ...]]:
    chosen: dict[str, tuple[Any, ...]] = {}
    for name, dim in DIMENSIONS.items():
        if name in ("params", "accum", "comm"):
            # bf16 before fp16: of two combinations of equal cost the planner keeps the first,
            # and bf16 needs no loss scaling. (fp16+bf16 is a contradiction, never a choice.)
            chosen[name] = ("fp32", "bf16", "fp16")
        elif name in _NOT_CHOSEN:
            continue
        elif name in ("offload_optimizer", "offload_param"):
            # NVMe has no byte model (plan.memory() refuses it): the planner cannot size it.
            chosen[name] = ("none", "cpu")
        else:
            chosen[name] = dim.values
    return chosen


CHOICES: Mapping[str, tuple[Any, ...]] = _choices()
"""The values enumerated per dimension (every value a user can set in a config)."""


@dataclass(frozen=True)
class Box:
    """Points the table decides alike: ``fixed`` values, every other choice dimension free."""

    fixed: Mapping[str, Any]
    free: Mapping[str, tuple[Any, ...]]
    rule_id: str
    implementation: str | None

    def points(self) -> Iterator[dict[str, Any]]:
        names = list(self.free)
        for values in itertools.product(*self.free.values()):
            yield {**self.fixed, **dict(zip(names, values, strict=True))}

    @property
    def size(self) -> int:
        size = 1
        for values in self.free.values():
            size *= len(values)
        return size


class _ReadRecorder(dict[str, Any]):
    """A point that records, in order, which of the ``free`` dimensions a lookup reads.

    A dict subclass that keeps ``__iter__``: ``{**point}`` copies its storage without calling
    ``__getitem__`` (the copies ``lookup`` makes are handled by the caller; see the module
    docstring)."""

    def __init__(self, values: Mapping[str, Any], free: Container[str]) -> None:
        super().__init__(values)
        self.free = free
        self.read: list[str] = []

    def __getitem__(self, name: str) -> Any:
        if name in self.free and name not in self.read:
            self.read.append(name)
        return super().__getitem__(name)


def choice_space(
    fixed: Mapping[str, Any], overrides: Mapping[str, Sequence[Any]] | None = None
) -> dict[str, tuple[Any, ...]]:
    """The values enumerated per dimension: :data:`CHOICES` with ``overrides`` (a narrower
    set, e.g. no hybrid layout on one node), less the dimensions ``fixed`` holds."""
    space = {name: tuple(values) for name, values in CHOICES.items()}
    for name, values in (overrides or {}).items():
        space[name] = tuple(values)
    return {name: values for name, values in space.items() if name not in fixed}


def ok_points(
    table: RuleTable,
    fixed: Mapping[str, Any],
    space: Mapping[str, tuple[Any, ...]],
    progress: Callable[[str], None] | None = None,
) -> list[Box]:
    """The OK boxes of ``space`` (dimension -> values) with ``fixed`` values on the others."""
    base = {name: dim.default_value for name, dim in DIMENSIONS.items()}
    base.update(FEATURES_UNUSED)
    base.update(fixed)
    core_names = [n for n in CORE_DIMENSIONS if n in space]
    feature_space = {n: v for n, v in space.items() if n not in CORE_DIMENSIONS}
    boxes: list[Box] = []
    cores = list(itertools.product(*(space[n] for n in core_names)))
    for i, core_values in enumerate(cores):
        core = {**base, **dict(zip(core_names, core_values, strict=True))}
        if progress is not None and i % 24 == 0:
            progress(f"enumerating the table: core {i + 1}/{len(cores)}, {len(boxes)} OK boxes")
        if table.lookup(core).status == Status.ERROR:
            continue  # a core Error decides every point with these core values
        chosen_core = {n: core[n] for n in core_names}
        _walk(table, core, feature_space, chosen_core, boxes)
    _check_sample(table, base, space, boxes)
    return boxes


def _check_sample(
    table: RuleTable,
    base: Mapping[str, Any],
    space: Mapping[str, tuple[Any, ...]],
    boxes: Sequence[Box],
    samples: int = 256,
) -> None:
    """Look up ``samples`` points of ``space`` drawn at random (a fixed seed) one by one: each
    must be in a box exactly when the table says OK, with the box's rule. The shortcut of
    recording reads holds while ``lookup`` reads a point by subscript; a table that reads it
    another way would make the boxes wrong, and this says so instead of planning with them."""
    import random

    draw = random.Random(0)
    names = list(space)
    by_core: dict[tuple[Any, ...], list[Box]] = {}
    core_names = [n for n in CORE_DIMENSIONS if n in space]
    for box in boxes:
        by_core.setdefault(tuple(box.fixed[n] for n in core_names), []).append(box)
    for _ in range(samples):
        point = {**base, **{n: draw.choice(space[n]) for n in names}}
        rule = table.lookup(point)
        holding = [
            box
            for box in by_core.get(tuple(point[n] for n in core_names), [])
            if all(point[n] == v for n, v in box.fixed.items())
            and all(point[n] in v for n, v in box.free.items())
        ]
        found = holding[0].rule_id if len(holding) == 1 else None
        expected = rule.id if rule.status == Status.OK else None
        if len(holding) > 1 or found != expected:
            raise RuntimeError(
                f"the planner's enumeration disagrees with RuleTable.lookup at {point}: the "
                f"table says {rule.status} ({rule.id}), the boxes {found or 'not OK'}; the "
                "table's lookup reads points in a way enumeration.py does not record"
            )


def _walk(
    table: RuleTable,
    base: Mapping[str, Any],
    space: Mapping[str, tuple[Any, ...]],
    fixed: dict[str, Any],
    boxes: list[Box],
) -> None:
    free = [n for n in space if n not in fixed]
    values = {**base, **fixed, **{n: space[n][0] for n in free}}
    # (``fixed`` starts with the core's chosen values: they are part of every box.)
    rule, read = _lookup(table, values, set(free))
    if rule.status == Status.OK:
        boxes.append(
            Box(
                fixed={**fixed, **{n: values[n] for n in read}},
                free={n: space[n] for n in free if n not in read},
                rule_id=rule.id,
                implementation=rule.implementation,
            )
        )
    for i, name in enumerate(read):
        prefix = {**fixed, **{n: values[n] for n in read[:i]}}
        for value in space[name][1:]:
            _walk(table, base, space, {**prefix, name: value}, boxes)


def _lookup(table: RuleTable, values: dict[str, Any], free: set[str]) -> tuple[Any, list[str]]:
    """The deciding rule of ``values`` and the free dimensions it depends on, in read order."""
    point = _ReadRecorder(values, free)
    rule = table.lookup(point)
    read = list(point.read)
    deferring = getattr(rule, "decided_by", ())
    if deferring:
        # The deciding rule is the one of the point with the deferring rule's values: follow
        # that walk too (its reads of the deferred-to dimensions are not the point's).
        rules = [*getattr(table, "gates", ()), *getattr(table, "rules", ())]
        decide_as = next(r.decide_as for r in rules if r.id == deferring[0])
        again = _ReadRecorder({**values, **decide_as}, free - set(decide_as))
        table.lookup(again)
        read += [n for n in again.read if n not in read]
    return rule, read


def stderr_progress(message: str) -> None:
    """A progress line on stderr, rewritten in place."""
    sys.stderr.write(f"\rdtypeplan plan: {message}\033[K")
    sys.stderr.flush()
