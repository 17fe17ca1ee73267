"""Parity cases: a dtypeplan optimizer against plain fp32 ``torch.optim`` on the full batch.

A case runs on every rank of a group: each rank trains on its slice of the batch, split into
micro-batches whose losses are divided by their count; the reference trains an fp32 copy of
the same model on the whole batch with the same torch optimizer. Both are replicated, so the
reference runs on every rank and nothing about it is communicated.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dtypeplan
from tests._helpers import make_batch, make_model, master_rel_error, mse


def run_case(case: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Train ``case["steps"]`` steps both ways; return losses and final master weights' error."""
    config = case["config"]
    steps, micro = case.get("steps", 4), case.get("micro_batches", 2)
    per_micro = case.get("micro_batch_size", 4)
    seed = case.get("seed", 0)
    use_loss_backward = case.get("loss_backward", False)
    plan = dtypeplan.resolve(config)
    assert plan.status == "OK", plan.explain()

    reference = make_model(seed)
    model = plan.prepare_model(copy.deepcopy(reference))
    groups = _param_groups(model, case.get("param_groups", 1))
    client = case.get("client")  # a torch.optim class name, its hyperparameters, build | wrap
    if client is None:
        optimizer = plan.build(groups)
    else:
        torch_class = client_class(client["optimizer"])
        if client["how"] == "wrap":
            optimizer = plan.wrap(torch_class(groups, **client["hyperparameters"]))
        else:
            optimizer = plan.build(groups, optimizer=torch_class, **client["hyperparameters"])
        plan = optimizer.plan
    ref_groups = _param_groups(reference, case.get("param_groups", 1))
    ref_opt = plan.optimizer.torch_class(ref_groups, **plan.optimizer.params)

    batch_size = world_size * micro * per_micro
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for step in range(steps):
        x, y = make_batch(seed + step, batch_size)
        # Reference: the whole batch at once, fp32.
        ref_opt.zero_grad()
        ref_loss = mse(reference, x, y)
        ref_loss.backward()
        if plan.gradient_clipping > 0:
            ref_norms.append(
                float(
                    torch.nn.utils.clip_grad_norm_(reference.parameters(), plan.gradient_clipping)
                )
            )
        else:
            ref_norms.append(
                float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
            )
        ref_opt.step()
        ref_losses.append(float(ref_loss.detach()))
        # dtypeplan: this rank's slice, in micro-batches.
        mine_x = x.chunk(world_size)[rank].chunk(micro)
        mine_y = y.chunk(world_size)[rank].chunk(micro)
        optimizer.zero_grad()
        total = torch.zeros(())
        for index, (xm, ym) in enumerate(zip(mine_x, mine_y, strict=True)):
            loss = mse(model, xm, ym) / micro
            if use_loss_backward:
                loss.backward()
            else:
                last = case.get("boundary", False) and index == micro - 1
                optimizer.backward(loss, last_micro_batch=last)
            total += loss.detach()
        optimizer.step()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(float(total) / world_size)
        norms.append(optimizer.grad_norm)
    ref_params = [p for group in ref_groups for p in group["params"]]
    master_error = master_rel_error(optimizer.full_state(), ref_params)
    # ZeRO-3 keeps shards in the master dtype (fp32, or bf16 masters) and computes in
    # plan.param_dtype on gathered copies.
    stored = plan.master_dtype if plan.zero_stage == 3 else plan.param_dtype
    param_dtype_ok = all(p.dtype == stored for p in model.parameters())
    digest = hashlib.sha256()
    for param in model.parameters():
        whole = param.detach()
        if isinstance(whole, DTensor):
            whole = whole.full_tensor()  # collective: every rank, same order
        digest.update(whole.float().cpu().numpy().tobytes())
    return {
        "name": case.get("name", ""),
        "losses": losses,
        "ref_losses": ref_losses,
        "grad_norms": norms,
        "ref_grad_norms": ref_norms,
        "master_rel_error": master_error,
        "param_dtype_ok": param_dtype_ok,
        "skipped_steps": optimizer.skipped_steps,
        "params_digest": digest.hexdigest(),
    }


def client_class(name: str) -> type[torch.optim.Optimizer]:
    """A ``torch.optim`` class by name, or ``"module:Class"`` (a test's own class, registered
    with ``dtypeplan.register_optimizer`` when its module is imported)."""
    if ":" not in name:
        return getattr(torch.optim, name)
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _param_groups(model: torch.nn.Module, count: int) -> list[dict[str, Any]]:
    params = list(model.parameters())
    if count == 1:
        return [{"params": params}]
    # Weights decay, biases do not, as in most training scripts.
    return [
        {"params": [p for p in params if p.dim() > 1]},
        {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
    ]


def run_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for case in cases:
        try:
            results.append(run_case(case, rank, world_size))
        except Exception as exc:  # report the case, keep the group alive for the others
            import traceback

            results.append(
                {"name": case.get("name", ""), "error": f"{exc!r}\n{traceback.format_exc()}"}
            )
    return results
