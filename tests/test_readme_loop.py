"""The docs' skipped-step loop, read from docs/torch-optim.md and run under fp16 overflows: the
learning rate of every step follows DeepSpeed 0.19.8's formulas at DeepSpeed's iteration
count, which its engine advances only after a step that was not skipped. The HF Trainer's loop
(``scheduler.step()`` only when the optimizer step was not skipped) must give the same schedule:
one skip holds the scheduler back once, whoever skips the call.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dtypeplan
from tests._helpers import make_batch, make_model, mse
from tests.test_schedulers import REL_TOL, reference

PAGE = Path(__file__).resolve().parent.parent / "docs" / "torch-optim.md"
OVERFLOW_AT = (1, 4, 5, 9)  # loop iterations whose loss overflows fp16 (two in a row)
STEPS = 12
HF_TRAINER_LOOP = """
for batch in loader:
    optimizer.backward(loss_fn(model(batch)))
    optimizer.step()
    if not optimizer.last_step_skipped:
        scheduler.step()
    optimizer.zero_grad()
"""
# One param group at lr 1e-3 = the reference's first group.
SCHEDULES = [
    ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 3, "warmup_max_lr": 2e-3}),
    ("WarmupCosineLR", {"total_num_steps": 9, "warmup_num_steps": 3}),
    (  # in stairs, then decaying; momentum cycles too (the fp16 AdamW has betas)
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 3,
            "cycle_first_stair_count": 2,
            "decay_step_size": 2,
            "decay_lr_rate": 0.1,
            "decay_mom_rate": 0.05,
        },
    ),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 1e-4,
            "lr_range_test_step_size": 2,
            "lr_range_test_staircase": True,
        },
    ),
]


def readme_loop() -> str:
    """The code block of docs/torch-optim.md's "Skipped steps" item, dedented."""
    text = PAGE.read_text(encoding="utf-8")
    item = text.index("- **Skipped steps.**")
    found = re.compile(r"```python\n(.*?)```", re.S).search(text, item)
    assert found is not None, "docs/torch-optim.md: no code block after the Skipped steps item"
    return textwrap.dedent(found.group(1))


def test_the_readme_loop_is_the_one_run_here() -> None:
    """The block read is the loop that steps the scheduler every iteration: a docs change
    that drops a line the test relies on fails here, not as a wrong schedule."""
    loop = readme_loop()
    assert loop.startswith("for batch in loader:\n"), loop
    assert "optimizer.step()\n" in loop and "scheduler.step()" in loop, loop
    assert "optimizer.backward(" in loop and "optimizer.zero_grad()" in loop, loop


def _run(loop: str, name: str, params: dict[str, Any]) -> tuple[list[bool], list[tuple]]:
    """Runs ``loop`` on an fp16 AdamW with a DeepSpeed schedule; per iteration: whether the step
    was skipped, and the (lr, betas) it ran with."""
    plan = dtypeplan.resolve(
        {
            "fp16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "scheduler": {"type": name, "params": params},
        }
    )
    model = make_model(0)
    optimizer = plan.build(model.parameters())
    scheduler = plan.build_scheduler(optimizer)
    used: list[tuple] = []
    skipped: list[bool] = []

    def loader() -> Iterator[int]:
        for step in range(STEPS):
            group = optimizer.param_groups[0]
            used.append((group["lr"], group.get("betas")))
            before = optimizer.skipped_steps
            yield step
            skipped.append(optimizer.skipped_steps > before)

    def loss_fn(step: int) -> torch.Tensor:
        x, y = make_batch(step, 8)
        return mse(model, x, y) * (1e30 if step in OVERFLOW_AT else 1.0)

    namespace = {
        "loader": loader(),
        "model": lambda step: step,  # the batch is the step; loss_fn runs the model
        "loss_fn": loss_fn,
        "optimizer": optimizer,
        "scheduler": scheduler,
    }
    exec(compile(loop, "docs/torch-optim.md:Skipped steps", "exec"), namespace)  # noqa: S102
    return skipped, used


def _deepspeed(name: str, params: dict[str, Any], skipped: list[bool]) -> list[tuple]:
    """DeepSpeed's (lr, beta1) for each iteration: its engine steps the scheduler after every
    step that was not skipped, so iteration i runs at t = (steps taken before i) - 1."""
    taken, out = 0, []
    for was_skipped in skipped:
        lrs, moms = reference(name, params, taken - 1)
        out.append((lrs[0], None if moms is None else moms[0]))
        taken += not was_skipped
    return out


@pytest.mark.parametrize("loop", ["readme", "hf_trainer"])
@pytest.mark.parametrize(("name", "params"), SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_skipped_steps_follow_deepspeeds_schedule(
    loop: str, name: str, params: dict[str, Any]
) -> None:
    code = readme_loop() if loop == "readme" else HF_TRAINER_LOOP
    skipped, used = _run(code, name, params)
    assert [i for i, s in enumerate(skipped) if s] == list(OVERFLOW_AT)
    expected = _deepspeed(name, params, skipped)
    for step, ((lr, betas), (ds_lr, ds_beta1)) in enumerate(zip(used, expected, strict=True)):
        assert lr == pytest.approx(ds_lr, rel=REL_TOL, abs=1e-300), (loop, name, step)
        if ds_beta1 is not None:
            assert betas == (pytest.approx(ds_beta1, rel=REL_TOL), 0.99), (loop, name, step)


@pytest.mark.parametrize("loop", ["readme", "hf_trainer"])
def test_a_torch_scheduler_by_name_holds_back_once_per_skip(loop: str) -> None:
    code = readme_loop() if loop == "readme" else HF_TRAINER_LOOP
    skipped, used = _run(code, "ExponentialLR", {"gamma": 0.5})
    taken_before = [sum(not s for s in skipped[:i]) for i in range(STEPS)]
    assert [lr for lr, _ in used] == [1e-3 * 0.5**taken for taken in taken_before]
