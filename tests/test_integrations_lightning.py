"""Lightning on dtypeplan (issue 20): ``Trainer(strategy=DtypeplanStrategy(config))``.

On 2 gloo ranks, a tiny GPT-2 ``LightningModule`` (torch AdamW and a WarmupDecayLR from its
``configure_optimizers``, taken over by the strategy) trained 6 steps with
``gradient_clip_val=0.5`` (automatic optimization) or ``self.clip_gradients`` (manual),
against Lightning's own "ddp" strategy with the plain torch AdamW fp32: the losses, masters
and Adam's first moment within the dtype's bound, every step clipped with the optimizer's norm
close to the plain run's ``.grad`` norm, a checkpoint written by ``trainer.save_checkpoint``
after 3 steps resuming (``fit(ckpt_path=...)``) bitwise, and its ``state_dict`` holding every
name as the fp32 masters. Default run: automatic optimization at ZeRO-1 bf16; the matrix
(both kinds of optimization) is slow.
"""

from __future__ import annotations

from typing import Any

import pytest

from dtypeplan.launch import spawn
from tests._helpers import assert_framework_case
from tests.workers.integrations import DEFAULT_CASES, MAX_GRAD_NORM, run_cases

DEFAULT = [c for c in DEFAULT_CASES if c[0] == "lightning"]
MATRIX = [
    (kind, s, d)
    for kind in ("lightning", "lightning_manual")
    for s in (0, 1, 2, 3)
    for d in ("bf16", "fp32")
]


def _check(results: list[dict[str, Any]], cases: list[tuple[str, int, str]]) -> None:
    for framework, stage, dtype in cases:
        case = f"{framework}-stage{stage}-{dtype}"
        per_rank = [r[case] for r in results]
        assert_framework_case(per_rank, case, MAX_GRAD_NORM)
        for got in per_rank:
            assert got["plan_stage"] == stage
            assert not got["ddp"], "a dtypeplan module must not be wrapped in DDP"
            assert got["ref_ddp"], "the reference runs under Lightning's DDP"
            own, optimizer = got["own_grad_norms"], got["optimizer_norms"]
            if stage < 3:
                # The gradients live in the optimizer: .grad holds only the placeholder.
                assert own == [None] * len(own), case
            else:
                # ZeRO-3 with an fp32 accumulator: FSDP2 leaves the reduced gradient in .grad,
                # so a plain norm of it is the optimizer's norm.
                assert len(own) == len(optimizer), case
                for plain, ours in zip(own, optimizer, strict=True):
                    assert plain is None or plain == pytest.approx(ours, rel=1e-5), case


@pytest.mark.slow
def test_lightning_zero1_bf16_two_ranks(integration_defaults: list[dict[str, Any]]) -> None:
    _check(integration_defaults, DEFAULT)


@pytest.mark.slow
def test_lightning_every_stage_dtype_and_optimization(tmp_path: Any) -> None:
    cases = [c for c in MATRIX if c not in DEFAULT]
    _check(spawn(run_cases, 2, str(tmp_path), cases, timeout_s=900), cases)
