"""What a table decides, as disjoint boxes, and where two tables differ.

:func:`verdict_regions` cuts the space into disjoint boxes on each of which one verdict holds
(status, implementation, single-process implementation) and one rule gives it: each gate's
region less the gates before it, each grid leaf less every gate, and each deferring gate's
region cut by where its deferred points land. :func:`differences` intersects the regions of two
tables and keeps the boxes whose verdicts differ: ``dtypeplan diff OLD NEW`` prints them, so an
edit's reach is known before anything runs, and the test that the shipped table decides every
point as the version-1 table did is the same computation against an oracle of the old file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dtypeplan.resolver._boxes import Box, box_text, intersect, remaining, size, with_values
from dtypeplan.resolver._rules import Rule, RuleTable

__all__ = [
    "Difference",
    "Region",
    "Verdict",
    "covered",
    "deferred",
    "differences",
    "verdict_regions",
]

Verdict = tuple[str, str | None, str | None]
"""(status, implementation, single-process implementation)."""


@dataclass(frozen=True)
class Region:
    box: Box
    verdict: Verdict
    rule: str
    """The id of the rule that decides (``gate+rule`` for a deferral)."""


@dataclass(frozen=True)
class Difference:
    box: Box
    old: Region
    new: Region

    @property
    def combinations(self) -> int:
        return size(self.box)

    def text(self) -> str:
        return (
            f"{box_text(self.box)} ({self.combinations} combinations): "
            f"{_verdict_text(self.old)} -> {_verdict_text(self.new)}"
        )


def _verdict_text(region: Region) -> str:
    status, implementation, single = region.verdict
    built = f" {implementation}" if implementation else ""
    if single and single != implementation:
        built += f" ({single} in one process)"
    return f"{status}{built} [{region.rule}]"


def verdict(rule: Rule) -> Verdict:
    return (str(rule.status), rule.implementation, rule.single_process_implementation)


def deferred(
    piece: Box, decide_as: Mapping[str, Any], decided: Iterable[Region], via: str
) -> list[Region]:
    """The regions of a deferring rule's ``piece``: where each of its points lands once the
    values of ``decide_as`` are set, among the non-deferring ``decided`` regions."""
    target = with_values(piece, decide_as)
    free = {dim: None for dim in decide_as}
    out = []
    for region in decided:
        if intersect(region.box, target) is None:
            continue
        common = intersect(piece, with_values(region.box, free))
        if common is not None:
            out.append(Region(common, region.verdict, f"{via}+{region.rule}"))
    return out


def verdict_regions(table: RuleTable) -> list[Region]:
    """Disjoint boxes covering the space, each with the one verdict ``table`` gives there."""
    taken: list[Box] = []
    plain: list[Region] = []
    deferring: list[tuple[Rule, Box]] = []
    for gate in table.gates:
        for box in gate.region():
            for piece in remaining(box, taken):
                if gate.decide_as:
                    deferring.append((gate, piece))
                else:
                    plain.append(Region(piece, verdict(gate), gate.id))
            taken.append(box)
    for leaf in table.leaves:
        if leaf.decided_by is None:
            continue
        rule = table.grid[leaf.decided_by]
        plain.extend(Region(piece, verdict(rule), rule.id) for piece in remaining(leaf.box, taken))
    out = list(plain)
    for gate, piece in deferring:
        out.extend(deferred(piece, gate.decide_as, plain, gate.id))
    return out


def differences(old: Iterable[Region], new: Iterable[Region]) -> list[Difference]:
    """The boxes where ``old`` and ``new`` (each a cover of the space by disjoint regions) give
    different verdicts."""
    new = list(new)
    out = []
    for a in old:
        for b in new:
            if a.verdict == b.verdict:
                continue
            common = intersect(a.box, b.box)
            if common is not None:
                out.append(Difference(common, a, b))
    return out


def covered(regions: Iterable[Region]) -> int:
    """How many combinations the regions hold (the whole space, for a table's regions)."""
    return sum(size(region.box) for region in regions)
