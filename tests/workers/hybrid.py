"""Hybrid layout cases (ZeRO-1/2 sharded within shard groups, replicated across them).

Every case runs on the 4 ranks of one spawned group, as 2 shard groups of 2 ranks; each
returns plain numbers (or tensors) for the parent to check. A case that raises is reported
with its traceback, and the group goes on with the next.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
import dtypeplan.checkpoint
from dtypeplan.optimizers.state.keys import MASTER, parse_param_key
from tests._helpers import make_batch, make_model, mse

MICRO, PER_MICRO = 2, 4


def plan_for(config: dict[str, Any], shard_group_size: int | None, across: str | None = None):
    """The plan of ``config`` in the given layout, through the config keys and the table."""
    config = copy.deepcopy(config)
    if shard_group_size is not None:
        config["zero_optimization"]["shard_group_size"] = shard_group_size
    if across is not None:
        config["communication_data_type_across_groups"] = across
    plan = dtypeplan.resolve(config)
    assert plan.status == "OK", plan.explain()
    assert (plan.shard_group_size, plan.wire_across_groups) == (shard_group_size, across)
    return plan


def build(plan: Any, seed: int = 0, model: torch.nn.Module | None = None) -> tuple[Any, Any]:
    model = plan.prepare_model(copy.deepcopy(model if model is not None else make_model(seed)))
    return model, plan.build(model.parameters())


def train(
    model: Any, opt: Any, steps: int, first: int = 0, micro: int = MICRO, boundary: bool = False
) -> list[float]:
    """``steps`` steps of ``micro`` micro-batches on this rank's slice of a seeded batch;
    ``boundary``: the last one marked (the step's reductions start inside its backward).
    Returns the gradient norm of each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    norms = []
    for step in range(first, first + steps):
        x, y = make_batch(step, world * micro * PER_MICRO)
        opt.zero_grad()
        mine_x, mine_y = x.chunk(world)[rank].chunk(micro), y.chunk(world)[rank].chunk(micro)
        pieces = list(zip(mine_x, mine_y, strict=True))
        for index, (xm, ym) in enumerate(pieces):
            last = boundary and index == len(pieces) - 1
            opt.backward(mse(model, xm, ym) / micro, last_micro_batch=last)
        opt.step()
        norms.append(float(opt.grad_norm))
    return norms


def masters(opt: Any) -> dict[str, torch.Tensor]:
    """The full fp32 master weights (collective), by ``param.{i}.master`` key."""
    state = opt.full_state()
    return {k: v.clone() for k, v in state.items() if (parse_param_key(k) or ("", ""))[1] == MASTER}


def full_tensors(opt: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in opt.full_state().items() if torch.is_tensor(v)}


# --- parity: hybrid against flat on the same 4 ranks -------------------------------------------
def parity(case: dict[str, Any]) -> dict[str, Any]:
    """Train flat and hybrid from the same start; the masters' largest relative difference."""
    steps = case.get("steps", 4)
    results = {}
    for name, size, across in (
        ("flat", None, None),
        ("hybrid", case.get("size", 2), case.get("across")),
    ):
        model, opt = build(plan_for(case["config"], size, across))
        results[name + "_norms"] = train(
            model, opt, steps, micro=case.get("micro", MICRO), boundary=case.get("boundary", False)
        )
        results[name] = masters(opt)
        results[name + "_digest"] = _digest(opt)
        results[name + "_hybrid"] = opt.levels.across is not None
        results[name + "_skipped"] = opt.skipped_steps
    flat, hybrid = results["flat"], results["hybrid"]
    scale = max(float(v.abs().max()) for v in flat.values())
    diff = max(float((flat[k] - hybrid[k]).abs().max()) for k in flat)
    return {
        "max_abs_diff": diff,
        "max_abs_master": scale,
        "norms": results["flat_norms"],
        "hybrid_digest": results["hybrid_digest"],
        "hybrid_norms": results["hybrid_norms"],
        "flat_is_flat": not results["flat_hybrid"],
        "hybrid_is_hybrid": results["hybrid_hybrid"],
        "skipped": results["flat_skipped"],
        "hybrid_skipped": results["hybrid_skipped"],
    }


# --- bytes per level and step ---------------------------------------------------------------
def traffic(case: dict[str, Any]) -> dict[str, Any]:
    """Bytes each level's CommStats counted in one step (after one warm-up step)."""
    model, opt = build(plan_for(case["config"], 2, case.get("across")))
    train(model, opt, 1)
    levels = opt.levels
    for comm in (levels.world, levels.shard, levels.across.comm):
        comm.stats.reset()
    train(model, opt, 1, first=1, micro=case.get("micro", MICRO))
    return {
        "numel": sum(s.flat.numel for s in opt.groups),
        "world": dict(levels.world.stats.bytes_sent),
        "within": dict(levels.shard.stats.bytes_sent),
        "within_calls": dict(levels.shard.stats.calls),
        "across": dict(levels.across.comm.stats.bytes_sent),
        "across_calls": dict(levels.across.comm.stats.calls),
    }


# --- held bytes ----------------------------------------------------------------------------
def held(case: dict[str, Any]) -> dict[str, Any]:
    """Held bytes of a hybrid optimizer (S = 2 of 4) and of a flat one over a 2-rank group."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 16, bias=False), torch.nn.Tanh(), torch.nn.Linear(16, 16, bias=False)
    )
    plan = plan_for(case["config"], 2)
    out: dict[str, Any] = {"numel": sum(p.numel() for p in net.parameters())}
    model, opt = build(plan, model=net)
    train_wide(model, opt)
    out["hybrid"] = opt.held_tensors().nbytes()
    shard = opt.shard_comm.group
    flat_plan = plan_for(case["config"], None)
    model = flat_plan.prepare_model(copy.deepcopy(net))
    flat = flat_plan.build(model.parameters(), process_group=shard)
    train_wide(model, flat)
    out["flat_world_2"] = flat.held_tensors().nbytes()
    return out


def train_wide(model: Any, opt: Any) -> None:
    for _ in range(2):
        x = torch.randn(4, 16).to(opt.plan.param_dtype)
        opt.zero_grad()
        opt.backward(model(x).float().square().mean())
        opt.step()


# --- checkpoints -----------------------------------------------------------------------------
def checkpoints(case: dict[str, Any], root: str) -> dict[str, Any]:
    """flat(4) -> hybrid(2x2) -> flat(4), each load compared with what was saved, bit for bit;
    and the hybrid save left for the parent to load into one process."""
    config = case["config"]
    out: dict[str, Any] = {}
    model, flat = build(plan_for(config, None))
    train(model, flat, 2)
    saved_flat = full_tensors(flat)
    dtypeplan.checkpoint.save(flat, os.path.join(root, "flat"))
    model, hybrid = build(plan_for(config, 2, case.get("across")), seed=1)
    dtypeplan.checkpoint.load(hybrid, os.path.join(root, "flat"))
    out["flat_to_hybrid"] = _same(saved_flat, full_tensors(hybrid))
    train(model, hybrid, 2, first=2)
    saved_hybrid = full_tensors(hybrid)
    exported = dtypeplan.checkpoint.export_model_state(hybrid, model)
    names = [name for name, _ in model.named_parameters()]
    out["export"] = _same(
        {name: saved_hybrid[f"param.{i}.master"].flatten() for i, name in enumerate(names)},
        {name: exported[name].flatten() for name in names},
    )
    dtypeplan.checkpoint.save(hybrid, os.path.join(root, "hybrid"))
    model, back = build(plan_for(config, None), seed=2)
    dtypeplan.checkpoint.load(back, os.path.join(root, "hybrid"))
    out["hybrid_to_flat"] = _same(saved_hybrid, full_tensors(back))
    out["step"] = back.step_count()
    out["hybrid_state"] = saved_hybrid
    out["hybrid_dir"] = os.path.join(root, "hybrid")
    # torch.optim's state dict: this rank's pieces, loadable into the same layout only. The
    # rank in the other shard group with the same place holds the same pieces.
    state = hybrid.state_dict()
    peers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peers, state)
    model, again = build(plan_for(config, 2), seed=3)
    again.load_state_dict(peers[(dist.get_rank() + 2) % 4])
    out["state_dict"] = _same(saved_hybrid, full_tensors(again))
    try:
        again.load_state_dict(flat.state_dict())
        out["flat_state_dict"] = "loaded"
    except Exception as exc:
        out["flat_state_dict"] = f"{type(exc).__name__}: {exc}"
    return out


def _digest(opt: Any) -> str:
    """This rank's master chunks and parameters: the same on the ranks of a replica group
    (they hold the same chunks) only if every step gave them the same bits."""
    digest = hashlib.sha256()
    for state in opt.groups:
        for master in state.masters:
            digest.update(master.detach().float().numpy().tobytes())
        digest.update(state.flat.buffer.detach().float().numpy().tobytes())
    return digest.hexdigest()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors differ (empty: bit for bit the same)."""
    return sorted(
        k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k])
    )


# --- refusals --------------------------------------------------------------------------------
def by_hand(config: dict[str, Any], shard_group_size: int, across: str | None = None) -> Any:
    """A plan the table would not give (made by hand): the engine's own defence."""
    plan = plan_for(config, None)
    return dataclasses.replace(plan, shard_group_size=shard_group_size, wire_across_groups=across)


def refusal(case: dict[str, Any]) -> dict[str, Any]:
    try:
        if case.get("by_hand"):
            build(by_hand(case["config"], case["size"], case.get("across")))
        else:
            build(plan_for(case["config"], case["size"], case.get("across")))
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


def stage0(case: dict[str, Any]) -> dict[str, Any]:
    """Stage 0 with a shard group size (an Error in the table; a plan made by hand): nothing
    to shard, the layout stays flat."""
    model, opt = build(by_hand(case["config"], 2))
    train(model, opt, 2)
    flat_model, flat = build(plan_for(case["config"], None))
    train(flat_model, flat, 2)
    a, b = masters(opt), masters(flat)
    return {"is_flat": opt.levels.across is None, "same": not _same(a, b)}


CASES: dict[str, Callable[..., dict[str, Any]]] = {
    "parity": parity,
    "traffic": traffic,
    "held": held,
    "checkpoints": checkpoints,
    "refusal": refusal,
    "stage0": stage0,
}


def hybrid_cases(rank: int, world_size: int, cases: list[dict[str, Any]], root: str) -> list[Any]:
    torch.manual_seed(0)
    results = []
    for index, case in enumerate(cases):
        kind = CASES[case["kind"]]
        try:
            args = (
                (case, os.path.join(root, str(index))) if case["kind"] == "checkpoints" else (case,)
            )
            results.append(kind(*args))
        except Exception as exc:
            results.append({"error": f"{exc!r}\n{traceback.format_exc()}"})
        dist.barrier()
    return results
