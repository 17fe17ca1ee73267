"""DeepSpeed's LR schedules (dtypeplan.schedulers) against the formulas of
tests/data/deepspeed_configs/SCHEDULERS.md, written out again here as scalar math; against
deepspeed.runtime.lr_schedules when DeepSpeed is importable; skipped fp16 steps; errors; state."""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan.schedulers import DEEPSPEED_SCHEDULERS, build_scheduler
from tests._helpers import make_batch, make_model, mse

STEPS = 300
GROUP_LRS = (1e-3, 5e-4)
# The reference and the schedule compute the same formula in a different operation order
# (log(t+1)/log(W) against (1/log(W))*log(t+1)): a few float64 roundings apart at most.
REL_TOL = 8 * sys.float_info.epsilon

CASES: list[tuple[str, dict[str, Any]]] = [
    ("WarmupLR", {"warmup_num_steps": 100}),
    (
        "WarmupLR",
        {
            "warmup_min_lr": [1e-5, 2e-5],
            "warmup_max_lr": 3e-4,
            "warmup_num_steps": 77,
            "warmup_type": "linear",
        },
    ),
    ("WarmupLR", {"warmup_num_steps": 1}),  # W = max(2, 1)
    ("WarmupDecayLR", {"total_num_steps": 250, "warmup_num_steps": 50, "warmup_max_lr": 2e-3}),
    (
        "WarmupDecayLR",
        {
            "total_num_steps": 200,
            "warmup_num_steps": 30,
            "warmup_type": "linear",
            "warmup_min_lr": [1e-6, 2e-6],
            "warmup_max_lr": [1e-3, 4e-3],
        },
    ),
    ("WarmupCosineLR", {"total_num_steps": 260, "warmup_num_steps": 40}),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 220,
            "warmup_num_steps": 25,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.05,
            "warmup_type": "linear",
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 100,
            "decay_step_size": 10,
            "decay_lr_rate": 0.01,
            "decay_mom_rate": 0.02,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": [1e-4, 2e-4],
            "cycle_max_lr": [1e-3, 3e-3],
            "cycle_first_step_size": 60,
            "cycle_second_step_size": 90,
            "cycle_first_stair_count": 4,
            "cycle_second_stair_count": 6,
            "cycle_min_mom": [0.85, 0.8],
            "cycle_max_mom": 0.95,
        },
    ),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 1e-4,
            "lr_range_test_step_size": 30,
            "lr_range_test_step_rate": 0.5,
        },
    ),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": [1e-4, 3e-4],
            "lr_range_test_step_size": 25,
            "lr_range_test_staircase": True,
        },
    ),
]
CASE_IDS = [f"{name}-{i}" for i, (name, _) in enumerate(CASES)]


# --- SCHEDULERS.md, written out again ----------------------------------------------------------
def _groups(value: Any) -> list[float]:
    return list(value) if isinstance(value, list) else [value] * len(GROUP_LRS)


def _warmup_fraction(t: int, w: int, kind: str) -> float:
    return math.log(t + 1) / math.log(w) if kind == "log" else t / w


def reference(name: str, params: dict[str, Any], t: int) -> tuple[list[float], list[float] | None]:
    """(lr per group, beta1 per group or None) at ``t`` (t = -1: after construction)."""
    p = params
    if name in ("WarmupLR", "WarmupDecayLR"):
        w = max(2, p.get("warmup_num_steps", 1000))
        default_max = list(GROUP_LRS) if name == "WarmupLR" else 0.001
        lo, hi = _groups(p.get("warmup_min_lr", 0.0)), _groups(p.get("warmup_max_lr", default_max))
        if t < 0:
            return lo, None
        if t < w:
            gamma = _warmup_fraction(t, w, p.get("warmup_type", "log"))
        elif name == "WarmupLR":
            gamma = 1.0
        else:
            total = p["total_num_steps"]
            gamma = max(0.0, (total - t) / max(1, total - w))
        return [a + (b - a) * gamma for a, b in zip(lo, hi, strict=True)], None
    if name == "WarmupCosineLR":
        w = max(2, p.get("warmup_num_steps", 1000))
        if t < 0:
            return [0.0] * len(GROUP_LRS), None
        if t < w:
            r = _warmup_fraction(t, w, p.get("warmup_type", "log"))
            floor = p.get("warmup_min_ratio", 0.0)
            ratio = floor + r * (1 - floor)
        else:
            progress = min(1.0, (t - w + 1) / max(1, p["total_num_steps"] - w))
            cmin = p.get("cos_min_ratio", 0.0001)
            ratio = max(0.0, cmin + (1 - cmin) * (1 + math.cos(math.pi * progress)) / 2)
        return [lr * ratio for lr in GROUP_LRS], None
    if name == "OneCycle":
        lo, hi = _groups(p["cycle_min_lr"]), _groups(p["cycle_max_lr"])
        mlo, mhi = _groups(p.get("cycle_min_mom", 0.8)), _groups(p.get("cycle_max_mom", 0.9))
        if t < 0:
            return lo, mlo
        s1 = float(p.get("cycle_first_step_size", 2000))
        s2 = float(p.get("cycle_second_step_size") or s1)
        total = s1 + s2
        if t < total:
            b = t + 1
            x = 1 + b / total - math.floor(1 + b / total)
            first_half = x <= s1 / total
            scale = x / (s1 / total) if first_half else (x - 1) / (s1 / total - 1)
            stairs1 = p.get("cycle_first_stair_count", 0)
            stairs = stairs1 if first_half else p.get("cycle_second_stair_count", stairs1)
            if stairs > 0:
                c = b % total
                pos = c * stairs / s1 if c <= s1 else (total - c) * stairs / s2
                scale = math.floor(pos) / stairs
            lrs = [a + (z - a) * scale for a, z in zip(lo, hi, strict=True)]
            return lrs, [z - (z - a) * scale for a, z in zip(mlo, mhi, strict=True)]
        d, size = t - total + 1, p.get("decay_step_size", 0)
        lr_rate, mom_rate = p.get("decay_lr_rate", 0.0), p.get("decay_mom_rate", 0.0)
        lrs = lo if size == 0 or lr_rate == 0 else [a / (1 + lr_rate * d / size) for a in lo]
        moms = mhi if size == 0 or mom_rate == 0 else [z * (1 + mom_rate * d / size) for z in mhi]
        return lrs, moms
    assert name == "LRRangeTest"
    i = (t + 1) / p["lr_range_test_step_size"]
    if p.get("lr_range_test_staircase", False):
        i = math.floor(i)
    rate = p.get("lr_range_test_step_rate", 1.0)
    return [lr * (1 + rate * i) for lr in _groups(p["lr_range_test_min_lr"])], None


# --- helpers -----------------------------------------------------------------------------------
def _adamw() -> torch.optim.AdamW:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.AdamW(
        [{"params": [a]}, {"params": [b], "lr": GROUP_LRS[1]}], lr=GROUP_LRS[0]
    )


def _assert_at(optimizer: torch.optim.Optimizer, name: str, params: dict[str, Any], t: int) -> None:
    lrs, moms = reference(name, params, t)
    got = [group["lr"] for group in optimizer.param_groups]
    assert got == pytest.approx(lrs, rel=REL_TOL, abs=1e-300), (name, t)
    if moms is not None:
        betas = [group["betas"] for group in optimizer.param_groups]
        assert [b[0] for b in betas] == pytest.approx(moms, rel=REL_TOL), (name, t)
        assert all(b[1] == 0.99 for b in betas), (name, t)


# --- the formulas ------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "params"), CASES, ids=CASE_IDS)
def test_schedule_follows_the_deepspeed_formulas(name: str, params: dict[str, Any]) -> None:
    optimizer = _adamw()
    scheduler = build_scheduler({"type": name, "params": params}, optimizer)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
    assert scheduler.last_epoch == -1
    _assert_at(optimizer, name, params, -1)
    for t in range(STEPS):
        scheduler.step()
        assert scheduler.last_epoch == t
        _assert_at(optimizer, name, params, t)
        assert scheduler.get_last_lr() == [g["lr"] for g in optimizer.param_groups]


@pytest.mark.parametrize(("name", "params"), CASES, ids=CASE_IDS)
def test_bit_identical_to_deepspeed(name: str, params: dict[str, Any]) -> None:
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    ours_opt, ds_opt = _adamw(), _adamw()
    ours = build_scheduler({"type": name, "params": params}, ours_opt)
    theirs = getattr(lr_schedules, name)(ds_opt, **params)
    assert ours is not None
    for _ in range(STEPS + 1):
        for mine, ds in zip(ours_opt.param_groups, ds_opt.param_groups, strict=True):
            assert (mine["lr"], mine["betas"]) == (ds["lr"], ds["betas"])
        ours.step()
        theirs.step()


def test_no_block_builds_nothing() -> None:
    assert build_scheduler(None, _adamw()) is None


def test_one_cycle_without_betas_cycles_only_the_lr() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10}
    with pytest.warns(UserWarning, match="cycle_momentum is switched off"):
        scheduler = build_scheduler({"type": "OneCycle", "params": params}, optimizer)
    assert scheduler is not None
    for _ in range(5):
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 + 0.09 * 0.5, rel=REL_TOL)
    assert "betas" not in optimizer.param_groups[0]


def test_unknown_warmup_type_warns_and_runs_log_like_deepspeed() -> None:
    optimizer = _adamw()
    params = {"warmup_num_steps": 10, "warmup_type": "linar"}
    with pytest.warns(UserWarning, match="did you mean 'linear'"):
        scheduler = build_scheduler({"type": "WarmupLR", "params": params}, optimizer)
    assert scheduler is not None
    for t in range(12):
        scheduler.step()
        _assert_at(optimizer, "WarmupLR", {"warmup_num_steps": 10}, t)


def test_torch_scheduler_by_name_takes_params_as_keywords() -> None:
    optimizer = _adamw()
    config = {"type": "StepLR", "params": {"step_size": 3, "gamma": 0.5}}
    scheduler = build_scheduler(config, optimizer)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [lr * 0.25 for lr in GROUP_LRS]


# --- skipped steps -----------------------------------------------------------------------------
FP16 = {"fp16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
OVERFLOW_AT = (1, 4, 5)  # optimizer steps whose loss is made to overflow


def _train_fp16(config: dict[str, Any], steps: int) -> tuple[Any, Any, list[bool]]:
    """fp16 training where the steps in OVERFLOW_AT get a loss of ~1e30 (inf fp16 gradients)."""
    model = make_model(0)
    optimizer = dtypeplan.resolve(FP16).build(model.parameters())
    scheduler = build_scheduler(config, optimizer)
    assert scheduler is not None
    skipped = []
    for step in range(steps):
        x, y = make_batch(step, 8)
        loss = mse(model, x, y) * (1e30 if step in OVERFLOW_AT else 1.0)
        before = optimizer.skipped_steps
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        skipped.append(optimizer.skipped_steps > before)
    return optimizer, scheduler, skipped


# One group at lr 1e-3 = GROUP_LRS[0], so the reference's first group applies.
FP16_CASES = [
    ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 3}),
    CASES[7],  # OneCycle, with momentum: the fp16 AdamW has betas
    CASES[9],
]


@pytest.mark.parametrize(("name", "params"), FP16_CASES, ids=[c[0] for c in FP16_CASES])
def test_fp16_overflow_does_not_advance_the_schedule(name: str, params: dict[str, Any]) -> None:
    optimizer, scheduler, skipped = _train_fp16({"type": name, "params": params}, 9)
    assert [i for i, s in enumerate(skipped) if s] == list(OVERFLOW_AT)
    assert scheduler.last_epoch == 9 - len(OVERFLOW_AT) - 1
    lrs, moms = reference(name, params, scheduler.last_epoch)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lrs[0], rel=REL_TOL)
    if moms is not None:
        assert optimizer.param_groups[0]["betas"] == (pytest.approx(moms[0], rel=REL_TOL), 0.99)


def test_fp16_overflow_does_not_advance_a_torch_scheduler() -> None:
    config = {"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}
    optimizer, scheduler, skipped = _train_fp16(config, 8)
    assert sum(skipped) == len(OVERFLOW_AT)
    assert scheduler.last_epoch == 8 - len(OVERFLOW_AT)
    assert optimizer.param_groups[0]["lr"] == 1e-3 * 0.5 ** (8 - len(OVERFLOW_AT))


class _FlagOnlySGD(torch.optim.SGD):
    """An optimizer that says whether its last step was skipped but keeps no counter."""

    last_step_skipped = False


def test_a_last_step_skipped_flag_alone_is_honoured() -> None:
    optimizer = _FlagOnlySGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = build_scheduler({"type": "WarmupLR", "params": {"warmup_num_steps": 5}}, optimizer)
    assert scheduler is not None
    for skip in (False, True, False, True, True, False):
        optimizer.last_step_skipped = skip
        scheduler.step()
    assert scheduler.last_epoch == 2


def test_a_plain_torch_optimizer_always_advances() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = build_scheduler({"type": "LRRangeTest", "params": {}}, optimizer)
    assert scheduler is not None
    for _ in range(6):
        scheduler.step()
    assert scheduler.last_epoch == 5


# --- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
            r"scheduler\.params\.warmup_num_steps must be a positive integer, got 0",
        ),
        (
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2.5}},
            r"scheduler\.params\.warmup_num_steps must be a positive integer",
        ),
        (
            {"type": "WarmupDecayLR", "params": {}},
            r"scheduler\.params\.total_num_steps is required",
        ),
        (
            {"type": "WarmupLR", "params": {"warmup_max_lrr": 1e-3}},
            r"unknown key scheduler\.params\.warmup_max_lrr.*did you mean 'warmup_max_lr'",
        ),
        (
            {"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.0, 0.0]}},
            r"scheduler\.params\.warmup_min_lr must be a number or a list of 2 numbers",
        ),
        (
            {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": "high"}},
            r"scheduler\.params\.cycle_max_lr must be a number",
        ),
        (
            {
                "type": "OneCycle",
                "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 0},
            },
            r"scheduler\.params\.cycle_first_step_size must be positive",
        ),
        (
            {"type": "LRRangeTest", "params": {"lr_range_test_step_size": -3}},
            r"scheduler\.params\.lr_range_test_step_size must be a positive integer",
        ),
        ({"type": "WarmupDecay"}, r"unknown scheduler\.type 'WarmupDecay'.*'WarmupDecayLR'"),
        ({"type": "Zigzag"}, r"unknown scheduler\.type 'Zigzag': the DeepSpeed names are"),
        ({"type": "StepLR", "params": {"step": 3}}, r"did you mean 'step_size'"),
        ({"type": "WarmupLR", "parms": {}}, r"unknown key scheduler\.parms: did you mean 'params'"),
    ],
)
def test_bad_blocks_are_refused_naming_the_key(config: dict[str, Any], message: str) -> None:
    with pytest.raises(dtypeplan.PrecisionConfigError, match=message):
        build_scheduler(config, _adamw())


def test_a_refused_block_leaves_the_optimizer_alone() -> None:
    optimizer = _adamw()
    with pytest.raises(dtypeplan.PrecisionConfigError):
        build_scheduler(
            {"type": "OneCycle", "params": {"cycle_min_lr": 0.5, "cycle_max_lr": []}}, optimizer
        )
    assert [g["lr"] for g in optimizer.param_groups] == list(GROUP_LRS)


# --- state -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "params"), CASES, ids=CASE_IDS)
def test_state_dict_round_trip_resumes_the_schedule(name: str, params: dict[str, Any]) -> None:
    optimizer = _adamw()
    scheduler = build_scheduler({"type": name, "params": params}, optimizer)
    assert scheduler is not None
    for _ in range(37):
        scheduler.step()
    state = scheduler.state_dict()
    resumed_opt = _adamw()
    resumed = build_scheduler({"type": name, "params": params}, resumed_opt)
    assert resumed is not None
    resumed.load_state_dict(state)
    for _ in range(60):
        scheduler.step()
        resumed.step()
        for group, resumed_group in zip(
            optimizer.param_groups, resumed_opt.param_groups, strict=True
        ):
            assert (group["lr"], group["betas"]) == (resumed_group["lr"], resumed_group["betas"])
    assert resumed.last_epoch == 96
    assert DEEPSPEED_SCHEDULERS[name] is type(resumed)


@pytest.mark.parametrize(("name", "params"), CASES, ids=CASE_IDS)
def test_constructed_mid_run_leaves_the_lr_and_resumes_at_the_next_step(
    name: str, params: dict[str, Any]
) -> None:
    """DeepSpeed's last_batch_iteration != -1: the constructor sets nothing, step() goes on."""
    optimizer = _adamw()
    scheduler = build_scheduler(
        {"type": name, "params": {**params, "last_batch_iteration": 36}}, optimizer
    )
    assert scheduler is not None and scheduler.last_epoch == 36
    assert [g["lr"] for g in optimizer.param_groups] == list(GROUP_LRS)
    scheduler.step()
    _assert_at(optimizer, name, params, 37)
    scheduler.step(120)  # DeepSpeed's explicit batch_iteration
    _assert_at(optimizer, name, params, 120)
