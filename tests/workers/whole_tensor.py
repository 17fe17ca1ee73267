"""Whole-tensor cases: Muon / Adafactor owned whole by one rank, against one fp32 process of
the same torch class on the full batch.

A case trains ``steps`` steps: each rank its slice of the batch in ``micro_batches`` pieces
(losses divided by their count), the reference the whole batch at once. With ``resume_at``,
the run is also cut there: a new model and optimizer load the saved ``state_dict`` (the
model's own weights come from the optimizer's load) and train on; the resumed run must end
bit-equal to the uninterrupted one.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dtypeplan
from tests._helpers import HIDDEN, IN, OUT, make_batch, master_rel_error, mse
from tests.workers.parity import client_class


def whole_model(seed: int, bias: bool) -> torch.nn.Module:
    """A 3-layer tanh MLP, seeded the same on every rank (Muon: no biases, its matrices only)."""
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN, bias=bias),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN, bias=bias),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT, bias=bias),
    )
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def _build(case: dict[str, Any], model: torch.nn.Module) -> Any:
    """The case's optimizer as a user builds it: the config's optimizer block
    (``"optimizer": "config"``) or a class passed to ``plan.build`` (``torch.optim`` by name)."""
    plan = dtypeplan.resolve(case["config"])
    assert plan.status == "OK", plan.explain()
    if case["optimizer"] == "config":
        return plan.build(model.parameters())
    torch_class = client_class(case["optimizer"])
    return plan.build(model.parameters(), optimizer=torch_class, **case["hyperparameters"])


def _prepared(case: dict[str, Any], model: torch.nn.Module) -> torch.nn.Module:
    """``model`` readied by the plan of the case's class (ZeRO-3 shards it; ``prepared_with``:
    another config's plan, for a model sharded on another mesh)."""
    plan = dtypeplan.resolve(case.get("prepared_with", case["config"]))
    if case["optimizer"] != "config":
        plan = plan.with_optimizer(client_class(case["optimizer"]), case["hyperparameters"])
    assert plan.status == "OK" and plan.implementation == "whole", plan.explain()
    return plan.prepare_model(model)


def _train_steps(
    model: torch.nn.Module,
    optimizer: Any,
    steps: range,
    case: dict[str, Any],
    rank: int,
    world: int,
) -> list[float]:
    micro = case["micro_batches"]
    losses = []
    for step in steps:
        x, y = make_batch(case.get("seed", 0) + step, world * 4 * micro)
        mine_x = x.chunk(world)[rank].chunk(micro)
        mine_y = y.chunk(world)[rank].chunk(micro)
        total = torch.zeros(())
        for xm, ym in zip(mine_x, mine_y, strict=True):
            loss = mse(model, xm, ym) / micro
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for param in model.parameters():
        whole = param.detach()
        if isinstance(whole, DTensor):
            whole = whole.full_tensor()  # collective: every rank, same order
        digest.update(whole.float().numpy().tobytes())
    return digest.hexdigest()


def run_case(case: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    bias = case["optimizer"] != "Muon"  # torch's Muon takes matrices only
    reference = whole_model(case.get("seed", 0), bias)
    model = _prepared(case, copy.deepcopy(reference))
    optimizer = _build(case, model)
    plan = optimizer.plan
    ref_opt = plan.optimizer.torch_class(reference.parameters(), **plan.optimizer.params)
    steps = case["steps"]
    ref_losses = []
    for step in range(steps):
        x, y = make_batch(case.get("seed", 0) + step, world * 4 * case["micro_batches"])
        ref_opt.zero_grad()
        loss = mse(reference, x, y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(float(loss.detach()))
    resume_at = case.get("resume_at")
    cut = resume_at if resume_at is not None else steps
    losses = _train_steps(model, optimizer, range(cut), case, rank, world)
    result: dict[str, Any] = {"name": case["name"], "ref_losses": ref_losses}
    if resume_at is not None:
        saved = copy.deepcopy(optimizer.state_dict())
        resumed_model = _prepared(case, whole_model(case.get("seed", 0) + 99, bias))
        resumed = _build(case, resumed_model)
        resumed.load_state_dict(saved)
        tail = range(cut, steps)
        losses += _train_steps(model, optimizer, tail, case, rank, world)
        resumed_losses = _train_steps(resumed_model, resumed, tail, case, rank, world)
        result["resumed_equal"] = (
            _digest(resumed_model) == _digest(model) and resumed_losses == losses[cut:]
        )
        resumed.close()
    result["losses"] = losses
    result["master_rel_error"] = master_rel_error(
        optimizer.full_state(), list(reference.parameters())
    )
    held = optimizer.held_tensors()
    result["master_dtypes"] = sorted({str(t.dtype) for t in held.master})
    result["state_dtypes"] = sorted(
        {str(t.dtype) for t in held.optimizer_states if t.dim() > 0 and t.is_floating_point()}
    )
    result["balance"] = optimizer.owners.balance if optimizer.owners is not None else 1.0
    result["params_digest"] = _digest(model)
    optimizer.close()
    return result


def run_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    results = []
    for case in cases:
        try:
            results.append(run_case(case, rank, world))
        except Exception as exc:  # report the case, keep the group alive for the others
            import traceback

            results.append({"name": case["name"], "error": f"{exc!r}\n{traceback.format_exc()}"})
    return results
