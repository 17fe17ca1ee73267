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


@pytest.mark.parametrize(
    ("flags", "expected"),
    [({}, "torch.float32"), ({"bf16": True}, "torch.bfloat16"), ({"fp16": True}, "torch.float16")],
)
def test_all_auto_config_trains_in_the_dtype_the_trainer_was_told(
    tmp_path: Any, flags: dict[str, bool], expected: str
) -> None:
    """The HF docs' all-"auto" config takes its precision from TrainingArguments (issue 27)."""
    import json

    import transformers

    import dtypeplan
    from dtypeplan.integrations.hf_trainer import check_trainer_precision, trainer_auto_values
    from tests.workers.integrations import HF_ZERO_CONFIG

    with open(HF_ZERO_CONFIG, encoding="utf-8") as handle:
        config = json.load(handle)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=5, **flags
    )
    plan = dtypeplan.resolve(config, auto=trainer_auto_values(args, 5))
    assert str(plan.param_dtype) == expected and plan.autocast_dtype is None
    check_trainer_precision(plan, args)  # agrees


def test_a_config_without_a_bf16_block_under_bf16_is_refused(tmp_path: Any) -> None:
    """--bf16 with a config that has no bf16 block would train in fp32 (the Trainer's autocast
    is off under dtypeplan): refused, naming both dtypes."""
    import transformers

    import dtypeplan
    from dtypeplan.errors import PrecisionConfigError
    from dtypeplan.integrations.hf_trainer import check_trainer_precision, trainer_auto_values

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=5, bf16=True
    )
    plan = dtypeplan.resolve({"zero_optimization": {"stage": 1}}, auto=trainer_auto_values(args, 5))
    with pytest.raises(PrecisionConfigError, match=r"trains in fp32 .* ask for bf16 \(--bf16\)"):
        check_trainer_precision(plan, args)


def test_a_config_without_the_told_block_gets_it_as_accelerate_adds_it(tmp_path: Any) -> None:
    """--bf16 (--fp16) with a config that has no bf16 (fp16) block: the block Accelerate's
    DeepSpeedPlugin.set_mixed_precision adds under the HF DeepSpeed integration, so the HF
    docs' ds_config_zero3.json (fp16 "auto", no bf16 block) trains in bf16 under --bf16, as
    under DeepSpeed. A config with the block, or a path to one, is left as it is."""
    import json

    import transformers

    import dtypeplan
    from dtypeplan.integrations.hf_trainer import trainer_auto_values, trainer_precision_config

    zero3 = "tests/data/hf_docs/ds_config_zero3.json"
    with open(zero3, encoding="utf-8") as handle:
        document = json.load(handle)
    bf16 = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=5, bf16=True
    )
    config = trainer_precision_config(zero3, bf16)
    assert config == {**document, "bf16": {"enabled": True}}
    plan = dtypeplan.resolve(config, auto=trainer_auto_values(bf16, 5))
    assert plan.status == "OK" and str(plan.param_dtype) == "torch.bfloat16", plan.explain()
    assert (plan.offload_param, plan.offload_optimizer, plan.zero_stage) == ("cpu", "cpu", 3)
    fp32 = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=5
    )
    assert trainer_precision_config(zero3, fp32) == zero3  # fp32: nothing to add
    assert trainer_precision_config({"bf16": {"enabled": "auto"}}, bf16) == {
        "bf16": {"enabled": "auto"}
    }
    assert trainer_precision_config({}, bf16) == {"bf16": {"enabled": True}}
