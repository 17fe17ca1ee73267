"""Spawn-able workers for the wire-dtype, memory and accumulation-precision tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from dtypeplan.comm import _collectives
from tests._helpers import make_batch, make_model, memory_mlp, mse

# --- the dtype on the wire ---------------------------------------------------------------------


@contextlib.contextmanager
def record_wire() -> Iterator[list[tuple[str, torch.dtype, int]]]:
    """Wrap every collective dtypeplan calls and record (op, dtype, numel) of what it sends."""
    log: list[tuple[str, torch.dtype, int]] = []
    originals = {
        "_reduce_scatter_flat": _collectives._reduce_scatter_flat,
        "_all_gather_flat": _collectives._all_gather_flat,
    }
    # FSDP2 (ZeRO-3) looks its collectives up on torch.distributed at call time.
    dist_originals = {
        "all_reduce": dist.all_reduce,
        "all_to_all_single": dist.all_to_all_single,
        "reduce_scatter_single": dist.reduce_scatter_single,
        "all_gather_single": dist.all_gather_single,
    }

    def wrap(op: str, fn: Any, which: int) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            # The sent tensor: positional, or by keyword (FSDP2 passes input=/input_tensor=).
            if len(args) > which:
                tensor = args[which]
            else:
                tensor = next(kwargs[k] for k in ("input", "input_tensor", "tensor") if k in kwargs)
            log.append((op, tensor.dtype, tensor.numel()))
            return fn(*args, **kwargs)

        return recorded

    _collectives._reduce_scatter_flat = wrap("reduce_scatter", originals["_reduce_scatter_flat"], 1)
    _collectives._all_gather_flat = wrap("all_gather", originals["_all_gather_flat"], 1)
    dist.all_reduce = wrap("all_reduce", dist_originals["all_reduce"], 0)
    dist.all_to_all_single = wrap("all_to_all", dist_originals["all_to_all_single"], 1)
    dist.reduce_scatter_single = wrap("reduce_scatter", dist_originals["reduce_scatter_single"], 1)
    dist.all_gather_single = wrap("all_gather", dist_originals["all_gather_single"], 1)
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(_collectives, name, fn)
        for name, fn in dist_originals.items():
            setattr(dist, name, fn)


def wire_case(rank: int, world_size: int, config: dict[str, Any]) -> list[tuple[str, str, int]]:
    plan = dtypeplan.resolve(config)
    model = plan.prepare_model(make_model(0))
    optimizer = plan.build(model.parameters())
    x, y = make_batch(0, 8 * world_size)
    micro_x, micro_y = x.chunk(world_size)[rank].chunk(2), y.chunk(world_size)[rank].chunk(2)
    with record_wire() as log:
        for index, (xm, ym) in enumerate(zip(micro_x, micro_y, strict=True)):
            # The last micro-batch starts the step's reduction inside its backward: the same
            # collectives as at step(), only earlier.
            optimizer.backward(mse(model, xm, ym) / 2, last_micro_batch=index == 1)
        optimizer.step()
    return [(op, str(dtype), numel) for op, dtype, numel in log]


def wire_cases(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[Any]:
    return [wire_case(rank, world_size, config) for config in configs]


# --- memory at the accumulation boundary --------------------------------------------------------


def memory_case(rank: int, world_size: int, config: dict[str, Any], width: int) -> dict[str, Any]:
    plan = dtypeplan.resolve(config)
    model = memory_mlp(width)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = plan.build(model.parameters())
    after_build = optimizer.held_tensors().nbytes()
    for _ in range(2):
        x = torch.randn(4, width).to(plan.param_dtype)
        optimizer.backward(model(x).float().square().mean())
    at_boundary = optimizer.held_tensors().nbytes()
    optimizer.step()
    return {
        "after_build": after_build,
        "at_boundary": at_boundary,
        "after_step": optimizer.held_tensors().nbytes(),
        "predicted": plan.memory(num_params, world_size),
        "num_params": num_params,
    }


def memory_cases(
    rank: int, world_size: int, configs: list[dict[str, Any]], width: int
) -> list[Any]:
    return [memory_case(rank, world_size, config, width) for config in configs]


# --- accumulation precision --------------------------------------------------------------------


def accumulation_error(
    rank: int, world_size: int, config: dict[str, Any], micro_batches: int
) -> float:
    """Relative error of the gradient the optimizer applies, against a float64 sum.

    Plain SGD with lr 1 and no clipping moves the master weights by exactly the reduced mean
    gradient, so the update itself is the measurement. The float64 reference sums the very
    same 16-bit per-micro-batch gradients, on every rank's data.
    """
    plan = dtypeplan.resolve(config)
    model = make_model(3).to(plan.param_dtype)
    probe = make_model(3).to(plan.param_dtype)
    optimizer = plan.build(model.parameters())
    before = {k: v.clone() for k, v in optimizer.full_state().items() if k.endswith(".master")}
    x, y = make_batch(5, 2 * micro_batches * world_size)
    reference = [torch.zeros(p.shape, dtype=torch.float64) for p in probe.parameters()]
    for r in range(world_size):
        for xm, ym in zip(
            x.chunk(world_size)[r].chunk(micro_batches),
            y.chunk(world_size)[r].chunk(micro_batches),
            strict=True,
        ):
            probe.zero_grad()
            (mse(probe, xm, ym) / micro_batches).backward()
            for total, param in zip(reference, probe.parameters(), strict=True):
                total += param.grad.double()
            if r == rank:
                optimizer.backward(mse(model, xm, ym) / micro_batches)
    optimizer.step()
    after = optimizer.full_state()
    num = den = 0.0
    for i, ref in enumerate(reference):
        applied = (before[f"param.{i}.master"] - after[f"param.{i}.master"]).double()
        expected = ref / world_size
        num += float((applied - expected).square().sum())
        den += float(expected.square().sum())
    return (num / den) ** 0.5


def accumulation_cases(
    rank: int, world_size: int, configs: list[dict[str, Any]], micro_batches: int
) -> list[float]:
    return [accumulation_error(rank, world_size, config, micro_batches) for config in configs]


def fsdp2_memory_cases(
    rank: int, world_size: int, configs: list[dict[str, Any]], width: int
) -> list[Any]:
    from dtypeplan.optimizers.fsdp2.sharding import REDUCE_SCATTER_OF

    results = []
    for config in configs:
        plan = dtypeplan.resolve(config)
        model = memory_mlp(width)
        num_params = sum(p.numel() for p in model.parameters())
        model = plan.prepare_model(model)
        optimizer = plan.build(model.parameters())
        for _ in range(2):  # a step first, so that the optimizer states exist at the boundary
            for _ in range(2):
                optimizer.backward(model(torch.randn(4, width)).float().square().mean())
            at_boundary = optimizer.held_tensors().nbytes()
            # bf16 masters: the reduce-scatter output kept for the hook is gone after backward.
            kept = {id(REDUCE_SCATTER_OF[p].last_output) for p in model.parameters()}
            optimizer.step()
            optimizer.zero_grad()
        results.append(
            {
                "at_boundary": at_boundary,
                "predicted": plan.memory(num_params, world_size),
                "reduce_scatter_output_kept": kept != {id(None)},
            }
        )
    return results
