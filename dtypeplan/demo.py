"""``dtypeplan demo``: a small model trained end to end on local CPU ranks.

A student MLP (with a residual LayerNorm block) learns to imitate a fixed random teacher MLP
from fresh samples, on ``world_size`` gloo ranks started by :func:`dtypeplan.launch.spawn`.
Every rank draws its own micro-batches, so the gradient reduction does real work. The run
shows a plan at work: the parameters in the plan's dtype, micro-batch gradients summed in the
accumulation dtype, one reduction per step, and the memory each rank really holds next to
``plan.memory()``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtypeplan import PrecisionPlan, Status, resolve
from dtypeplan.launch import RankFailure, spawn
from dtypeplan.optimizers import MixedPrecisionOptimizer
from dtypeplan.report import memory_layout, memory_report

__all__ = ["DEFAULT_CONFIG", "TinyMLP", "default_config", "run_demo"]

DEFAULT_CONFIG: dict[str, Any] = {
    "bf16": {"enabled": True},
    "gradient_accumulation_dtype": "fp32",
    "zero_optimization": {"stage": 1},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01},
    },
    "gradient_clipping": 1.0,
}
"""bf16 parameters, fp32 gradient accumulation, AdamW, clipping at 1.0, ZeRO stage 1."""

IN_FEATURES = 32
HIDDEN = 128
OUT_FEATURES = 8
MICRO_BATCH = 32
SEED = 1234


class TinyMLP(nn.Module):
    """Linear -> GELU -> (LayerNorm -> Linear -> GELU) + residual -> Linear."""

    def __init__(
        self, in_features: int = IN_FEATURES, hidden: int = HIDDEN, out_features: int = OUT_FEATURES
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.inp(x))
        h = h + nn.functional.gelu(self.mid(self.norm(h)))
        return self.out(h)


def default_config() -> dict[str, Any]:
    """:data:`DEFAULT_CONFIG` at ZeRO stage 1 if the rules call it OK, else at stage 0."""
    config = copy.deepcopy(DEFAULT_CONFIG)
    if resolve(config).status != Status.OK:
        config["zero_optimization"]["stage"] = 0
    return config


def _config_text(config: str | os.PathLike[str] | dict[str, Any]) -> str:
    """The config the demo runs, as given (a file's text, or the dict as JSON)."""
    if isinstance(config, dict):
        body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in config.items())
        return f"config:\n{{\n{body}\n}}"
    with open(config, encoding="utf-8") as handle:
        return f"config ({os.fspath(config)}):\n{handle.read().rstrip()}"


def _brief(explanation: str, reason: str) -> str:
    """``explain()`` with the rule's reason cut to its first sentence: the rest of a reason
    describes the rule's other cases (shard groups, sharded accumulators) that this config
    does not use; ``dtypeplan check`` prints it whole."""
    first = reason.split(". ", 1)[0].rstrip(".") + "."
    if first == reason or f"reason: {reason}" not in explanation:
        return explanation
    return explanation.replace(
        f"reason: {reason}", f"reason: {first} (dtypeplan check CONFIG prints the whole reason)"
    )


def _teacher() -> nn.Module:
    generator = torch.Generator().manual_seed(SEED + 1)
    teacher = nn.Sequential(nn.Linear(IN_FEATURES, 64), nn.Tanh(), nn.Linear(64, OUT_FEATURES))
    with torch.no_grad():
        for param in teacher.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.25)
    return teacher


def _batch(
    teacher: nn.Module, rank: int, step: int, micro: int
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1_000_003 * rank + 1009 * step + micro)
    x = torch.randn(MICRO_BATCH, IN_FEATURES, generator=generator)
    with torch.no_grad():
        y = teacher(x)
    return x, y


def _train(
    rank: int, world_size: int, plan: PrecisionPlan, steps: int, micro_batches: int
) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model: torch.nn.Module = TinyMLP()
    num_params = sum(p.numel() for p in model.parameters())
    teacher = _teacher()
    # Casts the model (ZeRO-3: shards it); under torch_autocast runs its forward in autocast.
    model = plan.prepare_model(model)
    optimizer = plan.build(model.parameters())
    assert isinstance(optimizer, MixedPrecisionOptimizer)  # what every registered class is
    dtype = plan.param_dtype
    losses: list[float] = []
    measured: dict[str, int] = {}
    for step in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        total = torch.zeros(1)
        for micro in range(micro_batches):
            x, y = _batch(teacher, rank, step, micro)
            # The loss is taken in fp32 whatever the parameter dtype.
            loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
            # The last micro-batch starts the step's reduction inside its backward.
            optimizer.backward(loss / micro_batches, last_micro_batch=micro == micro_batches - 1)
            total += loss.detach() / micro_batches
        if step == steps - 1:
            # What plan.memory() predicts: the bytes held at the accumulation boundary.
            measured = optimizer.held_tensors().nbytes()
        optimizer.step()
        elapsed_ms = (time.perf_counter() - start) * 1000
        # For the report only: the mean loss over ranks.
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
        if rank == 0:
            # Loss scale and skipped steps mean something with loss scaling (fp16) only.
            scaling = (
                f"  loss scale {optimizer.loss_scale:g}  skipped {optimizer.skipped_steps}"
                if plan.loss_scaling is not None
                else ""
            )
            print(
                f"step {step + 1:>3}/{steps}  loss {losses[-1]:.5f}  "
                f"grad norm {optimizer.grad_norm:.4f}{scaling}  {elapsed_ms:6.1f} ms/step",
                flush=True,
            )
    return {
        "losses": losses,
        "num_params": num_params,
        "measured": measured,
        "skipped_steps": optimizer.skipped_steps,
    }


def run_demo(
    config: str | os.PathLike[str] | dict[str, Any] | None = None,
    world_size: int = 2,
    steps: int = 20,
    micro_batches: int = 4,
) -> int:
    """Train on ``world_size`` spawned CPU ranks; returns the exit code of ``dtypeplan demo``.

    0 after training, 1 if the config's plan is not OK (its explanation is printed), 3 if a
    rank failed. An invalid config raises :class:`PrecisionConfigError`.
    """
    if config is None:
        config = default_config()
    print(_config_text(config))
    print()
    plan = resolve(config)
    print(_brief(plan.explain(), plan.reason))
    print(flush=True)
    if plan.status != Status.OK:
        print(f"demo: the plan is {plan.status}, nothing to train", file=sys.stderr)
        return 1
    print(
        f"training a {sum(p.numel() for p in TinyMLP().parameters()):,}-parameter MLP on "
        f"{world_size} CPU rank{'s' if world_size != 1 else ''}: {steps} steps of "
        f"{micro_batches} micro-batches of {MICRO_BATCH} samples per rank",
        flush=True,
    )
    start = time.perf_counter()
    try:
        results = spawn(_train, world_size, plan, steps, micro_batches, timeout_s=300.0)
    except RankFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    elapsed = time.perf_counter() - start
    losses = results[0]["losses"]
    num_params = results[0]["num_params"]
    print()
    skipped = (
        f"skipped steps {results[0]['skipped_steps']}; " if plan.loss_scaling is not None else ""
    )
    print(
        f"loss: first {losses[0]:.5f}, last {losses[-1]:.5f} "
        f"({losses[-1] / losses[0]:.1%} of the first); "
        f"{skipped}{elapsed:.1f} s including rank start-up"
    )
    print()
    print(
        memory_report(
            plan.memory(num_params, world_size),
            num_params,
            world_size,
            [r["measured"] for r in results],
            memory_layout(plan, world_size),
        )
    )
    measured = results[0]["measured"]
    predicted = plan.memory(num_params, world_size)["total"]
    print(
        f"(measured - predicted on rank 0: {measured['total'] - predicted:+,} bytes: bucket "
        "padding and step counters, which the byte model leaves out)"
    )
    return 0
