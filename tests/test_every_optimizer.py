"""The table's promise for every elementwise optimizer (issue 30): a point the table marks OK
builds and trains with parity against fp32 ``torch.optim``, whichever elementwise class and way
in (the config's optimizer block, ``build(optimizer=...)``, ``wrap(...)``); a point it refuses
is refused at ``resolve`` with a reason that names a setting of the rule, and ``build`` raises.

Points are drawn from what every gate and rule of the loaded table decides (``RuleTable.
decided``: each dimension a value of one of its boxes; the optimizer's ``state_kind`` is its
class's), :data:`OK_DRAWS` of them from each OK rule, crossed with the optimizers of
:data:`OPTIMIZERS` and the three ways in.

Bounds: a point whose parameters, accumulator, wire, masters and states are all fp32 does
torch's fp32 math on flat chunks (the same elementwise operations, another reduction order
across ranks): 1e-5 relative on the loss and the masters. Every other OK point stores
something in bf16 (8 significant bits, 2**-9 relative per rounding) or 8-bit codes (fp8 e4m3:
2**-4; int8 dynamic tree: 6.6-12.3%): over 3 steps with the hyperparameters of
``CLIENT_HYPERPARAMETERS`` the first steps amplify the bf16 forward's ~1e-3 loss noise into the
masters; the bound is the suite's low-precision one (1e-2 on the loss, 2e-2 on the masters,
tests/_helpers.py), measured worst 1.4e-2 (Adagrad, bf16 masters rounded stochastically, 5
steps).

The default run draws a few points in one process and trains a fixed handful on two ranks;
``-m slow`` takes every rule x optimizer x way in one process, and every OK rule x optimizer
on two ranks, and prints the counts.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
import zlib
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtypeplan
from dtypeplan.launch import spawn
from dtypeplan.resolver._boxes import FULL, intersect, with_values
from dtypeplan.resolver._dimensions import CORE_DIMENSIONS, DIMENSIONS, config_for
from dtypeplan.resolver._effective import fp8_execution
from dtypeplan.resolver._optimizer_kind import state_kind
from dtypeplan.resolver._rules import Rule
from tests._helpers import (
    CLIENT_HYPERPARAMETERS,
    FP32_RTOL,
    LOW_PRECISION_LOSS_RTOL,
    LOW_PRECISION_MASTER_RTOL,
    full_matrices,
)
from tests.workers import every_optimizer as worker

TABLE = dtypeplan.load_rules()

OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    **{name: (name, hyper) for name, hyper in CLIENT_HYPERPARAMETERS.items()},
    # Adagrad's first step is lr * sign(g) (its sum is g**2): a bf16 gradient that rounds
    # to the other sign moves that weight by 2 lr, so its lr is Adam's, for the same bound.
    "Adagrad": ("Adagrad", {"lr": 1e-2, "lr_decay": 0.01}),
    "SGD-dampening": ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.5}),
    "SGD-plain": ("SGD", {"lr": 0.05}),
    "AdamW-fused": ("AdamW", {"lr": 1e-2, "fused": True}),
    "SGD-foreach": ("SGD", {"lr": 0.05, "momentum": 0.9, "foreach": True}),
}
"""Every elementwise ``torch.optim`` class with the options that add states, and the fast-path
choices (``fused``, ``foreach``) that every way in accepts and gives way to dtypeplan's."""

WAYS = ("config", "build", "wrap")
STEPS = 3

# What one process can run of a feature: no shard groups (a group of several ranks), and the
# values a rule matches otherwise.
_SINGLE_PROCESS_FIXED = {"shard_groups": "flat"}


@functools.cache
def _decided(rule: Rule) -> list[tuple[int, ...]]:
    return TABLE.decided(rule)


def _rule_point(rule: Rule, name: str, rng: random.Random) -> dict[str, Any] | None:
    """A point ``rule`` decides (a box of ``RuleTable.decided``: past the gates before it) for
    optimizer class ``name`` (None: the rule decides none): each dimension a value of the
    box, the default where it is one for the features that one process cannot run
    otherwise."""
    boxes = _decided(rule)
    for box in rng.sample(boxes, len(boxes)):
        point = _box_point(box, name, rng)
        if point is not None:
            return point
    return None


def _decides_for_elementwise(rule: Rule) -> bool:
    """Whether ``rule`` decides a point of an elementwise class (on flat shards)."""
    flat_elementwise = with_values(FULL, {"optimizer": "elementwise", "param_access": "flat"})
    return any(intersect(box, flat_elementwise) is not None for box in _decided(rule))


def _box_point(box: tuple[int, ...], name: str, rng: random.Random) -> dict[str, Any] | None:
    point: dict[str, Any] = {}
    for position, (dim_name, dim) in enumerate(DIMENSIONS.items()):
        values = [v for i, v in enumerate(dim.values) if box[position] >> i & 1]
        if dim_name == "optimizer":
            want: Any = "elementwise"
        elif dim_name == "param_access":
            want = "flat"  # an elementwise class runs on flat shards
        elif dim_name == "state_kind":
            want = state_kind(getattr(torch.optim, name))
        elif dim_name in _SINGLE_PROCESS_FIXED and _SINGLE_PROCESS_FIXED[dim_name] in values:
            want = _SINGLE_PROCESS_FIXED[dim_name]
        else:
            want = rng.choice(values)
        if want not in values:
            return None
        point[dim_name] = want
    return point


_EMULATE = {"native": "auto", "emulated": "true", "unavailable": "false"}
"""The ``fp8.emulate`` each ``fp8_execution`` value's config fragment sets."""
_TRIES = 8


def _as_resolved(point: dict[str, Any]) -> dict[str, Any]:
    """``point`` as ``resolve`` reads the config written for it (``config_for``) on this
    machine: ``fp8_execution`` is what ``fp8.emulate`` gives on this device (auto: native
    only where it has the kernels); qgZ with shard groups and no other wire across named is
    the int8 wire (and no longer quantized communication); a wire across named as the
    communication dtype is plain ``hybrid``."""
    emulate = _EMULATE[point["fp8_execution"]]
    resolved = {**point, "fp8_execution": fp8_execution(point["fp8_recipe"], emulate)}
    layout, quantized = point["shard_groups"], point["quantized_communication"]
    if quantized in ("gradients", "both") and layout in ("hybrid", "hybrid_int8"):
        resolved["shard_groups"] = "hybrid_int8"
        resolved["quantized_communication"] = "weights" if quantized == "both" else "none"
    if resolved["shard_groups"] == f"hybrid_{point['comm']}":
        resolved["shard_groups"] = "hybrid"
    return resolved


def _decides_itself(rule: Rule, decided: Rule) -> bool:
    """Whether ``decided`` (a lookup) is ``rule``'s own decision: the rule, or its deferral,
    not a core contradiction's Error that overrules it."""
    return decided.id == rule.id or decided.decided_by[:1] == (rule.id,)


def case_for(rule: Rule, label: str, way: str, seed: int) -> dict[str, Any] | None:
    """The case of ``rule`` x optimizer ``label`` x ``way`` (None where the rule has no point
    for that optimizer's kind); ``seed`` picks the point within the rule, preferring one that
    the rule decides itself (not overruled by the Error of a core contradiction). What the
    case expects is the table's lookup of the point as ``resolve`` reads it: the rule, its
    deferral (``fp8-compute+zero1``: the rule of the point without fp8 decides), or the core
    Error."""
    name, hyper = OPTIMIZERS[label]
    rng = random.Random(seed)
    for _ in range(_TRIES):
        point = _rule_point(rule, name, rng)
        if point is None:
            return None
        decided = TABLE.lookup(_as_resolved(point))
        if _decides_itself(rule, decided):
            break
    chosen = {
        dim_name: value
        for dim_name, value in point.items()
        if dim_name in CORE_DIMENSIONS or value != DIMENSIONS[dim_name].default_value
    }
    config = config_for(chosen)
    config.pop("optimizer", None)
    # The parameter dtype as the point says (the master values' fragments enable bf16).
    config.setdefault("bf16", {})["enabled"] = point["params"] in ("bf16", "fp16+bf16")
    config.setdefault("fp16", {})["enabled"] = point["params"] in ("fp16", "fp16+bf16")
    # Small buckets, so that the model spans several; a low initial fp16 scale, so that no
    # step overflows and is skipped (correct, but another trajectory than the reference).
    config.setdefault("zero_optimization", {})["reduce_bucket_size"] = 700
    if point["params"] == "fp16" or point["autocast"] == "fp16":
        # fp16 autocast scales the loss with the fp16 block's scaler too.
        config["fp16"] = {**config.get("fp16", {}), "initial_scale_power": 4}
    if point["hierarchical_partitioning"]:
        # hpZ's size divides the world (config_for writes a node's 8); 2 is the two-rank group
        # here, and one process runs the flat sharded engine, which has no secondary gather.
        config["zero_optimization"]["zero_hpz_partition_size"] = 2
    if way == "config":
        config["optimizer"] = {"type": name, "params": hyper}
    return {
        "rule": decided.id,
        "drawn_from": rule.id,
        "point": _as_resolved(point),
        "label": label,
        "name": name,
        "hyper": hyper,
        "way": way,
        "config": config,
        "pipeline": point["pipeline"],
        "expect": str(decided.status),
        "steps": STEPS,
        "seed": seed % 100,
        # Shard groups divide a group of several ranks (one process has none to divide);
        # offloaded ZeRO-3 runs on FSDP2, which needs a process group. A refusal is resolve's
        # and build's answer before any collective: one process asks it.
        "ranks": 1
        if (point["shard_groups"] == "flat" and point["offload_param"] == "none")
        or decided.status != "OK"
        else 2,
    }


def _tokens(rule: Rule, point: dict[str, Any]) -> set[str]:
    """The words of the settings a refusal can name: each dimension the rule names, by its
    name and its config keys."""
    words: set[str] = set()
    for dim_name in rule.when:
        dim = DIMENSIONS[dim_name]
        words.add(dim_name)
        words.update(w for w in re.split(r"[^A-Za-z0-9_]+", dim.config_key) if len(w) > 3)
    return words


def _exact(point: dict[str, Any]) -> bool:
    return (
        point["params"] == point["accum"] == point["comm"] == "fp32"
        and point["master"] == "fp32"
        and point["states"] == "fp32"
        and point["autocast"] == "none"
    )


def check(case: dict[str, Any], result: dict[str, Any]) -> str:
    """Assert what the table promises for ``case``; return how it went (``parity`` or
    ``refused``)."""
    where = f"{case['rule']} x {case['label']} x {case['way']}"
    assert result["status"] != "raised", f"{where}: {result.get('error')}"
    assert result["rule"] == case["rule"], (where, result["rule"])
    if case["expect"] != "OK":
        assert result["status"] == case["expect"], (where, result)
        reason = result["reason"]
        words = _tokens(TABLE.lookup(case["point"]), case["point"])
        assert any(word in reason for word in words), (
            f"{where}: the reason names no setting of the rule: {reason}"
        )
        assert result["raised"], f"{where}: build did not raise for a {case['expect']} plan"
        return "refused"
    loss_rtol, master_rtol = (
        (FP32_RTOL, FP32_RTOL)
        if _exact(case["point"])
        else (LOW_PRECISION_LOSS_RTOL, LOW_PRECISION_MASTER_RTOL)
    )
    for step, (mine, ref) in enumerate(zip(result["losses"], result["ref_losses"], strict=True)):
        assert abs(mine - ref) <= loss_rtol * abs(ref) + 1e-7, (where, step, mine, ref)
    assert result["master_rel_error"] <= master_rtol, (where, result["master_rel_error"])
    return "parity"


OK_DRAWS = 6
"""Points drawn from each OK rule of the grid per optimizer and way: a grid rule spans many
cells (masters, states, autocast, offload, shard groups), a gate one refusal."""


def _all_cases(
    ways: tuple[str, ...] = WAYS, ok_only: bool = False, sample: int = 1
) -> list[dict[str, Any]]:
    """Each rule's cases for every optimizer and way; with ``sample`` > 1, one (optimizer, way)
    pair in ``sample`` per rule, offset by the rule's place (every rule keeps a case)."""
    cases = []
    for number, rule in enumerate(TABLE.rules):
        draws = OK_DRAWS if rule.status == "OK" and not rule.gate else 1
        kept: list[dict[str, Any]] = []
        spare: list[dict[str, Any]] = []
        for pair, (label, way) in enumerate(itertools.product(OPTIMIZERS, ways)):
            for draw in range(draws):
                seed = zlib.crc32(f"{rule.id}/{label}/{way}/{draw}".encode())
                case = case_for(rule, label, way, seed)
                if case is not None and (not ok_only or case["expect"] == "OK"):
                    (kept if (pair + number) % sample == 0 else spare).append(case)
        cases += kept or spare[:1]
    return cases


@settings(
    max_examples=max(8, settings.default.max_examples // 12),
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_a_drawn_point_is_what_the_table_says(data: st.DataObject) -> None:
    rule = data.draw(st.sampled_from(TABLE.rules), label="rule")
    label = data.draw(st.sampled_from(sorted(OPTIMIZERS)), label="optimizer")
    way = data.draw(st.sampled_from(WAYS), label="way")
    case = case_for(rule, label, way, data.draw(st.integers(0, 2**31), label="seed"))
    if case is None or case["ranks"] > 1:
        return  # the rule is about another state kind than this class's, or needs a group
    (result,) = worker.run(0, 1, [case])
    check(case, result)


# Two ranks, the low-precision cells of optimizers other than Adam/AdamW at ZeRO 0-3.
_TWO_RANK_SAMPLE = [
    ("SGD", {"optimizer_states": "bf16", "zero_optimization": {"stage": 1}}),
    ("Adagrad", {"optimizer_states": "int8", "zero_optimization": {"stage": 3}}),
    (
        "RMSprop",
        {
            "optimizer_states": {"exp_avg": "fp8", "exp_avg_sq": "bf16"},
            "zero_optimization": {"stage": 2},
        },
    ),
    ("Adam", {"optimizer_states": "fp8", "zero_optimization": {"stage": 0}}),
    (
        "NAdam",
        {
            "bf16": {"enabled": True},
            "master_weights": {"dtype": "bf16", "rounding": "stochastic"},
            "zero_optimization": {"stage": 2},
        },
    ),
    (
        "Adamax",
        {
            "bf16": {"enabled": True},
            "master_weights": {"dtype": "bf16", "rounding": "kahan"},
            "optimizer_states": "bf16",
            "zero_optimization": {"stage": 3},
        },
    ),
    ("Rprop", {"optimizer_states": "bf16", "zero_optimization": {"stage": 3}}),
]


def _two_rank_case(name: str, config: dict[str, Any], way: str) -> dict[str, Any]:
    hyper = CLIENT_HYPERPARAMETERS[name]
    full = {**config, "optimizer": {"type": name, "params": hyper}} if way == "config" else config
    plan = dtypeplan.resolve(full)
    assert plan.status == "OK", plan.explain()
    return {
        "rule": plan.rule_id,
        "point": None,
        "label": name,
        "name": name,
        "hyper": hyper,
        "way": way,
        "config": full,
        "pipeline": False,
        "expect": "OK",
        "steps": STEPS,
        "seed": 0,
        "exact": False,
    }


@pytest.mark.slow
def test_low_precision_cells_of_other_optimizers_on_two_ranks() -> None:
    cases = [
        _two_rank_case(name, config, WAYS[i % 3])
        for i, (name, config) in enumerate(_TWO_RANK_SAMPLE)
    ]
    per_rank = spawn(worker.run, 2, cases, timeout_s=600)
    for case, result in zip(cases, per_rank[0], strict=True):
        where = f"{case['rule']} x {case['name']} x {case['way']}"
        assert result["status"] == "OK", (where, result.get("error"))
        for mine, ref in zip(result["losses"], result["ref_losses"], strict=True):
            assert abs(mine - ref) <= LOW_PRECISION_LOSS_RTOL * abs(ref), (where, mine, ref)
        assert result["master_rel_error"] <= LOW_PRECISION_MASTER_RTOL, where


KNOWN_FAILURES: dict[tuple[int, str, str], str] = {}
"""Failing cases known and named, by ``(ranks, rule drawn from, optimizer label)``."""


def _counts(
    cases: list[dict[str, Any]], results: list[dict[str, Any]], ranks: int, failures: list[str]
) -> Counter:
    """``(ranks, parity | refused | failed | known failure)`` counts; each unknown failure's
    message into ``failures`` (every case is checked, so that one failure hides no other)."""
    counts: Counter = Counter()
    for case, result in zip(cases, results, strict=True):
        try:
            counts[(ranks, check(case, result))] += 1
        except AssertionError as error:
            if (ranks, case["drawn_from"], case["label"]) in KNOWN_FAILURES:
                counts[(ranks, "known failure")] += 1
                continue
            counts[(ranks, "failed")] += 1
            failures.append(f"{ranks} ranks: {str(error).splitlines()[0][:400]}")
    return counts


@pytest.mark.slow
def test_every_rule_every_optimizer_every_way() -> None:
    # Whole under DTYPEPLAN_FULL_MATRICES=1 (about 2.5 minutes); CI takes a third of each
    # rule's (optimizer, way) pairs, in turn, and every rule.
    sample = 1 if full_matrices() else 3
    every = _all_cases(sample=sample)
    cases = [c for c in every if c["ranks"] == 1]
    results = worker.run(0, 1, cases)
    failures: list[str] = []
    counts = _counts(cases, results, 1, failures)
    group = [c for c in every if c["ranks"] == 2]
    group += [
        c for c in _all_cases(ways=("config",), ok_only=True, sample=sample) if c["ranks"] == 1
    ]
    per_rank = spawn(worker.run, 2, group, timeout_s=3000)
    counts += _counts(group, per_rank[0], 2, failures)
    rules = {c["drawn_from"] for c in every}
    overruled = sum(c["rule"] != c["drawn_from"] and "+" not in c["rule"] for c in every)
    print(
        f"\n{len(rules)} rules x {len(OPTIMIZERS)} optimizers x {len(WAYS)} ways "
        f"({len(every)} cases, {overruled} decided by a core contradiction's Error): "
        f"{dict(counts)}"
    )
    print("\n".join(failures))
    # Every rule with a point for an elementwise optimizer (the shaped-optimizer rule is for
    # the others: tests/test_optimizer_names.py).
    assert rules == {r.id for r in TABLE.rules if _decides_for_elementwise(r)}
    assert not failures, f"{len(failures)} cases: " + "\n".join(failures[:20])
    known = sum(n for (_, outcome), n in counts.items() if outcome == "known failure")
    if known:
        pytest.xfail(f"{known} known failing cases: " + "; ".join(KNOWN_FAILURES.values()))
