"""Reliability: ranks that disagree, numeric faults, ranks that die or stall, determinism.

The multi-rank cases run in few spawned 2-rank gloo groups (see ``reliability_cases.py``): one
group runs every mismatch, fault, trajectory and resume case; a second group repeats the
trajectories, so determinism is checked across processes as well as within one, and ends with a
rank that stalls past its optimizer group's timeout; each dead rank needs a group of its own.
The loss scaler is unit-tested against hand-computed sequences of DeepSpeed's
``DynamicLossScaler`` and against a transcription of its update rule.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import dtypeplan
from dtypeplan import launch
from dtypeplan.comm import Communicator
from dtypeplan.comm._collectives import CollectiveError
from dtypeplan.launch import RankFailure, spawn
from dtypeplan.optimizers import LossScaler, MinimumLossScaleError
from dtypeplan.resolver._config import LossScaleConfig
from tests.workers import reliability as reliability_cases

WORLD = 2
STAGES = (0, 1, 2)
BUCKET = {"reduce_bucket_size": 200}  # several buckets for the 484-parameter model


def _config(model: str, stage: int, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "zero_optimization": {"stage": stage, **BUCKET},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    }
    if model == "fp16":
        config["fp16"] = {"enabled": True, **extra.pop("fp16", {})}
    elif model == "bf16":
        config["bf16"] = {"enabled": True}
    config.update(extra)
    return config


# --- the loss scaler, on its own ---------------------------------------------------------------
class _DeepSpeedDynamicLossScaler:
    """``update_scale`` of DeepSpeed's ``DynamicLossScaler`` (runtime/fp16/loss_scaler.py),
    transcribed with its names (``delayed_shift`` is the config's ``hysteresis``)."""

    def __init__(
        self,
        init_scale: float,
        scale_window: int,
        min_scale: float,
        delayed_shift: int,
        consecutive_hysteresis: bool,
    ) -> None:
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise Exception("Current loss scale already at minimum")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def _scaler(**fields: Any) -> LossScaler:
    return LossScaler(LossScaleConfig(**fields))


def _scales(scaler: LossScaler, pattern: str) -> list[float]:
    """The scale after each update; ``pattern`` is a string of O (overflow) and . (clean)."""
    out = []
    for mark in pattern:
        scaler.update(overflow=mark == "O")
        out.append(scaler.scale)
    return out


# Every expectation below was worked out by hand from DeepSpeed's update_scale.
@pytest.mark.parametrize(
    ("fields", "pattern", "expected"),
    [
        # hysteresis 2: the first overflow only spends budget, the second halves, and so does
        # every further one until the budget is refilled at growth.
        (
            dict(initial_scale_power=8, loss_scale_window=3, hysteresis=2),
            ".O.OO...",
            [256, 256, 256, 128, 64, 64, 64, 128],
        ),
        # An overflow-free step between two overflows does not refill the budget...
        (
            dict(initial_scale_power=4, loss_scale_window=1000, hysteresis=2),
            "O.O.OO",
            [16, 16, 8, 8, 4, 2],
        ),
        # ...unless consecutive_hysteresis is set.
        (
            dict(
                initial_scale_power=4,
                loss_scale_window=1000,
                hysteresis=2,
                consecutive_hysteresis=True,
            ),
            "O.O.OO",
            [16, 16, 16, 16, 16, 8],
        ),
        # Growth: doubles every `window` clean steps, counted from the last overflow.
        (
            dict(initial_scale_power=4, loss_scale_window=2, hysteresis=1),
            "......",
            [16, 32, 32, 64, 64, 128],
        ),
        (
            dict(initial_scale_power=4, loss_scale_window=2, hysteresis=1),
            ".O....",
            [16, 8, 8, 16, 16, 32],
        ),
        # Growth refills the budget: after it, one overflow is tolerated again.
        (
            dict(initial_scale_power=4, loss_scale_window=2, hysteresis=2),
            "O..OO",
            [16, 16, 32, 32, 16],
        ),
        # min_loss_scale is a floor even when halving would cross it.
        (
            dict(initial_scale_power=3, loss_scale_window=1000, hysteresis=1, min_loss_scale=3),
            "OO",
            [4, 3],
        ),
    ],
)
def test_loss_scaler_matches_deepspeed_by_hand(
    fields: dict[str, Any], pattern: str, expected: list[float]
) -> None:
    assert _scales(_scaler(**fields), pattern) == expected


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        (dict(initial_scale_power=1, hysteresis=1, min_loss_scale=1), "OO"),
        # At the floor the hysteresis budget is still spent before giving up.
        (dict(initial_scale_power=0, hysteresis=2, min_loss_scale=1), "OO"),
        (
            dict(initial_scale_power=3, loss_scale_window=1000, hysteresis=1, min_loss_scale=3),
            "OOO",
        ),
    ],
)
def test_loss_scaler_raises_at_minimum(fields: dict[str, Any], pattern: str) -> None:
    scaler = _scaler(**fields)
    _scales(scaler, pattern[:-1])
    with pytest.raises(MinimumLossScaleError, match=r"minimum \(\d+\)") as info:
        scaler.update(overflow=True)
    assert "min_loss_scale" in str(info.value)


def test_loss_scaler_static_and_disabled() -> None:
    static = _scaler(loss_scale=128.0)
    assert _scales(static, "OO..OO") == [128.0] * 6
    disabled = LossScaler(None)
    assert not disabled.enabled
    assert _scales(disabled, "O.O") == [1.0] * 3


def test_loss_scaler_state_dict_resumes_the_sequence() -> None:
    fields = dict(initial_scale_power=6, loss_scale_window=3, hysteresis=2)
    straight = _scaler(**fields)
    expected = _scales(straight, "O..O.....O")
    first = _scaler(**fields)
    head = _scales(first, "O..O")
    second = _scaler(**fields)
    second.load_state_dict(first.state_dict())
    assert head + _scales(second, ".....O") == expected


@given(
    power=st.integers(0, 12),
    window=st.integers(1, 6),
    hysteresis=st.integers(1, 4),
    consecutive=st.booleans(),
    min_power=st.integers(0, 4),
    overflows=st.lists(st.booleans(), max_size=40),
)
def test_loss_scaler_matches_deepspeed_transcription(
    power: int,
    window: int,
    hysteresis: int,
    consecutive: bool,
    min_power: int,
    overflows: list[bool],
) -> None:
    # Only a start at or above the floor: from below it, DeepSpeed's halving max(s/2, min)
    # *raises* the scale to the floor, where dtypeplan reports that it cannot go lower.
    assume(power >= min_power)
    ours = _scaler(
        initial_scale_power=power,
        loss_scale_window=window,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_loss_scale=float(2**min_power),
    )
    theirs = _DeepSpeedDynamicLossScaler(
        float(2**power), window, float(2**min_power), hysteresis, consecutive
    )
    for overflow in overflows:
        try:
            theirs.update_scale(overflow)
        except Exception:  # noqa: BLE001 - DeepSpeed raises a bare Exception at the minimum
            with pytest.raises(MinimumLossScaleError):
                ours.update(overflow)
            return
        ours.update(overflow)
        assert ours.scale == theirs.cur_scale


def test_collective_error_names_collective_group_and_cause() -> None:
    comm = Communicator()
    with pytest.raises(CollectiveError) as info:
        with comm._guard("reduce_scatter", 4096, torch.bfloat16):
            raise RuntimeError("Connection closed by peer")
    message = str(info.value)
    assert "reduce_scatter of 4096 bf16 elements" in message
    assert "Connection closed by peer" in message
    assert isinstance(info.value.__cause__, RuntimeError)


# --- the multi-rank cases ----------------------------------------------------------------------
MISMATCH_CASES = [
    {
        "name": "mismatch/none",
        "kind": "mismatch",
        "configs": [_config("bf16", 1), _config("bf16", 1)],
    },
    {
        "name": "mismatch/comm_dtype",
        "kind": "mismatch",
        "configs": [
            _config("bf16", 1, communication_data_type="bf16"),
            _config("bf16", 1, communication_data_type="fp32"),
        ],
    },
    {
        "name": "mismatch/param_shapes",
        "kind": "mismatch",
        "configs": [_config("bf16", 2), _config("bf16", 2)],
        "hidden": [16, 12],
    },
    {
        "name": "mismatch/stage",
        "kind": "mismatch",
        "configs": [_config("fp32", 0), _config("fp32", 1)],
    },
    {
        "name": "consistency/entries",
        "kind": "consistency",
        "configs": [
            _config("bf16", 1, communication_data_type="bf16"),
            _config("bf16", 1, communication_data_type="fp32"),
        ],
    },
]
# What "disagree on ..." must list, per case.
MISMATCH_EXPECTED = {
    "mismatch/comm_dtype": "plan",
    "mismatch/param_shapes": "param_shapes",
    "mismatch/stage": "implementation, plan",
}

FP16_HYSTERESIS = {"initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 2}
OVERFLOWS = [None, "inf", None, "inf", "inf", None, None, None]
# Hand-computed from DeepSpeed's update_scale for OVERFLOWS (see the unit test above).
OVERFLOW_SCALES = [256, 256, 256, 128, 64, 64, 64, 128]
OVERFLOW_SKIPPED = [0, 1, 1, 2, 3, 3, 3, 3]

FAULT_CASES = [
    case
    for stage in STAGES
    for case in (
        {
            "name": f"fp16-overflow/stage{stage}",
            "kind": "fault",
            "faults": OVERFLOWS,
            "config": _config("fp16", stage, fp16=FP16_HYSTERESIS),
        },
        {
            "name": f"fp16-minimum/stage{stage}",
            "kind": "fault",
            "faults": ["inf", "inf", None],
            "config": _config(
                "fp16", stage, fp16={"initial_scale_power": 1, "hysteresis": 1, "min_loss_scale": 1}
            ),
        },
        {
            "name": f"bf16-checked/stage{stage}",
            "kind": "fault",
            "faults": [None, "nan", None],
            "config": _config("bf16", stage, check_nonfinite=True),
            "compare_clean_run": True,
        },
        {
            "name": f"fp32-checked/stage{stage}",
            "kind": "fault",
            "faults": [None, "inf", None],
            "config": _config("fp32", stage, check_nonfinite=True),
            "compare_clean_run": True,
        },
        {
            "name": f"bf16-unchecked/stage{stage}",
            "kind": "fault",
            # After the NaN step the masters are NaN, so step 3's norm is NaN too: no 2nd warning.
            "faults": [None, "nan", None],
            "config": _config("bf16", stage),
        },
    )
]

TRAJECTORY_MODELS = {
    "fp32": {},
    "bf16": {},
    "fp16": {"fp16": {"initial_scale_power": 8}},
}
TRAJECTORY_CASES = [
    {
        "name": f"trajectory/{model}/stage{stage}",
        "kind": "trajectory",
        "steps": 4,
        "seed": 3,
        "config": _config(model, stage, **dict(extra)),
    }
    for model, extra in TRAJECTORY_MODELS.items()
    for stage in STAGES
]
RESUME_CASES = [
    {
        "name": f"resume/{model}/stage{stage}",
        "kind": "resume",
        "steps": 5,
        "resume_at": 2,
        "seed": 5,
        "config": _config(model, stage, **dict(extra)),
    }
    for model, extra in TRAJECTORY_MODELS.items()
    for stage in STAGES
]


STALL_TIMEOUT_S = 3.0


def _by_name(per_rank: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {name: [results[name] for results in per_rank] for name in per_rank[0]}


@pytest.fixture(scope="module")
def group_results() -> dict[str, list[Any]]:
    """Every mismatch, fault, trajectory and resume case, run once in one 2-rank group."""
    cases = MISMATCH_CASES + FAULT_CASES + TRAJECTORY_CASES + RESUME_CASES
    return _by_name(spawn(reliability_cases.run_cases, WORLD, cases, timeout_s=240))


@pytest.fixture(scope="module")
def second_group_results() -> dict[str, list[Any]]:
    """The trajectories again in a fresh group, twice (across processes and within one), and
    last a rank that stalls, which breaks only the optimizer's own group."""
    again = [dict(case, name=f"{case['name']}/again") for case in TRAJECTORY_CASES]
    stall = {
        "name": "stall",
        "kind": "stall",
        "timeout_s": STALL_TIMEOUT_S,
        "config": _config("bf16", 1, communication_data_type="bf16"),
    }
    return _by_name(
        spawn(reliability_cases.run_cases, WORLD, TRAJECTORY_CASES + again + [stall], timeout_s=240)
    )


def _ok(results: list[Any]) -> list[Any]:
    for rank, result in enumerate(results):
        assert not (isinstance(result, dict) and "error" in result), (
            f"rank {rank} failed:\n{result['error']}"
        )
    return results


# Item 3: ranks that disagree ------------------------------------------------------------------
def test_matching_ranks_build(group_results: dict[str, list[Any]]) -> None:
    assert [r["raised"] for r in _ok(group_results["mismatch/none"])] == [None, None]


@pytest.mark.parametrize("name", sorted(MISMATCH_EXPECTED))
def test_rank_mismatch_raises_on_every_rank(group_results: dict[str, list[Any]], name: str) -> None:
    for rank, result in enumerate(_ok(group_results[name])):
        assert result["raised"] == "RankMismatchError", f"rank {rank}: {result}"
        assert f"disagree on {MISMATCH_EXPECTED[name]} (" in result["message"], result["message"]
        assert "rank 0:" in result["message"] and "rank 1:" in result["message"]
        assert result["seconds"] < 30.0


def test_rank_mismatch_names_the_entries_of_a_dict_fact(
    group_results: dict[str, list[Any]],
) -> None:
    for rank, result in enumerate(_ok(group_results["consistency/entries"])):
        assert result["raised"] == "RankMismatchError", f"rank {rank}: {result}"
        entries = result["message"].split("the entries that differ: ")[1].split(". Every")[0]
        assert "plan.comm_dtype" in entries.split(", "), result["message"]
        assert "plan.param_dtype" not in entries, result["message"]


# Item 4: numeric faults ------------------------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES)
def test_fp16_overflow_on_one_rank_skips_everywhere(
    group_results: dict[str, list[Any]], stage: int
) -> None:
    for rank, records in enumerate(_ok(group_results[f"fp16-overflow/stage{stage}"])):
        where = f"stage {stage} rank {rank}"
        assert [r["loss_scale"] for r in records] == OVERFLOW_SCALES, where
        assert [r["skipped_steps"] for r in records] == OVERFLOW_SKIPPED, where
        for step, (fault, record) in enumerate(zip(OVERFLOWS, records, strict=True)):
            # A skipped step leaves master weights, optimizer states, step count and the
            # model's parameters bitwise as they were; any other step moves them.
            assert record["state_unchanged"] == (fault is not None), f"{where} step {step}"
            assert record["params_unchanged"] == (fault is not None), f"{where} step {step}"
            assert record["masters_finite"], f"{where} step {step}"


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_overflow_at_minimum_scale_raises(
    group_results: dict[str, list[Any]], stage: int
) -> None:
    for rank, records in enumerate(_ok(group_results[f"fp16-minimum/stage{stage}"])):
        assert len(records) == 2, f"rank {rank}: {records}"
        first, second = records
        assert first["loss_scale"] == 1.0 and first["skipped_steps"] == 1
        assert first["state_unchanged"]
        assert second["raised"] == "MinimumLossScaleError", second
        assert "loss scale already at its minimum (1)" in second["message"]
        assert second["skipped_steps"] == 2


@pytest.mark.parametrize("model", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", STAGES)
def test_check_nonfinite_skips_and_counts(
    group_results: dict[str, list[Any]], model: str, stage: int
) -> None:
    for rank, records in enumerate(_ok(group_results[f"{model}-checked/stage{stage}"])):
        where = f"{model} stage {stage} rank {rank}"
        assert [r["skipped_steps"] for r in records] == [0, 1, 1], where
        assert [r["state_unchanged"] for r in records] == [False, True, False], where
        assert [r["params_unchanged"] for r in records] == [False, True, False], where
        assert all(r["loss_scale"] == 1.0 and r["masters_finite"] for r in records), where
        assert records[-1]["matches_clean_run"], f"{where}: differs from the run without step 1"


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_without_check_nonfinite_takes_the_step(
    group_results: dict[str, list[Any]], stage: int
) -> None:
    """Documented behaviour: bf16 has no overflow check unless ``check_nonfinite`` is set, so a
    NaN from one rank is averaged into every rank's gradient and the step writes it into the
    master weights everywhere; nothing is counted as skipped."""
    for rank, records in enumerate(_ok(group_results[f"bf16-unchecked/stage{stage}"])):
        clean, poisoned, after = records
        assert poisoned["skipped_steps"] == 0, f"rank {rank}"
        assert not poisoned["state_unchanged"], f"rank {rank}"
        assert not poisoned["masters_finite"], f"rank {rank}"
        # Issue 12, item 8: every rank says so once, naming the key that would skip the step.
        assert clean["warnings"] == [] and after["warnings"] == [], f"rank {rank}"
        assert len(poisoned["warnings"]) == 1, (rank, poisoned["warnings"])
        assert '"check_nonfinite": true' in poisoned["warnings"][0], poisoned["warnings"]
        assert "step 2" in poisoned["warnings"][0], poisoned["warnings"]


# Item 7: determinism and resume ----------------------------------------------------------------
def _assert_same_run(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a["losses"] == b["losses"], f"{what}: losses {a['losses']} vs {b['losses']}"
    for index, (x, y) in enumerate(zip(a["params"], b["params"], strict=True)):
        assert torch.equal(x, y), f"{what}: parameter {index} differs"
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        assert torch.equal(a["state"][key], b["state"][key]), f"{what}: {key} differs"


@pytest.mark.parametrize("name", [case["name"] for case in TRAJECTORY_CASES])
@pytest.mark.slow
def test_same_seed_same_trajectory_bitwise(
    group_results: dict[str, list[Any]], second_group_results: dict[str, list[Any]], name: str
) -> None:
    first = _ok(group_results[name])
    second = _ok(second_group_results[name])
    within = _ok(second_group_results[f"{name}/again"])
    for rank in range(WORLD):
        _assert_same_run(first[rank], second[rank], f"{name} rank {rank}, two groups")
        _assert_same_run(second[rank], within[rank], f"{name} rank {rank}, one group")
    # Every rank ends with the same parameters, and they did move.
    _assert_same_run(first[0], dict(first[1], losses=first[0]["losses"]), f"{name} ranks")
    start = reliability_cases.make_model(3)
    assert not torch.equal(
        first[0]["params"][0], next(start.parameters()).to(first[0]["params"][0].dtype)
    )


@pytest.mark.parametrize("name", [case["name"] for case in RESUME_CASES])
def test_resumed_run_equals_uninterrupted_bitwise(
    group_results: dict[str, list[Any]], name: str
) -> None:
    for rank, result in enumerate(_ok(group_results[name])):
        straight, resumed = result["straight"], result["resumed"]
        for index, (x, y) in enumerate(zip(straight["params"], resumed["params"], strict=True)):
            assert torch.equal(x, y), f"{name} rank {rank}: parameter {index} differs"
        assert straight["state"].keys() == resumed["state"].keys()
        for key, value in straight["state"].items():
            same = (
                torch.equal(value, resumed["state"][key])
                if torch.is_tensor(value)
                else (value == resumed["state"][key])
            )
            assert same, f"{name} rank {rank}: {key} differs"


# The group spawn creates takes the plan's collective_timeout_s -------------------------------
def test_spawn_gives_its_group_the_plans_collective_timeout() -> None:
    plan = dtypeplan.resolve({"collective_timeout_s": 42.5})
    assert spawn(reliability_cases.group_timeout, 1, plan, timeout_s=60) == [42.5]
    # Without a plan the group gets the config's default (group_timeout_s, where given, wins:
    # the stalled-rank tests below run on it).
    assert launch._plan_timeout(("config.json", 3)) == dtypeplan.resolve({}).collective_timeout_s
    other = dtypeplan.resolve({"collective_timeout_s": 1})
    with pytest.raises(ValueError, match=r"collective_timeout_s \[1\.0, 42\.5\]"):
        spawn(reliability_cases.group_timeout, 1, plan, other)


# Item 5: a rank that dies or stalls ------------------------------------------------------------
def _failure(fn: Any, *args: Any, group_timeout_s: float) -> str:
    """The RankFailure message of a run that must end, one way or another, within 60 s."""
    with pytest.raises(RankFailure) as info:
        spawn(fn, WORLD, *args, timeout_s=60, group_timeout_s=group_timeout_s)
    message = str(info.value)
    assert "did not finish within" not in message, message
    return message


def _gave_up_after(message: str) -> float:
    found = re.search(r"rank 0 gave up after ([0-9.]+) s", message)
    assert found, f"rank 0 did not fail in a collective:\n{message}"
    return float(found.group(1))


@pytest.mark.parametrize(
    ("stage", "where"),
    [
        # Stage 1: rank 0 reaches step() and its reduce-scatter of the bf16 gradients.
        pytest.param(1, "before_step", marks=pytest.mark.slow),
        # Stage 2: rank 0 is inside backward, in a bucket's reduce-scatter run by a hook.
        pytest.param(2, "before_backward", marks=pytest.mark.slow),
        # Stage 3: rank 0 is in forward, in FSDP2's own all-gather of the parameters.
        (3, "before_backward"),
    ],
)
@pytest.mark.slow
def test_dead_rank_fails_the_collective_not_hangs(stage: int, where: str) -> None:
    config = _config("bf16", stage, communication_data_type="bf16")
    message = _failure(reliability_cases.die_mid_step, config, where, group_timeout_s=10)
    assert "rank 1 died with exit code 3" in message, message
    op = "FSDP2 all_gather" if stage == 3 else "reduce_scatter"
    assert re.search(rf"CollectiveError: {op} of \d+ bf16 elements failed", message), message
    assert "process group '0' (gloo, rank 0 of 2)" in message, message
    assert "Connection" in message or "Timed out" in message, message
    # gloo notices the closed connection at once; the group timeout (10 s) is the bound.
    assert _gave_up_after(message) < 10.0 + 5.0


@pytest.mark.slow
def test_dead_rank_fails_a_checkpoint_save_as_checkpoint_error() -> None:
    config = _config("fp32", 1)
    message = _failure(reliability_cases.die_mid_step, config, "before_save", group_timeout_s=10)
    assert "rank 1 died with exit code 3" in message, message
    assert re.search(
        r"CheckpointError: .*: all_gather_object over the default group \(2 ranks\) failed on "
        r"rank 0: a peer rank died or stalled",
        message,
    ), message
    assert _gave_up_after(message) < 10.0 + 5.0


def test_stalled_rank_fails_after_the_group_timeout(
    second_group_results: dict[str, list[Any]],
) -> None:
    waiting, stalled = _ok(second_group_results["stall"])
    assert stalled["message"] == "stalled"
    assert waiting["raised"] == "CollectiveError", waiting
    # The optimizer's own group timed out, not the default one (named '0').
    assert re.match(
        r"reduce_scatter of \d+ bf16 elements failed on process group "
        r"'[1-9]\d*' \(gloo, rank 0 of 2\)",
        waiting["message"],
    ), waiting["message"]
    assert "Timed out" in waiting["message"], waiting["message"]
    assert STALL_TIMEOUT_S * 0.9 <= waiting["seconds"] < STALL_TIMEOUT_S + 5.0, waiting
