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
from dtypeplan.resolver import (
    COMBINATIONS,
    DIMENSIONS,
    MAX_RULES,
    FrozenDict,
    Rule,
    RuleTable,
    Status,
    _rules,
    load_rules,
)
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


@dtypeplan.register("my_impl")
class MyOptimizer(ReplicatedOptimizer):
    """A user's implementation: the replicated optimizer, counting its steps."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps_taken = 0

    def step(self, closure: Any = None) -> Any:
        self.steps_taken += 1
        return super().step(closure)


# --- editing helpers -------------------------------------------------------------------------
# The rules are picked by what they are (the first rule, the first OK rule, ...), not by id, so
# the tests keep working as cells of the shipped table change status.
TABLE = dtypeplan.load_rules()
RULES = sorted(TABLE.rules, key=lambda rule: rule.line)
FIRST, LAST = RULES[0], RULES[-1]
FIRST_OK = next(rule for rule in RULES if rule.status == "OK")
NOT_OK = [rule for rule in RULES if rule.status != "OK"]


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
def _box_size(rule: Rule) -> int:
    return math.prod(
        len(rule.when[name]) if name in rule.when else len(dim.values)
        for name, dim in DIMENSIONS.items()
    )


def _disjoint(first: Rule, second: Rule) -> bool:
    return any(
        not (first.when[name] & second.when[name])
        for name in DIMENSIONS
        if name in first.when and name in second.when
    )


def test_shipped_table_loads_and_covers_every_point_once() -> None:
    """Checked apart from the loader's split: rule boxes pairwise disjoint, and their sizes sum
    to the whole space, is exactly "every point matched once"."""
    table = dtypeplan.load_rules()
    assert isinstance(table, RuleTable)
    for first, second in itertools.combinations(table.rules, 2):
        assert _disjoint(first, second), (first.id, second.id)
    assert sum(_box_size(rule) for rule in table.rules) == COMBINATIONS
    assert COMBINATIONS == math.prod(len(dim.values) for dim in DIMENSIONS.values())
    registered = set(dtypeplan.registered_names())
    for rule in table.rules:
        # A deferring rule names no implementation: the rule it defers to decides.
        assert (rule.status == "OK" and not rule.decide_as) == (rule.implementation is not None)
        if rule.implementation is not None:
            assert rule.implementation in registered
        assert SHIPPED.splitlines()[rule.line - 1] == f"  - id: {rule.id}"


def _sample_points(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Every core point (features unused) and ``count`` points drawn from the whole space."""
    rng = random.Random(seed)
    drawn = [
        {name: rng.choice(dim.values) for name, dim in DIMENSIONS.items()} for _ in range(count)
    ]
    return list(points()) + drawn


def _core_error(table: RuleTable, point: dict[str, Any]) -> Rule | None:
    """The Error rule of the point's core (features unused), found by matching, not lookup."""
    (core,) = [r for r in table.rules if r.matches({**point, **FEATURES_UNUSED})]
    return core if core.status == "Error" else None


def test_lookup_is_the_one_matching_rule() -> None:
    table = dtypeplan.load_rules()
    for point in _sample_points(3000) + _fp8_points(2000):
        matching = [rule for rule in table.rules if rule.matches(point)]
        assert len(matching) == 1, (point, [r.id for r in matching])
        rule = matching[0]
        assert table.matching(point) is rule
        decided = table.lookup(point)
        own = rule
        if rule.decide_as:
            # A deferral: the one rule of the point with the deferred values decides.
            deferred = {**point, **rule.decide_as}
            (base,) = [r for r in table.rules if r.matches(deferred)]
            assert not base.decide_as
            own = base
        core = _core_error(table, point)
        if core is not None and own.status != "Error":
            # The precedence: the core settings' contradiction decides whatever the features.
            overruled = f"{rule.id}+{own.id}" if rule.decide_as else rule.id
            assert (decided.id, decided.status, decided.overrules) == (core.id, "Error", overruled)
            assert core.reason in decided.reason and decided.implementation is None
            assert decided.matches(point)
        elif rule.decide_as:
            assert decided.decided_by == (rule.id, own.id)
            assert (decided.status, decided.implementation) == (own.status, own.implementation)
            assert decided.matches(point) and rule.reason in decided.reason
        else:
            assert decided is rule


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
    """Stage 0 with a sharded accumulator, stage 2 or 3 with ``sharded: false``: an Error
    with the contradiction's reason at every core point, crossed with every value of every
    feature (alone, and with fp8 on beside it), never a feature's NotSupported or OK."""
    table = dtypeplan.load_rules()
    checked = 0
    for point in CORE_CONTRADICTIONS:
        core = table.lookup(point)
        assert core.status == "Error" and "sharded" in core.reason, core.id
        for name, value in _every_feature_value():
            for fp8 in (False, True):
                fp8_on = fp8 or bool(FEATURE_DIMENSIONS[name].requires)
                at = {**point, name: value} | ({"fp8": True} if fp8_on else {})
                rule = table.lookup(at)
                assert rule.status == "Error", (at, rule.id)
                if rule.overrules is None:
                    # An Error of its own (bf16 masters of fp32 parameters, fp8 without its
                    # kernels, or the contradiction restated for the feature): it names a
                    # contradiction too.
                    assert rule.id == table.matching(at).id or rule.decided_by, rule.id
                else:
                    assert rule.id == core.id and core.reason in rule.reason
                    assert rule.overrules.split("+")[0] == table.matching(at).id
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
                    if name in ("shard_groups", "state_kind") and name not in rule.when:
                        # A rule that does not name the layout decides every layout as it
                        # decides the flat one (the layout changes only where states live);
                        # one that does not name the state kind decides every kind as it
                        # decides moments (fp32 states are torch's own).
                        assert rule is table.lookup(point), (value, rule.id)
                    else:
                        assert rule.reason and dim.name in rule.when, (name, rule.id)
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
    line = field_line(LAST, "when")
    path = write(tmp_path, replace_line(line, "    when: {params: fp32, stages: 3}"))
    error = rules_error(path)
    assert_at(error, path, line)
    assert "'stages'" in str(error)


def test_unknown_top_level_key(tmp_path: Path) -> None:
    line = line_of(SHIPPED, "version: 1")
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
    assert "matched by no rule" in str(error)


def test_overlap(tmp_path: Path) -> None:
    # Widen the last rule to every point: for the first point that another rule also matches,
    # the widened rule is the second match in file order, so its line is the one named.
    line = field_line(LAST, "when")
    path = write(tmp_path, replace_line(line, "    when: {}"))
    error = rules_error(path)
    assert_at(error, path, LAST.line)
    assert "overlap" in str(error) and repr(LAST.id) in str(error)


def test_overlap_names_both_rules_and_their_lines(tmp_path: Path) -> None:
    line = field_line(FIRST, "when")
    path = write(tmp_path, replace_line(line, "    when: {}"))
    error = rules_error(path)
    assert f"{FIRST.id!r} (line {FIRST.line})" in str(error)
    other = next(rule for rule in RULES if rule is not FIRST and repr(rule.id) in str(error))
    assert_at(error, path, other.line)


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
    when = schema["properties"]["rules"]["items"]["properties"]["when"]["propertyNames"]
    assert when["enum"] == list(DIMENSIONS)


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


def _rule_text(number: int, point: dict[str, Any], status: str = "NotSupported") -> str:
    when = ", ".join(f"{name}: {_matcher(value)}" for name, value in point.items())
    return f"  - id: r{number}\n    when: {{{when}}}\n    status: {status}\n    reason: r\n"


def _matcher(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    return value_text(value)


def _generated(rules: list[str]) -> str:
    head = SHIPPED[: SHIPPED.index("\nrules:")]
    return head + "\nrules:\n" + "".join(rules)


def _staircase(first: int, start: int) -> list[str]:
    """Rules for every point where a feature from the ``first``-th on is in use (the last
    feature in use decides); numbered from ``start``."""
    names = list(FEATURE_DIMENSIONS)
    rules = []
    for position in range(first, len(names)):
        dim = FEATURE_DIMENSIONS[names[position]]
        when: dict[str, Any] = {dim.name: [v for v in dim.values if v != dim.default_value]}
        when.update({later: FEATURES_UNUSED[later] for later in names[position + 1 :]})
        rules.append(_rule_text(start + len(rules), when))
    return rules


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
    # A guard against checking points one by one (minutes), not a timing: the bound leaves
    # room for a loaded 2-core machine.
    assert elapsed < 20.0, f"{len(table.rules)} rules took {elapsed:.1f} s"


def _rule(number: int, when: dict[str, Any]) -> Rule:
    """A rule built in memory, for timing the coverage check without YAML and the schema."""
    return Rule(
        id=f"r{number}",
        when=FrozenDict({k: frozenset(v if isinstance(v, list) else [v]) for k, v in when.items()}),
        status=Status.NOT_SUPPORTED,
        implementation=None,
        single_process_implementation=None,
        reason="r",
        line=number + 1,
    )


def _staircase_whens(first: int) -> list[dict[str, Any]]:
    names = list(FEATURE_DIMENSIONS)
    whens = []
    for position in range(first, len(names)):
        dim = FEATURE_DIMENSIONS[names[position]]
        when: dict[str, Any] = {dim.name: [v for v in dim.values if v != dim.default_value]}
        when.update({later: FEATURES_UNUSED[later] for later in names[position + 1 :]})
        whens.append(when)
    return whens


def test_a_rule_per_point_of_the_core_and_three_features_checks_fast() -> None:
    """20736 one-point rules over the core dimensions and master x states (fp32, bf16) x
    autocast (the features after them unused), one box for the other states values, and a
    staircase for the rest: the 239 million points are checked through about 20 thousand
    boxes."""
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
    index = _rules._check_coverage(rules, "generated.yaml", 1)
    elapsed = time.perf_counter() - start
    table = RuleTable(path="generated.yaml", defaults=TABLE.defaults, rules=rules, index=index)
    assert all(table.lookup(p).id == f"r{i}" for i, p in enumerate(all_points))
    # A guard against a pairwise check (20 thousand rules squared takes many minutes), not a
    # timing: it takes about 3 s on an idle core, and other work on the machine must not fail it.
    assert elapsed < 30.0, f"{len(rules)} rules took {elapsed:.1f} s"


def test_a_rule_the_precedence_overrules_everywhere_is_refused(tmp_path: Path) -> None:
    """A feature's rule inside a core contradiction would decide nothing: refused on load."""
    unused = [v for v in FEATURE_DIMENSIONS["master"].values if v != "fp32"]
    rules = [
        _rule_text(0, {"stage": 0, "sharded": True, "master": "fp32"}, status="Error"),
        _rule_text(1, {"stage": 0, "sharded": True, "master": unused}),
        _rule_text(2, {"stage": [1, 2, 3]}),
        _rule_text(3, {"stage": 0, "sharded": False}),
    ]
    with pytest.raises(RulesError, match="rule 'r1' decides nothing"):
        dtypeplan.load_rules(write(tmp_path, _generated(rules)))
    rules[1] = _rule_text(1, {"stage": 0, "sharded": True, "master": unused}, status="Error")
    table = dtypeplan.load_rules(write(tmp_path, _generated(rules)))
    point = {**next(points()), "stage": 0, "sharded": True, "master": "bf16"}
    assert table.lookup(point).id == "r1"


def test_ten_thousand_copies_of_a_rule_fail_fast_with_an_overlap() -> None:
    point = next(points())
    rules = tuple(_rule(i, point) for i in range(10_000))
    start = time.perf_counter()
    with pytest.raises(RulesError) as info:
        _rules._check_coverage(rules, "generated.yaml", 1)
    elapsed = time.perf_counter() - start
    assert "'r0' (line 1) and 'r1' overlap" in str(info.value)
    assert info.value.line == 2
    # A guard against checking every pair before refusing (minutes), not a timing.
    assert elapsed < 20.0, f"10000 rules took {elapsed:.1f} s to refuse"


def test_more_rules_than_points_fail_before_parsing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real bound is one rule per point (18 million); a small one shows the message.
    monkeypatch.setattr(_rules, "MAX_RULES", 100)
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


def test_gap_names_the_first_point_and_the_rules_nearest_to_it(tmp_path: Path) -> None:
    core = list(points())
    missing = core[5]
    rules = [_rule_text(i, p) for i, p in enumerate(core) if p is not missing]
    text = _generated(rules + _staircase(0, len(core)))
    path = write(tmp_path, text)
    error = rules_error(path)
    assert_at(error, path, line_of(text, "rules:"))
    shown = ", ".join(f"{name}={value_text(missing[name])}" for name in DIMENSIONS)
    assert f"1 combination(s) are matched by no rule: {shown}" in str(error)
    # The rules of the box the missing point was split from: at least its neighbour r4 or r6.
    assert "the rules nearest to it leave out " in str(error)
    assert "'r4' (line" in str(error) or "'r6' (line" in str(error)


def test_gaps_in_the_features_are_counted_as_boxes(tmp_path: Path) -> None:
    # Without the staircase every point that uses a feature is a gap: all but the core points.
    rules = [_rule_text(i, p) for i, p in enumerate(points())]
    path = write(tmp_path, _generated(rules))
    error = rules_error(path)
    assert f"{COMBINATIONS - CORE_COMBINATIONS} combination(s)" in str(error)
