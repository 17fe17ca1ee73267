"""Checkpoint round trips of every elementwise ``torch.optim`` class (in-process and spawned).

A run trains ``BEFORE`` steps, is saved (``dtypeplan.checkpoint`` or ``state_dict``), loaded
into a fresh optimizer on a fresh model, and trains ``AFTER`` more steps; the uninterrupted run
trains all of them. Two param groups with different learning rates, so the per-group scalar
states (ASGD's ``eta`` depends on ``lr``) differ between groups. Results are the fp32 master
weights and the optimizer states after the last step, compared bitwise by the test.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from dtypeplan import checkpoint
from tests._helpers import CLIENT_HYPERPARAMETERS, make_batch, make_model, mse
from tests.workers.checkpoint import capture

BEFORE = 3
AFTER = 2
GLOBAL_BATCH = 16
MICRO = 2

RESHARDED = ("NAdam", "ASGD", "Rprop")
"""The classes a 2-rank group saves at ZeRO stage 1 and loads at stage 2 with other buckets."""


def _rank_size() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def build(
    name: str, stage: int, bucket: int = 200, seed: int = 0
) -> tuple[torch.nn.Module, dtypeplan.MixedPrecisionOptimizer]:
    """Model and optimizer; small buckets, so that chunks cut through parameters."""
    plan = dtypeplan.resolve({"zero_optimization": {"stage": stage, "reduce_bucket_size": bucket}})
    model = plan.prepare_model(make_model(seed))
    params = list(model.parameters())
    hyper = CLIENT_HYPERPARAMETERS[name]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": hyper["lr"] / 2}]
    return model, plan.build(groups, optimizer=getattr(torch.optim, name), **hyper)


def train(
    model: torch.nn.Module, opt: dtypeplan.MixedPrecisionOptimizer, steps: range, micro: int = MICRO
) -> None:
    rank, size = _rank_size()
    for step in steps:
        x, y = make_batch(200 + step, GLOBAL_BATCH)
        opt.zero_grad()
        for xm, ym in zip(
            x.chunk(size)[rank].chunk(micro), y.chunk(size)[rank].chunk(micro), strict=True
        ):
            opt.backward(mse(model, xm, ym) / micro)
        opt.step()


def final_state(opt: dtypeplan.MixedPrecisionOptimizer) -> dict[str, Any]:
    """Masters, per-element states and every scalar state (layout-free, CPU)."""
    return {
        key: value.detach().cpu().clone() if torch.is_tensor(value) else value
        for key, value in opt.full_state().items()
    }


def uninterrupted(name: str, stage: int, micro: int = MICRO) -> dict[str, Any]:
    model, opt = build(name, stage)
    train(model, opt, range(BEFORE + AFTER), micro)
    return final_state(opt)


def resumed(
    name: str,
    path: str,
    save_stage: int,
    load_stage: int,
    load_bucket: int = 200,
    micro: int = MICRO,
) -> dict[str, Any]:
    """Save after ``BEFORE`` steps at ``save_stage``, resume at ``load_stage`` (other seed)."""
    model, opt = build(name, save_stage)
    train(model, opt, range(BEFORE), micro)
    checkpoint.save(opt, path)
    fresh_model, fresh = build(name, load_stage, load_bucket, seed=7)
    checkpoint.load(fresh, path)
    train(fresh_model, fresh, range(BEFORE, BEFORE + AFTER), micro)
    return final_state(fresh)


def state_dict_resumed(name: str, stage: int) -> dict[str, Any]:
    """The same through ``state_dict()`` / ``load_state_dict()`` (torch's layout)."""
    model, opt = build(name, stage)
    train(model, opt, range(BEFORE))
    saved = opt.state_dict()
    fresh_model, fresh = build(name, stage, seed=7)
    fresh.load_state_dict(saved)
    train(fresh_model, fresh, range(BEFORE, BEFORE + AFTER))
    return final_state(fresh)


def two_rank_group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Per class of :data:`RESHARDED`: stage 1 uninterrupted, and saved at stage 1 (buckets of
    200) then resumed at stage 2 (buckets of 120): other chunks on each rank. One micro-batch
    per step: stage 2 reduces each micro-batch as it comes, stage 1 their sum, which would
    differ in the last bit; with one, both add the same two gradients."""
    out: dict[str, Any] = {}
    for name in RESHARDED:
        path = os.path.join(root, name)
        out[name] = capture(
            lambda name=name, path=path: {
                "uninterrupted": uninterrupted(name, 1, micro=1),
                "resumed": resumed(name, path, 1, 2, load_bucket=120, micro=1),
            }
        )
    return out
