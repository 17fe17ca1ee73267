"""torch's own catalogue of optimizer inputs (``common_optimizers.optim_db``), with torch as the
oracle, and parameters whose first gradient comes late.

Every CPU input of every elementwise class (``_get_optim_inputs_including_global_cliquey_kwargs``:
``optim_inputs_func(device="cpu")`` with torch's ``foreach`` / ``fused`` / ``differentiable``
variants), plus ``foreach=True`` and ``capturable=True`` for each, goes through ``plan.build``
and ``plan.wrap``: stage 0 in one process, stages 0-3 on 2 ranks (one spawned group for every
2-rank case). An input either matches plain fp32 ``torch.optim`` on the full batch, or is
refused at build/wrap by an error that names the argument that cannot apply (``capturable``
on a CPU group, ``differentiable``). No input may train to other numbers.

Tolerance: fp32 on both sides; the only differences are the order of the sums (two ranks'
slices, averaged, against the full batch; fused or foreach kernels against torch's default
path), an ulp or two per step. Over 3 steps, relative to the largest parameter: ``FP32_RTOL``,
8 fp32 eps (measured: 3.1e-7 in one process, 2.4e-7 on 2 ranks). A wrong step count or state
is off by far more (Adagrad's dropped accumulator: 1.7e-2; a late head's step count: 0.19).
"""

from __future__ import annotations

import collections
import inspect
from typing import Any

import pytest
import torch
from torch.testing._internal.common_optimizers import (
    _get_optim_inputs_including_global_cliquey_kwargs,
    optim_db,
)

import dtypeplan
from dtypeplan.launch import spawn
from dtypeplan.resolver._optimizer_kind import ELEMENTWISE
from tests._helpers import full_matrices
from tests.workers.optim_db import STEPS, run_cases

FP32_RTOL = 8 * torch.finfo(torch.float32).eps
LOW_PRECISION_RTOL = 2e-2
"""bf16 parameters and masters against fp32 torch (8 mantissa bits), as test_parity.py."""
STAGES = (0, 1, 2, 3)
HOWS = ("build", "wrap")
SWITCH_REFUSED = ("capturable", "differentiable")
"""Arguments that cannot apply here: the refusal must name them."""


def _inputs() -> list[dict[str, Any]]:
    """Every catalogue input of the elementwise classes, with ``foreach`` and ``capturable``
    added to each base input where the class takes them."""
    found = []
    for info in optim_db:
        if info.optim_cls not in ELEMENTWISE:
            continue
        name = info.optim_cls.__name__
        accepted = inspect.signature(info.optim_cls.__init__).parameters
        variants = _get_optim_inputs_including_global_cliquey_kwargs("cpu", None, info)
        for base in info.optim_inputs_func(device="cpu"):
            extra = []
            if "foreach" in accepted:
                extra.append({**base.kwargs, "foreach": True})
            if "capturable" in accepted:
                extra.append({**base.kwargs, "capturable": True})
            variants += [type(base)(params=None, kwargs=k, desc=base.desc) for k in extra]
        for variant in variants:
            assert variant.params is None, "the catalogue's CPU inputs take the model's params"
            found.append({"optimizer": name, "kwargs": dict(variant.kwargs), "desc": variant.desc})
    return found


INPUTS = _inputs()


def _expected_refusal(kwargs: dict[str, Any]) -> str | None:
    for switch in SWITCH_REFUSED:
        if kwargs.get(switch):
            return switch
    return None


def _check(cases: list[dict[str, Any]], results: list[dict[str, Any]]) -> collections.Counter:
    outcomes: collections.Counter = collections.Counter()
    wrong = []
    for case, result in zip(cases, results, strict=True):
        label = f"{case['optimizer']} {case['kwargs']} stage {case['stage']} {case['how']}"
        cause = _expected_refusal(case["kwargs"])
        if cause is not None:
            if result["outcome"] != "refused" or cause not in result["error"]:
                wrong.append(f"{label}: expected a refusal naming {cause}, got {result}")
            outcomes["refused with reason"] += 1
        elif result["outcome"] != "match":
            wrong.append(f"{label}: {result['error'][-600:]}")
            outcomes[result["outcome"]] += 1
        elif case.get("late") is not None and (late := _late_lifecycle(case, result)):
            wrong.append(f"{label}: {late}")
            outcomes["differ"] += 1
        elif result["rel_error"] > (LOW_PRECISION_RTOL if case.get("low_precision") else FP32_RTOL):
            wrong.append(f"{label}: numbers differ from torch by {result['rel_error']:.3g}")
            outcomes["differ"] += 1
        else:
            outcomes["match"] += 1
    errors = [
        r["rel_error"]
        for c, r in zip(cases, results, strict=True)
        if r["outcome"] == "match" and not c.get("low_precision")
    ]
    print(dict(outcomes), "largest fp32 relative difference:", max(errors, default=0.0))
    assert not wrong, "\n".join(wrong[:20]) + f"\n({len(wrong)} in all)"
    return outcomes


def _late_lifecycle(case: dict[str, Any], result: dict[str, Any]) -> str | None:
    """What differs from torch's lifecycle for a late head, or None: its step count starts at
    its first gradient, the trunk's at the first step; a checkpoint saved after ``SAVE_AT``
    steps (the head with its own count, or no state yet) resumes at the same layout to the
    uninterrupted run's bits, and in another layout (``RESHARD_TO``) to torch's numbers and
    per-parameter counts; a state_dict round trip continues bit for bit."""
    late = STEPS - case["late"] - (case.get("skip") is not None)
    for where, counts in [
        ("the run", result),
        *zip(("resumed", "resharded"), result["checkpoint_counts"], strict=True),
    ]:
        if any(s != late for s in counts["late_steps"]) or any(
            s != STEPS for s in counts["trunk_steps"]
        ):
            return (
                f"steps, {where}: late head {counts['late_steps']} (torch: {late}), trunk "
                + str(counts["trunk_steps"])
            )
    if case.get("round_trip") and not result["checkpoint_equal"]:
        return "checkpoint resumed at the same layout: the parameters differ from the run's"
    tolerance = LOW_PRECISION_RTOL if case.get("low_precision") else FP32_RTOL
    if result["resharded_error"] > tolerance:
        return f"checkpoint resharded: differs from torch by {result['resharded_error']:.3g}"
    if case.get("round_trip") and not result["round_trip_equal"]:
        return "state_dict round trip: the next step differs"
    if case.get("skip") is not None and not result["full_state_agrees"]:
        return f"full_state's per-parameter scalars: {result['full_state_scalars']}"
    return None


def _merged(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank 0's results, with what each rank holds of the late head: the step counts of
    both ranks' pieces (in the run and in both resumed runs)."""
    merged = []
    for results in zip(*per_rank, strict=True):
        first = dict(results[0])
        if "late_steps" in first:
            for name in ("late_steps", "trunk_steps"):
                first[name] = [s for r in results for s in r[name]]
            first["checkpoint_counts"] = [
                {
                    name: [s for r in results for s in r["checkpoint_counts"][k][name]]
                    for name in ("late_steps", "trunk_steps")
                }
                for k in range(2)
            ]
            for name in ("round_trip_equal", "checkpoint_equal"):
                first[name] = all(r.get(name) for r in results)
        if "full_state_scalars" in first:
            # Every rank's, the same; the skipping head's weight and bias have their own.
            found = [r["full_state_scalars"] for r in results]
            first["full_state_scalars"] = found
            first["full_state_agrees"] = all(f == found[0] for f in found) and len(found[0]) >= 2
        merged.append(first)
    return merged


def test_the_catalogue_covers_every_elementwise_class() -> None:
    assert {getattr(torch.optim, i["optimizer"]) for i in INPUTS} == set(ELEMENTWISE)
    assert len(INPUTS) > 200


def test_optim_db_one_process_stage_0() -> None:
    cases = [{**i, "stage": 0, "how": how, "seed": n} for n, i in enumerate(INPUTS) for how in HOWS]
    outcomes = _check(cases, run_cases(0, 1, cases))
    assert outcomes["match"] > 0 and outcomes["refused with reason"] > 0


def _two_rank_cases() -> list[dict[str, Any]]:
    """Every input at every stage, through build and wrap (the slow run: the default run's
    two-rank parity of every class is tests/test_every_optimizer.py's sample). CI takes each
    input at one of the eight (stage, way) pairs, turn about, so every input, stage and way is
    drawn; ``DTYPEPLAN_FULL_MATRICES=1`` takes all eight (2,395 cases)."""
    pairs = [(stage, how) for stage in STAGES for how in HOWS]
    cases = [
        {**given, "stage": stage, "how": how, "seed": n}
        for n, given in enumerate(INPUTS)
        for stage, how in (pairs if full_matrices() else [pairs[n % len(pairs)]])
    ]
    return cases + _late_cases()


def _late_cases() -> list[dict[str, Any]]:
    """A head whose first gradient comes at step 1 or 2, for every class (each keeps state per
    parameter), at every stage; with optimizer offload at the sharded flat stages; and one
    that skips the second step (AdamW, NAdam, ASGD) at every stage."""
    cases = []
    for n, torch_class in enumerate(sorted(ELEMENTWISE, key=lambda c: c.__name__)):
        kwargs = _LATE_KWARGS.get(torch_class.__name__, {})
        for stage in STAGES:
            cases.append(
                {
                    "optimizer": torch_class.__name__,
                    "kwargs": kwargs,
                    "stage": stage,
                    "how": HOWS[(n + stage) % 2],
                    "late": 1 + (n + stage) % 2,
                    "seed": 500 + n,
                }
            )
        cases.append(
            {
                "optimizer": torch_class.__name__,
                "kwargs": kwargs,
                "stage": 1 + n % 2,
                "how": "build",
                "late": 2,
                "offload": True,
                "seed": 600 + n,
            }
        )
    for stage in STAGES:
        for name, rounding in (("Adam", "kahan"), ("AdamW", ("stochastic", "nearest")[stage % 2])):
            cases.append(
                {
                    "optimizer": name,
                    "kwargs": {"lr": 0.01},
                    "stage": stage,
                    "how": "build",
                    "late": 2,
                    "low_precision": True,
                    "rounding": rounding,
                    "seed": 700 + stage,
                }
            )
    for stage in STAGES:
        for name, kwargs in (
            ("AdamW", {"lr": 0.01}),
            ("NAdam", {}),
            ("ASGD", _LATE_KWARGS["ASGD"]),
        ):
            # From the first step, but none in the second: its own count from then on. Its
            # checkpoint goes through full_state() / load_full_state().
            cases.append(
                {
                    "optimizer": name,
                    "kwargs": kwargs,
                    "stage": stage,
                    "how": HOWS[stage % 2],
                    "late": 0,
                    "skip": 1,
                    "seed": 800 + stage,
                }
            )
    for case in cases:
        # Stochastic rounding too: its noise is keyed on checkpointed step counts (issue 29).
        case["round_trip"] = True
    return cases


_LATE_KWARGS: dict[str, dict[str, Any]] = {
    # Arguments where a wrong step count or a state created too early shows in the numbers.
    "Adagrad": {"lr": 0.1, "lr_decay": 0.5, "initial_accumulator_value": 0.1},
    "SGD": {"lr": 0.1, "momentum": 0.9, "dampening": 0.5},
    "AdamW": {"lr": 0.01},
    "Adam": {"lr": 0.01, "amsgrad": True},
    "ASGD": {"lr": 0.05, "t0": 1},
    "RMSprop": {"lr": 0.01, "centered": True, "momentum": 0.5},
}


def test_late_parameters_one_process() -> None:
    cases = [c for c in _late_cases() if c["stage"] == 0 and not c.get("offload")]
    _check(cases, _merged([run_cases(0, 1, cases)]))


@pytest.mark.slow
def test_optim_db_two_ranks_every_stage_both_ways() -> None:
    cases = _two_rank_cases()
    _check(cases, _merged(spawn(run_cases, 2, cases, timeout_s=1500)))


def test_switches_that_cannot_apply_are_refused_per_group() -> None:
    """A param group's own ``capturable`` / ``differentiable`` (the optimizer's defaults say
    False) is refused naming the group and the cause, through build and wrap alike; so is
    ``capturable`` with the optimizer offloaded to the host."""
    plan = dtypeplan.resolve({})
    model = torch.nn.Linear(3, 2)
    for switch, cause in (("capturable", "CPU group"), ("differentiable", "outside autograd")):
        groups = [{"params": [model.weight]}, {"params": [model.bias], switch: True}]
        with pytest.raises(dtypeplan.NotSupportedError, match=f"param group 1 sets {switch}"):
            plan.build(groups, optimizer=torch.optim.Adam)
        with pytest.raises(dtypeplan.NotSupportedError, match=cause):
            plan.wrap(torch.optim.Adam(groups))
    with pytest.raises(dtypeplan.NotSupportedError, match="capturable=True with parameters on"):
        plan.build(model.parameters(), capturable=True)
    offload = dtypeplan.resolve(
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    )
    with pytest.raises(dtypeplan.NotSupportedError, match="capturable=True with offload"):
        offload.build(model.parameters(), optimizer=torch.optim.AdamW, capturable=True)
