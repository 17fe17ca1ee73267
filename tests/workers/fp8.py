"""fp8 compute cases, run inside spawned ranks (tests/test_fp8.py).

Each training case trains the same seeded MLP twice on every rank: once through dtypeplan with
the case's fp8 config, once through dtypeplan with the same config and fp8 off (bf16 compute:
the bound the test states is fp8's distance from it), both on the ranks' shares of one global
batch. A reference run converts its own copy with torchao (``convert_to_float8_training`` with
the recipe's config) and trains it with ``torch.optim.AdamW`` on the whole batch, one process:
the distance of dtypeplan's fp8 run from it is the data-parallel summation order only.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan

WIDTH = 64
"""Every layer's in and out features: a multiple of 32, so every recipe converts all four."""
TOKENS = 32
"""Tokens per rank per micro-batch: MXFP8 scales the weight gradient per 32 tokens."""


class Head(torch.nn.Module):
    """An MLP with an output layer named as GPT-2's (``lm_head``: left out by default)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(3)
        )
        self.lm_head = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7000 + step)
    x = torch.randn(size, WIDTH, generator=generator)
    return x, torch.tanh(x.flip(-1)) + 0.1 * torch.randn(size, WIDTH, generator=generator)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(p for p in model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def _train(
    config: dict[str, Any], steps: int, rank: int, world: int, seed: int
) -> tuple[list[float], dtypeplan.PrecisionPlan, torch.nn.Module, Any]:
    plan = dtypeplan.resolve(config)
    assert plan.status == "OK", plan.explain()
    model = plan.prepare_model(Head(seed))
    optimizer = plan.build(model.parameters())
    losses = []
    for step in range(steps):
        x, y = batch(step, world * TOKENS)
        part = slice(rank * TOKENS, (rank + 1) * TOKENS)
        loss = loss_of(model, x[part], y[part])
        optimizer.zero_grad()
        optimizer.backward(loss)
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses, plan, model, optimizer


def _reference(config: dict[str, Any], steps: int, world: int, seed: int) -> list[float]:
    """torchao's conversion and torch.optim.AdamW, one process, the whole batch."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    plan = dtypeplan.resolve(config)
    model = Head(seed)
    fp8 = config.get("fp8", {})
    recipe = fp8.get("recipe", "tensorwise")
    if fp8.get("enabled") and recipe != "mxfp8":
        torchao_config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(recipe), emulate=True
        )
        convert_to_float8_training(
            model, config=torchao_config, module_filter_fn=lambda _m, n: n != "lm_head"
        )
    elif fp8.get("enabled"):
        from dtypeplan.optimizers.contract import MXFP8Linear

        for name, module in model.named_modules():
            if type(module) is torch.nn.Linear and name != "lm_head":
                MXFP8Linear.convert(module, emulate=True)
    masters = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    model.to(plan.param_dtype)
    optimizer = torch.optim.AdamW(masters, **plan.optimizer.params)
    losses = []
    for step in range(steps):
        x, y = batch(step, world * TOKENS)
        grads = [torch.zeros_like(m) for m in masters]
        total = 0.0
        for rank in range(world):
            part = slice(rank * TOKENS, (rank + 1) * TOKENS)
            model.zero_grad()
            loss = loss_of(model, x[part], y[part])
            loss.backward()
            total += float(loss)
            for grad, param in zip(grads, model.parameters(), strict=True):
                grad += param.grad.float() / world
        for master, grad in zip(masters, grads, strict=True):
            master.grad = grad
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(model.parameters(), masters, strict=True):
                param.copy_(master)
        losses.append(total / world)
    return losses


def training_cases(
    rank: int, world: int, cases: list[dict[str, Any]], steps: int
) -> list[dict[str, Any]]:
    """Per case: dtypeplan's fp8 losses, the same config's bf16-compute losses, torchao's
    reference losses (rank 0), the converted layers' classes and what the all-gather holds."""
    results = []
    for case in cases:
        config = case["config"]
        losses, plan, model, optimizer = _train(config, steps, rank, world, seed=case["seed"])
        off = {**config, "fp8": {"enabled": False}}
        bf16_losses, *_ = _train(off, steps, rank, world, seed=case["seed"])
        classes = sorted(
            {type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__}
        )
        local_types = sorted(
            {
                type(p.to_local() if hasattr(p, "to_local") else p).__name__
                for p in model.parameters()
            }
        )
        result = {
            "scales_off": _scales_off(model),
            "name": case["name"],
            "losses": losses,
            "bf16_losses": bf16_losses,
            "classes": classes,
            "local_types": local_types,
            "explain": plan.explain(),
        }
        if rank == 0 and case.get("reference", True):
            result["reference"] = _reference(config, steps, world, seed=case["seed"])
        results.append(result)
        del optimizer
    return results


def _scales_off(model: torch.nn.Module) -> list[str]:
    """The fp8-gathered weights whose precomputed scale (the one the next all-gather casts
    with, on this rank) is not torchao's tensorwise scale of the whole weight."""
    from torchao.float8.float8_utils import EPS

    off = []
    for name, module in model.named_modules():
        local = getattr(getattr(module, "weight", None), "_local_tensor", None)
        scale = getattr(local, "_precomputed_scale", None)
        if scale is None:
            continue
        amax = module.weight.full_tensor().abs().max().clamp(EPS).double()
        expected = (torch.finfo(torch.float8_e4m3fn).max / amax).float()
        if not torch.equal(scale, expected):
            off.append(f"{name}: {float(scale)} != {float(expected)}")
    return off


def resume_case(rank: int, world: int, config: dict[str, Any], steps: int) -> dict[str, Any]:
    """Train ``steps``, save at the half, resume into a fresh model and optimizer: the losses
    after the resume must be the uninterrupted run's, bit for bit."""
    from dtypeplan import checkpoint

    half = steps // 2
    plan = dtypeplan.resolve(config)
    directory = tempfile.mkdtemp(prefix="fp8-resume-") if rank == 0 else None
    shared = [directory]
    dist.broadcast_object_list(shared)
    directory = shared[0]

    def run(model: torch.nn.Module, optimizer: Any, first: int, last: int) -> list[float]:
        losses = []
        for step in range(first, last):
            x, y = batch(step, world * TOKENS)
            part = slice(rank * TOKENS, (rank + 1) * TOKENS)
            loss = loss_of(model, x[part], y[part])
            optimizer.zero_grad()
            optimizer.backward(loss)
            optimizer.step()
            if step == half - 1 and first == 0:
                checkpoint.save(optimizer, os.path.join(directory, "ckpt"))
            losses.append(float(loss))
        return losses

    model = plan.prepare_model(Head(3))
    optimizer = plan.build(model.parameters())
    straight = run(model, optimizer, 0, steps)
    resumed_model = plan.prepare_model(Head(99))
    resumed_optimizer = plan.build(resumed_model.parameters())
    checkpoint.load(resumed_optimizer, os.path.join(directory, "ckpt"))
    exported = checkpoint.export_model_state(resumed_optimizer, resumed_model)
    resumed = run(resumed_model, resumed_optimizer, half, steps)
    dist.barrier()  # every rank has read the checkpoint
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return {
        "straight": straight[half:],
        "resumed": resumed,
        "exported": {name: (tuple(t.shape), str(t.dtype)) for name, t in exported.items()},
        "names": [name for name, _ in Head(0).named_parameters()],
    }


def _counted_collectives() -> tuple[dict[str, int], Any]:
    """Bytes each collective sends from this rank, counted as ``CommStats`` counts them (a
    ring all-gather or reduce-scatter of ``n`` bytes over ``g`` ranks: ``n * (g - 1) / g``,
    an all-reduce twice that), and a context that counts while it is open. FSDP2's
    collectives run as c10d ops (seen by a dispatch mode); DTensor's reductions (the fp8
    scales' maxima) as functional all-reduces, which a dispatch mode cannot see from inside
    DTensor's own dispatch: those are counted at ``funcol.all_reduce``. The c10d all-reduce
    is the step's scalar summary, which ``plan.traffic()`` leaves out (``summary``)."""
    import contextlib

    import torch.distributed._functional_collectives as funcol
    from torch.utils._python_dispatch import TorchDispatchMode

    sent: dict[str, int] = defaultdict(int)
    g = dist.get_world_size()

    def ring(t: torch.Tensor) -> int:
        return t.numel() * t.element_size() * (g - 1) // g

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            name = str(func)
            if name.startswith("c10d._allgather_base_"):
                sent["all_gather"] += ring(args[0])
            elif name.startswith("c10d._reduce_scatter_base_"):
                sent["reduce_scatter"] += ring(args[1])
            elif name.startswith("c10d.allreduce_"):
                sent["summary"] += 2 * sum(ring(t) for t in args[0])
            elif func.namespace in ("c10d", "_c10d_functional"):
                sent[f"uncounted {name}"] += 1
            return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting() -> Any:
        all_reduce = funcol.all_reduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            sent["all_reduce"] += 2 * ring(tensor)
            return all_reduce(tensor, *args, **kwargs)

        funcol.all_reduce = counted
        try:
            with Mode():
                yield
        finally:
            funcol.all_reduce = all_reduce

    return sent, counting


def cost_case(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    """One step after a first (the first casts without precomputed scales, and builds the
    state): the bytes each collective sent and the bytes held at the accumulation boundary,
    with what ``plan.traffic()`` and ``plan.memory()`` predict from the model's fp8 weights."""
    from dtypeplan.optimizers.contract import fp8_weight_numels

    plan = dtypeplan.resolve(config)
    model = Head(5)
    num_params = sum(p.numel() for p in model.parameters())
    before = fp8_weight_numels(model, plan)
    model = plan.prepare_model(model)
    optimizer = plan.build(model.parameters())
    sent, counting = _counted_collectives()

    def step(index: int) -> dict[str, int]:
        x, y = batch(index, world * TOKENS)
        part = slice(rank * TOKENS, (rank + 1) * TOKENS)
        optimizer.backward(loss_of(model, x[part], y[part]))
        held = optimizer.held_tensors().nbytes()
        optimizer.step()
        optimizer.zero_grad()
        return held

    step(0)
    with counting():
        step(1)
    held = step(2)
    fp8_weights = fp8_weight_numels(model, plan)
    return {
        "sent": dict(sent),
        "held": held,
        "fp8_weights": list(fp8_weights),
        "fp8_weights_before_prepare": list(before),
        "traffic": dict(plan.traffic(num_params, world, fp8_weights=fp8_weights).within),
        "memory": plan.memory(num_params, world, fp8_weights=fp8_weights),
    }


# --- the frameworks' fp8 spellings (tests/test_fp8_frameworks.py) -------------------------------
def _train_through(
    plan: dtypeplan.PrecisionPlan,
    rank: int,
    world: int,
    steps: int,
    accelerator: Any = None,
    **build: Any,
) -> list[float]:
    """Head(2) prepared and built by ``plan``, trained ``steps`` (through ``accelerator``'s
    ``prepare`` and ``backward`` where given)."""
    model = plan.prepare_model(Head(2))
    optimizer = plan.build(model.parameters(), **build)
    backward = optimizer.backward
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
        backward = accelerator.backward
    losses = []
    for step in range(steps):
        x, y = batch(step, world * TOKENS)
        part = slice(rank * TOKENS, (rank + 1) * TOKENS)
        loss = loss_of(model, x[part], y[part])
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def accelerate_fp8_cases(
    rank: int, world: int, cases: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per case: ``DtypeplanAccelerator(mixed_precision="fp8", kwargs_handlers=...)`` with the
    case's torchao recipe (none: Accelerate's default) resolves the config and trains through
    ``accelerator.prepare`` / ``backward``; the same config with the fp8 block written out
    trains without Accelerate. The plans' fp8 fields and both runs' losses."""
    from accelerate.utils import AORecipeKwargs
    from torchao.float8 import Float8LinearConfig

    from dtypeplan.integrations import DtypeplanAccelerator

    results = []
    for case in cases:
        recipe = case["recipe"]
        handlers = (
            []
            if recipe is None
            else [AORecipeKwargs(config=Float8LinearConfig.from_recipe_name(recipe))]
        )
        accelerator = DtypeplanAccelerator(mixed_precision="fp8", kwargs_handlers=handlers)
        plan = accelerator.resolve(case["config"])
        losses = _train_through(plan, rank, world, 3, accelerator)
        direct = dtypeplan.resolve(
            {**case["config"], "bf16": {"enabled": True}, "fp8": case["block"]}
        )

        results.append(
            {
                "fp8": plan.to_dict(),
                "direct_fp8": direct.to_dict(),
                "accelerate_precision": str(accelerator.mixed_precision),
                "losses": losses,
                "direct_losses": _train_through(direct, rank, world, 3),
            }
        )
    return results


def lightning_fp8_case(rank: int, world: int, recipe: str, stage: int) -> dict[str, Any]:
    """A LightningModule that converts its own layers with torchao in ``configure_model``
    (Lightning's fp8 recipe), trained by ``DtypeplanStrategy`` at ``stage``: the plan reads
    the layers' recipe into its fp8 block and trains the layers as converted; the losses
    against the same config with that block, the model converted by ``prepare_model``."""
    import lightning
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from dtypeplan.integrations import DtypeplanStrategy
    from tests.workers.integrations import _env

    # The launcher's variables (as torchrun sets them): without LOCAL_RANK Lightning starts
    # the other ranks itself, by running this process's command line again (pytest's own).
    _env(rank, world)

    config = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": stage}}
    torchao_config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Head(2)
            self.losses: list[float] = []

        def configure_model(self) -> None:
            convert_to_float8_training(
                self.model,
                config=torchao_config,
                module_filter_fn=lambda _m, name: name != "lm_head",
            )

        def training_step(self, data: Any, index: int) -> torch.Tensor:
            x, y = batch(index, world * TOKENS)
            part = slice(rank * TOKENS, (rank + 1) * TOKENS)
            loss = loss_of(self.model, x[part], y[part])
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(list(range(3 * world)), batch_size=1)

    module = Module()
    strategy = DtypeplanStrategy(config)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision="bf16-true",
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module)
    assert strategy.plan is not None
    block = {"enabled": True, "recipe": recipe, "emulate": True}
    direct = dtypeplan.resolve(
        {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}, "fp8": block}
    )

    return {
        "plan": strategy.plan.to_dict(),
        "classes": sorted({type(m).__name__ for m in module.model.modules()}),
        "losses": module.losses,
        "direct_losses": _train_through(
            direct, rank, world, 3, optimizer=torch.optim.AdamW, lr=1e-2
        ),
    }


def bias_free_gather_case(rank: int, world: int) -> dict[str, float]:
    """A forward and backward at ZeRO-3 where each unit holds one fp8 weight alone (bias-free
    linear layers), its weights gathered in fp8 and, for the oracle, in bf16: the loss and the
    first weight's gradient norm of each."""
    found = {}
    for all_gather in ("fp8", "param_dtype"):
        config = {
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3},
            "fp8": {"enabled": True, "all_gather": all_gather},
        }
        plan = dtypeplan.resolve(config)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, WIDTH, bias=False), torch.nn.Linear(WIDTH, WIDTH, bias=False)
        )
        model = plan.prepare_model(model)
        loss = model(torch.randn(TOKENS, WIDTH).bfloat16()).float().square().mean()
        loss.backward()
        grad = model[0].weight.grad.full_tensor().float()
        found[f"loss_{all_gather}"] = float(loss.detach())
        found[f"grad_norm_{all_gather}"] = float(grad.norm())
    return found
