"""Boxes of the configuration space, and the decision tree the rules loader builds over them.

A *box* is the product of one value set per dimension, held as one bit mask per dimension (bit
``i`` is the dimension's ``i``-th value, in :data:`DIMENSIONS` order). Every rule, gate and
implementation declaration of the table is a box. The space has too many points to list (see
:data:`COMBINATIONS`), so everything here works on boxes:

- :class:`Coverage` splits the space one dimension at a time, grouping that dimension's values
  into classes that the grid's rules still in play treat alike, until every rule in play
  contains the whole of the current box: one rule there decides it, two are an overlap, none
  is a gap (unless the gates take the box). The splits form a decision tree, which is also the
  lookup index of the grid: a point is looked up in one step per split dimension. The cost
  grows with the number of distinct boxes the rules cut the space into, not with the space.
- :func:`remaining` subtracts boxes from a box (the gates from a grid leaf, earlier gates from
  a gate).
- :func:`leaves_within` walks that tree for the leaves a box reaches.
- :func:`outside` finds a point of a box that a union of boxes leaves out (what the loader
  reports when an OK rule reaches beyond its implementation's declaration).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dtypeplan.resolver._dimensions import DIMENSIONS, value_text

__all__ = [
    "Box",
    "Coverage",
    "FULL",
    "Leaf",
    "box_text",
    "first_point",
    "intersect",
    "leaves_within",
    "outside",
    "point_text",
    "remaining",
    "size",
    "subtract",
    "with_values",
]

Box = tuple[int, ...]
"""One value mask per dimension, in :data:`DIMENSIONS` order."""

_SIZES: tuple[int, ...] = tuple(len(dim.values) for dim in DIMENSIONS.values())
FULL: Box = tuple((1 << n) - 1 for n in _SIZES)
"""The whole space."""

Index = Any
"""A node of the decision tree: a leaf position (an ``int``, into :attr:`Coverage.leaves`), or
``(dimension position, children)`` with one child per value of that dimension (values of one
class share their child)."""


@dataclass(frozen=True)
class Leaf:
    """A box of the decision tree and what decides it: a box index into the boxes given to
    :class:`Coverage`, or ``None`` for a gap."""

    box: Box
    decided_by: int | None


def intersect(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` hold, or None when they share no point."""
    out = tuple(x & y for x, y in zip(a, b, strict=True))
    return None if 0 in out else out


def contains(outer: Box, inner: Box) -> bool:
    return all(i & ~o == 0 for o, i in zip(outer, inner, strict=True))


def size(box: Box) -> int:
    count = 1
    for mask in box:
        count *= mask.bit_count()
    return count


def first_point(box: Box) -> dict[str, Any]:
    """The point of ``box`` with each dimension's first value in it."""
    return {
        name: dim.values[(mask & -mask).bit_length() - 1]
        for (name, dim), mask in zip(DIMENSIONS.items(), box, strict=True)
    }


def point_text(point: dict[str, Any]) -> str:
    return ", ".join(f"{dim}={value_text(point[dim])}" for dim in DIMENSIONS)


def box_text(box: Box) -> str:
    """The dimensions ``box`` restricts, as ``dim=v1|v2`` pairs."""
    parts = []
    for (name, dim), mask, full in zip(DIMENSIONS.items(), box, FULL, strict=True):
        if mask != full:
            values = (value_text(v) for i, v in enumerate(dim.values) if mask >> i & 1)
            parts.append(f"{name}={'|'.join(values)}")
    return ", ".join(parts) or "any combination"


def with_values(box: Box, values: Mapping[str, Any]) -> Box:
    """``box`` with the dimensions of ``values`` set to those values (``None``: any value)."""
    out = list(box)
    for position, (name, dim) in enumerate(DIMENSIONS.items()):
        if name in values:
            value = values[name]
            out[position] = (
                FULL[position]
                if value is None
                # bool is an int in Python: match the type too.
                else 1
                << next(
                    i for i, v in enumerate(dim.values) if v == value and type(v) is type(value)
                )
            )
    return tuple(out)


def _positions(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


def _subtract(box: Box, cut: Box) -> Iterator[Box]:
    """Disjoint boxes that together hold the points of ``box`` outside ``cut``."""
    if intersect(box, cut) is None:
        yield box
        return
    rest = list(box)
    for d, (mask, taken) in enumerate(zip(box, cut, strict=True)):
        if mask & ~taken:
            yield (*rest[:d], mask & ~taken, *rest[d + 1 :])
            rest[d] = mask & taken


def subtract(box: Box, cut: Box) -> list[Box]:
    """Disjoint boxes that together hold the points of ``box`` outside ``cut``."""
    return list(_subtract(box, cut))


def remaining(box: Box, union: Sequence[Box]) -> list[Box]:
    """Disjoint boxes that hold the points of ``box`` no box of ``union`` holds."""
    pieces = [box]
    for cut in union:
        pieces = [piece for whole in pieces for piece in _subtract(whole, cut)]
        if not pieces:
            break
    return pieces


def outside(box: Box, union: Sequence[Box]) -> Box | None:
    """A box of points of ``box`` that no box of ``union`` holds, or None when it holds all."""
    pieces = remaining(box, union)
    return pieces[0] if pieces else None


@dataclass
class Coverage:
    """The decision tree over ``boxes`` (the grid's rules): each leaf is a box every box in
    play there contains whole. A leaf no box contains is a gap (``decided_by`` None); a leaf
    that several contain is recorded in :attr:`overlaps` (the loader forgives both where the
    gates take the whole leaf)."""

    boxes: Sequence[Box]
    leaves: list[Leaf] = field(default_factory=list)
    overlaps: list[tuple[Box, tuple[int, ...]]] = field(default_factory=list)

    def build(self) -> Index:
        return self._visit(list(range(len(self.boxes))), FULL)

    def _visit(self, live: list[int], box: Box) -> Index:
        """The index for ``box``, which the boxes ``live`` (in order) each intersect."""
        if not live:
            return self._leaf(box, None)
        best: tuple[int, int, list[tuple[int, list[int]]]] | None = None
        for d, full in enumerate(FULL):
            if box[d] != full:
                continue  # split already: every live box contains the box's values here
            by_mask: dict[int, list[int]] = {}
            for b in live:
                by_mask.setdefault(self.boxes[b][d], []).append(b)
            if len(by_mask) == 1 and full in by_mask:
                continue  # every live box takes every value: nothing to split
            classes = _classes(by_mask, _SIZES[d])
            # Split where the fewest boxes land in several classes: a box that takes every
            # value of the dimension is copied into each class, so a dimension most boxes
            # name ends the copying soonest.
            copies = sum(len(members) for _, members in classes)
            if best is None or copies < best[1]:
                best = (d, copies, classes)
        if best is None:
            if len(live) > 1:
                self.overlaps.append((box, tuple(live)))
            return self._leaf(box, live[0])
        split, _, classes = best
        children: list[Index] = [None] * _SIZES[split]
        for mask, members in classes:
            inner = (*box[:split], mask, *box[split + 1 :])
            child = self._visit(members, inner)
            for value in _positions(mask):
                children[value] = child
        return (split, tuple(children))

    def _leaf(self, box: Box, decided_by: int | None) -> int:
        self.leaves.append(Leaf(box, decided_by))
        return len(self.leaves) - 1


def _classes(by_mask: dict[int, list[int]], size: int) -> list[tuple[int, list[int]]]:
    """The values of a dimension grouped by the boxes containing them: ``(value mask, boxes in
    order)`` per class, in the order of the classes' first values; a class no box contains is
    kept (with no boxes: a gap)."""
    keyed: dict[tuple[int, ...], int] = {}
    for value in range(size):
        key = tuple(mask for mask in by_mask if mask >> value & 1)
        keyed[key] = keyed.get(key, 0) | 1 << value
    return [
        (values, sorted(b for mask in key for b in by_mask[mask])) for key, values in keyed.items()
    ]


def leaves_within(index: Index, box: Box, leaf: Callable[[int], Leaf]) -> Iterator[Leaf]:
    """The leaves of the tree ``index`` that share points with ``box``, each cut to ``box``."""
    if not isinstance(index, tuple):
        found = leaf(index)
        common = intersect(found.box, box)
        if common is not None:
            yield Leaf(common, found.decided_by)
        return
    position, children = index
    seen: set[int] = set()
    for value in _positions(box[position]):
        child = children[value]
        if id(child) in seen:
            continue
        seen.add(id(child))
        yield from leaves_within(child, box, leaf)
