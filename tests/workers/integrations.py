"""Training frameworks (HF Trainer, Accelerate, Lightning) on spawned ranks (issue 20).

Every case trains the same tiny GPT-2 (tests/workers/real_models.build_model, no dropout) on
the same seeded token data for ``STEPS`` optimizer steps of ``ACCUM`` micro-batches, three
ways in one framework: dtypeplan uninterrupted (saving the framework's checkpoint at step
``SAVE_AT`` and the weights at the end), dtypeplan resumed from that checkpoint in a fresh
model and framework object, and the framework's plain run with torch AdamW in fp32 (under the
framework's DDP) and the same schedule. It returns plain data; the test module compares.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

from dtypeplan.integrations._common import find_optimizer

VOCAB, SEQ = 128, 16
STEPS, SAVE_AT, ACCUM, MICRO = 6, 3, 2, 2
LR, WARMUP, WEIGHT_DECAY = 3e-3, 2, 0.01
MAX_GRAD_NORM = 0.5
"""Below the tiny GPT-2's gradient norms (about 1-3 at these steps): every step clips."""

HF_ZERO_CONFIG = "tests/data/deepspeed_configs/hf_transformers__ds_config_zero2.json"
"""The HF docs' ds_config_zero2.json, every optimizer, scheduler, batch and precision value
"auto"; the cases set its stage and drop its optimizer offload (a separate table cell)."""


def token_data(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (count, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def hf_config(stage: int) -> dict[str, Any]:
    """The HF docs' config at ``stage``, with a WarmupDecayLR (total_num_steps "auto" too)."""
    import json

    with open(HF_ZERO_CONFIG, encoding="utf-8") as handle:
        config = json.load(handle)
    zero = config["zero_optimization"]
    zero["stage"] = stage
    del zero["offload_optimizer"]
    config["scheduler"] = {
        "type": "WarmupDecayLR",
        "params": {key: "auto" for key in ("warmup_min_lr", "warmup_max_lr")}
        | {"warmup_num_steps": "auto", "total_num_steps": "auto", "warmup_type": "linear"},
    }
    return config


def scheduler_block() -> dict[str, Any]:
    """The workers' schedule as DeepSpeed's scheduler block, every value given."""
    return {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": LR,
            "warmup_num_steps": WARMUP,
            "total_num_steps": STEPS,
            "warmup_type": "linear",
        },
    }


def reference_schedule(optimizer: torch.optim.Optimizer) -> Any:
    """The schedule the config's WarmupDecayLR gives, on the reference's torch AdamW."""
    from dtypeplan.schedulers import build_scheduler

    return build_scheduler(scheduler_block(), optimizer)


def master_bits(state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Each tensor's fp32 bits (for a bitwise comparison in the parent)."""
    return {
        name: tensor.detach().float().contiguous().view(torch.int32).flatten().tolist()
        for name, tensor in sorted(state.items())
    }


# --- HF Trainer ----------------------------------------------------------------------------------


def _training_args(output_dir: str, dtype: str, **overrides: Any) -> Any:
    import transformers

    values: dict[str, Any] = dict(
        output_dir=output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        warmup_steps=WARMUP,
        max_grad_norm=MAX_GRAD_NORM,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        report_to=[],
        use_cpu=True,
        seed=0,
        bf16=dtype == "bf16",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def _recording(base: type) -> type:
    """``base`` recording each micro-batch's loss (the Trainer's logged loss is rounded and
    averaged over ranks) and, at each step, the optimizer's own gradient norm."""

    class Recording(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.losses: list[float] = []

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            self.losses.append(float(loss))
            return loss

    return Recording


def _norm_callback() -> Any:
    import transformers

    class OptimizerNorms(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.norms: list[float | None] = []

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.norms.append(None)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            optimizer = find_optimizer(kwargs.get("optimizer"))
            if optimizer is not None:
                self.norms[-1] = optimizer.grad_norm

    return OptimizerNorms()


def trainer_case(root: str, stage: int, dtype: str, world: int) -> dict[str, Any]:
    import transformers

    from dtypeplan.integrations import DtypeplanTrainer
    from tests.workers.real_models import build_model

    name = f"trainer-stage{stage}-{dtype}"
    out = os.path.join(root, name)
    data = token_data(STEPS * ACCUM * MICRO * world)
    config = hf_config(stage)
    result: dict[str, Any] = {}

    def run(resume: str | None, output_dir: str) -> Any:
        callback = _norm_callback()
        trainer = _recording(DtypeplanTrainer)(
            model=build_model("gpt2"),
            args=_training_args(output_dir, dtype),
            train_dataset=data,
            dtypeplan_config=config,
            callbacks=[callback],
        )
        trainer.train(resume_from_checkpoint=resume)
        trainer.callback_norms = callback.norms
        return trainer

    full = run(None, out)
    optimizer = full.dtypeplan_optimizer
    result["plan"] = {
        "stage": full.plan.zero_stage,
        "param_dtype": str(full.plan.param_dtype),
        "accum": str(full.plan.grad_accum_dtype),
        "clip": full.plan.gradient_clipping,
    }
    result["losses"] = full.losses
    logged = [e["grad_norm"] for e in full.state.log_history if "grad_norm" in e]
    result["logged_norms"] = logged
    result["optimizer_norms"] = full.callback_norms
    result["lrs"] = [e["learning_rate"] for e in full.state.log_history if "learning_rate" in e]
    ours = optimizer.full_state()  # collective; torch's parameter order
    full.save_model(os.path.join(out, "final"))
    exported = full_export(optimizer, full.model)
    result["final_masters"] = master_bits(exported)
    dist.barrier()
    result["saved_weights"] = _saved_weights(os.path.join(out, "final"), exported)
    # The checkpoint's model file too (the Trainer's _save_checkpoint calls save_model).
    result["checkpoint_weights"] = _saved_weights(os.path.join(out, f"checkpoint-{SAVE_AT}"), None)
    result["expected_names"] = sorted(
        n for n, _ in build_model("gpt2").named_parameters(remove_duplicate=False)
    )

    resumed = run(os.path.join(out, f"checkpoint-{SAVE_AT}"), os.path.join(root, name + "-r"))
    result["resumed_losses"] = resumed.losses
    result["resumed_logged_norms"] = [
        e["grad_norm"] for e in resumed.state.log_history if "grad_norm" in e
    ]
    result["resumed_masters"] = master_bits(full_export(resumed.dtypeplan_optimizer, resumed.model))

    reference = _recording(transformers.Trainer)
    model = build_model("gpt2")
    ref_opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WEIGHT_DECAY
    )
    ref = reference(
        model=model,
        args=_training_args(os.path.join(root, name + "-ref"), "fp32", save_strategy="no"),
        train_dataset=data,
        optimizers=(ref_opt, reference_schedule(ref_opt)),
    )
    ref.train()
    result.update(state_errors(ours, ref_opt))
    result["ref_losses"] = ref.losses
    result["ref_logged_norms"] = [e["grad_norm"] for e in ref.state.log_history if "grad_norm" in e]
    result["ref_lrs"] = [e["learning_rate"] for e in ref.state.log_history if "learning_rate" in e]
    return result


def state_errors(ours: dict[str, Any], reference: torch.optim.Optimizer) -> dict[str, float]:
    """Relative L2 distance of the master weights and of Adam's first moment (linear in the
    gradients: a clip factor missing on one side shows at full size) from the reference's."""
    params = [p for group in reference.param_groups for p in group["params"]]
    out: dict[str, float] = {}
    for key, name in (("master_rel", "master"), ("exp_avg_rel", "exp_avg")):
        diff = size = 0.0
        for i, param in enumerate(params):
            ref = param.detach() if name == "master" else reference.state[param][name]
            mine = ours[f"param.{i}.{name}"]
            assert isinstance(mine, torch.Tensor)
            diff += float((mine.flatten() - ref.flatten().float()).square().sum())
            size += float(ref.float().square().sum())
        out[key] = (diff / size) ** 0.5
    return out


def full_export(optimizer: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from dtypeplan.checkpoint import export_model_state

    return export_model_state(optimizer, model)


def _saved_weights(directory: str, exported: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """What ``save_pretrained`` wrote: reloaded with ``from_pretrained`` (rank 0 reads)."""
    import transformers

    # No dtype argument: the fp32 masters come back as written (config.json names their dtype).
    model = transformers.GPT2LMHeadModel.from_pretrained(directory)
    names = sorted(name for name, _ in model.named_parameters(remove_duplicate=False))
    from safetensors.torch import load_file

    stored = load_file(os.path.join(directory, "model.safetensors"))
    out: dict[str, Any] = {
        "names": names,
        "stored_dtypes": sorted({str(t.dtype) for t in stored.values()}),
        "loaded_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }
    if exported is not None:
        state = dict(model.named_parameters(remove_duplicate=False))
        out["missing"] = sorted(set(exported) - set(state))
        out["equal"] = all(torch.equal(state[n].detach(), exported[n]) for n in exported)
    return out


# --- Accelerate ---------------------------------------------------------------------------------


def plan_config(stage: int, dtype: str) -> dict[str, Any]:
    """A config with the workers' hyperparameters and schedule (no "auto")."""
    config: dict[str, Any] = {
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "scheduler": scheduler_block(),
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _loader(world: int) -> Any:
    data = token_data(STEPS * ACCUM * MICRO * world)
    return torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)


def _accelerate_run(
    accelerator: Any, model: Any, optimizer: Any, scheduler: Any, world: int,
    load_from: str | None, save_to: str | None, prepare_scheduler: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """The recipe's loop, recording each micro-batch's loss and each step's norm. The
    reference's scheduler is stepped by hand once per optimizer step, as DeepSpeed (and
    DtypeplanAccelerator) step a config's schedule; Accelerate would step it once per rank."""
    if prepare_scheduler:
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, _loader(world), scheduler
        )
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(world))
    out: dict[str, Any] = {"losses": [], "norms": [], "optimizer_norms": []}
    out["ddp"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    skip = 0
    if load_from is not None:
        accelerator.load_state(load_from)
        skip = SAVE_AT * ACCUM
        loader = accelerator.skip_first_batches(loader, skip)
    step = skip // ACCUM
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            out["losses"].append(float(loss))
            if accelerator.sync_gradients:
                out["norms"].append(
                    float(accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM))
                )
            optimizer.step()
            if prepare_scheduler or accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            own = find_optimizer(optimizer)
            out["optimizer_norms"].append(None if own is None else own.grad_norm)
            if save_to is not None and step == SAVE_AT:
                accelerator.save_state(save_to)
                own = find_optimizer(optimizer)
                assert own is not None
                out["saved_export"] = full_export(own, accelerator.unwrap_model(model))
    out["optimizer"] = optimizer
    out["model"] = accelerator.unwrap_model(model)
    return out


def accelerate_case(root: str, stage: int, dtype: str, world: int) -> dict[str, Any]:
    from accelerate import Accelerator

    import dtypeplan
    from dtypeplan.integrations import DtypeplanAccelerator
    from tests.workers.real_models import build_model

    name = f"accelerate-stage{stage}-{dtype}"
    ckpt = os.path.join(root, name, "ckpt")

    def dtypeplan_run(load_from: str | None, save_to: str | None) -> dict[str, Any]:
        accelerator = DtypeplanAccelerator(gradient_accumulation_steps=ACCUM)
        plan = dtypeplan.resolve(plan_config(stage, dtype))
        model = plan.prepare_model(build_model("gpt2"))
        optimizer = plan.build(model.parameters())
        scheduler = plan.build_scheduler(optimizer)
        return _accelerate_run(accelerator, model, optimizer, scheduler, world, load_from, save_to)

    full = dtypeplan_run(None, ckpt)
    optimizer = find_optimizer(full["optimizer"])
    assert optimizer is not None
    result: dict[str, Any] = {
        "losses": full["losses"],
        "logged_norms": full["norms"],
        "optimizer_norms": full["optimizer_norms"],
        "ddp": full["ddp"],
    }
    ours = optimizer.full_state()
    exported = full_export(optimizer, full["model"])
    result["final_masters"] = master_bits(exported)
    result["saved_weights"] = _state_file_weights(ckpt, full["saved_export"])
    result["expected_names"] = sorted(
        n for n, _ in build_model("gpt2").named_parameters(remove_duplicate=False)
    )
    resumed = dtypeplan_run(ckpt, None)
    result["resumed_losses"] = resumed["losses"]
    own = find_optimizer(resumed["optimizer"])
    assert own is not None
    result["resumed_masters"] = master_bits(full_export(own, resumed["model"]))

    accelerator = Accelerator(gradient_accumulation_steps=ACCUM)  # default kwargs: DDP
    model = build_model("gpt2")
    ref_opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    schedule = reference_schedule(ref_opt)
    ref = _accelerate_run(accelerator, model, ref_opt, schedule, world, None, None, False)
    result.update(state_errors(ours, ref_opt))
    result["ref_losses"] = ref["losses"]
    result["ref_logged_norms"] = ref["norms"]
    result["ref_ddp"] = ref["ddp"]
    return result


def _state_file_weights(directory: str, exported: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The model file ``save_state`` wrote (safetensors), against the exported masters."""
    from safetensors.torch import load_file

    stored = load_file(os.path.join(directory, "model.safetensors"))
    return {
        "names": sorted(stored),
        "stored_dtypes": sorted({str(t.dtype) for t in stored.values()}),
        "missing": sorted(set(exported) - set(stored)),
        "equal": all(torch.equal(stored[n], exported[n]) for n in exported if n in stored),
    }


# --- Lightning ----------------------------------------------------------------------------------


def _lightning_module(manual: bool) -> Any:
    import lightning

    from tests.workers.real_models import build_model

    class TinyGPT(lightning.LightningModule):
        """GPT-2 with the workers' AdamW and schedule; records losses and norms."""

        def __init__(self) -> None:
            super().__init__()
            self.model = build_model("gpt2")
            self.automatic_optimization = not manual
            self.losses: list[float] = []
            self.grad_norms: list[float | None] = []  # .grad's norm before clipping (plain)
            self.optimizer_norms: list[float | None] = []  # the dtypeplan optimizer's
            self.start_export: dict[str, torch.Tensor] | None = None

        def training_step(self, batch: Any, index: int) -> Any:
            loss = self.model(**batch).loss
            self.losses.append(float(loss))
            if self.automatic_optimization:
                return loss
            optimizer, scheduler = self.optimizers(), self.lr_schedulers()
            self.manual_backward(loss)
            if True:
                self._grad_norm()
                self.clip_gradients(optimizer, MAX_GRAD_NORM, "norm")
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                self._optimizer_norm()
            return None

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            if self.automatic_optimization:  # manual: taken before clip_gradients
                self._grad_norm()

        def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
            if self.automatic_optimization:
                self._optimizer_norm()

        def _grad_norm(self) -> None:
            from dtypeplan.optimizers.grads.owned import is_owned_gradient

            # Under dtypeplan .grad holds a placeholder that refuses arithmetic (the gradient
            # is in the optimizer): the plain run's norm only.
            grads = [
                p.grad
                for p in self.parameters()
                if p.grad is not None and not is_owned_gradient(p.grad)
            ]
            norm = torch.nn.utils.get_total_norm(grads) if grads else None
            self.grad_norms.append(None if norm is None else float(norm))

        def _optimizer_norm(self) -> None:
            own = find_optimizer(self.optimizers())
            self.optimizer_norms.append(None if own is None else own.grad_norm)

        def on_train_start(self) -> None:
            ddp = torch.nn.parallel.DistributedDataParallel
            self.under_ddp = isinstance(self.trainer.strategy.model, ddp)
            own = find_optimizer(self.optimizers())
            if own is not None:
                self.start_export = full_export(own, self)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            schedule = {"scheduler": reference_schedule(optimizer), "interval": "step"}
            return {"optimizer": optimizer, "lr_scheduler": schedule}

    return TinyGPT()


def _lightning_fit(
    strategy: Any, module: Any, world: int, steps: int, ckpt: str | None, manual: bool
) -> Any:
    import lightning

    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        # Steps of one batch of MICRO * ACCUM samples: under accumulate_grad_batches a resume
        # was seen to start one micro-batch early, for the plain DDP run as well.
        accumulate_grad_batches=1,
        gradient_clip_val=None if manual else MAX_GRAD_NORM,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    # Every sample the same sequence: Lightning's DistributedSampler reorders the samples by
    # epoch, and a checkpoint saved when fit stopped at max_steps resumes mid-epoch in another
    # order (its own plain DDP run as well: measured); with one sequence the order is moot and
    # the comparison is of the optimizer's state.
    data = token_data(1) * (SAVE_AT * ACCUM * MICRO * world)
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO * ACCUM, shuffle=False)
    trainer.fit(module, loader, ckpt_path=ckpt)
    return trainer


def lightning_case(root: str, stage: int, dtype: str, world: int, manual: bool = False) -> Any:
    from dtypeplan.integrations import DtypeplanStrategy

    name = f"lightning{'_manual' if manual else ''}-stage{stage}-{dtype}"
    out = os.path.join(root, name)
    config = plan_config(stage, dtype)
    del config["scheduler"]  # configure_optimizers gives the schedule, as Lightning users do
    first = _lightning_module(manual)
    stopped = _lightning_fit(DtypeplanStrategy(config), first, world, SAVE_AT, None, manual)
    checkpoint_file = os.path.join(out, "step3.ckpt")
    stopped.save_checkpoint(checkpoint_file)  # every rank: the optimizer's shards
    full = _lightning_module(manual)
    trainer = _lightning_fit(DtypeplanStrategy(config), full, world, STEPS, None, manual)
    optimizer = find_optimizer(trainer.strategy.optimizers[0])
    assert optimizer is not None
    ours = optimizer.full_state()
    result: dict[str, Any] = {
        "losses": full.losses,
        "optimizer_norms": full.optimizer_norms,
        # Lightning logs no norm of its own: the one to log is the optimizer's (float32 as
        # self.log stores it).
        "logged_norms": [float(torch.tensor(n, dtype=torch.float32)) for n in full.optimizer_norms],
        "own_grad_norms": full.grad_norms,
        "plan_stage": trainer.strategy.plan.zero_stage,
        "ddp": full.under_ddp,
    }
    result["final_masters"] = master_bits(full_export(optimizer, full))
    resumed = _lightning_module(manual)
    again = _lightning_fit(
        DtypeplanStrategy(config), resumed, world, STEPS, checkpoint_file, manual
    )
    own = find_optimizer(again.strategy.optimizers[0])
    assert own is not None and resumed.start_export is not None
    result["resumed_losses"] = resumed.losses
    result["resumed_masters"] = master_bits(full_export(own, resumed))
    stored = torch.load(checkpoint_file, weights_only=True, map_location="cpu")["state_dict"]
    result["saved_weights"] = {
        "names": sorted(n for n in stored if n in resumed.start_export),
        "stored_dtypes": sorted({str(stored[n].dtype) for n in resumed.start_export}),
        "missing": sorted(set(resumed.start_export) - set(stored)),
        "equal": all(torch.equal(stored[n], t) for n, t in resumed.start_export.items()),
    }
    result["expected_names"] = sorted(
        n for n, _ in _lightning_module(manual).named_parameters(remove_duplicate=False)
    )
    reference = _lightning_module(manual)
    ref = _lightning_fit("ddp", reference, world, STEPS, None, manual)
    result.update(state_errors(ours, ref.strategy.optimizers[0]))
    result["ref_losses"] = reference.losses
    result["ref_logged_norms"] = reference.grad_norms
    result["ref_ddp"] = reference.under_ddp
    return result


def lightning_manual_case(root: str, stage: int, dtype: str, world: int) -> Any:
    return lightning_case(root, stage, dtype, world, manual=True)


# --- the README's recipes -------------------------------------------------------------------------


def readme_recipes(rank: int, world: int, root: str, blocks: dict[str, str]) -> dict[str, Any]:
    """Run each README recipe (``blocks``: framework -> code) as it is, in its own directory
    holding the HF docs' ds_config_zero2.json as ``ds_config.json``; report what it left."""
    import shutil

    import transformers

    from tests.workers.real_models import build_model

    _env(rank, world)
    config = os.path.abspath(HF_ZERO_CONFIG)
    here = os.getcwd()
    out: dict[str, Any] = {}
    for framework, code in blocks.items():
        directory = os.path.join(root, framework)
        if rank == 0:
            os.makedirs(directory, exist_ok=True)
            shutil.copy(config, os.path.join(directory, "ds_config.json"))
        dist.barrier()
        os.chdir(directory)
        data = token_data(4 * MICRO * world)  # 4 steps of MICRO per rank
        namespace: dict[str, Any] = {
            "model": build_model("gpt2"),
            "train_dataset": data,
            "loader": torch.utils.data.DataLoader(data, batch_size=MICRO),
            "module": _lightning_module(False),
            "args": transformers.TrainingArguments(
                output_dir="out", max_steps=4, per_device_train_batch_size=MICRO,
                report_to=[], use_cpu=True, save_strategy="no", bf16=True, disable_tqdm=True,
            ),
        }  # fmt: skip
        try:
            exec(compile(code, f"README.md ({framework})", "exec"), namespace)
            out[framework] = _recipe_facts(framework, namespace)
        except Exception:  # noqa: BLE001 - reported to the parent
            out[framework] = traceback.format_exc()
        finally:
            os.chdir(here)
        dist.barrier()
    return out


def _recipe_facts(framework: str, namespace: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file

    if framework == "trainer":
        trainer = namespace["trainer"]
        optimizer = trainer.dtypeplan_optimizer
        stored = load_file(os.path.join("out", "model.safetensors")) if dist.get_rank() == 0 else {}
        return {
            "steps": optimizer.step_count(),
            "stage": trainer.plan.zero_stage,
            "clip": optimizer.grad_norm is not None,
            "weights": len(stored),
            "dtypes": sorted({str(t.dtype) for t in stored.values()}),
        }
    if framework == "accelerate":
        optimizer = find_optimizer(namespace["optimizer"])
        assert optimizer is not None
        return {
            "steps": optimizer.step_count(),
            "stage": optimizer.plan.zero_stage,
            "clip": optimizer.grad_norm is not None,
            "checkpoint": sorted(os.listdir("ckpt")),
            "param_dtype": str(optimizer.plan.param_dtype),
        }
    trainer = namespace["trainer"]
    optimizer = find_optimizer(trainer.strategy.optimizers[0])
    assert optimizer is not None
    return {
        "steps": optimizer.step_count(),
        "stage": optimizer.plan.zero_stage,
        "clip": optimizer.grad_norm is not None,
        "global_step": trainer.global_step,
        "param_dtype": str(optimizer.plan.param_dtype),
        "explained_lr": trainer.strategy.plan.optimizer.params["lr"],
        "explained_scheduler": trainer.strategy.plan.scheduler,
        "explain": trainer.strategy.plan.explain(),
    }


# --- entry ---------------------------------------------------------------------------------------


def _env(rank: int, world: int) -> None:
    # Accelerate (also inside TrainingArguments) reads the launcher's variables; the spawn
    # harness made the group already, so these only describe it. ACCELERATE_USE_CPU is what
    # `accelerate launch --cpu` sets: without it Accelerate takes CPU ranks for one process.
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "ACCELERATE_USE_CPU": "true",
        }
    )


DEFAULT_CASES = [("trainer", 2, "bf16"), ("accelerate", 3, "bf16"), ("lightning", 1, "bf16")]
"""The default run's case per framework (a group of 2 ranks costs seconds to start, and each
imports three frameworks: one group runs them and the README's recipes)."""


def default_group(rank: int, world: int, root: str, blocks: dict[str, str]) -> dict[str, Any]:
    out = run_cases(rank, world, root, DEFAULT_CASES)
    out["readme"] = readme_recipes(rank, world, os.path.join(root, "readme"), blocks)
    return out


RUNNERS = {
    "trainer": trainer_case,
    "accelerate": accelerate_case,
    "lightning": lightning_case,
    "lightning_manual": lightning_manual_case,
}


def run_cases(rank: int, world: int, root: str, cases: list[tuple[str, int, str]]) -> Any:
    """Each ``(framework, stage, dtype)`` case on this rank; an error is returned as text so
    that one case's failure does not hide the others'."""
    _env(rank, world)
    results: dict[str, Any] = {}
    for framework, stage, dtype in cases:
        key = f"{framework}-stage{stage}-{dtype}"
        try:
            results[key] = RUNNERS[framework](root, stage, dtype, world)
        except Exception:  # noqa: BLE001 - reported per case to the parent
            results[key] = traceback.format_exc()
        dist.barrier()
    return results
