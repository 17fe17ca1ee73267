"""The HF Trainer on dtypeplan (issue 20): ``DtypeplanTrainer(..., dtypeplan_config=...)``.

On 2 gloo ranks, a tiny GPT-2 trained with the HF docs' ds_config_zero2.json (every value
"auto", filled from TrainingArguments and the computed steps) for 6 steps of 2 micro-batches,
against the Trainer with torch AdamW fp32 under DDP and the same WarmupDecayLR: the losses,
masters and Adam's first moment within the dtype's bound, every step clipped (max_grad_norm
0.5) with the logged norm the optimizer's own, a resume from checkpoint-3 in a fresh Trainer
bitwise equal to the run that did not stop, and save_model writing every weight as the fp32
masters. The default run has ZeRO-2 bf16 (the HF docs' stage); the matrix is slow.
"""

from __future__ import annotations

from typing import Any

import pytest

from dtypeplan.launch import spawn
from tests._helpers import assert_framework_case
from tests.workers.integrations import DEFAULT_CASES, MAX_GRAD_NORM, run_cases

DEFAULT = [c for c in DEFAULT_CASES if c[0] == "trainer"]
MATRIX = [("trainer", s, d) for s in (0, 1, 2, 3) for d in ("bf16", "fp32")]


def _run(cases: list[tuple[str, int, str]], root: str) -> list[dict[str, Any]]:
    return spawn(run_cases, 2, root, cases, timeout_s=600, group_timeout_s=120)


def test_trainer_zero2_bf16_two_ranks(tmp_path: Any) -> None:
    results = _run(DEFAULT, str(tmp_path))
    assert_framework_case(
        [r["trainer-stage2-bf16"] for r in results], "trainer-stage2-bf16", MAX_GRAD_NORM
    )


@pytest.mark.slow
def test_trainer_every_stage_and_dtype(tmp_path: Any) -> None:
    results = _run([c for c in MATRIX if c not in DEFAULT], str(tmp_path))
    for framework, stage, dtype in MATRIX:
        if (framework, stage, dtype) in DEFAULT:
            continue
        case = f"{framework}-stage{stage}-{dtype}"
        assert_framework_case([r[case] for r in results], case, MAX_GRAD_NORM)


def test_plain_trainer_with_a_dtypeplan_optimizer_names_the_integration(tmp_path: Any) -> None:
    """A plain ``transformers.Trainer`` given a dtypeplan optimizer (``optimizers=``) clips
    with torch's clip_grad_norm_, which cannot see the optimizer's gradients: the error names
    DtypeplanTrainer and ``dtypeplan run`` (issue 27). One process, ZeRO-0."""
    import torch
    import transformers

    import dtypeplan
    from dtypeplan.errors import OptimizerUsageError
    from tests.workers.integrations import token_data
    from tests.workers.real_models import build_model

    plan = dtypeplan.resolve({"bf16": {"enabled": True}, "zero_optimization": {"stage": 0}})
    model = plan.prepare_model(build_model("gpt2"))
    optimizer = plan.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
        use_cpu=True, save_strategy="no", bf16=True, disable_tqdm=True, max_grad_norm=1.0,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=token_data(4), optimizers=(optimizer, schedule)
    )
    with pytest.raises(OptimizerUsageError, match=r"DtypeplanTrainer.*dtypeplan run"):
        trainer.train()
