"""Checkpoints of the whole-tensor optimizer (``optimizers/whole``): Adafactor, DeepSpeed's
``"Muon"`` (Muon on matrices, AdamW on the rest) and ``torch.optim.Muon``, saved in one layout
and resumed in another (world size 1 or 2, ZeRO 0-3, fp32 or bf16 masters and states).

A run trains ``CUT`` steps, is saved with ``dtypeplan.checkpoint``, and a fresh model (another
seed) and optimizer load it and train to ``STEPS``; each uninterrupted run trains all of them.
Every step takes the same global batch, each rank its slice, so every layout follows the one
process of the same class within the whole-tensor bounds (tests/test_whole_tensor.py). Results
are the final ``full_state()``s (masters, states, scalar states; CPU), compared by the test.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from dtypeplan import checkpoint
from tests._helpers import make_batch, mse
from tests.workers.checkpoint import capture
from tests.workers.whole_tensor import whole_model

CUT = 2
STEPS = 4
BATCH = 8

MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
DEEPSPEED_MUON = {"lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.01, "betas": [0.9, 0.95]}
BF16_KAHAN_STATES = {
    "bf16": {"enabled": True},
    "master_weights": {"dtype": "bf16", "rounding": "kahan"},
    "optimizer_states": {"exp_avg": "bf16", "exp_avg_sq": "bf16"},
}
BF16_STOCHASTIC = {
    "bf16": {"enabled": True},
    "master_weights": {"dtype": "bf16", "rounding": "stochastic"},
}

CASES: dict[str, dict[str, Any]] = {
    "Adafactor": {"optimizer": {"type": "Adafactor", "params": {"lr": 0.01}}},
    "DeepSpeed Muon": {"optimizer": {"type": "Muon", "params": DEEPSPEED_MUON}},
    "DeepSpeed Muon bf16 Kahan masters and states": {
        "optimizer": {"type": "Muon", "params": DEEPSPEED_MUON},
        **BF16_KAHAN_STATES,
    },
    "torch Muon": {"class": torch.optim.Muon},
    "Adafactor bf16 Kahan masters and states": {
        "optimizer": {"type": "Adafactor", "params": {"lr": 0.01}},
        **BF16_KAHAN_STATES,
    },
    "Adafactor bf16 stochastic masters": {
        "optimizer": {"type": "Adafactor", "params": {"lr": 0.01}},
        **BF16_STOCHASTIC,
    },
    "torch Muon bf16 states": {
        "class": torch.optim.Muon,
        "bf16": {"enabled": True},
        "optimizer_states": {"exp_avg": "bf16"},
    },
}
"""Each case's config (``"class"``: passed to ``plan.build`` with :data:`MUON`)."""

DEFAULT = ("DeepSpeed Muon bf16 Kahan masters and states",)
"""The case of the default test run (per-parameter state names, bf16 masters and states; about
25 s on 2 CPU cores); the others are marked slow (Adafactor's in-process cases run by default)."""

TWO_RANK_LOADS = ((1, 0), (1, 1), (1, 2), (1, 3), (3, 1), (3, 3))
"""(save stage, load stage) of the checkpoints a 2-rank group saves and resumes itself."""
ONE_PROCESS_LOADS = (1, 3)
"""The stages at which a 2-rank group resumes a one-process ZeRO-0 checkpoint."""


def _rank_size() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def build(
    name: str, stage: int, seed: int = 0, model: torch.nn.Module | None = None
) -> tuple[torch.nn.Module, dtypeplan.MixedPrecisionOptimizer]:
    """Case ``name``'s model (``model``, else the seeded MLP) and optimizer at ``stage``."""
    case = dict(CASES[name])
    torch_class = case.pop("class", None)
    plan = dtypeplan.resolve({"zero_optimization": {"stage": stage}, **case})
    if torch_class is not None:
        plan = plan.with_optimizer(torch_class, MUON)
    assert plan.status == "OK" and plan.implementation == "whole", plan.explain()
    if model is None:
        model = whole_model(seed, bias=torch_class is None)  # torch's Muon: matrices only
    model = plan.prepare_model(model)
    if torch_class is not None:
        return model, plan.build(model.parameters(), optimizer=torch_class, **MUON)
    return model, plan.build(model.parameters())


def train(model: torch.nn.Module, opt: dtypeplan.MixedPrecisionOptimizer, steps: range) -> None:
    """As a user trains: ``loss.backward()``, ``opt.step()``, ``model.zero_grad()``."""
    rank, size = _rank_size()
    for step in steps:
        x, y = make_batch(300 + step, BATCH)
        mse(model, x.chunk(size)[rank], y.chunk(size)[rank]).backward()
        opt.step()
        model.zero_grad(set_to_none=True)


def final_state(opt: dtypeplan.MixedPrecisionOptimizer) -> dict[str, Any]:
    return {
        key: value.detach().cpu().clone() if torch.is_tensor(value) else value
        for key, value in opt.full_state().items()
    }


def uninterrupted(name: str, stage: int) -> dict[str, Any]:
    model, opt = build(name, stage)
    train(model, opt, range(STEPS))
    out = final_state(opt)
    opt.close()
    return out


def save_at_cut(name: str, stage: int, path: str) -> None:
    model, opt = build(name, stage)
    train(model, opt, range(CUT))
    checkpoint.save(opt, path)
    opt.close()


def resume(name: str, stage: int, path: str) -> dict[str, Any]:
    """A fresh model (another seed) and optimizer at ``stage`` load ``path`` and train on."""
    model, opt = build(name, stage, seed=7)
    checkpoint.load(opt, path)
    train(model, opt, range(CUT, STEPS))
    out = final_state(opt)
    opt.close()
    return out


def path_of(root: str, name: str, where: str) -> str:
    return os.path.join(root, name.replace(" ", "_"), where)


def one_process(name: str, root: str) -> dict[str, Any]:
    """In a process without ``torch.distributed``: the uninterrupted ZeRO-0 run, and its
    checkpoint at the cut (``p1``), resumed at ZeRO 0 and 1."""
    save_at_cut(name, 0, path_of(root, name, "p1"))
    return {
        "uninterrupted": uninterrupted(name, 0),
        "resumed 0": resume(name, 0, path_of(root, name, "p1")),
        "resumed 1": resume(name, 1, path_of(root, name, "p1")),
    }


def one_process_from_two_ranks(name: str, root: str) -> dict[str, Any]:
    """The 2-rank group's ZeRO-1 and ZeRO-3 checkpoints resumed in one process at ZeRO 0."""
    return {f"from z{s}": resume(name, 0, path_of(root, name, f"z{s}")) for s in (1, 3)}


def two_rank_group(rank: int, world_size: int, root: str, names: list[str]) -> dict[str, Any]:
    """Per case: the uninterrupted 2-rank run at each stage; checkpoints at ZeRO 1 and 3
    (``z1``, ``z3``) resumed at the stages of :data:`TWO_RANK_LOADS`; the one-process
    checkpoint (``p1``, written before the group started) resumed at ZeRO 1 and 3."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in names:

        def case(name: str = name) -> dict[str, Any]:
            result: dict[str, Any] = {}
            for stage in sorted({load for _, load in TWO_RANK_LOADS}):
                result[f"uninterrupted {stage}"] = uninterrupted(name, stage)
            for stage in sorted({save for save, _ in TWO_RANK_LOADS}):
                save_at_cut(name, stage, path_of(root, name, f"z{stage}"))
            for save, load in TWO_RANK_LOADS:
                path = path_of(root, name, f"z{save}")
                result[f"z{save} -> {load}"] = resume(name, load, path)
            for load in ONE_PROCESS_LOADS:
                result[f"p1 -> {load}"] = resume(name, load, path_of(root, name, "p1"))
            return result

        out[name] = capture(case)
    return out
