"""The whole-tensor optimizer under a loop as users write it: ``model.zero_grad()`` and
``.grad = None`` between two ``loss.backward()`` calls discard the first, as in torch
(tests/workers/whole_loop.py). Before the placeholder in ``.grad``, the discarded gradient was
summed into the step: 2.2e-2 off torch's Adafactor at every stage (ZeRO-3 too, until the
check ran before FSDP2's reduce-scatter)."""

from __future__ import annotations

import pytest

from dtypeplan.launch import spawn
from tests.workers.whole_loop import discarding_loop

BOUND = 1e-5  # fp32 Adafactor, the same sums in another order


@pytest.fixture(scope="module")
def errors() -> dict[int, float]:
    return spawn(discarding_loop, 2, [0, 1, 2, 3], timeout_s=300)[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_discarded_backward_is_discarded(errors: dict[int, float], stage: int) -> None:
    assert errors[stage] <= BOUND, errors
