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

import contextlib
import copy
import shutil
import tempfile
import traceback
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dtypeplan
import dtypeplan.checkpoint
from dtypeplan.checkpoint import _adapters, _io

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


def _config(case: dict[str, Any], bucket: int = 40) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": case["stage"], "reduce_bucket_size": bucket}
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
    # ``skip``: a step after that in which it gets none (an MoE expert no token was routed to).
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
    # (model, optimizer, whether it trains on the whole batch alone): the run, and from
    # SAVE_AT on the runs resumed from its checkpoint (late-head cases).
    runs: list[tuple[torch.nn.Module, Any, bool]] = [(model, optimizer, world_size == 1)]
    folder = None
    for step in range(STEPS):
        if late is not None and step == SAVE_AT:
            folder = _shared_folder(rank)
            with _checkpoint_io(case):
                dtypeplan.checkpoint.save(optimizer, folder)
            runs += _resumed(case, plan, folder, rank, world_size)
        joined = (late is None or step >= late) and step != case.get("skip")
        x, y = _batch(seed, step, PER_RANK * world_size)
        ref_opt.zero_grad()
        loss_of(reference, x, y, joined).backward()
        ref_opt.step()
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        for net, opt, alone in runs:
            opt.zero_grad()
            part = slice(None) if alone else mine
            opt.backward(loss_of(net, x[part], y[part], joined))
            opt.step()
    worst = _difference(model, reference)
    extra: dict[str, Any] = {}
    if late is not None:
        # torch's counts: the trunk stepped every step, the late head since it joined.
        extra.update(_counts(model, optimizer))
        same, moved = runs[1], runs[2]
        extra["checkpoint_equal"] = all(
            torch.equal(*(_local(t) for t in pair))
            for pair in zip(model.parameters(), same[0].parameters(), strict=True)
        )
        extra["checkpoint_counts"] = [_counts(same[0], same[1]), _counts(moved[0], moved[1])]
        extra["resharded_error"] = _difference(moved[0], reference)
        if case.get("skip") is not None:
            # full_state() is the same on every rank: each parameter's own scalars included,
            # wherever its pieces are.
            full = optimizer.full_state()
            extra["full_state_scalars"] = sorted(
                (key, float(value))
                for key, value in full.items()
                if key.startswith("scalar.param.")
            )
        if case.get("round_trip"):
            extra["round_trip_equal"] = _round_trip(case, plan, model, optimizer, rank)
    for _, opt, _ in runs:
        opt.close()
    if folder is not None and dist.is_initialized():
        dist.barrier()
    if folder is not None and rank == 0:
        shutil.rmtree(folder)
    return {"outcome": "match", "rel_error": worst, **extra}


SAVE_AT = 2
"""Late-head cases save a checkpoint after this many steps and resume from it: a head that
joins at step 1 has its own count then (1, the trunk's 2), one that joins at 2 no state yet."""

RESHARD_TO: dict[int, int | None] = {0: 3, 1: None, 2: 3, 3: 1}
"""The stage each 2-rank stage's checkpoint is loaded into (None: one process, ZeRO-0), with
other buckets; in one process, stage 0 with other buckets."""

_SINGLES: dict[int, Any] = {}


def _single_group(rank: int, world_size: int) -> Any:
    """This rank alone as a process group (made once per spawned group, on every rank)."""
    if not _SINGLES:
        for r in range(world_size):
            _SINGLES[r] = dist.new_group([r])
    return _SINGLES[rank]


def _shared_folder(rank: int) -> str:
    """A fresh checkpoint folder, the same on every rank."""
    made = [tempfile.mkdtemp(prefix="optim-db-ckpt-") if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(made, src=0)
    assert made[0] is not None
    return made[0]


def _resumed(
    case: dict[str, Any], plan: dtypeplan.PrecisionPlan, folder: str, rank: int, world_size: int
) -> list[tuple[torch.nn.Module, Any, bool]]:
    """Two runs loaded from ``folder``: the same layout, and another (``RESHARD_TO``)."""
    torch_class = getattr(torch.optim, case["optimizer"])
    seed = case.get("seed", 0)
    runs = []
    target = RESHARD_TO[case["stage"]] if world_size > 1 else 0
    moved = {**case, "stage": 0 if target is None else target, "offload": False}
    for config, group in (
        (plan, None),
        (
            dtypeplan.resolve(_config(moved, bucket=1000)),
            _single_group(rank, world_size) if target is None else None,
        ),
    ):
        # Other initial weights: the load must replace them.
        net = config.prepare_model(make_model(seed + 1), process_group=group)
        if case["how"] == "wrap":
            opt = config.wrap(torch_class(net.parameters(), **case["kwargs"]), process_group=group)
        else:
            opt = config.build(
                net.parameters(), optimizer=torch_class, process_group=group, **case["kwargs"]
            )
        with _checkpoint_io(case):
            dtypeplan.checkpoint.load(opt, folder)
        runs.append((net, opt, world_size == 1 or group is not None))
    return runs


def _checkpoint_io(case: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """Skipping-head cases save and load through ``full_state()`` / ``load_full_state()``
    (the layout-free way) instead of per-rank pieces."""
    if case.get("skip") is None:
        return contextlib.nullcontext()
    return mock.patch.object(_io, "adapter_for", _adapters.FullStateAdapter)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.detach().to_local() if isinstance(param, DTensor) else param.detach()


def _difference(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """The largest parameter difference from the reference, relative to its largest value."""
    worst = 0.0
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        whole = param.detach()
        if isinstance(whole, DTensor):
            whole = whole.full_tensor()  # collective: every rank, same order
        error = (whole.float() - ref.detach()).abs().max() / ref.detach().abs().max()
        worst = max(worst, float(error))
    return worst


def _counts(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, list[float]]:
    """The late head's and the trunk's step counts in ``optimizer``'s state dict."""
    params = list(model.parameters())
    first_late = len(params) - len(list(model.late.parameters()))
    return {
        "late_steps": _steps_of(optimizer, range(first_late, len(params))),
        "trunk_steps": _steps_of(optimizer, range(2)),
    }


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
