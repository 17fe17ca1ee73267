"""Edge cases of the flat engine that training loops hit: frozen parameters, a backward that
raises, a micro-batch that reaches no parameter."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import dtypeplan
from dtypeplan.errors import OptimizerUsageError
from dtypeplan.launch import spawn
from dtypeplan.optimizers.grads.reduction import InFlightReduction
from tests._helpers import make_batch, make_model, mse
from tests.workers.engine_edge_cases import (
    empty_micro_batch_on_one_rank,
    reentrant_checkpoint_boundary,
    twice_reached_parameter,
)

BF16_SGD = {"bf16": {"enabled": True}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def test_frozen_parameters_take_the_plan_dtype_and_stay_put() -> None:
    model = make_model(0)
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    optimizer = dtypeplan.resolve(BF16_SGD).build(model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    x, y = make_batch(0, 8)
    optimizer.backward(mse(model, x, y))
    optimizer.step()
    assert torch.equal(model[0].weight.float(), frozen.bfloat16().float())


def test_a_group_with_only_frozen_parameters_is_accepted() -> None:
    model = make_model(0)
    for param in model[0].parameters():
        param.requires_grad_(False)
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2:].parameters())}]
    frozen = [p.detach().clone() for p in model[0].parameters()]
    trainable = [p.detach().clone() for p in model[2:].parameters()]
    optimizer = dtypeplan.resolve(BF16_SGD).build(groups)
    x, y = make_batch(0, 8)
    optimizer.backward(mse(model, x, y))
    optimizer.step()
    # The frozen group keeps its values (cast to bf16); the trainable one moves.
    for before, param in zip(frozen, model[0].parameters(), strict=True):
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, before.to(torch.bfloat16))
    assert all(
        not torch.equal(param.float(), before.to(torch.bfloat16).float())
        for before, param in zip(trainable, model[2:].parameters(), strict=True)
        if param.dim() > 1
    )


def test_a_backward_that_raises_leaves_no_trace() -> None:
    model = make_model(0)
    reference = copy.deepcopy(model)
    config = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    optimizer = dtypeplan.resolve(config).build(model.parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = make_batch(0, 8)

    def failing_hook(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("simulated out-of-memory in backward")

    out = model(x)
    out.register_hook(failing_hook)
    with pytest.raises(RuntimeError, match="simulated"):
        optimizer.backward(torch.nn.functional.mse_loss(out, y))
    # The usual recovery: skip the batch, start the step again.
    optimizer.zero_grad()
    optimizer.backward(mse(model, x, y))
    optimizer.step()
    ref_opt.zero_grad()
    mse(reference, x, y).backward()
    ref_opt.step()
    for mine, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)


def test_micro_batch_that_reaches_no_parameter_keeps_ranks_paired() -> None:
    # Stage 2 reduce-scatters every micro-batch: without the zero contribution rank 1 would
    # skip two reduce-scatters and pair its norm all-reduce with rank 0's reduce-scatter.
    rank0, rank1 = spawn(empty_micro_batch_on_one_rank, 2, [1, 2])
    assert rank0 == rank1


def test_backward_after_the_last_micro_batch_is_refused() -> None:
    model = make_model(0)
    optimizer = dtypeplan.resolve(BF16_SGD).build(model.parameters())
    x, y = make_batch(0, 8)
    optimizer.backward(mse(model, x, y), last_micro_batch=True)
    with pytest.raises(RuntimeError, match="last_micro_batch"):
        optimizer.backward(mse(model, x, y))
    optimizer.zero_grad()  # recovers: a fresh step
    optimizer.backward(mse(model, x, y), last_micro_batch=True)
    optimizer.step()


def test_a_backward_that_raises_waits_for_reductions_in_flight() -> None:
    # A reduce-scatter still in flight writes into the accumulator: it must be waited for
    # before the accumulator is reused, and its own failure must not hide the first error.
    model = make_model(0)
    optimizer = dtypeplan.resolve(BF16_SGD).build(model.parameters())
    waited: list[str] = []

    def finish_ok() -> None:
        waited.append("ok")

    def finish_failing() -> None:
        waited.append("failing")
        raise RuntimeError("the peer is gone too")

    chunk = torch.zeros(4)
    scheduler = optimizer.reductions
    for finish in (finish_failing, finish_ok):
        scheduler._in_flight.append(InFlightReduction(finish, chunk, chunk, torch.zeros(4)))

    def failing_hook(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("simulated out-of-memory in backward")

    x, y = make_batch(0, 8)
    out = model(x.to(torch.bfloat16)).float()
    out.register_hook(failing_hook)
    with pytest.raises(RuntimeError, match="simulated"):
        optimizer.backward(torch.nn.functional.mse_loss(out, y))
    assert waited == ["failing", "ok"]
    assert scheduler.buffers() == []


@pytest.mark.slow
def test_a_second_gradient_in_one_backward_is_added_or_refused() -> None:
    """A parameter used inside and outside a reentrant checkpoint gets two gradients in one
    backward: added where its bucket is still open (ZeRO-0/1 without an early reduction),
    refused with a clear error once its reduction has started (never silently dropped)."""
    results = spawn(twice_reached_parameter, 2)
    for per_rank in results:
        for case, outcome in per_rank.items():
            stage, mode = case
            if stage < 2 and mode == "plain":
                assert isinstance(outcome, float) and outcome < 1e-5, (case, outcome)
            else:
                assert isinstance(outcome, str) and "second gradient" in outcome, (case, outcome)
                assert "use_reentrant=False" in outcome, outcome


def _check_reentrant_boundary(results: dict) -> None:
    for key, outcome in results.items():
        assert not isinstance(outcome, str), (key, outcome)
        stage, told, _ = key.split("/")
        plain = results[f"{stage}/nothing/none"]
        for a, b in zip(outcome, plain, strict=True):
            assert torch.equal(a, b), key


@pytest.mark.slow
def test_a_reentrant_checkpoint_counts_one_backward_once() -> None:
    """A reentrant ``torch.utils.checkpoint`` region runs a backward nested in the outer one;
    its end is not the end of the micro-batch. Told the boundary (gradient_accumulation_steps,
    DeepSpeed's batch sizes, last_micro_batch=True), each micro-batch counts once and the run
    trains bit for bit as without the checkpoint, at ZeRO 0-2, in one process and on two ranks.
    (A backward counted twice raised at the second micro-batch: the first pass had started the
    step's reduction.)"""
    _check_reentrant_boundary(reentrant_checkpoint_boundary(0, 1))
    for per_rank in spawn(reentrant_checkpoint_boundary, 2):
        _check_reentrant_boundary(per_rank)


@pytest.mark.parametrize(
    "config",
    [
        {"fp16": {"enabled": True}, "zero_optimization": {"stage": 0}},
        {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}},
        {
            "torch_autocast": {"enabled": True, "dtype": "float16"},
            "zero_optimization": {"stage": 1},
        },  # noqa: E501
    ],
)
def test_bare_backward_under_fp16_loss_scaling_is_refused(config: dict) -> None:
    """Under fp16 loss scaling, step() divides by the loss scale: an unscaled loss.backward()
    would give gradients 65536 times too small without a word. It is refused at the backward;
    with pipeline_parallel=True (a schedule scales the loss itself) it is taken."""
    plan = dtypeplan.resolve(config)
    model = plan.prepare_model(make_model(0))
    optimizer = plan.build(model.parameters())
    x, y = make_batch(0, 8)
    loss = mse(model, x, y)
    with pytest.raises(OptimizerUsageError, match=r"outside opt.backward\(loss\)"):
        loss.backward()
    optimizer.zero_grad()
    optimizer.backward(mse(model, x, y))
    optimizer.step()
    assert optimizer.skipped_steps == 0 and optimizer.grad_norm > 1e-3
    optimizer.close()
    pipeline = dtypeplan.resolve(config, pipeline_parallel=True)
    model = pipeline.prepare_model(make_model(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = pipeline.build(model.parameters())
    (mse(model, x, y) * optimizer.loss_scale).backward()
    optimizer.step()
    assert optimizer.skipped_steps == 0
