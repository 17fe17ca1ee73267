"""The rules file: the shipped table, user tables, and every way a table can be wrong.

Each broken table is the shipped ``precision_rules.yaml`` with one edit. The expected line is
found in the edited text (the line holding the edit), never hard-coded, so the tests follow the
shipped file as it changes while still asserting the exact line that the error must name.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan import RegistryError, RulesError
from dtypeplan.optimizers import ReplicatedOptimizer, get_implementation
from dtypeplan.optimizers.contract import registry
from dtypeplan.optimizers.contract.served import REPLICATED
from dtypeplan.resolver import (
    COMBINATIONS,
    DIMENSIONS,
    MAX_RULES,
    Declaration,
    FrozenDict,
    Rule,
    RuleTable,
    Status,
    _rules,
    _rules_file,
    load_rules,
)
from dtypeplan.resolver._boxes import intersect, size
from dtypeplan.resolver._dimensions import (
    CORE_COMBINATIONS,
    FEATURE_DIMENSIONS,
    FEATURES_UNUSED,
    STATES,
    points,
    value_text,
)
from dtypeplan.resolver._rules import default_rules_path

SHIPPED = Path(default_rules_path()).read_text()


@dtypeplan.register("my_impl", serves=REPLICATED)
class MyOptimizer(ReplicatedOptimizer):
    """A user's implementation: the replicated optimizer, counting its steps; it serves what
    the replicated optimizer serves."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps_taken = 0

    def step(self, closure: Any = None) -> Any:
        self.steps_taken += 1
        return super().step(closure)


# --- editing helpers -------------------------------------------------------------------------
# The rules are picked by what they are (the first gate, the first OK rule of the grid, ...),
# not by id, so the tests keep working as cells of the shipped table change status.
TABLE = dtypeplan.load_rules()
RULES = sorted(TABLE.rules, key=lambda rule: rule.line)
FIRST, LAST = RULES[0], RULES[-1]
FIRST_OK = next(rule for rule in TABLE.grid if rule.status == "OK")
NOT_OK = [rule for rule in TABLE.gates if not rule.decide_as]
GATE = {rule.id: rule for rule in TABLE.gates}
GRID = {rule.id: rule for rule in TABLE.grid}


def field_line(rule: Rule, name: str) -> int:
    """1-based line of ``name:`` inside ``rule`` in the shipped file."""
    lines = SHIPPED.splitlines()
    following = [r.line for r in RULES if r.line > rule.line]
    end = following[0] - 1 if following else len(lines)
    for number in range(rule.line, end + 1):
        if lines[number - 1].lstrip(" -").startswith(f"{name}:"):
            return number
    raise AssertionError(f"rule {rule.id} has no {name!r} line")


def replace_line(number: int, new: str, text: str = SHIPPED) -> str:
    lines = text.splitlines(keepends=True)
    lines[number - 1] = new + "\n"
    return "".join(lines)


def insert_after(number: int, new: str, text: str = SHIPPED) -> str:
    lines = text.splitlines(keepends=True)
    lines.insert(number, new + "\n")
    return "".join(lines)


def delete_lines(first: int, last: int, text: str = SHIPPED) -> str:
    lines = text.splitlines(keepends=True)
    del lines[first - 1 : last]
    return "".join(lines)


def rule_end(rule: Rule) -> int:
    """Last line of ``rule`` (before the next rule, or the end of the file)."""
    following = [r.line for r in RULES if r.line > rule.line]
    return following[0] - 1 if following else len(SHIPPED.splitlines())


def block_end(rule: Rule, text: str = SHIPPED) -> int:
    """Last line of ``rule``'s own block: its indented lines, without the blank lines, comments
    and the ``rules:`` key that may follow it."""
    lines = text.splitlines()
    end = rule.line
    while end < len(lines) and lines[end].startswith("    "):
        end += 1
    return end


def when_span(rule: Rule, name: str = "when") -> tuple[int, int]:
    """First and last line of ``rule``'s flow mapping ``name`` (it may span lines)."""
    lines = SHIPPED.splitlines()
    first = field_line(rule, name)
    last = first
    text = lines[first - 1]
    while text.count("{") != text.count("}"):
        text += lines[last]
        last += 1
    return first, last


def replace_when(rule: Rule, new: str, name: str = "when", text: str = SHIPPED) -> str:
    """``text`` with ``rule``'s ``name`` mapping (all its lines) replaced by the line ``new``."""
    first, last = when_span(rule, name)
    lines = text.splitlines(keepends=True)
    lines[first - 1 : last] = [new + "\n"]
    return "".join(lines)


def id_line(text: str, rule_id: str) -> int:
    """1-based number of the line ``  - id: <rule_id>`` of ``text``."""
    found = [n for n, line in enumerate(text.splitlines(), 1) if line == f"  - id: {rule_id}"]
    assert len(found) == 1, (rule_id, found)
    return found[0]


def line_of(text: str, needle: str) -> int:
    """1-based number of the one line of ``text`` that contains ``needle``."""
    found = [n for n, line in enumerate(text.splitlines(), start=1) if needle in line]
    assert len(found) == 1, (needle, found)
    return found[0]


def write(tmp_path: Path, text: str, name: str = "rules.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def rules_error(path: str) -> RulesError:
    with pytest.raises(RulesError) as info:
        dtypeplan.load_rules(path)
    return info.value


def assert_at(error: RulesError, path: str, line: int) -> None:
    assert str(error).startswith(f"{path}:{line}: "), str(error)
    assert (error.file, error.line) == (path, line)


# --- the shipped table -----------------------------------------------------------------------
def _disjoint(first: Rule, second: Rule) -> bool:
    return any(
        not (first.when[name] & second.when[name])
        for name in DIMENSIONS
        if name in first.when and name in second.when
    )


def test_shipped_table_loads_and_covers_every_point_once() -> None:
    """What each rule decides (a gate: its region less the gates before it; a grid rule: its
    box less every gate) is pairwise disjoint, and the sizes sum to the whole space: exactly
    "every point decided once". The grid's boxes, filled in with unused features, are pairwise
    disjoint even before the gates (the shipped grid is a partition of its cells)."""
    table = dtypeplan.load_rules()
    assert isinstance(table, RuleTable)
    assert table.rules == table.gates + table.grid
    assert all(rule.gate for rule in table.gates) and not any(r.gate for r in table.grid)
    for first, second in itertools.combinations(table.grid, 2):
        assert _disjoint(first, second), (first.id, second.id)
    decided = {rule.id: table.decided(rule) for rule in table.rules}
    assert all(decided.values()), [rule for rule, boxes in decided.items() if not boxes]
    pieces = [box for boxes in decided.values() for box in boxes]
    for first, second in itertools.combinations(pieces, 2):
        assert intersect(first, second) is None
    assert sum(size(box) for box in pieces) == COMBINATIONS
    assert COMBINATIONS == math.prod(len(dim.values) for dim in DIMENSIONS.values())
    registered = set(dtypeplan.registered_names())
    for rule in table.rules:
        # A deferring gate names no implementation: the rule it defers to decides; gates refuse.
        assert (rule.status == "OK" and not rule.decide_as) == (rule.implementation is not None)
        if rule.gate:
            assert rule.implementation is None and (rule.decide_as or rule.fix), rule.id
        if rule.implementation is not None:
            assert rule.implementation in registered
        assert SHIPPED.splitlines()[rule.line - 1] == f"  - id: {rule.id}"
    assert [r.id for r in table.grid if r.status == "OK"] == [
        "stage0-data-parallel",
        "zero1",
        "zero2",
        "zero3",
        "zero3-offload-optimizer",
        "zero3-offload",
        "whole-tensor",
    ]


def _sample_points(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Every core point (features unused) and ``count`` points drawn from the whole space."""
    rng = random.Random(seed)
    drawn = [
        {name: rng.choice(dim.values) for name, dim in DIMENSIONS.items()} for _ in range(count)
    ]
    return list(points()) + drawn


def _scan(table: RuleTable, point: dict[str, Any]) -> Rule:
    """The rule of ``point`` by a linear scan, not the loader's index: the first gate that
    holds it, else the one grid rule that matches it."""
    for gate in table.gates:
        if gate.matches(point):
            return gate
    matching = [rule for rule in table.grid if rule.matches(point)]
    assert len(matching) == 1, (point, [r.id for r in matching])
    return matching[0]


def test_lookup_is_the_first_gate_else_the_one_grid_rule() -> None:
    table = dtypeplan.load_rules()
    for point in _sample_points(3000) + _fp8_points(2000):
        rule = _scan(table, point)
        assert table.matching(point) is rule
        decided = table.lookup(point)
        if rule.decide_as:
            # A deferral: the rule of the point with the deferred values decides.
            base = _scan(table, {**point, **rule.decide_as})
            assert not base.decide_as
            assert decided.id == f"{rule.id}+{base.id}"
            assert decided.decided_by == (rule.id, base.id)
            assert (decided.status, decided.implementation) == (base.status, base.implementation)
            assert decided.single_process_implementation == base.single_process_implementation
            assert decided.matches(point) and rule.reason in decided.reason
            assert base.reason in decided.reason
        else:
            assert decided is rule


def test_version_2_decides_as_version_1() -> None:
    """The rewrite to gates and a grid changed no decision: at every core point and a sample of
    the whole space (fp8 on and off), the status and the implementations are version 1's, as
    its own semantics give them (tests/rules_v1.py: a linear scan of the old file with its core
    Error precedence; the rule ids differ)."""
    from tests.rules_v1 import load_v1, v1_verdict

    old = load_v1()
    table = dtypeplan.load_rules()
    for drawn in _sample_points(1500, seed=7) + _fp8_points(1000, seed=8):
        # Version 1's space: the dimensions added since (param_access) at "not used".
        point = {**drawn, "param_access": "flat"}
        rule = table.lookup(point)
        verdict, old_id = v1_verdict(old, point)
        new = (str(rule.status), rule.implementation, rule.single_process_implementation)
        assert new == verdict, (point, rule.id, old_id)


CORE_CONTRADICTIONS = [
    p
    for p in points()
    if p["params"] != "fp16+bf16"
    and (p["stage"], p["sharded"]) in ((0, True), (2, False), (3, False))
]


def _every_feature_value() -> list[tuple[str, Any]]:
    """Each feature's values but "not used"; fp8's own dimensions with fp8 on."""
    cases: list[tuple[str, Any]] = []
    for name, dim in FEATURE_DIMENSIONS.items():
        cases += [(name, v) for v in dim.values if v != dim.default_value or dim.requires]
    return cases


def test_core_contradictions_are_errors_whatever_features_are_set() -> None:
    """Stage 0 with a sharded accumulator, stage 2 or 3 with ``sharded: false``, both 16-bit
    modes on: the first gates, so their Error decides at every core point, crossed with every
    value of every feature (alone, and with fp8 on beside it), never a feature's NotSupported,
    a deferral or OK."""
    table = dtypeplan.load_rules()
    contradictions = [
        "fp16-and-bf16",
        "stage0-sharded-accumulator",
        "partitioned-gradients-whole-accumulator",
    ]
    assert [gate.id for gate in table.gates[:3]] == contradictions
    checked = 0
    for point in CORE_CONTRADICTIONS + [p for p in points() if p["params"] == "fp16+bf16"]:
        core = table.lookup(point)
        assert core.id in contradictions and core.status == "Error", core.id
        assert core.fix and ("sharded" in core.reason or "fp16" in core.reason)
        for name, value in _every_feature_value():
            for fp8 in (False, True):
                fp8_on = fp8 or bool(FEATURE_DIMENSIONS[name].requires)
                at = {**point, name: value} | ({"fp8": True} if fp8_on else {})
                assert table.lookup(at) is core, (at, table.lookup(at).id)
                checked += 1
    assert checked > 10_000


def _fp8_points(count: int, seed: int = 1) -> list[dict[str, Any]]:
    """Points drawn from the whole space with fp8 on (where its own dimensions mean anything)."""
    rng = random.Random(seed)
    return [
        {name: rng.choice(dim.values) for name, dim in DIMENSIONS.items()} | {"fp8": True}
        for _ in range(count)
    ]


def _fp8_ok(table: RuleTable, point: dict, name: str, value: object) -> bool:
    """Where fp8 compute is implemented (tests/test_fp8.py): bf16 or fp32 parameters, no
    pipeline, where the same point without fp8 is OK; emulated or native, never unavailable;
    the fp8 all-gather at ZeRO-3 with tensorwise scaling only."""
    if point["params"] not in ("fp32", "bf16") or point["pipeline"]:
        return False
    if table.lookup(point).status != "OK":
        return False
    if name == "fp8_execution":
        return value != "unavailable"
    if name == "fp8_all_gather" and value == "fp8":
        return point["stage"] == 3 and point["fp8_recipe"] == "tensorwise"
    return True


def test_fp8_dimensions_at_every_core_point() -> None:
    """fp8 on, and each value of its own dimensions with fp8 on: OK exactly where
    implemented, then with the implementation of the point without fp8 (the optimizer's cell
    is unchanged); refusals carry a reason. With fp8 off, fp8's own dimensions change nothing."""
    table = dtypeplan.load_rules()
    fp8_dims = [dim for dim in FEATURE_DIMENSIONS.values() if dim.requires]
    assert {dim.name for dim in fp8_dims} == {"fp8_recipe", "fp8_all_gather", "fp8_execution"}
    for point in points():
        if point["params"] == "fp16+bf16":
            continue
        base = table.lookup(point)
        cases = [("fp8", True)] + [(dim.name, v) for dim in fp8_dims for v in dim.values]
        for name, value in cases:
            on = {**point, "fp8": True, name: value}
            rule = table.lookup(on)
            assert (rule.status == "OK") == _fp8_ok(table, point, name, value), (on, rule.id)
            assert rule.reason, rule.id
            if rule.status == "OK":
                assert rule.implementation == base.implementation, rule.id
                assert rule.decided_by[1] == base.id
            if name != "fp8":
                assert table.lookup({**point, name: value}) is base  # fp8 off


def _implemented_feature(point: dict, name: str, value: object) -> bool:
    """The feature values dtypeplan implements (each with its parity test): bf16 master
    weights of bf16 parameters at ZeRO 0-3 (not with ZeRO-3's unsupported fp32_sum), with or
    without pipeline parallelism; autocast of fp32 parameters wherever fp32 parameters are OK;
    optimizer offload to the CPU at ZeRO 1-2 without pipeline parallelism, and at ZeRO-3 with
    the flat or hybrid layout and collective reduction (tests/test_offload_zero3_optimizer.py);
    ZeRO++ hpZ at flat ZeRO-3 with collective reduction (tests/test_hpz.py); every
    optimizer-state dtype (fp32 masters) of any parameter dtype at ZeRO 0-3 (not with ZeRO-3's
    unsupported fp32_sum), with or without pipeline parallelism."""
    offload = (
        name == "offload_optimizer"
        and value == "cpu"
        and not point["pipeline"]
        and (
            (point["stage"], point["sharded"]) in ((1, False), (1, True), (2, True))
            or (
                (point["stage"], point["sharded"], point["reduction"]) == (3, True, "collective")
                and point.get("shard_groups", "flat") in ("flat", "hybrid")
            )
        )
    )
    states = name == "states" and _states_proven(point)
    # ZeRO++ hpZ: FSDP2's reshard_after_forward=H at flat ZeRO-3 (tests/test_hpz.py).
    hpz = (
        name == "hierarchical_partitioning"
        and value is True
        and not point["pipeline"]
        and (point["stage"], point["sharded"], point["reduction"]) == (3, True, "collective")
        and point.get("shard_groups", "flat") == "flat"
    )
    # Rprop and ASGD with fp32 states: torch's own step wherever the point is OK.
    kinds = name == "state_kind" and dtypeplan.load_rules().lookup(point).status == "OK"
    return (
        offload
        or hpz
        or states
        or kinds
        or _implemented_layout(point, name, value)
        or _implemented_autocast(point, name, value)
        or (
            name == "master"
            and value in ("bf16", "bf16_sr", "bf16_kahan")
            and point["params"] == "bf16"
            and (point["stage"], point["sharded"]) in ((0, False), (1, False), (1, True), (2, True))
        )
        or (
            name == "master"
            and value in ("bf16", "bf16_sr", "bf16_kahan")
            and point["params"] == "bf16"
            and (point["stage"], point["sharded"], point["reduction"]) == (3, True, "collective")
        )
    )


def _states_proven(point: dict) -> bool:
    """Where every optimizer-state dtype is proven (tests/test_optimizer_states.py,
    tests/test_pipeline.py): ZeRO 0-2, and ZeRO-3 with collective reduction, with or without
    pipeline parallelism."""
    return (point["stage"], point["sharded"]) in (
        (0, False),
        (1, False),
        (1, True),
        (2, True),
    ) or (point["stage"], point["sharded"], point["reduction"]) == (3, True, "collective")


def _implemented_layout(point: dict, name: str, value: object) -> bool:
    """Shard groups (issue 22): every wire across groups at ZeRO-1/2 wherever the flat layout is
    OK; at ZeRO-3 (FSDP2's HSDP) the communication dtype across only (``hybrid``: the resolver
    reads a wire across named as the communication dtype as that); never at stage 0."""
    if name != "shard_groups":
        return False
    zero12 = (point["stage"], point["sharded"]) in ((1, False), (1, True), (2, True))
    zero3 = (point["stage"], point["sharded"], point["reduction"]) == (3, True, "collective")
    return zero12 or (zero3 and value == "hybrid")


def _implemented_autocast(point: dict, name: str, value: object) -> bool:
    """torch_autocast in bf16 or fp16 with fp32 parameters: every ZeRO stage with or without
    pipeline parallelism (tests/test_autocast.py, tests/test_pipeline.py), except what fp32
    parameters cannot do either (the accumulator's sharding, fp32_sum at ZeRO-3)."""
    return (
        name == "autocast"
        and value in ("bf16", "fp16")
        and point["params"] == "fp32"
        and (point["stage"], point["sharded"])
        in ((0, False), (1, False), (1, True), (2, True), (3, True))
        and not (point["stage"] == 3 and point["reduction"] == "fp32_sum")
    )


@pytest.mark.slow
def test_every_feature_value_but_the_unused_one_is_refused() -> None:
    """At every core point, each feature value other than "not used" is not OK, except the
    implemented ones (and the rule says why by naming the feature; both 16-bit modes on is an
    Error whatever else)."""
    table = dtypeplan.load_rules()
    for point in points():
        if point["params"] == "fp16+bf16" or table.core_error(point) is not None:
            continue  # an Error whatever else: test_core_contradictions_are_errors_...
        for name, dim in FEATURE_DIMENSIONS.items():
            for value in dim.values:
                if dim.requires or name == "fp8":
                    continue  # fp8 and its own dimensions: test_fp8_dimensions_at_every_core_point
                rule = table.lookup({**point, name: value})
                if value != dim.default_value:
                    implemented = _implemented_feature(point, name, value)
                    assert (rule.status == "OK") == implemented, (name, value, rule.id, point)
                    if name not in rule.named:
                        # A gate that does not name the feature refuses the point whatever the
                        # feature's value: it decides the point with the feature unused too.
                        assert rule.gate and rule is table.lookup(point), (value, rule.id)
                    else:
                        assert rule.reason, (name, rule.id)
                    if implemented and name == "master":
                        # Optimizer states ride on bf16 masters (one update path): every
                        # state dtype wherever bf16 masters are OK.
                        for states in STATES.values:
                            cell = table.lookup({**point, name: value, "states": states})
                            expected = _states_proven(point)
                            assert (cell.status == "OK") == expected, (value, states, cell.id)


def test_shipped_table_by_explicit_path_equals_default() -> None:
    by_path = dtypeplan.load_rules(default_rules_path())
    assert by_path.rules == dtypeplan.load_rules().rules


def test_unchanged_copy_loads(tmp_path: Path) -> None:
    table = dtypeplan.load_rules(write(tmp_path, SHIPPED))
    assert [r.id for r in table.rules] == [r.id for r in dtypeplan.load_rules().rules]


# --- broken tables ---------------------------------------------------------------------------
def test_malformed_yaml(tmp_path: Path) -> None:
    line = field_line(LAST, "status")
    text = replace_line(line, "    status: Not: valid")
    path = write(tmp_path, text)
    error = rules_error(path)
    assert_at(error, path, line)
    assert "not valid YAML" in str(error)


def test_unclosed_flow_mapping(tmp_path: Path) -> None:
    line = field_line(FIRST, "when")
    when = SHIPPED.splitlines()[line - 1]
    assert when.endswith("}")
    path = write(tmp_path, replace_line(line, when[:-1]))
    error = rules_error(path)
    # The parser notices at a later token; a line before the edit would be wrong.
    assert error.line is not None and error.line >= line
    assert str(error).startswith(f"{path}:{error.line}: not valid YAML")


def test_python_object_tag_is_refused_and_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    line = field_line(FIRST, "status")
    text = replace_line(
        line, f'    status: !!python/object/apply:os.system ["echo pwned > {marker}"]'
    )
    path = write(tmp_path, text)
    error = rules_error(path)
    assert_at(error, path, line)
    assert "tag" in str(error)
    with pytest.raises(RulesError):
        dtypeplan.resolve({}, rules=path)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("field", "new"),
    [
        ("status", "    status: !!str {status}"),
        ("id", "  - id: !!str {id}"),
        ("status", "    status: !local {status}"),
        ("when", "    when: !!map {{}}"),
    ],
)
def test_plain_tags_are_refused_too(tmp_path: Path, field: str, new: str) -> None:
    line = field_line(FIRST, field)
    path = write(tmp_path, replace_line(line, new.format(status=FIRST.status, id=FIRST.id)))
    error = rules_error(path)
    assert_at(error, path, line)
    assert "tag" in str(error)


def test_tag_in_defaults_is_refused(tmp_path: Path) -> None:
    line = line_of(SHIPPED, "  communication_data_type:")
    path = write(tmp_path, replace_line(line, "  communication_data_type: !!str accum"))
    assert_at(rules_error(path), path, line)


def test_anchor_is_refused_at_its_line(tmp_path: Path) -> None:
    first, last = field_line(FIRST, "status"), field_line(LAST, "status")
    text = replace_line(first, f"    status: &status {FIRST.status}")
    text = replace_line(last, "    status: *status", text)
    path = write(tmp_path, text)
    error = rules_error(path)
    assert_at(error, path, first)
    assert "anchor" in str(error)


def test_alias_is_refused_at_its_line(tmp_path: Path) -> None:
    line = field_line(LAST, "status")
    path = write(tmp_path, replace_line(line, "    status: *status"))
    error = rules_error(path)
    assert_at(error, path, line)
    assert "alias" in str(error)


def test_duplicate_key(tmp_path: Path) -> None:
    line = field_line(FIRST_OK, "status")
    path = write(tmp_path, insert_after(line, "    status: Error"))
    error = rules_error(path)
    assert_at(error, path, line + 1)
    assert "duplicate key 'status'" in str(error)


def test_duplicate_rule_id(tmp_path: Path) -> None:
    path = write(tmp_path, replace_line(LAST.line, f"  - id: {FIRST.id}"))
    error = rules_error(path)
    assert_at(error, path, LAST.line)
    assert f"{FIRST.id!r} already used at line {FIRST.line}" in str(error)


def test_unknown_key_in_a_rule(tmp_path: Path) -> None:
    line = field_line(LAST, "status")
    path = write(tmp_path, insert_after(line, "    priority: 1"))
    error = rules_error(path)
    assert_at(error, path, line + 1)
    assert "'priority'" in str(error)


def test_unknown_dimension_name(tmp_path: Path) -> None:
    line, _ = when_span(LAST)
    path = write(tmp_path, replace_when(LAST, "    when: {params: fp32, stages: 3}"))
    error = rules_error(path)
    assert_at(error, path, line)
    assert "'stages'" in str(error)


def test_unknown_dimension_name_in_a_gate_and_its_unless(tmp_path: Path) -> None:
    gate = next(rule for rule in TABLE.gates if rule.unless is not None)
    for name in ("when", "unless"):
        line, _ = when_span(gate, name)
        path = write(tmp_path, replace_when(gate, f"    {name}: {{stage: 3, stages: 3}}", name))
        error = rules_error(path)
        assert_at(error, path, line)
        assert "'stages'" in str(error)


def test_unknown_top_level_key(tmp_path: Path) -> None:
    line = line_of(SHIPPED, "version: 2")
    path = write(tmp_path, insert_after(line, "author: me"))
    assert_at(rules_error(path), path, line + 1)


@pytest.mark.parametrize(
    ("when", "dimension"),
    [
        ("{params: fp8}", "params"),
        ("{params: [fp32, fp8]}", "params"),
        ("{accum: fp64}", "accum"),
        ("{stage: 7}", "stage"),
        ("{stage: true}", "stage"),
        ("{stage: '1'}", "stage"),
        ("{sharded: 1}", "sharded"),
        ("{pipeline: [false, maybe]}", "pipeline"),
        ("{comm: int8}", "comm"),
    ],
)
def test_unknown_dimension_value(tmp_path: Path, when: str, dimension: str) -> None:
    line = field_line(FIRST, "when")
    path = write(tmp_path, replace_line(line, f"    when: {when}"))
    error = rules_error(path)
    assert_at(error, path, line)
    assert f"{dimension}: unknown value" in str(error)


def test_dimension_value_on_a_later_line_of_a_block_mapping(tmp_path: Path) -> None:
    line = field_line(FIRST, "when")
    path = write(tmp_path, replace_line(line, "    when:\n      params: fp32\n      stage: 9"))
    assert_at(rules_error(path), path, line + 2)


def test_bad_status(tmp_path: Path) -> None:
    line = field_line(LAST, "status")
    path = write(tmp_path, replace_line(line, "    status: Maybe"))
    assert_at(rules_error(path), path, line)


def test_missing_reason(tmp_path: Path) -> None:
    reason = field_line(LAST, "reason")
    path = write(tmp_path, delete_lines(reason, rule_end(LAST)))
    error = rules_error(path)
    assert_at(error, path, LAST.line)
    assert "reason" in str(error)


def test_gap(tmp_path: Path) -> None:
    text = delete_lines(LAST.line, rule_end(LAST))
    path = write(tmp_path, text)
    error = rules_error(path)
    assert_at(error, path, line_of(text, "rules:"))
    assert "matched by no gate and no rule" in str(error)
    # The gap is the deleted rule's cell, less what the gates take.
    assert "param_access=owner" in str(error) and "optimizer=shaped" in str(error)


def test_gap_left_by_a_removed_gate(tmp_path: Path) -> None:
    """A gate refuses what the grid does not have: without it, its points are a gap."""
    gate = GATE["offload-nvme"]
    text = delete_lines(gate.line, block_end(gate))
    path = write(tmp_path, text)
    error = rules_error(path)
    assert_at(error, path, line_of(text, "rules:"))
    assert "offload_param=nvme" in str(error)


def test_overlap(tmp_path: Path) -> None:
    # Widen the last grid rule to every core point: for the first point that another rule also
    # matches, the widened rule is the second match in file order, so its line is the one named.
    line, _ = when_span(LAST)
    path = write(tmp_path, replace_when(LAST, "    when: {}"))
    error = rules_error(path)
    assert_at(error, path, LAST.line)
    assert "overlap" in str(error) and repr(LAST.id) in str(error)
    assert "no gate takes it" in str(error)


def test_overlap_names_both_rules_and_their_lines(tmp_path: Path) -> None:
    first = TABLE.grid[0]
    path = write(tmp_path, replace_when(first, '    when: {master: "*", states: "*"}'))
    error = rules_error(path)
    assert f"{first.id!r} (line {first.line})" in str(error)
    other = next(rule for rule in TABLE.grid if rule is not first and repr(rule.id) in str(error))
    assert_at(error, path, other.line)


def test_grid_rules_may_overlap_where_the_gates_take_every_common_point(tmp_path: Path) -> None:
    """zero2 widened to ``sharded: "*"``: its whole-accumulator points are the Error gate
    partitioned-gradients-whole-accumulator's, so the grid has no overlap past the gates."""
    rule = GRID["zero2"]
    line, _ = when_span(rule)
    text = SHIPPED.splitlines()[line - 1 : when_span(rule)[1]]
    widened = " ".join(text).replace("{stage: 2,", '{stage: 2, sharded: "*",')
    table = dtypeplan.load_rules(write(tmp_path, replace_when(rule, widened)))
    point = {**next(points()), "stage": 2, "sharded": False}
    assert table.lookup(point).id == "partitioned-gradients-whole-accumulator"
    # Widened into stage 1 it overlaps zero1 where no gate stands.
    widened = " ".join(text).replace("{stage: 2,", "{stage: [1, 2],")
    error = rules_error(write(tmp_path, replace_when(rule, widened)))
    assert "'zero1'" in str(error) and "'zero2'" in str(error) and "overlap" in str(error)


def test_ok_rule_with_unknown_implementation(tmp_path: Path) -> None:
    line = field_line(FIRST_OK, "implementation")
    path = write(tmp_path, replace_line(line, "    implementation: warp_drive"))
    error = rules_error(path)
    assert_at(error, path, line)
    assert "'warp_drive'" in str(error)
    for name in dtypeplan.registered_names():
        assert name in str(error)


def test_unknown_implementation_passes_without_the_registry_check(tmp_path: Path) -> None:
    line = field_line(FIRST_OK, "implementation")
    path = write(tmp_path, replace_line(line, "    implementation: warp_drive"))
    table = load_rules(path)  # the resolver's loader checks only the names it is given
    assert any(rule.implementation == "warp_drive" for rule in table.rules)


def test_ok_rule_without_implementation(tmp_path: Path) -> None:
    line = field_line(FIRST_OK, "implementation")
    path = write(tmp_path, delete_lines(line, line))
    error = rules_error(path)
    assert_at(error, path, FIRST_OK.line)
    assert "no implementation" in str(error)


def test_non_ok_rule_with_implementation(tmp_path: Path) -> None:
    rule = NOT_OK[0]
    line = field_line(rule, "status")
    path = write(tmp_path, insert_after(line, "    implementation: replicated"))
    assert_at(rules_error(path), path, line + 1)


def test_missing_rules_file(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.yaml")
    assert str(rules_error(path)).startswith(path)


def test_document_not_a_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "- just\n- a list\n")
    assert_at(rules_error(path), path, 1)


# --- user tables and user implementations ----------------------------------------------------
def _rule_for_empty_config() -> Rule:
    return next(rule for rule in RULES if rule.id == dtypeplan.resolve({}).rule_id)


def test_resolve_uses_a_user_rules_file(tmp_path: Path) -> None:
    rule = _rule_for_empty_config()
    assert rule.status == "OK"
    # The user's copy turns the cell of the empty config into NotSupported.
    implementation = field_line(rule, "implementation")
    text = delete_lines(implementation, implementation)
    text = replace_line(field_line(rule, "status"), "    status: NotSupported", text)
    path = write(tmp_path, text, "mine.yaml")
    plan = dtypeplan.resolve({}, rules=path)
    assert plan.status == "NotSupported" and plan.implementation is None
    assert plan.rule_location == f"mine.yaml:{rule.line}"
    assert plan.rule_location in plan.explain()
    with pytest.raises(dtypeplan.NotSupportedError):
        plan.build(torch.nn.Linear(2, 2).parameters())
    assert dtypeplan.resolve({}).status == "OK"


def test_resolve_with_a_broken_rules_file_raises(tmp_path: Path) -> None:
    path = write(tmp_path, delete_lines(LAST.line, rule_end(LAST)))
    with pytest.raises(RulesError):
        dtypeplan.resolve({}, rules=path)


def test_user_implementation_is_built_from_a_user_rules_file(tmp_path: Path) -> None:
    rule = _rule_for_empty_config()
    text = replace_line(field_line(rule, "implementation"), "    implementation: my_impl")
    path = write(tmp_path, text)
    plan = dtypeplan.resolve({"bf16": {"enabled": True}}, rules=path)
    assert plan.status == "OK" and plan.implementation == "my_impl"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = plan.build(model.parameters())
    assert type(optimizer) is MyOptimizer
    assert isinstance(optimizer, dtypeplan.MixedPrecisionOptimizer)
    assert model.weight.dtype == torch.bfloat16
    before = model.weight.detach().clone()
    loss = model(torch.randn(3, 4, dtype=torch.bfloat16)).float().square().mean()
    optimizer.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    assert optimizer.steps_taken == 1
    assert not torch.equal(model.weight, before)


def test_registering_a_name_twice_fails() -> None:
    class Another(ReplicatedOptimizer):
        pass

    for name in ("my_impl", "replicated", "sharded"):
        with pytest.raises(RegistryError, match=name):
            dtypeplan.register(name)(Another)
    assert get_implementation("my_impl") is MyOptimizer
    assert get_implementation("replicated") is not Another


def test_registering_a_non_optimizer_fails() -> None:
    with pytest.raises(RegistryError):
        dtypeplan.register("not_an_optimizer")(torch.optim.SGD)  # type: ignore[arg-type]
    assert "not_an_optimizer" not in dtypeplan.registered_names()


def test_unknown_implementation_name_lists_the_registered_ones() -> None:
    with pytest.raises(RegistryError) as info:
        get_implementation("warp_drive")
    message = str(info.value)
    assert "warp_drive" in message
    for name in ("my_impl", "replicated", "sharded"):
        assert name in message


def test_rules_file_may_be_a_pathlike(tmp_path: Path) -> None:
    path = Path(write(tmp_path, SHIPPED))
    assert isinstance(dtypeplan.load_rules(path), RuleTable)
    assert dtypeplan.resolve({}, rules=path).status == "OK"
    assert os.fspath(path) == dtypeplan.load_rules(path).path


# --- the dimension records, statuses, size ---------------------------------------------------
def test_rule_status_is_the_status_enum() -> None:
    assert all(isinstance(rule.status, Status) for rule in TABLE.rules)


def test_the_old_model_dimension_name_is_refused(tmp_path: Path) -> None:
    line = field_line(FIRST, "when")
    path = write(tmp_path, replace_line(line, "    when: {model: fp16+bf16}"))
    error = rules_error(path)
    assert_at(error, path, line)
    assert "'model'" in str(error) and "params" in str(error)


def test_schema_names_exactly_the_dimensions() -> None:
    schema = json.loads(
        (Path(default_rules_path()).parent / "schemas" / "rules.schema.json").read_text()
    )
    when = schema["$defs"]["when"]["propertyNames"]
    assert when["enum"] == list(DIMENSIONS)
    for part in ("gate", "rule"):
        assert schema["$defs"][part]["properties"]["when"]["$ref"] == "#/$defs/when"
    assert schema["$defs"]["gate"]["properties"]["unless"]["$ref"] == "#/$defs/when"


def test_single_process_implementation_must_be_registered(tmp_path: Path) -> None:
    line = field_line(FIRST_OK, "implementation")
    path = write(tmp_path, insert_after(line, "    single_process_implementation: warp_drive"))
    error = rules_error(path)
    assert_at(error, path, line + 1)
    assert "'warp_drive'" in str(error)


def test_single_process_implementation_only_on_ok_rules(tmp_path: Path) -> None:
    line = field_line(NOT_OK[0], "status")
    path = write(tmp_path, insert_after(line, "    single_process_implementation: sharded"))
    assert_at(rules_error(path), path, line + 1)


def _rule_text(
    number: int, point: dict[str, Any], status: str = "NotSupported", prefix: str = "r"
) -> str:
    when = ", ".join(f"{name}: {_matcher(value)}" for name, value in point.items())
    return f"  - id: {prefix}{number}\n    when: {{{when}}}\n    status: {status}\n    reason: r\n"


def _gate_text(number: int, when: dict[str, Any], status: str = "NotSupported") -> str:
    return _rule_text(number, when, status, prefix="g")


def _matcher(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_matcher(v) for v in value) + "]"
    return '"*"' if value == "*" else value_text(value)


def _generated(rules: list[str], gates: list[str] = ()) -> str:  # type: ignore[assignment]
    """The shipped version, defaults and sets, then ``gates`` and the grid ``rules``."""
    head = SHIPPED[: SHIPPED.index("\ngates:")]
    gates_text = "\ngates:\n" + "".join(gates) if gates else "\ngates: []\n"
    return head + gates_text + "rules:\n" + "".join(rules)


def _cell(**where: Any) -> dict[str, Any]:
    """A grid rule's when naming every feature (unused unless given): generated tables name
    them all, so fp8's own dimensions are pinned even where fp8 is off."""
    return {**where, **{k: v for k, v in FEATURES_UNUSED.items() if k not in where}}


def _staircase_whens(first: int) -> list[dict[str, Any]]:
    """Boxes of every point where a feature from the ``first``-th on is in use: the last
    feature in use decides (the features before it take any value, the ones after it are
    unused)."""
    names = list(FEATURE_DIMENSIONS)
    whens = []
    for position in range(first, len(names)):
        dim = FEATURE_DIMENSIONS[names[position]]
        when: dict[str, Any] = {earlier: "*" for earlier in names[first:position]}
        when[dim.name] = [v for v in dim.values if v != dim.default_value]
        when.update({later: FEATURES_UNUSED[later] for later in names[position + 1 :]})
        whens.append(when)
    return whens


def _staircase(first: int, start: int) -> list[str]:
    """Grid rules for the staircase (numbered from ``start``); the features before the
    ``first``-th take any value."""
    names = list(FEATURE_DIMENSIONS)
    before = {name: "*" for name in names[:first]}
    return [
        _rule_text(start + i, {**before, **when}) for i, when in enumerate(_staircase_whens(first))
    ]


def test_one_rule_per_combination_lints_fast(tmp_path: Path) -> None:
    """One rule per core point, and one per feature: the check costs boxes, not points."""
    core = list(points())
    rules = [_rule_text(i, p) for i, p in enumerate(core)] + _staircase(0, len(core))
    path = write(tmp_path, _generated(rules))
    start = time.perf_counter()
    table = dtypeplan.load_rules(path)
    elapsed = time.perf_counter() - start
    assert len(table.rules) == CORE_COMBINATIONS + len(FEATURE_DIMENSIONS)
    assert all(table.lookup(p).id == f"r{i}" for i, p in enumerate(core))
    # A guard against checking points one by one (hours), not a timing: the bound leaves room
    # for a loaded 2-core machine (the schema validation of the 25 thousand matchers takes
    # most of it: about 40 s in all at a load average of 12 on 2 cores).
    assert elapsed < 90.0, f"{len(table.rules)} rules took {elapsed:.1f} s"


def test_a_gate_per_core_point_before_a_one_rule_grid_lints_fast(tmp_path: Path) -> None:
    """Every core point but the last refused by a gate of its own, before a grid of one rule
    (every core point) and the staircase: the gates' checks (each decides something, the grid
    rule decides the last point) cost boxes too."""
    core = list(points())
    gates = [_gate_text(i, p) for i, p in enumerate(core[:-1])]
    rules = [_rule_text(0, _cell()), *_staircase(0, 1)]
    path = write(tmp_path, _generated(rules, gates))
    start = time.perf_counter()
    table = dtypeplan.load_rules(path)
    elapsed = time.perf_counter() - start
    assert len(table.gates) == CORE_COMBINATIONS - 1
    assert table.lookup(core[-1]).id == "r0"
    assert [table.lookup(p).id for p in core[:50]] == [f"g{i}" for i in range(50)]
    assert elapsed < 90.0, f"{len(table.rules)} rules took {elapsed:.1f} s"


def _rule(number: int, when: dict[str, Any], gate: bool = False) -> Rule:
    """A rule built in memory, for timing the coverage check without YAML and the schema (a
    dimension it does not name: any value)."""
    return Rule(
        id=f"{'g' if gate else 'r'}{number}",
        when=FrozenDict(
            {
                k: frozenset(
                    DIMENSIONS[k].values if v == "*" else v if isinstance(v, list) else [v]
                )
                for k, v in when.items()
            }
        ),
        status=Status.NOT_SUPPORTED,
        implementation=None,
        single_process_implementation=None,
        reason="r",
        line=number + 1,
        gate=gate,
    )


def test_a_rule_per_point_of_the_core_and_three_features_checks_fast() -> None:
    """34560 one-point rules over the core dimensions and master x states (fp32, bf16) x
    autocast (the features after them unused), one box for the other states values, and a
    staircase for the rest: the whole space is checked through about 35 thousand boxes (and
    the check that each rule decides something must not be quadratic in them)."""
    names = list(FEATURE_DIMENSIONS)[:3]
    # Two of the states values one point at a time (as many rules as before the moments got
    # their own dtypes); one box takes the other fourteen.
    values_of = {name: FEATURE_DIMENSIONS[name].values for name in names}
    values_of["states"] = STATES.values[:2]
    all_points = [
        {**core, **dict(zip(names, values, strict=True))}
        for core in points()
        for values in itertools.product(*values_of.values())
    ]
    other_states = {
        "states": list(STATES.values[2:]),
        **{later: FEATURES_UNUSED[later] for later in list(FEATURE_DIMENSIONS)[3:]},
    }
    whens = [*all_points, other_states, *_staircase_whens(3)]
    rules = tuple(_rule(i, when) for i, when in enumerate(whens))
    start = time.perf_counter()
    index, leaves = _rules._check_coverage((), rules, "generated.yaml", 1)
    elapsed = time.perf_counter() - start
    table = RuleTable(
        path="generated.yaml",
        defaults=TABLE.defaults,
        gates=(),
        grid=rules,
        index=index,
        leaves=leaves,
    )
    assert all(table.lookup(p).id == f"r{i}" for i, p in enumerate(all_points))
    # A guard against a pairwise check (20 thousand rules squared takes many minutes), not a
    # timing: it takes about 3 s on an idle core, and other work on the machine must not fail it.
    assert elapsed < 30.0, f"{len(rules)} rules took {elapsed:.1f} s"


def _core_grid(start: int = 0) -> list[str]:
    """A grid NotSupported everywhere: one rule per ZeRO stage, then the staircase."""
    rules = [_rule_text(start + stage, _cell(stage=stage)) for stage in range(4)]
    return rules + _staircase(0, start + 4)


def test_a_gate_the_earlier_gates_cover_decides_nothing_and_is_refused(tmp_path: Path) -> None:
    """A gate inside the gates before it would decide nothing: refused on load, naming it;
    the same gate first decides its points."""
    outer = _gate_text(0, {"stage": 0, "sharded": True}, "Error")
    inner = _gate_text(1, {"stage": 0, "sharded": True, "master": "bf16"})
    text = _generated(_core_grid(), [outer, inner])
    path = write(tmp_path, text)
    error = rules_error(path)
    assert_at(error, path, line_of(text, "- id: g1"))
    assert "gate 'g1' decides nothing" in str(error)
    table = dtypeplan.load_rules(write(tmp_path, _generated(_core_grid(), [inner, outer])))
    point = {**next(points()), "stage": 0, "sharded": True}
    assert table.lookup(point).id == "g0"
    assert table.lookup({**point, "master": "bf16"}).id == "g1"
    # Covered by two earlier gates together, not by either alone: refused too.
    halves = [
        _gate_text(0, {"stage": 0, "sharded": True, "params": ["fp32", "fp16"]}),
        _gate_text(2, {"stage": 0, "sharded": True, "params": ["bf16", "fp16+bf16"]}),
    ]
    text = _generated(_core_grid(), [*halves, inner])
    error = rules_error(write(tmp_path, text))
    assert "gate 'g1' decides nothing" in str(error)


def test_a_grid_rule_the_gates_cover_decides_nothing_and_is_refused(tmp_path: Path) -> None:
    """A grid rule whose every point a gate takes would decide nothing: refused on load,
    naming it and the gates that take it."""
    gate = _gate_text(0, {"stage": 0, "sharded": True}, "Error")
    rules = [
        _rule_text(100, _cell(stage=0, sharded=True)),
        _rule_text(101, _cell(stage=0, sharded=False)),
        *_core_grid(start=0)[1:],
    ]
    text = _generated(rules, [gate])
    path = write(tmp_path, text)
    error = rules_error(path)
    assert_at(error, path, line_of(text, "- id: r100"))
    assert "rule 'r100' decides nothing" in str(error) and "g0" in str(error)
    # With the gate narrowed, the rule decides the rest and loads.
    gate = _gate_text(0, {"stage": 0, "sharded": True, "pipeline": False}, "Error")
    table = dtypeplan.load_rules(write(tmp_path, _generated(rules, [gate])))
    point = {**next(points()), "stage": 0, "sharded": True, "pipeline": True}
    assert table.lookup(point).id == "r100"
    assert table.lookup({**point, "pipeline": False}).id == "g0"


def test_ten_thousand_copies_of_a_rule_fail_fast_with_an_overlap() -> None:
    point = next(points())
    rules = tuple(_rule(i, point) for i in range(10_000))
    start = time.perf_counter()
    with pytest.raises(RulesError) as info:
        _rules._check_coverage((), rules, "generated.yaml", 1)
    elapsed = time.perf_counter() - start
    assert "'r0' (line 1) and 'r1' overlap" in str(info.value)
    assert info.value.line == 2
    # A guard against checking every pair before refusing (minutes), not a timing.
    assert elapsed < 20.0, f"10000 rules took {elapsed:.1f} s to refuse"


def test_more_rules_than_points_fail_before_parsing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real bound is one rule per point (18 million); a small one shows the message.
    monkeypatch.setattr(_rules_file, "MAX_RULES", 100)
    point = next(points())
    path = write(tmp_path, _generated([_rule_text(i, point) for i in range(101)]))
    error = rules_error(path)
    assert "more than 100 rules" in str(error)
    assert_at(error, path, line_of(_generated([]), "rules:"))
    assert MAX_RULES == COMBINATIONS


def test_overlap_in_a_long_table_fails_at_the_second_rule(tmp_path: Path) -> None:
    core = list(points())
    rules = [_rule_text(i, p) for i, p in enumerate(core[:-1])] + [_rule_text(len(core), core[0])]
    path = write(tmp_path, _generated(rules + _staircase(0, len(core) + 1)))
    error = rules_error(path)
    assert "'r0'" in str(error) and f"'r{len(core)}'" in str(error)
    assert_at(error, path, line_of(_generated(rules), f"- id: r{len(core)}"))


def test_gap_names_the_first_point_and_its_box(tmp_path: Path) -> None:
    core = list(points())
    missing = core[5]
    rules = [_rule_text(i, p) for i, p in enumerate(core) if p is not missing]
    text = _generated(rules + _staircase(0, len(core)))
    path = write(tmp_path, text)
    error = rules_error(path)
    assert_at(error, path, line_of(text, "rules:"))
    shown = ", ".join(f"{name}={value_text(missing[name])}" for name in DIMENSIONS)
    assert f"1 combination(s) are matched by no gate and no rule: {shown}" in str(error)
    assert "(the combinations: " in str(error)


def test_a_gap_the_gates_take_is_no_gap(tmp_path: Path) -> None:
    """The missing core point refused by a gate: the table loads, and the gate decides it."""
    core = list(points())
    missing = core[5]
    rules = [_rule_text(i, p) for i, p in enumerate(core) if p is not missing]
    text = _generated(rules + _staircase(0, len(core)), [_gate_text(0, missing)])
    table = dtypeplan.load_rules(write(tmp_path, text))
    assert table.lookup(missing).id == "g0"
    assert table.lookup(core[4]).id == "r4"


def test_gaps_in_the_features_are_counted_as_boxes(tmp_path: Path) -> None:
    # Without the staircase every point that uses a feature is a gap: all but the core points.
    rules = [_rule_text(i, p) for i, p in enumerate(points())]
    path = write(tmp_path, _generated(rules))
    error = rules_error(path)
    assert f"{COMBINATIONS - CORE_COMBINATIONS} combination(s)" in str(error)


# --- version 2: sets, {not: ...}, unless, gate order, deferrals ------------------------------
def test_sets_are_matchers_in_any_dimension_whose_values_they_are() -> None:
    sets = TABLE.sets
    assert set(sets) >= {"bf16_masters", "shard_groups_any", "quantized_states"}
    assert GATE["fp8-shard-groups"].when["shard_groups"] == frozenset(sets["shard_groups_any"])
    assert GATE["master-weights-bf16-with-fp16-params"].when["master"] == frozenset(
        sets["bf16_masters"]
    )
    for name, values in sets.items():
        assert all(any(v in dim.values for dim in DIMENSIONS.values()) for v in values), name


def test_a_set_used_in_a_new_gate(tmp_path: Path) -> None:
    line = line_of(SHIPPED, "sets:")
    text = insert_after(line, "  middle_stages: [1, 2]")
    gate = GATE["fp16-and-bf16"]
    text = insert_after(
        line_of(text, "  - id: fp16-and-bf16") - 1,
        "  - id: middle\n    when: {stage: middle_stages, pipeline: true}\n"
        "    status: NotSupported\n    reason: r\n",
        text,
    )
    table = dtypeplan.load_rules(write(tmp_path, text))
    assert table.gates[0].id == "middle" and table.gates[1].id == gate.id
    assert table.gates[0].when["stage"] == frozenset({1, 2})
    point = {**next(points()), "pipeline": True}
    assert [table.lookup({**point, "stage": s}).id for s in (1, 2)] == ["middle"] * 2
    assert table.lookup({**point, "stage": 0}).id == "stage0-data-parallel"


def test_unknown_set_name(tmp_path: Path) -> None:
    gate = GATE["fp8-shard-groups"]
    line = field_line(gate, "when")
    text = replace_line(line, "    when: {fp8: true, shard_groups: shard_group_any}")
    path = write(tmp_path, text)
    error = rules_error(path)
    assert_at(error, path, line)
    assert "shard_groups: unknown value 'shard_group_any'" in str(error)
    assert "sets: " in str(error) and "shard_groups_any" in str(error)


@pytest.mark.parametrize("name", ["fp32", "cpu", "hybrid", "tensorwise"])
def test_a_set_named_as_a_value_is_refused(tmp_path: Path, name: str) -> None:
    line = line_of(SHIPPED, "sets:")
    path = write(tmp_path, insert_after(line, f"  {name}: [fp32, bf16]"))
    error = rules_error(path)
    assert_at(error, path, line + 1)
    assert f"set name {name!r} is also a dimension value" in str(error)


def test_a_set_value_of_no_dimension_is_refused(tmp_path: Path) -> None:
    """A typo in a set (bf16_kahn) must not narrow every matcher that uses it in silence."""
    line = line_of(SHIPPED, "  bf16_masters:")
    path = write(tmp_path, replace_line(line, "  bf16_masters: [bf16, bf16_sr, bf16_kahn]"))
    with pytest.raises(RulesError, match="bf16_kahn"):
        dtypeplan.load_rules(path)


def test_not_matcher() -> None:
    states = GATE["autocast-optimizer-states"].when["states"]
    assert states == frozenset(STATES.values) - {"fp32"}
    recipe = GATE["fp8-all-gather-not-tensorwise"].when["fp8_recipe"]
    assert "tensorwise" not in recipe and len(recipe) == len(DIMENSIONS["fp8_recipe"].values) - 1


@pytest.mark.parametrize(
    ("matcher", "expected"),
    [
        ("{not: [fp32, bf16]}", set(STATES.values) - {"fp32", "bf16"}),
        (
            "{not: unquantized_states}",
            set(STATES.values) - {"fp32", "bf16", "fp32/bf16", "bf16/fp32"},
        ),
        ("{not: fp33}", "states: unknown value 'fp33'"),
        ('{not: "*"}', "states: unknown value"),
        ("{not: quantized_states, other: 1}", "other"),
    ],
)
def test_not_matcher_edited(tmp_path: Path, matcher: str, expected: Any) -> None:
    gate = GATE["autocast-optimizer-states"]
    line = field_line(gate, "when")
    path = write(
        tmp_path, replace_line(line, f"    when: {{autocast: [bf16, fp16], states: {matcher}}}")
    )
    if isinstance(expected, str):
        error = rules_error(path)
        assert_at(error, path, line)
        assert expected in str(error)
        return
    # The resolver's loader without declarations: the narrowed gate lets cells the
    # implementations do not declare through to the grid.
    table = load_rules(path)
    assert next(g for g in table.gates if g.id == gate.id).when["states"] == expected


def test_a_not_matcher_that_allows_nothing_is_refused(tmp_path: Path) -> None:
    gate = GATE["autocast-optimizer-states"]
    line = field_line(gate, "when")
    every = "[" + ", ".join(_matcher(v) for v in STATES.values) + "]"
    path = write(tmp_path, replace_line(line, f"    when: {{states: {{not: {every}}}}}"))
    error = rules_error(path)
    assert_at(error, path, line)
    assert "allows no value" in str(error)


def _zero3_point(**where: Any) -> dict[str, Any]:
    return {**next(points()), "stage": 3, "sharded": True, **where}


def test_unless_leaves_its_box_to_the_rules_after_the_gate() -> None:
    gate = GATE["hierarchical-partitioning"]
    assert gate.unless is not None
    served = _zero3_point(hierarchical_partitioning=True)
    assert TABLE.lookup(served).id == "zero3" and TABLE.lookup(served).status == "OK"
    assert not gate.matches(served)
    for where in (
        {"pipeline": True},
        {"stage": 2},
        {"master": "bf16", "params": "bf16"},
        {"reduction": "fp32_sum"},
    ):
        refused = {**served, **where}
        assert gate.matches(refused)
        # The first gate holding it decides: this one, or one before it.
        rule = TABLE.matching(refused)
        assert rule.gate and TABLE.gates.index(rule) <= TABLE.gates.index(gate), rule.id
    assert TABLE.lookup({**served, "pipeline": True}).id == gate.id


@pytest.mark.parametrize(
    ("unless", "message"),
    [
        ("{hierarchical_partitioning: true}", "holds its whole when"),
        ("{}", "holds its whole when"),
        ("{hierarchical_partitioning: false}", "shares no combination with its when"),
        ("{stage: 3, hierarchical_partitioning: false}", "shares no combination with its when"),
    ],
)
def test_an_unless_that_holds_all_or_none_of_its_gate_is_refused(
    tmp_path: Path, unless: str, message: str
) -> None:
    gate = GATE["hierarchical-partitioning"]
    line, _ = when_span(gate, "unless")
    path = write(tmp_path, replace_when(gate, f"    unless: {unless}", "unless"))
    error = rules_error(path)
    assert_at(error, path, line)
    assert f"gate {gate.id!r}: its unless {message}" in str(error)


def test_an_unless_with_an_unknown_value(tmp_path: Path) -> None:
    gate = GATE["offload-zero3"]
    line, _ = when_span(gate, "unless")
    path = write(
        tmp_path,
        replace_when(gate, "    unless: {stage: 3, shard_groups: [flat, hibrid]}", "unless"),
    )
    error = rules_error(path)
    assert_at(error, path, line)
    assert "shard_groups: unknown value 'hibrid'" in str(error)


def _move_before(text: str, moved: Rule, before: Rule) -> str:
    """``text`` with ``moved``'s block cut and put just before ``before``'s."""
    lines = text.splitlines(keepends=True)
    block = lines[moved.line - 1 : block_end(moved)]
    del lines[moved.line - 1 : block_end(moved)]
    at = next(n for n, line in enumerate(lines) if line == f"  - id: {before.id}\n")
    lines[at:at] = block
    return "".join(lines)


def test_the_first_gate_holding_a_point_decides_it(tmp_path: Path) -> None:
    point = {**next(points()), "params": "fp16", "fp8": True, "autocast": "bf16"}
    holding = [gate.id for gate in TABLE.gates if gate.matches(point)]
    assert holding[:3] == ["fp8-fp16-params", "fp8-autocast", "fp8-compute"]
    assert "autocast-with-16-bit-params" in holding
    assert TABLE.lookup(point).id == "fp8-fp16-params"
    # The same gates in another order: the one now first decides.
    text = _move_before(SHIPPED, GATE["fp8-autocast"], GATE["fp8-fp16-params"])
    table = dtypeplan.load_rules(write(tmp_path, text))
    assert table.lookup(point).id == "fp8-autocast"
    assert [g.id for g in table.gates if g.matches(point)][:2] == [
        "fp8-autocast",
        "fp8-fp16-params",
    ]
    # The deferral moved before the fp8 refusals takes all of fp8: they decide nothing.
    text = _move_before(SHIPPED, GATE["fp8-compute"], GATE["fp8-fp16-params"])
    path = write(tmp_path, text)
    error = rules_error(path)
    assert_at(error, path, line_of(text, "- id: fp8-fp16-params"))
    assert "gate 'fp8-fp16-params' decides nothing" in str(error)


def test_a_deferral_gate_decides_as_its_point_without_fp8() -> None:
    gate = GATE["fp8-compute"]
    assert gate.decide_as == {"fp8": False} and gate.status == "OK" and gate.implementation is None
    for stage, sharded, rule in (
        (0, False, "stage0-data-parallel"),
        (1, False, "zero1"),
        (2, True, "zero2"),
        (3, True, "zero3"),
    ):
        point = {
            **next(points()),
            "stage": stage,
            "sharded": sharded,
            "params": "bf16",
            "fp8": True,
            "fp8_execution": "emulated",
        }
        decided = TABLE.lookup(point)
        assert decided.id == f"fp8-compute+{rule}" and decided.decided_by == ("fp8-compute", rule)
        assert decided.implementation == GRID[rule].implementation
        assert decided.single_process_implementation == GRID[rule].single_process_implementation
        assert TABLE.matching(point) is gate
        assert TABLE.lookup({**point, "fp8": False}) is GRID[rule]
    # A refusal of the point without fp8 is the decision with fp8 too.
    point = {**next(points()), "fp8": True, "fp8_execution": "emulated", "offload_param": "nvme"}
    assert TABLE.lookup(point).decided_by == ("fp8-compute", "offload-nvme")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("    decide_as: {fp8: true}", "does not exclude that value"),
        ("    decide_as: {stage: 0}", "does not exclude that value"),
        ("    decide_as: {fp8: maybe}", "fp8: unknown value"),
        (None, "neither status nor decide_as"),
    ],
)
def test_a_bad_deferral_is_refused(tmp_path: Path, edit: str | None, message: str) -> None:
    gate = GATE["fp8-compute"]
    line = field_line(gate, "decide_as")
    text = delete_lines(line, line) if edit is None else replace_line(line, edit)
    path = write(tmp_path, text)
    error = rules_error(path)
    assert message in str(error), str(error)
    assert error.line in (line, gate.line)


def test_a_deferral_with_a_status_is_refused(tmp_path: Path) -> None:
    gate = GATE["fp8-compute"]
    line = field_line(gate, "decide_as")
    path = write(tmp_path, insert_after(line, "    status: NotSupported"))
    error = rules_error(path)
    assert_at(error, path, line + 1)
    assert "defers (decide_as) and names a status" in str(error)


def test_a_deferral_to_a_deferral_is_refused(tmp_path: Path) -> None:
    gate = GATE["fp8-compute"]
    block = SHIPPED.splitlines(keepends=True)[gate.line - 1 : block_end(gate)]
    second = (
        "".join(block)
        .replace("id: fp8-compute", "id: fp8-again")
        .replace("{fp8: true}", "{fp8: false, pipeline: true}")
        .replace("{fp8: false}", "{fp8: true}", 1)
    )
    # fp8-again defers fp8=false points to fp8=true ones, which fp8-compute defers back.
    text = insert_after(block_end(gate), second.rstrip("\n"))
    error = rules_error(write(tmp_path, text))
    assert "a deferral must reach a rule that decides" in str(error)


def test_a_gate_that_earlier_gates_cover_in_the_shipped_file_is_refused(tmp_path: Path) -> None:
    """A copy of a gate after it decides nothing (its original takes every point)."""
    gate = GATE["offload-nvme"]
    block = SHIPPED.splitlines(keepends=True)[gate.line - 1 : block_end(gate)]
    copy = "".join(block).replace("id: offload-nvme", "id: offload-nvme-again").rstrip("\n")
    text = insert_after(block_end(gate), copy)
    path = write(tmp_path, text)
    error = rules_error(path)
    assert_at(error, path, line_of(text, "- id: offload-nvme-again"))
    assert "gate 'offload-nvme-again' decides nothing" in str(error)


def test_a_grid_rule_the_shipped_gates_cover_is_refused(tmp_path: Path) -> None:
    """A grid rule for ZeRO-0 offload: the gates refuse all of it, so it decides nothing."""
    rule = (
        "  - id: stage0-offload\n    when: {stage: 0, offload_param: [cpu, nvme]}\n"
        "    status: NotSupported\n    reason: r"
    )
    text = SHIPPED.rstrip("\n") + "\n\n" + rule + "\n"
    path = write(tmp_path, text)
    error = rules_error(path)
    assert_at(error, path, line_of(text, "- id: stage0-offload"))
    assert "rule 'stage0-offload' decides nothing" in str(error)
    assert "offload" in str(error)


# --- implementations declare what they serve ---------------------------------------------------
@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test vanish with it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_SERVES", dict(registry._SERVES))


def _declaration_error(path: str) -> tuple[RulesError, Rule, str]:
    """The load error, the grid rule it names, and the implementation it names."""
    error = rules_error(path)
    message = str(error)
    assert "the rule claims more than the code does" in message, message
    rule = next(r for r in TABLE.grid if f"rule {r.id!r} sends " in message)
    implementation = message.split("to implementation ")[1].split("'")[1]
    return error, rule, implementation


def test_zero3_fp32_sum_routed_to_fsdp2_is_refused(tmp_path: Path) -> None:
    gate = GATE["zero3-fp32-sum"]
    text = delete_lines(gate.line, block_end(gate))
    path = write(tmp_path, text)
    error, rule, implementation = _declaration_error(path)
    assert rule.id.startswith("zero3") and implementation in ("fsdp2", "sharded")
    assert "reduction=fp32_sum" in str(error) and "stage=3" in str(error)
    assert_at(error, path, id_line(text, rule.id))


def test_gradient_prescaling_routed_to_sharded_is_refused(tmp_path: Path) -> None:
    gate, rule = GATE["gradient-prescaling"], GRID["zero1"]
    text = replace_when(
        rule,
        '    when: {stage: 1, master: "*", states: "*", autocast: "*", state_kind: "*", '
        'shard_groups: "*", offload_optimizer: [none, cpu], gradient_prescaling: "*"}',
    )
    line = line_of(text, "when: {gradient_prescaling: [prescale, predivide]}")
    text = replace_line(
        line, "    when: {gradient_prescaling: [prescale, predivide], stage: [0, 2, 3]}", text
    )
    path = write(tmp_path, text)
    error, named, implementation = _declaration_error(path)
    assert (named.id, implementation) == ("zero1", "sharded")
    assert "gradient_prescaling=prescale" in str(error) or "gradient_prescaling=predivide" in str(
        error
    )
    assert "stage=1" in str(error)
    assert_at(error, path, id_line(text, "zero1"))
    # The shipped file refuses it at the gate.
    assert (
        dtypeplan.load_rules()
        .lookup({**next(points()), "stage": 1, "gradient_prescaling": "prescale"})
        .id
        == gate.id
    )


def test_quantized_weights_routed_to_fsdp2_are_refused(tmp_path: Path) -> None:
    gate, rule = GATE["quantized-communication"], GRID["zero3"]
    # The grid rule first: the gate is above it, so its line stays put.
    text = replace_when(
        rule,
        '    when: {stage: 3, master: "*", states: "*", autocast: "*", state_kind: "*", '
        'shard_groups: [flat, hybrid], hierarchical_partitioning: "*", '
        "quantized_communication: [none, weights]}",
    )
    text = insert_after(
        field_line(gate, "when"),
        "    unless: {stage: 3, quantized_communication: weights, offload_optimizer: none, "
        "offload_param: none}",
        text,
    )
    path = write(tmp_path, text)
    error, named, implementation = _declaration_error(path)
    assert (named.id, implementation) == ("zero3", "fsdp2")
    assert "quantized_communication=weights" in str(error)
    assert_at(error, path, id_line(text, "zero3"))


def test_the_shipped_table_is_checked_against_the_declarations() -> None:
    """Every OK point of a sample lies in its implementation's declaration (the loader's check
    redone by matching the declared boxes point by point)."""
    declarations = registry.registered_declarations()
    boxes = {
        name: [
            _rules.grid_when(box)
            for box in ((*declared.serves, *declared.alone) if declared is not None else ())
        ]
        for name, declared in declarations.items()
    }
    checked = 0
    for point in _sample_points(3000) + _fp8_points(3000):
        rule = TABLE.lookup(point)
        if rule.status != "OK":
            continue
        for impl in (rule.implementation, rule.single_process_implementation):
            if impl is not None:
                assert any(all(point[d] in v for d, v in box.items()) for box in boxes[impl]), (
                    rule.id,
                    impl,
                    point,
                )
                checked += 1
    assert checked > 500


def test_an_implementation_without_serves_cannot_be_named_by_an_ok_rule(
    tmp_path: Path, clean_registry: None
) -> None:
    @dtypeplan.register("undeclared")
    class Undeclared(ReplicatedOptimizer):
        pass

    assert registry.registered_declarations()["undeclared"] is None
    rule = FIRST_OK
    line = field_line(rule, "implementation")
    path = write(tmp_path, replace_line(line, "    implementation: undeclared"))
    error = rules_error(path)
    assert f"rule {rule.id!r} sends " in str(error)
    assert "'undeclared', which declares nothing it serves" in str(error)
    assert_at(error, path, rule.line)
    # Declared, the same file loads and builds it.
    registry._SERVES["undeclared"] = Declaration(serves=tuple(dict(box) for box in REPLICATED))
    plan = dtypeplan.resolve({}, rules=path)
    assert plan.implementation == "undeclared"
    assert type(plan.build(torch.nn.Linear(2, 2).parameters())) is Undeclared


def test_a_narrow_declaration_refuses_a_wide_rule(tmp_path: Path, clean_registry: None) -> None:
    @dtypeplan.register("fp32_only", serves=[{"stage": 0, "sharded": False, "params": "fp32"}])
    class Fp32Only(ReplicatedOptimizer):
        pass

    rule = FIRST_OK
    line = field_line(rule, "implementation")
    path = write(tmp_path, replace_line(line, "    implementation: fp32_only"))
    error = rules_error(path)
    assert "'fp32_only', which does not declare that combination" in str(error)
    assert f"rule {rule.id!r} sends " in str(error)
    # The resolver's loader checks the declarations it is given, and only those.
    assert load_rules(
        path, implementations=["fp32_only", "replicated", "sharded", "fsdp2", "whole"]
    )
    with pytest.raises(RulesError, match="fp32_only"):
        load_rules(path, implementations={**registry.registered_declarations()})


@pytest.mark.parametrize(
    ("serves", "message"),
    [
        ([{"stages": 1}], "stages"),
        ([{"stage": 7}], "stage: unknown value"),
        ([{"master": "fp64"}], "master: unknown value"),
        ([{"stage": True}], "stage: unknown value"),
        ([{"master": {"not": "fp33"}}], "master: unknown value"),
    ],
)
def test_register_with_a_bad_declaration_raises(
    serves: list[dict[str, Any]], message: str, clean_registry: None
) -> None:
    with pytest.raises(RegistryError, match=message) as info:

        @dtypeplan.register("badly_declared", serves=serves)
        class Bad(ReplicatedOptimizer):
            pass

    assert "@register('badly_declared', serves=...)" in str(info.value)
    assert "badly_declared" not in dtypeplan.registered_names()
