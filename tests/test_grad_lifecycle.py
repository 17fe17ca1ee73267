"""The owned-gradient lifecycle and clipping requests against fp32 torch.optim (issue 29).

``.grad`` zeroed, set to None or set by hand between backward passes, gradients kept across
steps (refused where torch would use them again: README's departures), and
``clip_grad_norm_`` called twice. Cases live in ``tests/workers/grad_lifecycle.py``; one
process runs stages 0-2 here, two ranks run stages 0-3 in ONE spawned group.
"""

from __future__ import annotations

import pytest

from dtypeplan.launch import spawn
from tests.workers.grad_lifecycle import CLIPS, LIFECYCLE, case_id, run_cases, run_named

ELEMENTWISE = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop"]


@pytest.mark.parametrize("name", LIFECYCLE + CLIPS)
@pytest.mark.parametrize(("stage", "dtype"), [(0, "fp32"), (1, "bf16"), (2, "bf16")])
def test_one_process(name: str, stage: int, dtype: str) -> None:
    outcome = run_named(0, 1, name, stage, dtype, "AdamW")
    assert outcome == "ok", outcome


@pytest.mark.parametrize("stage", [0, 2])
def test_one_process_adam(stage: int) -> None:
    """Type "Adam" runs AdamW (DeepSpeed's reading) and took torch.optim.AdamW's default
    weight decay, 0.01, for an absent key: 3e-4 off torch.optim.Adam (and DeepSpeed) after 3
    steps, on any number of ranks. Its default is Adam's 0."""
    outcome = run_named(0, 1, "discard_by_model_zero_grad", stage, "fp32", "Adam")
    assert outcome == "ok", outcome


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_maximize_after_build_refused_at_step(stage: int) -> None:
    outcome = run_named(0, 1, "maximize_after_build", stage, "bf16", "AdamW")
    assert outcome == "ok", outcome


def _two_rank_cases(optimizers: list[str], lifecycle: list[str], clips: list[str]) -> list:
    cases: list[tuple[str, int, str, str]] = []
    for stage in (0, 1, 2, 3):
        for optimizer in optimizers:
            cases += [(name, stage, "fp32", optimizer) for name in lifecycle]
        # ZeRO-3 with 16-bit accumulation holds the gradients in its own accumulator.
        cases += [(name, stage, "bf16", "AdamW") for name in lifecycle if stage == 3]
        cases += [(name, stage, "fp32", "SGD") for name in clips]
    cases.append(("maximize_after_build", 3, "bf16", "AdamW"))
    return cases


# The default run: every stage, the cases that cover each mechanism once (a case costs ~5 s of
# two ranks on a shared CPU); the slow run: every elementwise optimizer and case.
DEFAULT_CASES = _two_rank_cases(
    ["SGD"], ["discard_by_model_zero_grad", "kept_across_steps"], CLIPS[:1]
)
SLOW_CASES = [c for c in _two_rank_cases(ELEMENTWISE, LIFECYCLE, CLIPS) if c not in DEFAULT_CASES]


def check(results: list[dict[str, str]], case: str) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank[case] == "ok", f"rank {rank}: {per_rank[case]}"


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, str]]:
    return spawn(run_cases, 2, DEFAULT_CASES, timeout_s=500, group_timeout_s=60)


@pytest.fixture(scope="module")
def two_ranks_every_optimizer() -> list[dict[str, str]]:
    return spawn(run_cases, 2, SLOW_CASES, timeout_s=900, group_timeout_s=60)


@pytest.mark.parametrize("case", [case_id(*c) for c in DEFAULT_CASES])
def test_two_ranks(two_ranks: list[dict[str, str]], case: str) -> None:
    check(two_ranks, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [case_id(*c) for c in SLOW_CASES])
def test_two_ranks_every_elementwise_optimizer(
    two_ranks_every_optimizer: list[dict[str, str]], case: str
) -> None:
    check(two_ranks_every_optimizer, case)
