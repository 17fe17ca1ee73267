"""Worker functions for the checkpoint tests, run on spawned ranks (and in-process for 1 rank).

One spawned group of 4 ranks does everything multi-rank (a group costs seconds to start): the
pair of ranks 0-1 saves the reference runs on its own 2-rank subgroup while the pair 2-3 tests
an interrupted save; all 4 ranks then load on the default group; then each pair loads on its
subgroup into other ZeRO stages, and the pair 2-3 checks the refusals. So the optimizers run
on subgroups as well as on the default group.

Every case trains the ``tests/parity.py`` model on a fixed global batch of ``GLOBAL_BATCH``
samples per step, split evenly over the ranks and into ``MICRO`` micro-batches, so a run on
1, 2 or 4 ranks sees the same data and (up to summation order) the same gradients. That is
what lets a run resumed on another world size be compared with the uninterrupted one.
"""

from __future__ import annotations

import errno
import os
import shutil
import traceback
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dtypeplan
from dtypeplan import checkpoint
from dtypeplan.checkpoint import _adapters, _io
from tests._helpers import make_batch, make_model, mse

GLOBAL_BATCH = 16
MICRO = 2
STEPS_BEFORE = 3
STEPS_AFTER = 3
SMALL_BUCKETS = 300
"""A bucket size that splits the model into several buckets: another layout than the default."""

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "sgd": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
}
PRECISIONS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    # A short window makes the dynamic scale move during the run, so a lost scale would show.
    "fp16": {
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
    },
}
CASES: dict[str, dict[str, Any]] = {
    "fp32": {"precision": "fp32", "optimizer": "adamw"},
    "bf16": {"precision": "bf16", "optimizer": "adamw"},
    "sgd": {"precision": "fp32", "optimizer": "sgd"},
    # Step 1 overflows on purpose: one skipped step and a lowered scale must survive too.
    "fp16": {"precision": "fp16", "optimizer": "adamw", "overflow_steps": (1,)},
}


def config(
    case: str, stage: int, bucket: int | None = None, optimizer: str | None = None
) -> dict[str, Any]:
    spec = CASES[case]
    zero: dict[str, Any] = {"stage": stage}
    if bucket is not None:
        zero["reduce_bucket_size"] = bucket
    return {
        **PRECISIONS[spec["precision"]],
        "zero_optimization": zero,
        "optimizer": OPTIMIZERS[optimizer or spec["optimizer"]],
    }


def build(
    case: str,
    stage: int,
    bucket: int | None = None,
    seed: int = 0,
    optimizer: str | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.nn.Module, dtypeplan.MixedPrecisionOptimizer]:
    plan = dtypeplan.resolve(config(case, stage, bucket, optimizer))
    assert plan.status == "OK", plan.explain()
    model = make_model(seed)
    return model, plan.build(model.parameters(), process_group=group)


def _rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def train(
    model: torch.nn.Module,
    opt: dtypeplan.MixedPrecisionOptimizer,
    steps: range,
    group: dist.ProcessGroup | None = None,
    overflow_steps: tuple[int, ...] = (),
) -> list[float]:
    """Train ``steps`` on ``group``; return the global mean loss of each step."""
    rank, size = _rank_size(group)
    losses = []
    for step in steps:
        x, y = make_batch(100 + step, GLOBAL_BATCH)
        mine = zip(x.chunk(size)[rank].chunk(MICRO), y.chunk(size)[rank].chunk(MICRO), strict=True)
        opt.zero_grad()
        total = torch.zeros(())
        for xm, ym in mine:
            loss = mse(model, xm, ym) / MICRO
            opt.backward(loss * float("inf") if step in overflow_steps else loss)
            total += loss.detach()
        opt.step()
        if size > 1:
            dist.all_reduce(total, group=group)
        losses.append(float(total) / size)
    return losses


def snapshot(opt: dtypeplan.MixedPrecisionOptimizer) -> dict[str, Any]:
    """What a checkpoint must preserve, as plain data (from the layout-free full state)."""
    full = opt.full_state()
    count = sum(1 for key in full if key.endswith(".master"))
    return {
        "masters": [full[f"param.{i}.master"].clone() for i in range(count)],
        "states": {
            k: v.clone()
            for k, v in full.items()
            if k.startswith("param.") and not k.endswith(".master")
        },
        "step": full["scalar.step"],
        "loss_scale": opt.loss_scale,
        "skipped_steps": opt.skipped_steps,
        "scaler": dict(opt.scaler.state_dict()),
    }


def capture(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn``; report its exception (type and message) instead of raising."""
    try:
        return {"ok": True, "value": fn()}
    except Exception as exc:
        return {
            "ok": False,
            "type": type(exc).__name__,
            "message": str(exc),
            "trace": traceback.format_exc(),
        }


# --- saving and loading ----------------------------------------------------------------------
def save_case(root: str, case: str, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Train, save at stage 1 (several buckets), keep training: the uninterrupted reference."""
    overflow = CASES[case].get("overflow_steps", ())
    model, opt = build(case, stage=1, bucket=SMALL_BUCKETS, group=group)
    train(model, opt, range(STEPS_BEFORE), group, overflow)
    checkpoint.save(opt, os.path.join(root, case))
    saved = snapshot(opt)
    after = train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), group)
    return {**saved, "losses_after": after}


def load_case(
    root: str, case: str, stage: int, group: dist.ProcessGroup | None, full_state_io: bool = False
) -> dict[str, Any]:
    """Build a differently initialized optimizer, load, report its state and continued losses."""
    model, opt = build(case, stage=stage, seed=7, group=group)
    if full_state_io:
        with mock.patch.object(_io, "adapter_for", _adapters.FullStateAdapter):
            checkpoint.load(opt, os.path.join(root, case))
    else:
        checkpoint.load(opt, os.path.join(root, case))
    loaded = snapshot(opt)
    # How many master elements this rank reads: its shard only, unless written as full state.
    adapter = _adapters.adapter_for(opt)
    targets = adapter.load_targets(["master"], adapter.shapes())
    loaded["read_numel"] = sum(t.numel() for flat in targets.values() for _o, t in flat.pieces)
    params = [p.detach().clone() for p in model.parameters()]
    losses = train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), group)
    return {**loaded, "params": params, "losses_after": losses}


def full_state_save(root: str, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Save through ``full_state()`` (full tensors, written once) instead of per-rank pieces."""
    model, opt = build("fp32", stage=2, seed=11, group=group)
    train(model, opt, range(2), group)
    with mock.patch.object(_io, "adapter_for", _adapters.FullStateAdapter):
        checkpoint.save(opt, os.path.join(root, "written-as-full"))
    return snapshot(opt)


# --- failures --------------------------------------------------------------------------------
def _entries_after(
    path: str, group: dist.ProcessGroup | None, keep: Callable[[str], bool]
) -> list[str]:
    """The directory's entries once every rank is back from a failed save, before any goes on.

    The first barrier lets rank 0 finish removing the failed save's directory; the second keeps
    it from creating the next save's directory while another rank still looks.
    """
    if dist.is_initialized():
        dist.barrier(group)
    entries = sorted(e for e in os.listdir(path) if keep(e))
    if dist.is_initialized():
        dist.barrier(group)
    return entries


def interrupted_save(
    root: str, group: dist.ProcessGroup | None, failing_rank: int
) -> dict[str, Any]:
    """A save whose writer dies on one rank must leave the previous checkpoint in place."""
    path = os.path.join(root, "interrupted")
    model, opt = build("fp32", stage=1, group=group)
    train(model, opt, range(2), group)
    checkpoint.save(opt, path)
    first = snapshot(opt)
    train(model, opt, range(2, 3), group)
    original = dcp.FileSystemWriter.write_data
    rank, _size = _rank_size(group)

    def dying_write(self: Any, plan: Any, planner: Any) -> Any:
        if rank == failing_rank:
            raise OSError("disk died while writing")
        return original(self, plan, planner)

    with mock.patch.object(dcp.FileSystemWriter, "write_data", dying_write):
        failed = capture(lambda: checkpoint.save(opt, path))
    leftovers = _entries_after(path, group, lambda e: e.endswith(".tmp"))

    full: dict[str, Any] = {}
    for who in ("one", "all"):

        def disk_full(self: Any, plan: Any, planner: Any, who: str = who) -> Any:
            # Real bytes first, then the error a full disk gives: the failed save has written.
            written = original(self, plan, planner)
            if who == "all" or rank == failing_rank:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return written

        with mock.patch.object(dcp.FileSystemWriter, "write_data", disk_full):
            full[who] = capture(lambda: checkpoint.save(opt, path))
        full[who]["entries"] = _entries_after(path, group, lambda e: True)
    _fresh_model, fresh = build("fp32", stage=1, seed=3, group=group)
    checkpoint.load(fresh, path)
    reloaded = snapshot(fresh)
    # The next good save replaces the old snapshot and removes the dead one's leftovers.
    checkpoint.save(opt, path)
    return {
        "failed": failed,
        "leftovers": leftovers,
        "disk_full": full,
        "first_masters": first["masters"],
        "reloaded_masters": reloaded["masters"],
        "after_next_save": sorted(os.listdir(path)),
    }


def _damage(source: str, path: str, kind: str) -> None:
    shutil.copytree(source, path)
    with open(os.path.join(path, "LATEST")) as handle:
        snap = os.path.join(path, handle.read().strip())
    data = sorted(e for e in os.listdir(snap) if e.endswith(".distcp"))[-1]
    file = os.path.join(snap, data)
    size = os.path.getsize(file)
    with open(file, "r+b") as handle:
        if kind == "truncated":
            handle.truncate(size // 2)
        else:
            handle.write(bytes(size))


def refusals(root: str, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Loads that must be refused on every rank: wrong optimizer, wrong shapes, damaged files."""
    source = os.path.join(root, "fp32")
    out: dict[str, Any] = {}
    _model, sgd = build("fp32", stage=1, optimizer="sgd", group=group)
    out["optimizer_type"] = capture(lambda: checkpoint.load(sgd, source))
    other = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh(), torch.nn.Linear(20, 6))
    plan = dtypeplan.resolve(config("fp32", stage=1))
    out["shapes"] = capture(lambda: checkpoint.load(plan.build(other.parameters(), group), source))
    damaged = {kind: os.path.join(root, f"damaged-{kind}") for kind in ("truncated", "zeroed")}
    if _rank_size(group)[0] == 0:
        for kind, path in damaged.items():
            _damage(source, path, kind)
    if dist.is_initialized():
        dist.barrier(group)
    model, opt = build("fp32", stage=2, seed=9, group=group)
    before = [p.detach().clone() for p in model.parameters()]
    for kind, path in damaged.items():
        out[kind] = capture(lambda path=path: checkpoint.load(opt, path))
    out["unchanged_after_failed_loads"] = all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )
    return out


# --- the spawned group -----------------------------------------------------------------------
FOUR_RANK_LOADS = [
    ("fp32", 1, False),
    ("fp32", 2, True),
    ("bf16", 1, False),
    ("sgd", 2, False),
    ("fp16", 1, False),
]
PAIR_LOADS = {
    0: [("fp32", 0), ("bf16", 2), ("sgd", 0)],
    1: [("fp32", 2), ("fp16", 2)],
}


def four_rank_group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    assert world_size == 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    out: dict[str, Any] = {"rank": rank, "load": {}}
    if rank < 2:
        out["save"] = {
            case: capture(lambda case=case: save_case(root, case, pair)) for case in CASES
        }
    else:
        out["interrupted"] = capture(lambda: interrupted_save(root, pair, failing_rank=1))
    dist.barrier()
    for case, stage, full_io in FOUR_RANK_LOADS:
        key = f"4 ranks/{case}/stage{stage}" + ("/full-state" if full_io else "")
        out["load"][key] = capture(
            lambda case=case, stage=stage, full_io=full_io: load_case(
                root, case, stage, None, full_io
            )
        )
    out["full_state_save"] = capture(lambda: full_state_save(root, None))
    for case, stage in PAIR_LOADS[rank // 2]:
        out["load"][f"2 ranks/{case}/stage{stage}"] = capture(
            lambda case=case, stage=stage: load_case(root, case, stage, pair)
        )
    if rank >= 2:
        out["refusals"] = capture(lambda: refusals(root, pair))
    out["skipped"] = hybrid_skipped_step_resumes(root)
    return out


def hybrid_skipped_step_resumes(root: str) -> dict[str, Any]:
    """Issue 29 item 4 on the hybrid layout (2 shard groups of 2 ranks, ZeRO-2): resume after
    skipped steps through ``dtypeplan.checkpoint``, every master rounding (the cases and the
    comparison are ``tests/workers/exact_resume.py``'s)."""
    from tests.workers import exact_resume  # it imports this module

    out: dict[str, Any] = {}
    for stage, master, momentum in exact_resume.HYBRID_SKIPPED_STEP_CASES:
        key = exact_resume.skipped_step_key(stage, master, momentum)
        cfg = exact_resume.skipping_config(master, stage, momentum, shard_group_size=2)
        directory = os.path.join(root, "hybrid-" + key.replace("/", "-"))
        out[key] = capture(
            lambda cfg=cfg, directory=directory: exact_resume.skipped_step_resume(
                cfg, "checkpoint", directory
            )
        )
    return out


def _bf16_master_optimizer(
    stage: int, master: dict[str, Any] | None, bf16_states: bool = False
) -> tuple[torch.nn.Module, dtypeplan.MixedPrecisionOptimizer]:
    config: dict[str, Any] = {
        "bf16": {"enabled": True, "bf16_optimizer_states": bf16_states},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
    }
    if master is not None:
        config["master_weights"] = master
    plan = dtypeplan.resolve(config)
    assert plan.status == "OK", plan.explain()
    model = plan.prepare_model(make_model(0))
    return model, plan.build(model.parameters())


KAHAN = {"dtype": "bf16", "rounding": "kahan"}


def zero3_bf16_master_conversions(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """ZeRO-3 with Kahan bf16 masters and bf16 moments: saved, then loaded at ZeRO-3 with fp32
    masters, at ZeRO-1 with the same masters, and (from the fp32 run) at ZeRO-3 with bf16
    masters rounded to nearest. Returns the snapshots (full states) for the parent to compare,
    and the path of the first checkpoint, which the parent loads on one process."""
    model, opt = _bf16_master_optimizer(3, KAHAN, bf16_states=True)
    train(model, opt, range(3))
    saved = snapshot(opt)
    dtypeplan.checkpoint.save(opt, path)
    model, fp32 = _bf16_master_optimizer(3, None)
    dtypeplan.checkpoint.load(fp32, path)
    as_fp32 = snapshot(fp32)
    train(model, fp32, range(3, 4))
    trained_fp32 = snapshot(fp32)
    dtypeplan.checkpoint.save(fp32, path + "-fp32")
    _model, zero1 = _bf16_master_optimizer(1, KAHAN, bf16_states=True)
    dtypeplan.checkpoint.load(zero1, path)
    model, nearest = _bf16_master_optimizer(3, {"dtype": "bf16"})
    dtypeplan.checkpoint.load(nearest, path + "-fp32")
    as_nearest = snapshot(nearest)
    train(model, nearest, range(4, 5))
    return {
        "path": path,
        "saved": saved,
        "as_fp32": as_fp32,
        "as_zero1_kahan": snapshot(zero1),
        "trained_fp32": trained_fp32,
        "as_nearest": as_nearest,
        "nearest_shard_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }


def zero3_round_trip(rank: int, world_size: int, path: str) -> dict[str, list[float]]:
    """Save a ZeRO-3 (FSDP2) run; resume it at ZeRO-3 and at ZeRO-1; run it uninterrupted.

    ``gathered`` counts the elements ``DTensor.full_tensor`` gathered inside ``save`` and
    ``load`` at ZeRO-3 (issue 14 C4: none; the local shards are written and read as they are).
    """
    from unittest import mock

    from torch.distributed.tensor import DTensor

    from tests._helpers import make_batch, make_model, mse

    gathered: list[float] = [0.0]
    real_full_tensor = DTensor.full_tensor

    def counting(self: DTensor, **kw: Any) -> torch.Tensor:
        gathered[0] += self.numel()
        return real_full_tensor(self, **kw)

    def run(stage: int, steps: range, load: bool, save: bool) -> list[float]:
        config = {
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        }
        plan = dtypeplan.resolve(config)
        model = plan.prepare_model(make_model(0))
        optimizer = plan.build(model.parameters())
        if load:
            with mock.patch.object(DTensor, "full_tensor", counting):
                dtypeplan.checkpoint.load(optimizer, path)
        norms = []
        for step in steps:
            x, y = make_batch(step, 8 * world_size)
            optimizer.zero_grad()
            optimizer.backward(mse(model, x.chunk(world_size)[rank], y.chunk(world_size)[rank]))
            optimizer.step()
            norms.append(float(optimizer.grad_norm))
        if save:
            with mock.patch.object(DTensor, "full_tensor", counting):
                dtypeplan.checkpoint.save(optimizer, path)
        return norms

    return {
        "bf16_masters": zero3_bf16_master_conversions(rank, world_size, path + "-bf16"),
        "saved": run(3, range(0, 3), load=False, save=True),
        "resumed_zero3": run(3, range(3, 6), load=True, save=False),
        "gathered": list(gathered),
        "resumed_zero1": run(1, range(3, 6), load=True, save=False),
        "uninterrupted": run(3, range(0, 6), load=False, save=False),
    }
