"""Spawn-able worker for tests/test_spawned_plan.py: a rank that receives its plan pickled and
imports nothing of dtypeplan itself (no ``dtypeplan.resolve``), as a user's training module
started with ``dtypeplan.launch.spawn(train, 2, plan)`` may."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def build_and_step(rank: int, world_size: int, plan: Any) -> float:
    """Build the plan's optimizer on the default group, take two steps on a batch that is
    the same on every rank, and return the largest difference from torch's AdamW (fp32, one
    process) on the same batches."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    reference = torch.nn.Linear(8, 4)
    reference.load_state_dict(model.state_dict())
    model = plan.prepare_model(model)
    optimizer = plan.build(model.parameters())
    torch_optimizer = torch.optim.AdamW(reference.parameters(), **plan.optimizer.params)
    for step in range(2):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        for net, opt in ((model, optimizer), (reference, torch_optimizer)):
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert dist.get_world_size() == world_size
    return max(
        (p - q).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
