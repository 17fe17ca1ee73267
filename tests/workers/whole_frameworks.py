"""The HF Trainer, Accelerate and Lightning reaching each optimizer class the way their users
write it (issue 44): ``torch.optim.Muon``, ``torch.optim.Adafactor``, the HF Trainer's
``optim="adafactor"`` (transformers' Adafactor), DeepSpeed's ``"Muon"`` and ``"Lion"`` config
types and a user's class registered with ``dtypeplan.register_optimizer``.

A case trains a tiny MLP (tests/workers/whole_tensor.whole_model, wrapped to take a dict batch
and return ``{"loss": ...}``) ``STEPS`` optimizer steps of ``ACCUM`` micro-batches of
``MICRO`` samples per rank, clipped at ``MAX_GRAD_NORM``, in one framework on dtypeplan. The
model records the indices of the samples each forward saw, so the reference (one process, fp32,
the same torch class) trains on exactly the samples the ranks saw in each step, whatever order
the framework's sampler chose: their union as one batch, clipped at the same norm.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from dtypeplan.integrations._common import find_optimizer
from tests._helpers import make_batch, master_rel_error
from tests.workers.integrations import _env
from tests.workers.parity import client_class
from tests.workers.whole_tensor import _digest, whole_model

STEPS, ACCUM, MICRO = 4, 2, 4
MAX_GRAD_NORM = 1.0
MINE = "tests.test_register_optimizer:MyLion"
"""The user's own class (a 20-line Lion), registered elementwise when its module is imported."""

SPECS: dict[str, dict[str, Any]] = {
    # A class the program constructs (class path, hyperparameters); bias=False: Muon takes
    # matrices only, so its model has no vectors.
    "Muon": {"class": "Muon", "hyper": {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}},
    "Adafactor": {"class": "Adafactor", "hyper": {"lr": 0.01}},
    "MyLion": {"class": MINE, "hyper": {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}},
    # The config's optimizer block (DeepSpeed's types): Muon on the matrices, AdamW on the rest.
    "config Muon": {
        "block": {
            "type": "Muon",
            "params": {"lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.01, "betas": [0.9, 0.95]},
        },
        # The HF Trainer refuses a config value that TrainingArguments contradict, as its
        # DeepSpeed integration does: the arguments say the same.
        "args": {"learning_rate": 0.02, "weight_decay": 0.01, "adam_beta2": 0.95},
    },
    "config Lion": {
        "block": {
            "type": "Lion",
            "params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1},
        },
        "args": {"learning_rate": 1e-3, "weight_decay": 0.1, "adam_beta2": 0.99},
    },
    # The torch way to the same mix: two optimizers prepared together (Accelerate only: the
    # Trainer takes one optimizer, Lightning two under manual optimization only). Unclipped:
    # each dtypeplan optimizer clips its own norm, and torch's clip_grad_norm_ the global one.
    "Muon and AdamW": {"pair": {"Muon": {"lr": 0.02, "weight_decay": 0.1}, "AdamW": {"lr": 3e-3}}},
    # The HF Trainer's own name: TrainingArguments(optim="adafactor", learning_rate=...).
    "hf adafactor": {"optim": "adafactor", "hyper": {"lr": 0.01}},
}


class Net(torch.nn.Module):
    """The MLP taking a dict batch, as framework models do; records what each forward saw."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.body = whole_model(0, bias)
        self.seen: list[list[int]] = []
        self.losses: list[float] = []
        self.plan_warnings: list[str] = []  # Lightning's strategy.plan.warnings

    def forward(self, x: torch.Tensor, labels: torch.Tensor, idx: torch.Tensor) -> Any:
        dtype = next(self.parameters()).dtype
        loss = torch.nn.functional.mse_loss(self.body(x.to(dtype)).float(), labels)
        if self.training:
            self.seen.append([int(i) for i in idx])
            self.losses.append(float(loss.detach()))
        return {"loss": loss}


def dataset(world: int) -> list[dict[str, torch.Tensor]]:
    count = STEPS * ACCUM * MICRO * world
    x, y = make_batch(0, count)
    return [{"x": x[i], "labels": y[i], "idx": torch.tensor(i)} for i in range(count)]


def _bias(name: str) -> bool:
    return name != "Muon"  # torch's Muon takes matrices only


def _config(name: str, stage: int) -> dict[str, Any]:
    config: dict[str, Any] = {"zero_optimization": {"stage": stage}}
    if "block" in SPECS[name]:
        config["optimizer"] = SPECS[name]["block"]
    return config


def _pair(name: str, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """Case ``name``'s optimizers: torch's Muon on the matrices, AdamW on the rest."""
    hyper = SPECS[name]["pair"]
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [torch.optim.Muon(matrices, **hyper["Muon"]), torch.optim.AdamW(rest, **hyper["AdamW"])]


def _constructed(name: str, params: Any) -> torch.optim.Optimizer:
    """The optimizer a program constructs for case ``name``."""
    spec = SPECS[name]
    if "optim" in spec:
        from transformers.optimization import Adafactor

        # What TrainingArguments(optim="adafactor") makes (transformers' _get_adafactor).
        return Adafactor(params, scale_parameter=False, relative_step=False, **spec["hyper"])
    return client_class(spec["class"])(params, **spec["hyper"])


# --- the frameworks -------------------------------------------------------------------------------


def _trainer(name: str, stage: int, root: str, world: int) -> tuple[Net, Any]:
    import transformers

    from dtypeplan.integrations import DtypeplanTrainer

    spec = SPECS[name]
    model = Net(_bias(name))
    values = dict(
        output_dir=os.path.join(root, f"trainer-{name}-{stage}"), max_steps=STEPS,
        per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        learning_rate=spec.get("hyper", {}).get("lr", 1e-3), weight_decay=0.0,
        lr_scheduler_type="constant", max_grad_norm=MAX_GRAD_NORM, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
        optim=spec.get("optim", "adamw_torch"),
    )  # fmt: skip
    args = transformers.TrainingArguments(**{**values, **spec.get("args", {})})
    given = None
    if "class" in spec:
        given = (_constructed(name, model.parameters()), None)
    trainer = DtypeplanTrainer(
        model=model, args=args, train_dataset=dataset(world),
        dtypeplan_config=_config(name, stage), optimizers=given or (None, None),
    )  # fmt: skip
    trainer.train()
    return model, trainer.dtypeplan_optimizer


def _accelerator(name: str, stage: int, root: str, how: str) -> tuple[Any, Any]:
    """The accelerator and the case's plan: the config given to ``accelerator.resolve``
    (``how="resolve"``), or Accelerate's DeepSpeed spellings of it: a ``DeepSpeedPlugin`` passed
    in (``"plugin"``) or the environment ``accelerate launch --use_deepspeed
    --deepspeed_config_file ds.json`` sets (``"launch"``), the config resolved without an
    argument. DeepSpeed is not installed here: Accelerate would refuse to start with either."""
    import json

    from accelerate.utils import DeepSpeedPlugin

    from dtypeplan.integrations import DtypeplanAccelerator

    config = _config(name, stage)
    if how == "resolve":
        accelerator = DtypeplanAccelerator(gradient_accumulation_steps=ACCUM)
        return accelerator, accelerator.resolve(config)
    # DeepSpeed's value wins over the accelerator's under Accelerate: the config says it.
    config = {**config, "gradient_accumulation_steps": ACCUM}
    if how == "plugin":
        accelerator = DtypeplanAccelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
        return accelerator, accelerator.resolve()
    path = os.path.join(root, f"ds-{name}-{stage}.json".replace(" ", "_"))
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=path)
    try:
        accelerator = DtypeplanAccelerator()
    finally:
        del os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
    assert os.environ["ACCELERATE_USE_DEEPSPEED"] == "false"
    return accelerator, accelerator.resolve()


def _accelerate(name: str, stage: int, root: str, world: int, how: str = "resolve") -> Any:
    accelerator, plan = _accelerator(name, stage, root, how)
    assert accelerator.gradient_accumulation_steps == ACCUM
    assert accelerator.distributed_type.value == "MULTI_CPU", accelerator.distributed_type
    model = plan.prepare_model(Net(_bias(name)))
    if "block" in SPECS[name]:
        optimizers = [plan.build(model.parameters())]
    elif "pair" in SPECS[name]:
        optimizers = [plan.wrap(o) for o in _pair(name, model)]
    else:
        optimizers = [plan.wrap(_constructed(name, model.parameters()))]
    loader = torch.utils.data.DataLoader(dataset(world), batch_size=MICRO)
    prepared, *optimizers, loader = accelerator.prepare(model, *optimizers, loader)
    for batch in loader:
        with accelerator.accumulate(prepared):
            accelerator.backward(prepared(**batch)["loss"])
            if accelerator.sync_gradients and len(optimizers) == 1:
                accelerator.clip_grad_norm_(prepared.parameters(), MAX_GRAD_NORM)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    assert not isinstance(prepared, torch.nn.parallel.DistributedDataParallel)
    found = [find_optimizer(o) for o in optimizers]
    return model, found if len(found) > 1 else found[0]


def _lightning(name: str, stage: int, root: str, world: int) -> tuple[Net, Any]:
    import lightning

    from dtypeplan.integrations import DtypeplanStrategy

    pair = "pair" in SPECS[name]

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(_bias(name))
            # Two optimizers: manual optimization (Lightning's only way to several), stepping
            # every ACCUM batches as its docs write accumulation.
            self.automatic_optimization = not pair

        def training_step(self, batch: Any, index: int) -> Any:
            loss = self.net(**batch)["loss"]
            if not pair:
                return loss
            self.manual_backward(loss / ACCUM)
            if (index + 1) % ACCUM == 0:
                for optimizer in self.optimizers():
                    optimizer.step()
                    optimizer.zero_grad()
            return None

        def configure_optimizers(self) -> Any:
            # The config's block: none here, as under Lightning's DeepSpeedStrategy.
            if "block" in SPECS[name]:
                return None
            if pair:
                return _pair(name, self.net)
            return _constructed(name, self.parameters())

    config = _config(name, stage)
    if name == "Adafactor":
        # A DeepSpeed config carried over with its own block: configure_optimizers' wins.
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    module = Module()
    strategy = DtypeplanStrategy(config)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=world, strategy=strategy,
        max_steps=STEPS * (ACCUM if pair else 1), accumulate_grad_batches=1 if pair else ACCUM,
        gradient_clip_val=None if pair else MAX_GRAD_NORM,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(dataset(world), batch_size=MICRO, shuffle=False)
    trainer.fit(module, loader)
    module.net.plan_warnings = list(strategy.plan.warnings)
    found = [find_optimizer(o) for o in trainer.strategy.optimizers]
    if not found or None in found:
        return module.net, None
    return module.net, found if len(found) > 1 else found[0]


def _accelerate_plugin(name: str, stage: int, root: str, world: int) -> Any:
    return _accelerate(name, stage, root, world, "plugin")


def _accelerate_launch(name: str, stage: int, root: str, world: int) -> Any:
    return _accelerate(name, stage, root, world, "launch")


FRAMEWORKS = {
    "trainer": _trainer,
    "accelerate": _accelerate,
    "accelerate DeepSpeedPlugin": _accelerate_plugin,
    "accelerate launch --use_deepspeed": _accelerate_launch,
    "lightning": _lightning,
}


# --- the reference --------------------------------------------------------------------------------


def _reference(name: str, stage: int, seen: list[list[list[int]]], world: int) -> Any:
    """One fp32 process of the same class on the samples the ranks saw, step by step: the
    model, its losses, and how far it moved (relative L2 from the start)."""
    model = Net(_bias(name))
    start = [p.detach().clone() for p in model.parameters()]
    if "block" in SPECS[name]:
        plan = dtypeplan.resolve(_config(name, stage))
        optimizers = [plan.optimizer.torch_class(model.parameters(), **plan.optimizer.params)]
    elif "pair" in SPECS[name]:
        optimizers = _pair(name, model)
    else:
        optimizers = [_constructed(name, model.parameters())]
    data = dataset(world)
    losses = []
    for step in range(STEPS):
        picked = sorted(
            i
            for rank_seen in seen
            for micro in rank_seen[step * ACCUM : (step + 1) * ACCUM]
            for i in micro
        )
        batch = torch.utils.data.default_collate([data[i] for i in picked])
        model.zero_grad()
        loss = model(**batch)["loss"]
        loss.backward()
        if len(optimizers) == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        for optimizer in optimizers:
            optimizer.step()
        losses.append(float(loss.detach()))
    moved = sum(
        float((p.detach() - s).square().sum())
        for p, s in zip(model.parameters(), start, strict=True)
    )
    size = sum(float(s.square().sum()) for s in start)
    return model, losses, (moved / size) ** 0.5


def run_case(framework: str, name: str, stage: int, root: str, world: int) -> dict[str, Any]:
    model, built = FRAMEWORKS[framework](name, stage, root, world)
    if built is None:
        return {"error": f"{framework} built no dtypeplan optimizer for {name}"}
    optimizers = built if isinstance(built, list) else [built]
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, model.seen)
    reference, ref_losses, ref_moved = _reference(name, stage, seen, world)
    # Each step's loss over every rank's micro-batches (equal sizes): the full batch's mean.
    mine = torch.tensor(model.losses).reshape(STEPS, ACCUM)
    dist.all_reduce(mine)
    # The reference's parameters in the optimizer's order (the Trainer's optim= groups them
    # by weight decay), which full_state follows.
    names = {id(p): n for n, p in model.named_parameters()}
    by_name = dict(reference.named_parameters())
    errors = []
    for optimizer in optimizers:
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        errors.append(master_rel_error(optimizer.full_state(), [by_name[n] for n in order]))
    optimizer = optimizers[0]
    result = {
        "counts": [len(s) for s in seen],
        "samples": sorted(i for s in seen for m in s for i in m),
        "losses": (mine.sum(dim=1) / (world * ACCUM)).tolist(),
        "ref_losses": ref_losses,
        "ref_moved": ref_moved,
        "master_rel_error": max(errors),
        "implementation": optimizer.plan.implementation,
        "torch_class": optimizer.plan.optimizer.torch_class.__qualname__,
        "stage": optimizer.plan.zero_stage,
        "digest": _digest(model),
        "plan_warnings": getattr(model, "plan_warnings", []),
    }
    for optimizer in optimizers:
        optimizer.close()
    return result


def run_cases(rank: int, world: int, root: str, cases: list[tuple[str, str, int]]) -> Any:
    """Each ``(framework, optimizer, stage)`` case on this rank; an error is returned as text
    so that one case's failure does not hide the others'."""
    _env(rank, world)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for framework, name, stage in cases:
        key = f"{framework} {name} ZeRO-{stage}"
        try:
            results[key] = run_case(framework, name, stage, root, world)
        except Exception:  # noqa: BLE001 - reported per case to the parent
            results[key] = {"error": traceback.format_exc()}
        dist.barrier()
    return results
