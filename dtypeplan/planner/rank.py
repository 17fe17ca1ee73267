"""Ranking the combinations that fit: an objective, and the Pareto front of all three.

Three costs, each lower is better: the device bytes per rank (``memory``), the modelled
communication time per step (``time``), the expected numerical cost (``fidelity``; a
combination with an unmeasured component ranks after every measured one of the same figure).
The objective sorts by its cost, ties broken by the other two in the order listed. A
combination is on the *Pareto front* when no other is at least as good on all three costs and
better on one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from dtypeplan.planner.costs import Candidate

__all__ = ["OBJECTIVES", "pareto_front", "ranked"]


def _memory(c: Candidate) -> float:
    return float(c.device_bytes)


def _time(c: Candidate) -> float:
    return c.seconds


def _fidelity(c: Candidate) -> tuple[float, bool]:
    return (c.numerics.total, bool(c.numerics.unmeasured))


OBJECTIVES: dict[str, Callable[[Candidate], Any]] = {
    "memory": lambda c: (_memory(c), _time(c), _fidelity(c)),
    "time": lambda c: (_time(c), _fidelity(c), _memory(c)),
    "fidelity": lambda c: (_fidelity(c), _time(c), _memory(c)),
}
"""Each objective's sort key."""


def ranked(candidates: Sequence[Candidate], objective: str) -> list[Candidate]:
    """``candidates`` sorted by ``objective`` (one of :data:`OBJECTIVES`), the Pareto front
    marked (:attr:`Candidate.pareto`)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
    front = {id(c) for c in pareto_front(candidates)}
    marked = [replace(c, pareto=id(c) in front) for c in candidates]
    return sorted(marked, key=OBJECTIVES[objective])


def _costs(c: Candidate) -> tuple[float, float, float]:
    return (
        float(c.device_bytes),
        c.seconds,
        c.numerics.total + (1e-12 if c.numerics.unmeasured else 0),
    )


def pareto_front(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates no other dominates (at least as good on every cost, better on one).

    Sorted by memory, then time, then drift: a candidate can be dominated only by one before it,
    and only by one on the front found so far."""
    front: list[Candidate] = []
    front_costs: list[tuple[float, float, float]] = []
    for candidate in sorted(candidates, key=_costs):
        costs = _costs(candidate)
        dominated = any(
            all(f <= c for f, c in zip(other, costs, strict=True)) and other != costs
            for other in front_costs
        )
        if not dominated and costs not in front_costs:
            front.append(candidate)
            front_costs.append(costs)
    return front
