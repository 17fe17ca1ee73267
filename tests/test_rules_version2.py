"""The version-2 table decides every combination as the version-1 table did.

The version-1 file stays as a fixture (``tests/data/rules/precision_rules_v1.yaml``) with an
oracle of its semantics written apart from the loader (``tests/rules_v1.py``). The proof is
exact: both tables cut the space into disjoint boxes of one verdict each
(``dtypeplan.resolver._diff``), each cover holds all ``COMBINATIONS`` points, and no box of one
meets a box of the other with another verdict. A seeded sample of points then checks the boxes
against the two lookups themselves: the old one by a linear scan of its rules with its
precedence and deferrals, the new one through ``RuleTable.lookup``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from dtypeplan.resolver._boxes import FULL, Box, intersect, size, with_values
from dtypeplan.resolver._diff import Region, covered, differences, verdict_regions
from dtypeplan.resolver._dimensions import COMBINATIONS, DIMENSIONS, FEATURES_UNUSED, points
from dtypeplan.resolver._rules import load_rules
from tests._helpers import full_matrices
from tests.rules_v1 import load_v1, v1_regions, v1_verdict

# The version-1 space: dimensions added since (param_access, issue 44) at their "not used"
# value, where the old table's combinations are.
V1_SPACE = with_values(FULL, {name: FEATURES_UNUSED[name] for name in ("param_access",)})


def _within_v1_space(regions: list[Region]) -> list[Region]:
    out = []
    for region in regions:
        box = intersect(region.box, V1_SPACE)
        if box is not None:
            out.append(Region(box, region.verdict, region.rule))
    return out


def test_every_combination_is_decided_as_by_the_version_1_table() -> None:
    old = _within_v1_space(v1_regions(load_v1()))
    new = _within_v1_space(verdict_regions(load_rules()))
    assert covered(verdict_regions(load_rules())) == COMBINATIONS
    assert covered(old) == covered(new) == size(V1_SPACE)
    found = differences(old, new)
    assert not found, "\n".join(d.text() for d in found[:5])


def _draw(rng: random.Random, box: Box = FULL) -> dict[str, Any]:
    return {
        name: rng.choice([v for i, v in enumerate(dim.values) if box[k] >> i & 1])
        for k, (name, dim) in enumerate(DIMENSIONS.items())
    }


def _sample(count: int, seed: int) -> list[dict[str, Any]]:
    """Every core combination; a point in every region of the new table; ``count`` points
    drawn uniformly and as many with each feature unused at odds 3 in 5 (a uniform draw
    almost always sets some refused feature)."""
    rng = random.Random(seed)
    drawn = list(points())
    drawn += [_draw(rng, region.box) for region in _within_v1_space(verdict_regions(load_rules()))]
    for _ in range(count):
        drawn.append(_draw(rng, V1_SPACE))
        point = _draw(rng, V1_SPACE)
        unused = {n: u for n, u in FEATURES_UNUSED.items() if rng.random() < 0.6}
        drawn.append({**point, **unused})
    return drawn


def _check(points_: list[dict[str, Any]], regions_checked: int) -> None:
    """Both lookups agree at every point; the new table's regions agree with its lookup at the
    first ``regions_checked`` points (a scan of every region per point)."""
    rules, table = load_v1(), load_rules()
    regions = verdict_regions(table)
    for count, point in enumerate(points_):
        old, old_id = v1_verdict(rules, point)
        rule = table.lookup(point)
        new = (str(rule.status), rule.implementation, rule.single_process_implementation)
        assert old == new, (point, old_id, rule.id)
        if count < regions_checked:
            (region,) = [r for r in regions if intersect(r.box, _point_box(point)) is not None]
            assert region.verdict == new, (point, region.rule, rule.id)


def _point_box(point: dict[str, Any]) -> Box:
    return with_values(FULL, point)


def test_a_sample_of_points_agrees_with_both_lookups() -> None:
    _check(_sample(200, seed=0)[::3], regions_checked=100)


@pytest.mark.slow
def test_a_large_sample_of_points_agrees_with_both_lookups() -> None:
    # Whole under DTYPEPLAN_FULL_MATRICES=1 (about 4.5 minutes); CI draws a tenth of it and
    # scans the regions at 300 points (the scan costs about 40 ms a point).
    full = full_matrices()
    _check(_sample(50_000 if full else 5_000, seed=1), regions_checked=2_000 if full else 300)
