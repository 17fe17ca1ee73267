"""Spawn-able workers for the optimizer-offload tests (``tests/test_offload.py``).

One spawned group of 2 ranks runs everything multi-rank: the parity cases of every offload
cell, the host-sync count of an offloaded step, and checkpoints moving between offloaded and
non-offloaded optimizers (and, with the parent process, between 1 and 2 ranks). Checkpoint
runs reuse ``tests/workers/checkpoint.py``'s fixed global batch, so runs on 1 and 2 ranks see
the same data.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import dtypeplan
from dtypeplan import checkpoint
from tests._helpers import make_batch, make_model, mse
from tests.workers import checkpoint as ckpt
from tests.workers.hot_path import count_host_syncs
from tests.workers.parity import run_cases

OFFLOAD = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}


def offload_config(precision: str, stage: int, offload: bool, optimizer: str = "adamw") -> dict:
    """A checkpoint-test config (several buckets) with or without the optimizer offloaded."""
    config = ckpt.config(precision, stage, ckpt.SMALL_BUCKETS, optimizer)
    if offload:
        config["zero_optimization"].update(OFFLOAD)
    return config


def _build(config: dict[str, Any], seed: int) -> tuple[torch.nn.Module, Any]:
    plan = dtypeplan.resolve(config)
    assert plan.status == "OK", plan.explain()
    model = plan.prepare_model(make_model(seed))
    return model, plan.build(model.parameters())


def save_run(path: str, config: dict[str, Any]) -> dict[str, Any]:
    """Train, save, snapshot, keep training: the uninterrupted reference."""
    model, opt = _build(config, seed=0)
    ckpt.train(model, opt, range(ckpt.STEPS_BEFORE))
    checkpoint.save(opt, path)
    saved = ckpt.snapshot(opt)
    after = ckpt.train(model, opt, range(ckpt.STEPS_BEFORE, ckpt.STEPS_BEFORE + ckpt.STEPS_AFTER))
    return {**saved, "losses_after": after, "offloaded": opt.offload is not None}


def load_run(path: str, config: dict[str, Any]) -> dict[str, Any]:
    """Build from another seed, load, snapshot, continue training."""
    model, opt = _build(config, seed=7)
    checkpoint.load(opt, path)
    loaded = ckpt.snapshot(opt)
    params = [p.detach().float().clone() for p in model.parameters()]
    after = ckpt.train(model, opt, range(ckpt.STEPS_BEFORE, ckpt.STEPS_BEFORE + ckpt.STEPS_AFTER))
    return {**loaded, "params": params, "losses_after": after, "offloaded": opt.offload is not None}


CHECKPOINT_RUNS = {
    # name: (saved by, loaded into), each (precision, stage, offloaded)
    "bf16-offloaded-to-plain": (("bf16", 2, True), ("bf16", 1, False)),
    "fp32-plain-to-offloaded": (("fp32", 1, False), ("fp32", 2, True)),
    "fp16-offloaded-to-offloaded": (("fp16", 1, True), ("fp16", 2, True)),
}


def checkpoint_runs(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (saver, loader) in CHECKPOINT_RUNS.items():
        path = os.path.join(root, name)
        out[name] = {
            "saved": ckpt.capture(lambda s=saver, p=path: save_run(p, offload_config(*s))),
            "loaded": ckpt.capture(lambda s=loader, p=path: load_run(p, offload_config(*s))),
        }
    return out


def sync_count(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    """Host syncs (``tests/workers/hot_path.py``'s counter) and the offload's own waits for the
    device over two steps after a warm-up step, and the bucket chunks per step."""
    model, opt = _build(config, seed=0)
    opt.norm_probe.enabled = False  # as in sync_case: only reads that would wait on a GPU
    opt.hyperparameter_check.enabled = False  # likewise (read after an event on a GPU)
    x, y = make_batch(rank, 16)

    def run_step() -> None:
        for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
            opt.backward(mse(model, xm, ym) / 2)
        opt.step()
        opt.zero_grad()

    run_step()
    logs, waits, unstaged = [], [], []
    for staged in (True, True, False):
        # Staged: the accelerator's pipeline (slots, copies, waits), run on the CPU.
        opt.offload.staged = staged
        before = opt.offload.device_waits
        with count_host_syncs() as log:
            run_step()
        logs.append(log)
        (waits if staged else unstaged).append(opt.offload.device_waits - before)
    chunks = sum(len(state.masters) for state in opt.groups)
    return {"logs": logs, "waits": waits, "unstaged_waits": unstaged, "chunks": chunks}


def offload_group(
    rank: int,
    world_size: int,
    root: str,
    parity_cases: list[dict[str, Any]],
    sync_configs: list[dict[str, Any]],
    reshard_path: str,
) -> dict[str, Any]:
    """Everything multi-rank of tests/test_offload.py, on one spawned group."""
    return {
        "parity": run_cases(rank, world_size, parity_cases),
        "syncs": [ckpt.capture(lambda c=c: sync_count(rank, c)) for c in sync_configs],
        "checkpoints": checkpoint_runs(root),
        # A checkpoint saved by one offloaded process, loaded on 2 offloaded ranks.
        "resharded": ckpt.capture(lambda: load_run(reshard_path, offload_config("bf16", 2, True))),
    }


# --- ZeRO-3: FSDP2's CPUOffloadPolicy (offload_param and offload_optimizer cpu) -----------------
def zero3_offload_case(
    rank: int, world_size: int, rules: str | None, precision: str
) -> dict[str, Any]:
    """The same ZeRO-3 training with FSDP2's CPU offload (offload_param and offload_optimizer
    cpu; ``rules``: a rules file, else the shipped table) and without; losses and final shards
    of both."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    out: dict[str, Any] = {}
    for offload in (True, False):
        config = ckpt.config(precision, 3)
        if offload:
            config["zero_optimization"].update(
                {**OFFLOAD, "offload_param": {"device": "cpu", "pin_memory": True}}
            )
        plan = dtypeplan.resolve(config, rules=rules if offload else None)
        assert plan.status == "OK" and plan.implementation == "fsdp2", plan.explain()
        model = plan.prepare_model(make_model(0))
        policies = {
            type(module._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
            for module in model.modules()
            if hasattr(module, "_get_fsdp_state") and module._get_fsdp_state()._fsdp_param_group
        }
        opt = plan.build(model.parameters())
        losses = ckpt.train(model, opt, range(4))
        shards = [p.to_local().detach().clone() for p in model.parameters()]
        out["offloaded" if offload else "plain"] = {
            "losses": losses,
            "shards": shards,
            "policies": sorted(policies),
            "devices": sorted({s.device.type for s in shards}),
            "cpu_offload": any(p == CPUOffloadPolicy.__name__ for p in policies),
        }
    return out


def zero3_offload_cases(
    rank: int, world_size: int, rules: str | None, precisions: list[str]
) -> list[dict[str, Any]]:
    return [
        ckpt.capture(lambda p=p: zero3_offload_case(rank, world_size, rules, p)) for p in precisions
    ]


# --- ZeRO-3 offloaded as the shipped table serves it (the zero3-offload rule) ---------------------
ZERO3_OFFLOAD = {
    "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True},
}


def zero3_config(precision: str, offload: bool, stage: int = 3) -> dict[str, Any]:
    """A checkpoint-test config at ``stage``, offloaded as that stage offloads (ZeRO-3: the
    parameters and the optimizer; ZeRO 1-2: the optimizer)."""
    config = ckpt.config(precision, stage, ckpt.SMALL_BUCKETS)
    if offload:
        config["zero_optimization"].update(ZERO3_OFFLOAD if stage == 3 else OFFLOAD)
    return config


def offload_policies(model: torch.nn.Module) -> list[str]:
    """The FSDP2 offload policy of every unit of ``model`` (class names)."""
    names = set()
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = get_state()._fsdp_param_group if get_state is not None else None
        if group is not None:
            names.add(type(group.offload_policy).__name__)
    return sorted(names)


def zero3_placement(config: dict[str, Any]) -> dict[str, Any]:
    """Where an offloaded ZeRO-3 model and optimizer keep what they hold after one step."""
    model, opt = _build(config, seed=0)
    ckpt.train(model, opt, range(1))
    held = opt.held_tensors()
    return {
        "policies": offload_policies(model),
        "on_host": sorted(held.on_host),
        "devices": sorted({t.device.type for _, ts in held.items() for t in ts}),
        "pinned": sorted({t.is_pinned() for _, ts in held.items() for t in ts}),
    }


def zero3_resume(root: str, precision: str) -> dict[str, Any]:
    """Save an offloaded ZeRO-3 run at step STEPS_BEFORE and load it into a fresh one (another
    seed), into ZeRO-2 with the optimizer offloaded, and into ZeRO-3 without offload; each
    continues STEPS_AFTER steps."""
    path = os.path.join(root, f"zero3-offload-{precision}")
    out = {"saved": save_run_any(path, zero3_config(precision, True))}
    for name, config in (
        ("zero3_offloaded", zero3_config(precision, True)),
        ("zero2_offloaded", zero3_config(precision, True, stage=2)),
        ("zero3_plain", zero3_config(precision, False)),
    ):
        out[name] = ckpt.capture(lambda c=config: load_run_any(path, c))
    # And the other way: a ZeRO-2 offloaded checkpoint into offloaded ZeRO-3.
    other = os.path.join(root, f"zero2-offload-{precision}")
    out["from_zero2"] = {
        "saved": save_run_any(other, zero3_config(precision, True, stage=2)),
        "loaded": ckpt.capture(lambda: load_run_any(other, zero3_config(precision, True))),
    }
    return out


def save_run_any(path: str, config: dict[str, Any]) -> dict[str, Any]:
    model, opt = _build(config, seed=0)
    ckpt.train(model, opt, range(ckpt.STEPS_BEFORE))
    checkpoint.save(opt, path)
    saved = ckpt.snapshot(opt)
    after = ckpt.train(model, opt, range(ckpt.STEPS_BEFORE, ckpt.STEPS_BEFORE + ckpt.STEPS_AFTER))
    return {**saved, "losses_after": after, "final": ckpt.snapshot(opt)["masters"]}


def load_run_any(path: str, config: dict[str, Any]) -> dict[str, Any]:
    model, opt = _build(config, seed=7)
    checkpoint.load(opt, path)
    loaded = ckpt.snapshot(opt)
    after = ckpt.train(model, opt, range(ckpt.STEPS_BEFORE, ckpt.STEPS_BEFORE + ckpt.STEPS_AFTER))
    return {**loaded, "losses_after": after, "final": ckpt.snapshot(opt)["masters"]}


def zero3_offload_group(
    rank: int,
    world_size: int,
    root: str,
    parity_cases: list[dict[str, Any]],
    memory_configs: list[dict[str, Any]],
    width: int,
    resume_precisions: list[str],
) -> dict[str, Any]:
    """Everything multi-rank of tests/test_offload_zero3.py, on one spawned group."""
    from tests.workers.optimizer import fsdp2_memory_cases

    return {
        "parity": run_cases(rank, world_size, parity_cases),
        "placement": ckpt.capture(lambda: zero3_placement(zero3_config("bf16", True))),
        "memory": ckpt.capture(lambda: fsdp2_memory_cases(rank, world_size, memory_configs, width)),
        "resume": {p: ckpt.capture(lambda p=p: zero3_resume(root, p)) for p in resume_precisions},
    }


# --- ZeRO-3 with offload_optimizer cpu alone (zero3-offload-optimizer) ----------------------
def zero3_optimizer_offload_config(precision: str) -> dict[str, Any]:
    """A checkpoint-test config at ZeRO-3 with the optimizer offloaded and the shards not."""
    config = ckpt.config(precision, 3, ckpt.SMALL_BUCKETS)
    config["zero_optimization"].update(OFFLOAD)
    return config


def zero3_optimizer_placement(config: dict[str, Any]) -> dict[str, Any]:
    """Where the shards and the host masters are after one step, and whether they agree."""
    model, opt = _build(config, seed=0)
    ckpt.train(model, opt, range(1))
    held = opt.held_tensors()
    shards = [p.to_local() for p in model.parameters()]
    masters = list(held.master)
    return {
        "policies": offload_policies(model),
        "on_host": sorted(held.on_host),
        "shards_are_params": {s.data_ptr() for s in shards} == {t.data_ptr() for t in held.params},
        "masters_apart": not ({m.data_ptr() for m in masters} & {s.data_ptr() for s in shards}),
        "masters_equal_shards": all(
            torch.equal(m, s) for m, s in zip(masters, shards, strict=True)
        ),
        "staged_waits": opt.offload.device_waits,
    }


def zero3_optimizer_resume(root: str, precision: str) -> dict[str, Any]:
    """Save an optimizer-offloaded ZeRO-3 run, load it into a fresh one (another seed), into
    ZeRO-3 without offload and into ZeRO-3 with both offloads; each continues."""
    path = os.path.join(root, f"zero3-optimizer-offload-{precision}")
    out = {"saved": save_run_any(path, zero3_optimizer_offload_config(precision))}
    for name, config in (
        ("same", zero3_optimizer_offload_config(precision)),
        ("zero3_plain", zero3_config(precision, False)),
        ("zero3_both", zero3_config(precision, True)),
    ):
        out[name] = ckpt.capture(lambda c=config: load_run_any(path, c))
    return out


def zero3_optimizer_offload_group(
    rank: int,
    world_size: int,
    root: str,
    parity_cases: list[dict[str, Any]],
    memory_configs: list[dict[str, Any]],
    width: int,
    resume_precisions: list[str],
) -> dict[str, Any]:
    """Everything multi-rank of the optimizer-alone tests in tests/test_offload_zero3.py."""
    from tests.workers.optimizer import fsdp2_memory_cases

    placement = zero3_optimizer_offload_config("bf16")
    return {
        "parity": run_cases(rank, world_size, parity_cases),
        "placement": ckpt.capture(lambda: zero3_optimizer_placement(placement)),
        "memory": ckpt.capture(lambda: fsdp2_memory_cases(rank, world_size, memory_configs, width)),
        "resume": {
            p: ckpt.capture(lambda p=p: zero3_optimizer_resume(root, p)) for p in resume_precisions
        },
    }
