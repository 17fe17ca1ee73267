"""A training loop as users write it, on the whole-tensor optimizer (tests/test_whole_loop.py):
a backward whose gradients the loop discards (``.grad = None``, ``model.zero_grad()``, or
``model.zero_grad(set_to_none=False)``), a no_grad forward, then the backward that counts
(once discarded too, right before the step), against one process of torch's Adafactor on the
full batch."""

from __future__ import annotations

import copy

import torch

import dtypeplan


def discarding_loop(rank: int, world: int, stages: list[int]) -> dict[int, float]:
    """The largest relative error of the masters after 6 steps, per ZeRO stage."""
    torch.set_num_threads(1)
    errors = {}
    for stage in stages:
        torch.manual_seed(0)
        source = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
        )
        reference = copy.deepcopy(source)
        plan = dtypeplan.resolve(
            {"zero_optimization": {"stage": stage},
             "optimizer": {"type": "Adafactor", "params": {"lr": 1e-2}}}
        )  # fmt: skip
        model = plan.prepare_model(copy.deepcopy(source))
        optimizer = plan.build(model.parameters())
        torch_optimizer = torch.optim.Adafactor(reference.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(1)
        mine = slice(4 * rank, 4 * rank + 4)
        for step in range(6):
            xa = torch.randn(4 * world, 8, generator=generator)
            ya = torch.randn(4 * world, 4, generator=generator)
            xb = torch.randn(4 * world, 8, generator=generator)
            yb = torch.randn(4 * world, 4, generator=generator)
            torch.nn.functional.mse_loss(model(xa[mine]), ya[mine]).backward()
            if step % 3 == 0:
                for param in model.parameters():
                    param.grad = None
            else:
                model.zero_grad(set_to_none=step % 3 == 1)
            with torch.no_grad():
                model(xa[mine])
            torch.nn.functional.mse_loss(model(xb[mine]), yb[mine]).backward()
            torch.nn.functional.mse_loss(reference(xb), yb).backward()
            if step == 4:  # discarded after the last backward: torch steps nothing
                model.zero_grad()
                reference.zero_grad()
            optimizer.step()
            optimizer.zero_grad()
            torch_optimizer.step()
            torch_optimizer.zero_grad()
        full = optimizer.full_state()
        errors[stage] = max(
            float(
                (full[f"param.{i}.master"].view(p.shape) - p.detach()).abs().max()
                / p.detach().abs().max()
            )
            for i, p in enumerate(reference.parameters())
        )
    return errors
