"""Spawn-able workers for tests/test_framework_use.py."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

import dtypeplan
from dtypeplan.optimizers._owned_gradient import is_owned_gradient
from tests._helpers import make_batch, make_model, mse

BULK = 64
"""Collectives over more elements than this carry gradients or parameters (the MLP's smallest
bucket holds hundreds); the smaller ones are bookkeeping (the step summary, DDP's record of
used parameters, its bucket-order broadcast)."""


def _bulk_collectives(prof: Any) -> list[tuple[str, int]]:
    out = []
    for event in prof.events():
        if event.name.startswith("gloo:") and event.input_shapes:
            numel = sum(int(torch.Size(s).numel()) for s in event.input_shapes if s)
            if numel > BULK:
                out.append((event.name, numel))
    return sorted(out)


def _ddp_run(rank: int, case: dict[str, Any], wrapped: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "zero_optimization": {"stage": case["stage"]},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
    }
    if case["bf16"]:
        config["bf16"] = {"enabled": True}
        config["gradient_accumulation_dtype"] = "fp32"
    plan = dtypeplan.resolve(config)
    model = plan.prepare_model(make_model(0))
    optimizer = plan.build(model.parameters())
    net: torch.nn.Module = model
    if wrapped:
        net = DistributedDataParallel(
            model,
            gradient_as_bucket_view=case["bucket_view"],
            find_unused_parameters=case["find_unused"],
            static_graph=case["static_graph"],
        )
        if case.get("own_hook"):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            net.register_comm_hook(None, allreduce_hook)
    micro = case["micro_batches"]
    losses: list[float] = []
    wire: list[tuple[str, int]] = []
    grads_after_backward: list[bool] = []
    for step in range(3):
        # DDP rebuilds its buckets (one broadcast) in the second iteration: the third is steady.
        watch = step == 2
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) if watch else (
            _nullcontext()
        ) as prof:
            for m in range(micro):
                x, y = make_batch(100 * step + 10 * m + rank, 4)
                sync = m == micro - 1 or not case["no_sync"] or not wrapped
                context = net.no_sync() if not sync else _nullcontext()  # type: ignore[operator]
                with context:
                    loss = mse(net, x, y) / micro
                    loss.backward()
                losses.append(float(loss))
                # None or the optimizer's placeholder, never DDP's zeros
                grads_after_backward.append(
                    any(
                        p.grad is not None and not is_owned_gradient(p.grad)
                        for p in model.parameters()
                    )
                )
            optimizer.step()
            optimizer.zero_grad()
        if watch:
            wire = _bulk_collectives(prof)
    params = [p.detach().float().clone() for p in model.parameters()]
    optimizer.close()
    return {
        "losses": losses,
        "params": params,
        "wire": wire,
        "grads_after_backward": grads_after_backward,
    }


class _nullcontext:
    def __enter__(self) -> Any:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def ddp_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[Any]:
    """Each case twice, under DDP and bare; a refusal comes back as its message."""
    torch.set_num_threads(1)
    results: list[Any] = []
    for case in cases:
        try:
            wrapped = _ddp_run(rank, case, wrapped=True)
        except dtypeplan.errors.OptimizerUsageError as exc:
            results.append(str(exc))
            continue
        results.append((wrapped, _ddp_run(rank, case, wrapped=False)))
    return results


def _zero3_run(rank: int, bf16: bool, moved: bool) -> list[float]:
    config: dict[str, Any] = {
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    plan = dtypeplan.resolve(config)
    model = plan.prepare_model(make_model(0))
    device = next(model.parameters()).device
    if moved:  # what a framework does to a model it receives, before the optimizer exists
        model.to(device)
    optimizer = plan.build(model.parameters())
    losses = []
    for step in range(4):
        if moved:  # and after (Accelerate's prepare(model, optimizer), Lightning's setup)
            model.to(device) if step % 2 else model.cpu()
        x, y = make_batch(10 * step + rank, 4)
        loss = mse(model, x, y)
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    optimizer.close()
    return losses


def zero3_handling(rank: int, world_size: int) -> dict[str, Any]:
    """A ZeRO-3 model moved to its own device before and after build trains as one not moved;
    DDP around it is refused."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for bf16 in (False, True):
        out[f"moved_bf16={bf16}"] = _zero3_run(rank, bf16, moved=True)
        out[f"still_bf16={bf16}"] = _zero3_run(rank, bf16, moved=False)
    plan = dtypeplan.resolve({"zero_optimization": {"stage": 3}})
    model = plan.prepare_model(make_model(0))
    try:
        DistributedDataParallel(model)
        out["ddp"] = "wrapped"
    except RuntimeError as exc:
        out["ddp"] = str(exc)
    return out
