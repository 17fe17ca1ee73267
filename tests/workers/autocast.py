"""torch_autocast cases: dtypeplan against plain torch under ``torch.autocast``, on every rank.

The reference is what a torch user writes without dtypeplan: the same fp32 model, forward under
``torch.autocast(dtype)``, ``torch.optim`` on its fp32 parameters, and for fp16
``torch.amp.GradScaler`` configured like the plan's loss scaler (window = growth interval,
hysteresis 1). It runs every rank's micro-batches in turn and sums their gradients in fp32
``.grad``, so each micro-batch's autocast forward and backward are the very ops dtypeplan runs
on that rank: the two runs differ only in the order of the fp32 sums (and in what the plan
rounds on purpose: a bf16 accumulator or wire). dtypeplan's model gets no autocast from the
test: ``plan.prepare_model`` must install it, and the output dtype is recorded to show it did.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from tests._helpers import make_batch, make_model, master_rel_error, memory_mlp

OVERFLOW_INPUT = 1e6
"""Put in one input of the overflow step: above fp16's 65504, so fp16 autocast's first matmul
turns inf (tanh keeps the loss finite) and its weight gradient NaN: the step must be skipped,
by GradScaler and by dtypeplan alike."""


def _reference_scaler(plan: dtypeplan.PrecisionPlan) -> torch.amp.GradScaler:
    scaling = plan.loss_scaling
    if scaling is None:
        return torch.amp.GradScaler("cpu", enabled=False)
    assert scaling.loss_scale == 0 and scaling.hysteresis == 1, "GradScaler is dynamic, no delay"
    return torch.amp.GradScaler(
        "cpu",
        init_scale=2.0**scaling.initial_scale_power,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=scaling.loss_scale_window,
    )


def parity_case(case: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    plan = dtypeplan.resolve(case["config"])
    assert plan.status == "OK", plan.explain()
    assert plan.autocast_dtype is not None
    steps, micro, per_micro = case.get("steps", 3), case.get("micro_batches", 2), 4
    seed = case.get("seed", 0)

    reference = make_model(seed)
    model = plan.prepare_model(copy.deepcopy(reference))
    optimizer = plan.build(model.parameters())
    ref_opt = plan.optimizer.torch_class(reference.parameters(), **plan.optimizer.params)
    scaler = _reference_scaler(plan)

    losses, ref_losses, scales, ref_scales, out_dtypes = [], [], [], [], set()
    ref_skipped = 0
    for step in range(steps):
        x, y = make_batch(seed + step, world_size * micro * per_micro)
        if step == case.get("overflow_step"):
            x[0, 0] = OVERFLOW_INPUT  # rank 0's first micro-batch
        # Reference: every rank's micro-batches, fp32 .grad sums, torch.autocast forward.
        ref_opt.zero_grad()
        ref_total = 0.0
        for r in range(world_size):
            for xm, ym in zip(
                x.chunk(world_size)[r].chunk(micro),
                y.chunk(world_size)[r].chunk(micro),
                strict=True,
            ):
                with torch.autocast("cpu", dtype=plan.autocast_dtype):
                    out = reference(xm)
                loss = torch.nn.functional.mse_loss(out.float(), ym) / (micro * world_size)
                scaler.scale(loss).backward()
                ref_total += float(loss.detach())
        ref_scales.append(scaler.get_scale() if scaler.is_enabled() else 1.0)
        scaler.step(ref_opt)
        scaler.update()
        # GradScaler skips a step exactly when it backs the scale off.
        ref_skipped += scaler.is_enabled() and scaler.get_scale() < ref_scales[-1]
        ref_losses.append(ref_total)
        # dtypeplan: this rank's micro-batches; the model applies autocast itself.
        optimizer.zero_grad()
        total = torch.zeros(())
        mine = zip(
            x.chunk(world_size)[rank].chunk(micro),
            y.chunk(world_size)[rank].chunk(micro),
            strict=True,
        )
        for xm, ym in mine:
            out = model(xm)
            out_dtypes.add(str(out.dtype))
            loss = torch.nn.functional.mse_loss(out.float(), ym) / micro
            if case.get("loss_backward"):
                loss.backward()
            else:
                optimizer.backward(loss)
            total += loss.detach()
        scales.append(optimizer.loss_scale)
        optimizer.step()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
    master_error = master_rel_error(optimizer.full_state(), list(reference.parameters()))
    return {
        "name": case["name"],
        "losses": losses,
        "ref_losses": ref_losses,
        "loss_scales": scales,
        "ref_loss_scales": ref_scales,
        "skipped_steps": optimizer.skipped_steps,
        "ref_skipped_steps": ref_skipped,
        "master_rel_error": master_error,
        "output_dtypes": sorted(out_dtypes),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "autocast_left_on": torch.is_autocast_enabled("cpu"),
    }


def memory_case(config: dict[str, Any], world_size: int, width: int) -> dict[str, Any]:
    """What the optimizer holds at the accumulation boundary and after a step, with the
    forward under autocast (tests/test_memory.py's measurement, through prepare_model)."""
    plan = dtypeplan.resolve(config)
    model = memory_mlp(width)
    num_params = sum(p.numel() for p in model.parameters())
    model = plan.prepare_model(model)
    optimizer = plan.build(model.parameters())
    measured = {}
    for _step in range(2):  # a step first, so that the optimizer states exist at the boundary
        for _ in range(2):
            optimizer.backward(model(torch.randn(4, width)).float().square().mean())
        measured["at_boundary"] = optimizer.held_tensors().nbytes()
        optimizer.step()
        measured["after_step"] = optimizer.held_tensors().nbytes()
        optimizer.zero_grad()
    return {**measured, "predicted": plan.memory(num_params, world_size)}


def run_autocast_cases(
    rank: int,
    world_size: int,
    cases: list[dict[str, Any]],
    memory_configs: list[dict[str, Any]],
    width: int,
) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {"parity": [], "memory": []}
    for case in cases:
        try:
            results["parity"].append(parity_case(case, rank, world_size))
        except Exception as exc:  # report the case, keep the group alive for the others
            import traceback

            results["parity"].append(
                {"name": case["name"], "error": f"{exc!r}\n{traceback.format_exc()}"}
            )
    for config in memory_configs:
        results["memory"].append(memory_case(config, world_size, width))
    return results
