"""The spawned group of tests/test_state_formats.py: quantized states on ranks that hold no
element of some parameter (a ZeRO-3 local shard that is empty, a flat chunk without a piece of
it), against one-process fp32 ``torch.optim.AdamW``, then through a checkpoint and
``state_dict``."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from dtypeplan import checkpoint
from tests._helpers import master_rel_error
from tests.workers import checkpoint as checkpoint_cases

IN, HIDDEN = 12, 16
BATCH, MICRO = 16, 2


class HeadNet(torch.nn.Module):
    """Parameters whose first dimension is below 2: a ``[1, d]`` token, a ``Linear(d, 1)``
    head (weight ``[1, d]``, bias ``[1]``) and a 0-dim scale; on 2 ranks at ZeRO-3 their
    local shards on rank 1 are empty. Last in order, so in one flat bucket on 2 ranks rank 0's
    chunk holds none of them and rank 1's none of the token."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.token = torch.nn.Parameter(torch.randn(1, IN, generator=generator) * 0.3)
        self.body = torch.nn.Linear(IN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, 1)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        with torch.no_grad():
            for param in (self.body.weight, self.body.bias, self.head.weight, self.head.bias):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.body(x + self.token))
        return self.head(hidden).squeeze(-1) * self.scale


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, generator=generator)


def _train(
    model: torch.nn.Module,
    optimizer: Any,
    steps: range,
    rank: int,
    world_size: int,
    reference: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None,
) -> None:
    """Each rank its slice of the batch in micro-batches through ``loss.backward()``; the
    reference (one process, fp32) the whole batch."""
    for step in steps:
        x, y = _batch(step)
        if reference is not None:
            ref_model, ref_opt = reference
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref_model(x), y).backward()
            ref_opt.step()
        optimizer.zero_grad()
        xs, ys = x.chunk(world_size)[rank].chunk(MICRO), y.chunk(world_size)[rank].chunk(MICRO)
        for xm, ym in zip(xs, ys, strict=True):
            (torch.nn.functional.mse_loss(model(xm), ym) / MICRO).backward()
        optimizer.step()


def _case(case: dict[str, Any], rank: int, world_size: int, directory: str) -> dict[str, Any]:
    config = case["config"]
    plan = dtypeplan.resolve(config)
    reference = HeadNet(0)
    ref_opt = torch.optim.AdamW(reference.parameters(), **config["optimizer"]["params"])
    model = plan.prepare_model(copy.deepcopy(reference))
    optimizer = plan.build(model.parameters())
    _train(model, optimizer, range(case["steps"]), rank, world_size, (reference, ref_opt))
    full = optimizer.full_state()
    errors = {
        name: float((full[f"param.{i}.master"] - param.detach()).abs().max())
        for i, (name, param) in enumerate(reference.named_parameters())
    }
    rel_error = master_rel_error(full, list(reference.parameters()))
    # A checkpoint and a state_dict into fresh optimizers of the same layout: the same
    # values (codes restored bit for bit), and both train on.
    saved = checkpoint_cases.snapshot(optimizer)
    where = os.path.join(directory, case["name"].replace("/", "-"))
    checkpoint.save(optimizer, where)
    state_dict = optimizer.state_dict()
    restored = {}
    for how in ("checkpoint", "state_dict"):
        fresh_model = plan.prepare_model(HeadNet(1))
        fresh = plan.build(fresh_model.parameters())
        if how == "checkpoint":
            checkpoint.load(fresh, where)
        else:
            fresh.load_state_dict(state_dict)
        got = checkpoint_cases.snapshot(fresh)
        restored[how] = all(
            torch.equal(a, b) for a, b in zip(got["masters"], saved["masters"], strict=True)
        ) and all(torch.equal(got["states"][k], v) for k, v in saved["states"].items())
        _train(fresh_model, fresh, range(case["steps"], case["steps"] + 1), rank, world_size)
    if dist.is_initialized():
        dist.barrier()
    return {"name": case["name"], "errors": errors, "rel_error": rel_error, "restored": restored}


def empty_pieces_group(
    rank: int, world_size: int, cases: list[dict[str, Any]], directory: str
) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [_case(case, rank, world_size, directory) for case in cases]
