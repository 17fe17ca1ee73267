"""Accelerate on dtypeplan (issue 20): ``DtypeplanAccelerator`` in place of ``Accelerator``.

On 2 gloo ranks, a tiny GPT-2 trained through ``accelerator.prepare`` / ``accumulate`` /
``backward`` / ``clip_grad_norm_`` (6 steps of 2 micro-batches, the config's WarmupDecayLR)
against ``Accelerator()`` with its default kwargs (DDP) and torch AdamW fp32 with the same
schedule: the losses, masters and Adam's first moment within the dtype's bound, every step
clipped (0.5) with the norm ``clip_grad_norm_`` returned the optimizer's own, ``save_state``
at step 3 and ``load_state`` in a fresh accelerator resuming bitwise, and the model file of
``save_state`` (safetensors) holding every name as the fp32 masters. The default run has
ZeRO-3 bf16; the matrix is slow.
"""

from __future__ import annotations

from typing import Any

import pytest

from dtypeplan.launch import spawn
from tests._helpers import assert_framework_case
from tests.workers.integrations import DEFAULT_CASES, MAX_GRAD_NORM, run_cases

DEFAULT = [c for c in DEFAULT_CASES if c[0] == "accelerate"]
MATRIX = [("accelerate", s, d) for s in (0, 1, 2, 3) for d in ("bf16", "fp32")]


def _check(results: list[dict[str, Any]], cases: list[tuple[str, int, str]]) -> None:
    for framework, stage, dtype in cases:
        case = f"{framework}-stage{stage}-{dtype}"
        per_rank = [r[case] for r in results]
        assert_framework_case(per_rank, case, MAX_GRAD_NORM)
        for got in per_rank:
            assert not got["ddp"], "a dtypeplan model must not be wrapped in DDP"
            assert got["ref_ddp"], "the reference runs under Accelerate's default DDP"


@pytest.mark.slow
def test_accelerate_zero3_bf16_two_ranks(integration_defaults: list[dict[str, Any]]) -> None:
    _check(integration_defaults, DEFAULT)


@pytest.mark.slow
def test_accelerate_every_stage_and_dtype(tmp_path: Any) -> None:
    cases = [c for c in MATRIX if c not in DEFAULT]
    _check(spawn(run_cases, 2, str(tmp_path), cases, timeout_s=600), cases)
