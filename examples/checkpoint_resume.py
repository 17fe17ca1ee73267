"""Save a run on 2 ranks at ZeRO-1, resume it on 1 rank at ZeRO-0 (and it continues identically).

python examples/checkpoint_resume.py
"""

from __future__ import annotations

import sys
import tempfile

import torch

import dtypeplan
from dtypeplan.launch import spawn

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def train(
    rank: int, world_size: int, config: dict, path: str, steps: range, resume: bool
) -> list[float]:
    # [docs: checkpoint] (docs/checkpoints.md shows the lines down to the end marker)
    net = model()
    optimizer = dtypeplan.resolve(config).build(net.parameters())
    if resume:
        dtypeplan.checkpoint.load(optimizer, path)  # the model now holds the checkpoint's weights
    losses = []
    for step in steps:
        x, y = batch(step)
        mine = slice(rank * 16 // world_size, (rank + 1) * 16 // world_size)
        optimizer.zero_grad()
        optimizer.backward(torch.nn.functional.mse_loss(net(x[mine]), y[mine]))
        optimizer.step()
        with torch.no_grad():
            losses.append(float(torch.nn.functional.mse_loss(net(x), y)))
    if not resume:
        dtypeplan.checkpoint.save(optimizer, path)
    # [docs: end checkpoint]
    return losses


def main() -> int:
    with tempfile.TemporaryDirectory() as path:
        first = spawn(train, 2, CONFIG, path, range(0, 5), False)[0]
        stage0 = {**CONFIG, "zero_optimization": {"stage": 0}}
        resumed = spawn(train, 1, stage0, path, range(5, 10), True)[0]
        straight = spawn(train, 2, CONFIG, path + "-unused", range(0, 10), False)[0]
    print("saved on 2 ranks (ZeRO-1):  ", " ".join(f"{v:.5f}" for v in first))
    print("resumed on 1 rank (ZeRO-0): ", " ".join(f"{v:.5f}" for v in resumed))
    print("uninterrupted, steps 5-9:   ", " ".join(f"{v:.5f}" for v in straight[5:]))
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed, straight[5:], strict=True))
    print(f"largest relative difference: {worst:.1e}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
