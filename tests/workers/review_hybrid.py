"""Spawn-able worker for tests/test_review_hybrid.py: hybrid-layout paths the parity cases of
tests/test_hybrid.py do not take (stochastic rounding, hand-set .grad, untouched parameters),
each run flat and hybrid (2 shard groups of 2) on the same 4 ranks."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from tests._helpers import make_batch, make_model, mse

STEPS = 3


def _plan(config: dict[str, Any], size: int | None) -> Any:
    plan = dtypeplan.resolve(config)
    assert plan.status == "OK", plan.explain()
    return dataclasses.replace(plan, shard_group_size=size)


class _WithUnused(torch.nn.Module):
    """The MLP and a layer that no rank's loss reaches: torch.optim leaves it alone."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model(0)
        torch.manual_seed(1)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _model(unused: bool) -> torch.nn.Module:
    return _WithUnused() if unused else make_model(0)


def _digest(opt: Any) -> str:
    digest = hashlib.sha256()
    for state in opt.groups:
        for master in state.masters:
            digest.update(master.detach().float().numpy().tobytes())
        digest.update(state.flat.buffer.detach().float().numpy().tobytes())
    return digest.hexdigest()


def _run(case: dict[str, Any], size: int | None) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = _plan(case["config"], size)
    model = plan.prepare_model(copy.deepcopy(_model(case.get("unused", False))))
    opt = plan.build(model.parameters())
    used = [p for name, p in model.named_parameters() if not name.startswith("unused")]
    for step in range(STEPS):
        x, y = make_batch(step, world * 4)
        xm, ym = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        if case.get("hand_set"):
            loss = mse(model, xm, ym)
            grads = torch.autograd.grad(loss, used)
            for param, grad in zip(used, grads, strict=True):
                param.grad = grad
        else:
            opt.backward(mse(model, xm, ym))
        opt.step()
    params = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    return {"params": params, "digest": _digest(opt), "hybrid": opt.levels.across is not None}


def review_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    out = []
    for case in cases:
        try:
            flat, hybrid = _run(case, None), _run(case, 2)
            out.append(
                {
                    "max_diff": max(
                        float((flat["params"][k] - hybrid["params"][k]).abs().max())
                        for k in flat["params"]
                    ),
                    "unused_moved": {
                        k: float((v - _model(True).state_dict()[k]).abs().max())
                        for k, v in hybrid["params"].items()
                        if k.startswith("unused")
                    },
                    # Both layouts trained (a path that dropped every gradient would agree).
                    "used_moved": min(
                        float((v - _model(True).state_dict()[k]).abs().max())
                        if case.get("unused")
                        else float((v - _model(False).state_dict()[k]).abs().max())
                        for k, v in hybrid["params"].items()
                        if not k.startswith("unused")
                    ),
                    "digest": hybrid["digest"],
                    "hybrid": hybrid["hybrid"] and not flat["hybrid"],
                }
            )
        except Exception as error:  # noqa: BLE001 - reported to the parent per case
            out.append({"error": f"{type(error).__name__}: {error}"})
        dist.barrier()
    return out
