"""The table's promise for every elementwise optimizer (tests/test_every_optimizer.py): a point
of a rule, an optimizer and a way in; an OK point trains against fp32 ``torch.optim``, a refused
one is refused at resolve and at build.

A case is plain data (picklable, for a spawned group): the config, ``pipeline``, the optimizer
(``name``, ``hyper``) and the way in (``config``: the config's optimizer block; ``build``:
``plan.build(params, optimizer=cls, **hyper)``; ``wrap``: ``plan.wrap(cls(params, **hyper))``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from dtypeplan.errors import NotSupportedError, PrecisionConfigError
from tests._helpers import make_batch, make_model, master_rel_error, mse


def plan_of(case: dict[str, Any]) -> dtypeplan.PrecisionPlan:
    """The plan of ``case``'s way in: the config's, or that config's with the client class."""
    plan = dtypeplan.resolve(case["config"], pipeline_parallel=case["pipeline"])
    if case["way"] != "config" and plan.resolution is not None:
        torch_class = getattr(torch.optim, case["name"])
        plan = plan.with_optimizer(torch_class, case["hyper"])
    return plan


def _optimizer(
    plan: dtypeplan.PrecisionPlan, case: dict[str, Any], model: torch.nn.Module
) -> torch.optim.Optimizer:
    params = list(model.parameters())
    torch_class = getattr(torch.optim, case["name"])
    if case["way"] == "wrap":
        return plan.wrap(torch_class(params, **case["hyper"]))
    if case["way"] == "build":
        return plan.build(params, optimizer=torch_class, **case["hyper"])
    return plan.build(params)


def refused(case: dict[str, Any]) -> dict[str, Any]:
    """What resolve says and what build raises for a refused point."""
    plan = plan_of(case)
    base = dtypeplan.resolve(case["config"], pipeline_parallel=case["pipeline"])
    model = make_model(0)
    raised = ""
    try:
        prepared = base.prepare_model(model) if base.status == "OK" else model
        _optimizer(base, case, prepared)
    except (NotSupportedError, PrecisionConfigError) as error:
        raised = str(error)
    return {
        "status": str(plan.status),
        "rule": plan.rule_id,
        "reason": plan.reason,
        "raised": raised,
    }


def trained(case: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Three steps both ways (this rank's slice against the whole batch in fp32): losses and
    the final master weights' relative error."""
    base = dtypeplan.resolve(case["config"], pipeline_parallel=case["pipeline"])
    reference = make_model(case["seed"])
    model = base.prepare_model(copy.deepcopy(reference))
    optimizer = _optimizer(base, case, model)
    plan = optimizer.plan  # type: ignore[attr-defined]
    torch_class = getattr(torch.optim, case["name"])
    hyper = dict(case["hyper"])
    if case["way"] == "config" and "weight_decay" in plan.optimizer.params:
        # The config's reading: DeepSpeed's Adam/AdamW decay by 0 where the key is absent.
        hyper["weight_decay"] = plan.optimizer.params["weight_decay"]
    ref_opt = torch_class(reference.parameters(), **hyper)
    losses, ref_losses = [], []
    for step in range(case["steps"]):
        x, y = make_batch(case["seed"] + step, 8 * world_size)
        ref_opt.zero_grad()
        ref_loss = mse(reference, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(float(ref_loss.detach()))
        optimizer.zero_grad()
        loss = mse(model, x.chunk(world_size)[rank], y.chunk(world_size)[rank])
        optimizer.backward(loss)  # type: ignore[attr-defined]
        optimizer.step()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(float(total) / world_size)
    error = master_rel_error(optimizer.full_state(), list(reference.parameters()))  # type: ignore[attr-defined]
    return {
        "status": "OK",
        "rule": plan.rule_id,
        "losses": losses,
        "ref_losses": ref_losses,
        "master_rel_error": error,
        "kernel": getattr(getattr(optimizer, "update_kernel", None), "name", "fsdp2"),
    }


def run(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every case on this rank (OK ones train, refused ones are asked); an exception is the
    case's result, so one failure does not hide the others."""
    results = []
    for case in cases:
        try:
            if case["expect"] == "OK":
                results.append(trained(case, rank, world_size))
            else:
                results.append(refused(case))
        except Exception as exc:  # reported per case
            import traceback

            results.append({"status": "raised", "error": f"{exc!r}\n{traceback.format_exc()}"})
    return results
