"""DeepSpeed's batch sizes: the micro-batches per step worked out at build, and mismatches.

DeepSpeed 0.19 (``runtime/config.py``, ``_set_batch_related_parameters`` / ``_batch_assertion``)
completes ``train_batch_size = micro x gradient_accumulation_steps x data-parallel ranks`` from
any two and refuses a triple that does not multiply out. dtypeplan takes the count where the
config gives it or DeepSpeed derives it from both batch sizes (and they multiply out), and
warns at build (where the world size is known) about sizes DeepSpeed would refuse.
"""

from __future__ import annotations

import pytest
import torch

import dtypeplan
from dtypeplan.resolver._batch import accumulation_steps, batch_size_mismatch
from tests._helpers import make_batch, make_model, mse

# (gradient_accumulation_steps, train_batch_size, train_micro_batch_size_per_gpu, ranks) ->
# micro-batches per step (None: not counted)
_KNOWN = [
    ((4, None, None, 8), 4),  # given
    ((4, 64, 2, 8), 4),  # all three, consistent
    ((4, 64, None, 8), 4),  # DeepSpeed derives micro = 64 // 8 // 4 = 2
    ((None, 64, 2, 8), 4),  # DeepSpeed derives 64 // 2 // 8 = 4
    ((None, 64, 2, 1), 32),
    ((None, 256, 4, 16), 4),  # Megatron-DeepSpeed's ds_config on 16 data-parallel ranks
    ((None, 64, None, 8), None),  # DeepSpeed takes 1 micro-batch of 8: the loop decides here
    ((None, None, 2, 8), None),  # likewise
    ((None, None, None, 8), None),
]

# DeepSpeed refuses these: a warning names the mismatch; given steps are still counted,
# derived ones are not (there is no sound count).
_MISMATCHED = [
    ((4, 60, 2, 8), 4),  # 2 x 4 x 8 = 64
    ((None, 60, 2, 8), None),  # 60 // 2 // 8 = 3, and 2 x 3 x 8 = 48
    ((None, 8, 4, 4), None),  # 8 // 4 // 4 = 0 micro-batches per step
    ((2, 6, None, 4), 2),  # micro = 6 // 4 // 2 = 0
    ((None, 6, None, 4), None),  # one micro-batch of 6 // 4 = 1 on each rank: 4 != 6
]


@pytest.mark.parametrize(("given", "expected"), _KNOWN)
def test_micro_batches_per_step_as_deepspeed_works_them_out(
    given: tuple[int | None, ...], expected: int | None
) -> None:
    found = accumulation_steps(*given)
    assert (found.micro_batches if found else None) == expected
    assert batch_size_mismatch(*given) is None


@pytest.mark.parametrize(("given", "expected"), _MISMATCHED)
def test_batch_sizes_deepspeed_refuses_are_reported(
    given: tuple[int | None, ...], expected: int | None
) -> None:
    found = accumulation_steps(*given)
    assert (found.micro_batches if found else None) == expected
    mismatch = batch_size_mismatch(*given)
    assert mismatch is not None and "DeepSpeed would refuse" in mismatch, mismatch


def _config(**batch: object) -> dict:
    return {
        "bf16": {"enabled": True},
        "gradient_accumulation_dtype": "fp32",
        "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        **batch,
    }


def test_the_optimizer_counts_the_derived_micro_batches() -> None:
    plan = dtypeplan.resolve(_config(train_batch_size=6, train_micro_batch_size_per_gpu=2))
    assert "train_batch_size 6 / (train_micro_batch_size_per_gpu 2" in plan.explain()
    model = plan.prepare_model(make_model(0))
    optimizer = plan.build(model.parameters())
    assert optimizer.accumulation is not None and optimizer.accumulation.micro_batches == 3
    x, y = make_batch(0, 8)
    for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
        try:
            mse(model, xm.to(torch.bfloat16), ym).backward()
        except RuntimeError as error:  # the fourth: the third started the step's reduction
            assert "derived as DeepSpeed does: train_batch_size 6" in str(error)
            break
    else:
        pytest.fail("a fourth backward in a step of three micro-batches was taken")
    optimizer.zero_grad()


def test_batch_sizes_that_do_not_multiply_out_warn_at_build() -> None:
    plan = dtypeplan.resolve(
        _config(
            train_batch_size=10, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2
        )
    )
    model = plan.prepare_model(make_model(0))
    with pytest.warns(UserWarning, match=r"\(4 x 2 x 1 = 8\).*counts the 2 micro-batches"):
        optimizer = plan.build(model.parameters())
    assert optimizer.accumulation is not None and optimizer.accumulation.micro_batches == 2


def test_an_auto_left_to_the_hf_default_is_not_counted() -> None:
    """``"auto"`` without the caller's fill takes the HF Trainer's default (1 micro-batch): a
    guess about the loop, so the optimizer does not count by it (a loop of two micro-batches
    runs); filled by the caller, it is counted."""
    config = {**_config(), "gradient_accumulation_steps": "auto"}
    guessed = dtypeplan.resolve(config)
    assert guessed.gradient_accumulation_steps == 1
    assert 'default for "auto": not counted' in guessed.explain()
    model = guessed.prepare_model(make_model(0))
    optimizer = guessed.build(model.parameters())
    assert optimizer.accumulation is None
    x, y = make_batch(0, 8)
    for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
        mse(model, xm.to(torch.bfloat16), ym).backward()
    optimizer.step()
    filled = dtypeplan.resolve(config, auto={"gradient_accumulation_steps": 2})
    optimizer = filled.build(filled.prepare_model(make_model(0)).parameters())
    assert optimizer.accumulation is not None and optimizer.accumulation.micro_batches == 2


def test_an_hf_default_steps_leaves_the_batch_sizes_to_count() -> None:
    """gradient_accumulation_steps "auto" left to the HF default, batch sizes given: the count
    is worked out from the batch sizes, and explain(), the DeepSpeed differences and build
    agree on it."""
    config = {
        **_config(train_batch_size=8, train_micro_batch_size_per_gpu=2),
        "gradient_accumulation_steps": "auto",
    }
    plan = dtypeplan.resolve(config)
    text = plan.explain()
    assert "train_batch_size 8 / (train_micro_batch_size_per_gpu 2" in text
    assert "not counted" not in text
    assert any("train_batch_size=8" in d for d in plan.deepspeed_differences)
    optimizer = plan.build(plan.prepare_model(make_model(0)).parameters())
    assert optimizer.accumulation is not None and optimizer.accumulation.micro_batches == 4


def test_null_and_whole_float_counts_read_as_deepspeed_reads_them() -> None:
    """DeepSpeed reads a null batch key as absent, and 32.0 as 32."""
    nulls = dtypeplan.resolve(
        _config(train_batch_size=None, train_micro_batch_size_per_gpu=None)
        | {"gradient_accumulation_steps": None}
    )
    assert nulls.accumulation_steps(2) is None and nulls.batch_size_mismatch(2) is None
    floats = dtypeplan.resolve(_config(train_batch_size=32.0, train_micro_batch_size_per_gpu=4.0))
    found = floats.accumulation_steps(2)
    assert found is not None and found.micro_batches == 4 and isinstance(found.micro_batches, int)
    assert "train_batch_size 32 /" in found.source


def test_the_mismatch_warning_points_at_the_callers_build() -> None:
    plan = dtypeplan.resolve(_config(train_batch_size=10, train_micro_batch_size_per_gpu=4))
    model = plan.prepare_model(make_model(0))
    with pytest.warns(UserWarning, match="DeepSpeed would refuse") as caught:
        plan.build(model.parameters())
    assert caught[0].filename == __file__
