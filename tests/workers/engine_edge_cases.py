"""Spawn-able workers for tests/test_engine_edge_cases.py."""

from __future__ import annotations

import copy

import torch
from torch.utils.checkpoint import checkpoint

import dtypeplan
from tests._helpers import make_batch, make_model, mse


def empty_micro_batch_on_one_rank(
    rank: int, world_size: int, stages: list[int]
) -> list[list[float]]:
    return [_empty_micro_batch(rank, stage) for stage in stages]


def _empty_micro_batch(rank: int, stage: int) -> list[float]:
    """Rank 1's second micro-batch reaches no parameter; the ranks must still pair up."""
    config = {
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    model = make_model(0)
    optimizer = dtypeplan.resolve(config).build(model.parameters())
    x, y = make_batch(0, 8)
    optimizer.backward(mse(model, x, y))
    if rank == 1:
        optimizer.backward(torch.zeros((), requires_grad=True).sum())
    else:
        optimizer.backward(mse(model, x, y) * 0)
    optimizer.step()
    return [float(p.detach().sum()) for p in model.parameters()]


class _ReusedInsideCheckpoint(torch.nn.Module):
    """``a`` is used before a reentrant checkpoint and inside it: two gradients per backward."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(5, 5), torch.nn.Linear(5, 5), torch.nn.Linear(5, 3)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)

    def forward(self, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        inner = lambda t: torch.tanh(self.b(t)) + torch.tanh(self.a(t))  # noqa: E731
        return self.c(checkpoint(inner, h, use_reentrant=reentrant))


def _twice_reached(rank: int, world: int, stage: int, mode: str) -> float | str:
    config = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.3}},
        "zero_optimization": {"stage": stage},
    }
    model = _ReusedInsideCheckpoint()
    reference = copy.deepcopy(model)
    optimizer = dtypeplan.resolve(config).build(model.parameters())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.3)
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(4, 5, generator=generator), torch.randn(4, 3, generator=generator))
        for _ in range(2 * world)
    ]
    try:
        for micro in range(2):
            x, y = batches[2 * rank + micro]
            loss = torch.nn.functional.mse_loss(model(x, True), y)
            optimizer.backward(loss, last_micro_batch=mode == "last" and micro == 1)
        optimizer.step()
    except dtypeplan.errors.OptimizerUsageError as exc:
        optimizer.zero_grad()
        return str(exc)
    for x, y in batches:
        (torch.nn.functional.mse_loss(reference(x, False), y) / world).backward()
    reference_optimizer.step()
    return max(
        float((a - b).abs().max())
        for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )


def twice_reached_parameter(rank: int, world: int) -> dict[tuple[int, str], float | str]:
    return {
        (stage, mode): _twice_reached(rank, world, stage, mode)
        for stage in (0, 1, 2)
        for mode in ("plain", "last")
    }


class _HalfInsideCheckpoint(_ReusedInsideCheckpoint):
    """The same layers, ``a`` before a reentrant checkpoint and ``b``, ``c`` inside it only:
    autograd reaches ``b`` and ``c`` in a backward nested in the outer one, ``a`` after that
    one has ended."""

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:  # type: ignore[override]
        h = torch.tanh(self.a(x))
        inner = lambda t: self.c(torch.tanh(self.b(t)))  # noqa: E731
        if mode == "none":
            return inner(h)
        return checkpoint(inner, h, use_reentrant=mode == "reentrant")


def reentrant_checkpoint_boundary(rank: int, world: int) -> dict[str, list[torch.Tensor] | str]:
    """Two steps of two micro-batches, told the boundary three ways, with and without a
    reentrant checkpoint region: each backward must count once and train as without it."""
    results: dict[str, list[torch.Tensor] | str] = {}
    for stage in (0, 1, 2):
        for told in ("steps", "batch", "last", "nothing"):
            for mode in ("none", "reentrant"):
                results[f"{stage}/{told}/{mode}"] = _boundary_run(rank, world, stage, told, mode)
    return results


def _boundary_run(
    rank: int, world: int, stage: int, told: str, mode: str
) -> list[torch.Tensor] | str:
    config: dict = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.5,
    }
    if told == "steps":
        config["gradient_accumulation_steps"] = 2
    elif told == "batch":
        config.update(train_batch_size=8 * world, train_micro_batch_size_per_gpu=4)
    model = _HalfInsideCheckpoint()
    optimizer = dtypeplan.resolve(config).build(model.parameters())
    generator = torch.Generator().manual_seed(1 + rank)
    try:
        for _ in range(2):
            for micro in range(2):
                x, y = (
                    torch.randn(4, 5, generator=generator),
                    torch.randn(4, 3, generator=generator),
                )
                loss = torch.nn.functional.mse_loss(model(x, mode), y)
                if told == "last":
                    optimizer.backward(loss, last_micro_batch=micro == 1)
                else:
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as exc:
        return str(exc)
    return [p.detach().clone() for p in model.parameters()]
