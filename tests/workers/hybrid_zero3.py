"""ZeRO-3 on a 2-D mesh (HSDP) on 4 spawned ranks as 2 shard groups of 2: parity with flat
ZeRO-3, the bytes held, checkpoints between layouts, and the refusals."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import traceback
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

import dtypeplan
from dtypeplan.comm._groups import hybrid_groups
from tests._helpers import make_batch, make_model, mse

SHARD = 2
"""Ranks per shard group in these tests (4 ranks: 2 x 2)."""

STEPS = 3
MICRO_BATCHES = 2

CELLS: dict[str, dict[str, Any]] = {
    "fp32-adamw-clip": {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "gradient_clipping": 0.3,
    },
    "fp32-sgd-momentum": {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    },
    "bf16-adamw-clip": {
        "bf16": {"enabled": True},
        "communication_data_type": "bf16",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "gradient_clipping": 0.3,
    },
    "bf16-accum-bf16": {
        "bf16": {"enabled": True},
        "gradient_accumulation_dtype": {"dtype": "bf16"},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    },
    "fp16-loss-scaling": {
        "fp16": {"enabled": True, "initial_scale_power": 4},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "gradient_clipping": 0.3,
    },
    "bf16-masters-stochastic": {
        "bf16": {"enabled": True},
        "master_weights": {"dtype": "bf16", "rounding": "stochastic"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
    },
}
"""Per cell, the config keys besides ZeRO-3."""


def plan_for(cell: dict[str, Any], shard_group_size: int | None, **extra: Any) -> Any:
    config = {**cell, "zero_optimization": {"stage": 3}}
    plan = dtypeplan.resolve(config)
    assert plan.status == "OK", plan.explain()
    return dataclasses.replace(plan, shard_group_size=shard_group_size, **extra)


def build(plan: Any, group: dist.ProcessGroup | None = None) -> tuple[torch.nn.Module, Any]:
    model = plan.prepare_model(make_model(0), process_group=group)
    return model, plan.build(model.parameters(), process_group=group)


def train(model: torch.nn.Module, opt: Any, steps: range) -> dict[str, list[float]]:
    """Each rank trains on batches of its own (by global rank), the same in every layout."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses, norms = [], []
    for step in steps:
        for micro in range(MICRO_BATCHES):
            x, y = make_batch(1000 * step + 10 * rank + micro, 4)
            loss = mse(model, x, y)
            opt.backward(loss)
            losses.append(float(loss.detach()))
        opt.step()
        norms.append(float(opt.grad_norm) if opt.grad_norm is not None else float("nan"))
        opt.zero_grad()
    return {"losses": losses, "norms": norms}


@contextlib.contextmanager
def record_levels() -> Iterator[list[tuple[str, str, str, int]]]:
    """Record (op, level, dtype, bytes sent by the ring count) of every collective FSDP2 and
    the optimizer run; level: "shard", "replica" or "world" by the group it spans."""
    layout = hybrid_groups(None, SHARD)
    log: list[tuple[str, str, str, int]] = []
    names = {"all_gather_single": 1, "reduce_scatter_single": 1, "all_reduce": 0}
    originals = {name: getattr(dist, name) for name in names}

    def level(group: Any) -> str:
        # By name: a DeviceMesh may hand out its own handle of the same group.
        name = dist.group.WORLD.group_name if group is None else group.group_name
        for label, known in (
            ("shard", layout.shard),
            ("replica", layout.replica),
            ("world", dist.group.WORLD),
        ):
            if known is not None and known.group_name == name:
                return label
        return "other"

    def wrap(name: str, which: int) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            tensor = args[which] if len(args) > which else kwargs.get("input", kwargs.get("tensor"))
            group = kwargs.get("group")
            size = dist.get_world_size(group)
            sent = tensor.numel() * tensor.element_size()
            sent = (
                2 * sent * (size - 1) // size
                if name == "all_reduce"
                else (
                    sent * (size - 1) if name == "all_gather_single" else sent * (size - 1) // size
                )
            )
            log.append((name, level(group), str(tensor.dtype), sent))
            return originals[name](*args, **kwargs)

        return recorded

    for name, which in names.items():
        setattr(dist, name, wrap(name, which))
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def local_digest(opt: Any) -> str:
    """The bits of this rank's local shards (the master weights)."""
    digest = hashlib.sha256()
    for local in opt._locals():
        digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def parity(rank: int, world: int) -> dict[str, Any]:
    # The flat layout makes no subgroup (new_group is collective: at scale it costs).
    with mock.patch.object(dist, "new_group", wraps=dist.new_group) as new_group:
        build(plan_for(CELLS["fp32-sgd-momentum"], None))
    layout = hybrid_groups(None, SHARD)
    out: dict[str, Any] = {"flat_new_groups": new_group.call_count}
    for name, cell in CELLS.items():
        runs: dict[str, Any] = {}
        for label, size in (("flat", None), ("hybrid", SHARD)):
            model, opt = build(plan_for(cell, size))
            with record_levels() as log:
                runs[label] = train(model, opt, range(STEPS))
            runs[label]["wire"] = sorted(set((op, lv, dtype) for op, lv, dtype, _ in log))
            runs[label]["bytes"] = {
                lv: sum(b for _, at, _, b in log if at == lv) // STEPS
                for lv in ("shard", "replica", "world", "other")
            }
            runs[label]["state"] = opt.full_state()
            runs[label]["held"] = opt.held_tensors().nbytes()
            runs[label]["digest"] = local_digest(opt)
            runs[label]["mesh"] = list(next(model.parameters()).device_mesh.shape)
        # Flat ZeRO-3 on S ranks (this rank's shard group): what a hybrid rank should hold.
        model, opt = build(plan_for(cell, None), layout.shard)
        train(model, opt, range(1))
        runs["flat_S"] = {"held": opt.held_tensors().nbytes()}
        runs["shard_rank"] = layout.shard_rank
        out[name] = runs
    # The two ends: S = W is the flat layout, S = 1 replicates everything (no sharding).
    cell = CELLS["fp32-adamw-clip"]
    for label, size in (("S=W", world), ("S=1", 1)):
        model, opt = build(plan_for(cell, size))
        ends = train(model, opt, range(STEPS))
        ends["state"] = opt.full_state()
        ends["held"] = opt.held_tensors().nbytes()
        ends["mesh"] = list(next(model.parameters()).device_mesh.shape)
        ends["numel"] = sum(p.numel() for p in model.parameters())
        out[label] = ends
    return out


def checkpoints(rank: int, world: int, root: str) -> dict[str, Any]:
    """one process -> hybrid -> flat(4) -> hybrid -> (one process, in the parent)."""
    cell = CELLS["bf16-adamw-clip"]
    out: dict[str, Any] = {}
    model, hybrid = build(plan_for(cell, SHARD))
    dtypeplan.checkpoint.load(hybrid, f"{root}/one")
    out["hybrid_from_one"] = hybrid.full_state()
    train(model, hybrid, range(2, 3))
    out["hybrid_trained"] = hybrid.full_state()
    # The weights by name, gathered within the shard group.
    exported = dtypeplan.checkpoint.export_model_state(hybrid, model)
    out["exported"] = {name: exported[name] for name in sorted(exported)}
    out["names"] = [name for name, _ in model.named_parameters()]
    dtypeplan.checkpoint.save(hybrid, f"{root}/hybrid")
    model, flat = build(plan_for(cell, None))
    dtypeplan.checkpoint.load(flat, f"{root}/hybrid")
    out["flat_from_hybrid"] = flat.full_state()
    train(model, flat, range(3, 4))
    out["flat_trained"] = flat.full_state()
    dtypeplan.checkpoint.save(flat, f"{root}/flat")
    model, hybrid = build(plan_for(cell, SHARD))
    dtypeplan.checkpoint.load(hybrid, f"{root}/flat")
    out["hybrid_from_flat"] = hybrid.full_state()
    dtypeplan.checkpoint.save(hybrid, f"{root}/hybrid2")
    # A per-rank state dict names its layout: another layout's is refused.
    state = hybrid.state_dict()
    model, flat = build(plan_for(cell, None))
    out["state_dict_layout"] = capture(lambda: flat.load_state_dict(state))
    return out


def refusals(rank: int, world: int) -> dict[str, str]:
    cell = CELLS["bf16-adamw-clip"]
    out: dict[str, str] = {}
    for wire in ("int8", "fp8", "fp32"):
        out[f"wire {wire}"] = capture(
            lambda wire=wire: build(plan_for(cell, SHARD, wire_across_groups=wire))
        )
    out["wire bf16 (the comm dtype)"] = capture(
        lambda: build(plan_for(cell, SHARD, wire_across_groups="bf16"))
    )
    out["shard_group_size 3"] = capture(lambda: build(plan_for(cell, 3)))

    def mismatch() -> None:
        model = plan_for(cell, None).prepare_model(make_model(0))
        plan_for(cell, SHARD).build(model.parameters())

    out["flat model, hybrid plan"] = capture(mismatch)
    return out


def capture(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the parent checks the message
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def run_group(rank: int, world: int, root: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, fn in (
        ("parity", lambda: parity(rank, world)),
        ("checkpoints", lambda: checkpoints(rank, world, root)),
        ("refusals", lambda: refusals(rank, world)),
    ):
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - reported per part
            results[name] = {"error": f"{exc!r}\n{traceback.format_exc()}"}
        dist.barrier()
    return results
