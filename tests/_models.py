"""Seeded models for the torch-contract tests (issue 10) and their fp32 torch references.

Each builder returns the same weights for the same seed on every rank, unless asked otherwise.
The shapes are tiny: these tests check behaviour (what moves, what is refused), not speed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

IN, WIDTH, OUT = 8, 16, 4
VOCAB, SEQ = 32, 6


def _seed_weights(model: nn.Module, seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


class TwoHeads(nn.Module):
    """A trunk (Linear + LayerNorm) and two heads; ``use_b=False`` leaves head_b unused."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(IN, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head_a = nn.Linear(WIDTH, OUT)
        self.head_b = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.norm(self.trunk(x)))
        out = self.head_a(h)
        return out + self.head_b(h) if use_b else out


def two_heads(seed: int) -> TwoHeads:
    return _seed_weights(TwoHeads(), seed)  # type: ignore[return-value]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.mlp(self.norm(h)))


class TiedLM(nn.Module):
    """Embedding, a ``ModuleList`` of blocks as a top-level child, a head tied to the embedding.

    The shape of GPT-2 / Llama in miniature: what ZeRO-3 must shard per block and keep tied.
    """

    def __init__(self, blocks: int = 2, container: type[nn.Module] = nn.ModuleList) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layers = [Block() for _ in range(blocks)]
        self.layers = nn.ModuleList(layers) if container is nn.ModuleList else container(*layers)
        self.final_norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.final_norm(h))


def tied_lm(seed: int, container: type[nn.Module] = nn.ModuleList) -> TiedLM:
    return _seed_weights(TiedLM(container=container), seed)  # type: ignore[return-value]


class NormAndFrozen(nn.Module):
    """BatchNorm (floating buffers) and a frozen layer, as in fine-tuning a backbone."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(IN, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)
        self.head = nn.Linear(WIDTH, OUT)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bn(self.frozen(x))))


def norm_and_frozen(seed: int) -> NormAndFrozen:
    model = NormAndFrozen()
    _seed_weights(model, seed)
    return model


def batch(seed: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 + seed)
    return torch.randn(size, IN, generator=generator), torch.randn(size, OUT, generator=generator)


def token_batch(seed: int, size: int = 4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(20_000 + seed)
    return torch.randint(0, VOCAB, (size, SEQ), generator=generator)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in (ZeRO-3 keeps fp32 shards and computes in 16 bits)."""
    return next(model.parameters()).dtype


def regression_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kw: Any) -> torch.Tensor:
    return nn.functional.mse_loss(model(x.to(model_dtype(model)), **kw).float(), y)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def decay_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """Weights decay; biases and norms do not (the usual two param groups)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for _, p in named if p.dim() > 1], "weight_decay": weight_decay},
        {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0},
    ]


def rel_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Normwise relative error ||got - want|| / ||want|| over a list of tensors."""
    assert len(got) == len(want), f"{len(got)} tensors against {len(want)}"
    diff = sum(
        float((g.double() - w.double()).square().sum()) for g, w in zip(got, want, strict=True)
    )
    size = sum(float(w.double().square().sum()) for w in want)
    return (diff / max(size, 1e-30)) ** 0.5
