"""torch's own optimizer inputs (``optim_db``) through ``plan.build`` and ``plan.wrap``,
against plain fp32 ``torch.optim`` on the full batch.

A case is one optimizer input at one ZeRO stage, built one way, optionally with a late head (a
layer that gets its first gradient at step ``late``). Every rank trains on its slice of the
batch; the reference trains an fp32 copy of the model on the whole batch with the same torch
class and arguments, on every rank, so nothing about it is communicated. Each case reports
its outcome: ``match`` (with the largest parameter difference), ``refused`` (with the error
raised at build or wrap) or ``failed`` (an error anywhere else, with its traceback).
"""

from __future__ import annotations

import copy
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dtypeplan

IN, HIDDEN, OUT = 6, 8, 3
STEPS = 3
PER_RANK = 4


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; ``late`` (the second head) joins the loss at a later step."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(IN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT)
        self.late = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, joined: bool) -> torch.Tensor:
        hidden = torch.tanh(self.trunk(x))
        out = self.head(hidden)
        return out + self.late(hidden) if joined else out


def make_model(seed: int) -> TwoHeads:
    generator = torch.Generator().manual_seed(seed)
    model = TwoHeads()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, joined: bool) -> torch.Tensor:
    dtype = next(model.parameters()).dtype  # bf16 parameters take bf16 inputs
    return torch.nn.functional.mse_loss(model(x.to(dtype), joined).float(), y)


def _batch(seed: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randn(size, IN, generator=generator), torch.randn(size, OUT, generator=generator)


LOW_PRECISION = {
    "bf16": {"enabled": True, "bf16_optimizer_states": True},
    "master_weights": {"dtype": "bf16", "rounding": "kahan"},
}
"""bf16 parameters, Kahan-compensated bf16 masters and bf16 moments (Adam/AdamW only)."""


def _config(case: dict[str, Any]) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": case["stage"], "reduce_bucket_size": 40}
    if case.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    config: dict[str, Any] = {"zero_optimization": zero}
    if case.get("low_precision"):
        config.update(LOW_PRECISION)
        config["master_weights"] = {"dtype": "bf16", "rounding": case.get("rounding", "kahan")}
    return config


def _steps_of(optimizer: torch.optim.Optimizer, indices: range) -> list[float]:
    """The ``step`` this rank's state dict gives the parameters at ``indices`` (those with a
    state here; a rank may hold no piece of a parameter)."""
    state = optimizer.state_dict()["state"]
    return [float(state[i]["step"]) for i in indices if "step" in state.get(i, {})]


def run_case(case: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    torch_class = getattr(torch.optim, case["optimizer"])
    kwargs = case["kwargs"]
    seed = case.get("seed", 0)
    late = case.get("late")  # the step at which the late head gets its first gradient
    plan = dtypeplan.resolve(_config(case))
    assert plan.status == "OK", plan.explain()
    reference = make_model(seed)
    model = plan.prepare_model(copy.deepcopy(reference))
    try:
        if case["how"] == "wrap":
            optimizer = plan.wrap(torch_class(model.parameters(), **kwargs))
        else:
            optimizer = plan.build(model.parameters(), optimizer=torch_class, **kwargs)
    except (dtypeplan.NotSupportedError, dtypeplan.PrecisionConfigError) as exc:
        return {"outcome": "refused", "error": f"{type(exc).__name__}: {exc}"}
    ref_opt = torch_class(reference.parameters(), **kwargs)
    for step in range(STEPS):
        joined = late is None or step >= late
        x, y = _batch(seed, step, PER_RANK * world_size)
        ref_opt.zero_grad()
        loss_of(reference, x, y, joined).backward()
        ref_opt.step()
        optimizer.zero_grad()
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        optimizer.backward(loss_of(model, x[mine], y[mine], joined))
        optimizer.step()
    worst = 0.0
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        whole = param.detach()
        if isinstance(whole, DTensor):
            whole = whole.full_tensor()  # collective: every rank, same order
        error = (whole.float() - ref.detach()).abs().max() / ref.detach().abs().max()
        worst = max(worst, float(error))
    extra: dict[str, Any] = {}
    if late is not None:
        # torch's counts: the trunk stepped every step, the late head since it joined.
        params = list(model.parameters())
        first_late = len(params) - len(list(model.late.parameters()))
        extra["late_steps"] = _steps_of(optimizer, range(first_late, len(params)))
        extra["trunk_steps"] = _steps_of(optimizer, range(2))
        try:
            optimizer.group_scalar_state()  # what a checkpoint keeps: one count per group
            extra["checkpoint"] = "accepted"
        except dtypeplan.NotSupportedError as exc:
            extra["checkpoint"] = str(exc)
        if case.get("round_trip"):
            extra["round_trip_equal"] = _round_trip(case, plan, model, optimizer, rank)
    optimizer.close()
    return {"outcome": "match", "rel_error": worst, **extra}


def _round_trip(
    case: dict[str, Any],
    plan: dtypeplan.PrecisionPlan,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
) -> bool:
    """Whether a copy loaded from ``optimizer.state_dict()`` takes the next step to the same
    bits as the original (own step counts included)."""
    saved = copy.deepcopy(optimizer.state_dict())
    twin = plan.prepare_model(make_model(case.get("seed", 0)))
    twin_opt = plan.build(
        twin.parameters(), optimizer=getattr(torch.optim, case["optimizer"]), **case["kwargs"]
    )
    twin_opt.load_state_dict(saved)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    x, y = _batch(case.get("seed", 0), STEPS, PER_RANK * world_size)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    equal = True
    for net, opt in ((model, optimizer), (twin, twin_opt)):
        opt.zero_grad()
        opt.backward(loss_of(net, x[mine], y[mine], True))
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        a, b = (t.detach().to_local() if isinstance(t, DTensor) else t.detach() for t in (a, b))
        equal = equal and torch.equal(a, b)
    twin_opt.close()
    return equal


def run_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    results = []
    for case in cases:
        try:
            results.append(run_case(case, rank, world_size))
        except Exception as exc:  # report the case, keep the group alive for the others
            results.append({"outcome": "failed", "error": f"{exc!r}\n{traceback.format_exc()}"})
        if dist.is_initialized():
            dist.barrier()  # a failed case must not leave the ranks pairing other collectives
    return results
