"""Rank side of tests/test_zero3_caches.py: training-loop programs at ZeRO-3 against torch.

A program is a list of the calls a training loop makes, run twice on every rank: through
dtypeplan at ZeRO-3 (each rank its share of the batch) and through plain fp32 ``torch.optim`` on
a copy of the model, one process, on the whole batch (replicated: the reference runs on every
rank and nothing of it is communicated). Operations:

``("train", k)``      forward and ``loss.backward()`` on batch ``k`` (``opt.backward`` under fp16);
                      the loss (mean over ranks) is recorded
``("eval", k)``       a forward under ``torch.no_grad()`` (its output is recorded; the
                      reference's from a copy in the parameter dtype, each rank's rows apart)
``("clip", c)``       ``opt.clip_grad_norm_(c)`` / ``torch.nn.utils.clip_grad_norm_``
``("step",)``         ``opt.step()`` (the reference clips by ``gradient_clipping`` first)
``("zero_grad",)``    ``opt.zero_grad()`` / ``ref_opt.zero_grad()``
``("save", name)``    snapshot: the optimizer's ``state_dict``, a dtypeplan checkpoint, the
                      model's ``state_dict``; the reference's weights and optimizer state
``("load_opt", n)``   ``opt.load_state_dict`` of snapshot ``n`` (the weights come with it)
``("load_ckpt", n)``  ``dtypeplan.checkpoint.load`` of snapshot ``n``
``("load_model", n)`` ``model.load_state_dict`` of snapshot ``n`` (the weights only)
``("write", f)``      every weight multiplied by ``f`` under ``torch.no_grad()`` (a user's write,
                      an EMA swap)
``("swap", s, w)``    every weight set to ``RootScaled(s, w)``'s under ``torch.no_grad()`` (an EMA
                      swap: bf16 values, the same fp8 scales from the shards as from bf16)
``("grads",)``        record ``.grad`` (dtypeplan: gathered) where it is readable (an fp32
                      accumulator; a 16-bit one leaves a placeholder there)

At the end, and at every ``eval``, the outputs and weights are compared by the test.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

import dtypeplan
from dtypeplan import checkpoint
from dtypeplan.errors import OptimizerUsageError

WIDTH = 32
"""In and out features of every layer: a multiple of 16, so fp8 converts every linear."""
BATCH = 8
"""Rows per rank per batch."""


class RootScaled(torch.nn.Module):
    """Two blocks and a head, scaled by a parameter the root holds itself (CLIP's 0-dim
    ``logit_scale``): FSDP2 keeps the root unit gathered after its forward."""

    def __init__(self, seed: int, scale: float = 0.2) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(2)
        )
        self.head = torch.nn.Linear(WIDTH, WIDTH)
        self.logit_scale = torch.nn.Parameter(torch.tensor(0.1))
        with torch.no_grad():
            for param in self.parameters():
                # bf16 values: the fp8 scale of a weight is then the same from the fp32
                # shards as from a bf16 copy (the reference's), and so is every fp8 value.
                param.copy_((torch.randn(param.shape, generator=generator) * scale).bfloat16())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.logit_scale.exp()


def batch(k: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + k)
    x = torch.randn(rows, WIDTH, generator=generator)
    return x, torch.tanh(x.flip(-1)) + 0.1 * torch.randn(rows, WIDTH, generator=generator)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(p for p in model.parameters() if p.requires_grad).dtype
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def _full(param: torch.Tensor) -> torch.Tensor:
    value = param.full_tensor() if isinstance(param, DTensor) else param
    return value.detach().float().clone()


def _reference_model(model: torch.nn.Module, fp8: bool) -> torch.nn.Module:
    """The reference's copy: fp32; with fp8, converted by torchao itself (emulated, no
    fp8 all-gather: dynamic tensorwise scales computed at each forward from the weights)."""
    reference = copy.deepcopy(model)
    if fp8:
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        tensorwise = Float8LinearConfig.from_recipe_name("tensorwise")
        config = dataclasses.replace(tensorwise, emulate=True)
        convert_to_float8_training(reference, config=config)
    return reference


@torch.no_grad()
def _swap_in(model: torch.nn.Module, reference: torch.nn.Module, other: torch.nn.Module) -> None:
    """Copy ``other``'s weights into both models (an EMA swap): into dtypeplan's shards as
    each rank's piece of them."""
    for param, ref, value in zip(
        model.parameters(), reference.parameters(), other.parameters(), strict=True
    ):
        ref.copy_(value)
        if isinstance(param, DTensor):
            whole = value.to(param.dtype).reshape(param.shape)
            param.copy_(distribute_tensor(whole, param.device_mesh, param.placements))
        else:
            param.copy_(value.reshape(param.shape))


def run_program(
    rank: int, world: int, config: dict[str, Any], program: list[tuple[Any, ...]], seed: int = 0
) -> dict[str, Any]:
    """Run ``program`` both ways; return what the test compares (see the module docstring)."""
    plan = dtypeplan.resolve(config)
    assert plan.status == "OK" and plan.implementation == "fsdp2", plan.explain()
    fp8 = plan.fp8
    source = RootScaled(seed)
    reference = _reference_model(source, fp8)
    model = plan.prepare_model(copy.deepcopy(source))
    opt = plan.build(model.parameters())
    ref_opt = plan.optimizer.torch_class(reference.parameters(), **plan.optimizer.params)
    fp16 = plan.loss_scaling is not None
    directory = tempfile.mkdtemp(prefix="zero3-caches-") if rank == 0 else ""
    shared = [directory]
    dist.broadcast_object_list(shared)
    saved: dict[str, dict[str, Any]] = {}
    record: dict[str, Any] = {
        key: [] for key in ("evals", "ref_evals", "grads", "ref_grads", "losses", "ref_losses")
    }
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    for op, *args in program:
        if op == "train":
            x, y = batch(args[0], world * BATCH)
            loss = _loss(model, x[rows], y[rows])
            if fp16:
                opt.backward(loss)
            else:
                loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            record["losses"].append(float(total) / world)
            ref_loss = _loss(reference, x, y)
            ref_loss.backward()
            record["ref_losses"].append(float(ref_loss.detach()))
        elif op == "eval":
            x, _ = batch(args[0], world * BATCH)
            with torch.no_grad():
                dtype = plan.param_dtype
                mine = model(x[rows].to(dtype)).float()
                out = torch.empty(world * BATCH, WIDTH)
                dist.all_gather_into_tensor(out, mine.contiguous())
                record["evals"].append(out)
                # In the parameter dtype and rank by rank, as dtypeplan's forward (fp8 scales
                # each input by its own maximum): what remains is the weights'.
                copy_ = copy.deepcopy(reference).to(dtype)
                parts = [copy_(part.to(dtype)).float() for part in x.chunk(world)]
                record["ref_evals"].append(torch.cat(parts))
        elif op == "clip":
            opt.clip_grad_norm_(args[0])
            torch.nn.utils.clip_grad_norm_(reference.parameters(), args[0])
        elif op == "step":
            opt.step()
            if plan.gradient_clipping > 0:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), plan.gradient_clipping)
            ref_opt.step()
        elif op == "zero_grad":
            opt.zero_grad()
            ref_opt.zero_grad()
        elif op == "save":
            path = os.path.join(shared[0], args[0])
            checkpoint.save(opt, path)
            saved[args[0]] = {
                "opt": copy.deepcopy(opt.state_dict()),
                "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "path": path,
                "ref_weights": [p.detach().clone() for p in reference.parameters()],
                "ref_opt": copy.deepcopy(ref_opt.state_dict()),
            }
        elif op in ("load_opt", "load_ckpt", "load_model"):
            snap = saved[args[0]]
            if op == "load_opt":
                opt.load_state_dict(snap["opt"])
            elif op == "load_ckpt":
                checkpoint.load(opt, snap["path"])
            else:
                model.load_state_dict(snap["model"])
            with torch.no_grad():
                for param, value in zip(reference.parameters(), snap["ref_weights"], strict=True):
                    param.copy_(value)
            if op != "load_model":
                ref_opt.load_state_dict(snap["ref_opt"])
        elif op == "write":
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(args[0])
                for param in reference.parameters():
                    param.mul_(args[0])
        elif op == "swap":
            _swap_in(model, reference, RootScaled(args[0], args[1]))
        elif op == "grads":
            try:
                grads = [_full(p.grad) for p in model.parameters()]
            except OptimizerUsageError:
                continue  # a 16-bit accumulator's placeholder: nothing to read in .grad
            record["grads"].append(grads)
            record["ref_grads"].append([p.grad.detach().clone() for p in reference.parameters()])
        else:
            raise ValueError(f"unknown operation {op}")
    record["weights"] = [_full(p) for p in model.parameters()]
    record["ref_weights"] = [p.detach().float().clone() for p in reference.parameters()]
    opt.close()
    dist.barrier()  # every rank is done with the checkpoints
    if rank == 0:
        shutil.rmtree(shared[0], ignore_errors=True)
    return record


def run_programs(
    rank: int, world: int, cases: list[tuple[dict[str, Any], list[tuple[Any, ...]]]]
) -> list[dict[str, Any]]:
    """Every case on this group; a failing case reports its exception instead of raising."""
    import traceback

    torch.set_num_threads(1)
    results = []
    for config, program in cases:
        try:
            results.append({"ok": True, "value": run_program(rank, world, config, program)})
        except Exception as exc:  # reported to the test, which names the case
            results.append({"ok": False, "trace": traceback.format_exc(), "error": repr(exc)})
    return results
