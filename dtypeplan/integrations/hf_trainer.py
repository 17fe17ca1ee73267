"""The HF Trainer on a dtypeplan optimizer: ``DtypeplanTrainer(..., dtypeplan_config=...)``.

What a plain Trainer script changes is what ``--deepspeed ds_config.json`` changes, one
argument::

    trainer = DtypeplanTrainer(
        model=model, args=args, train_dataset=data, dtypeplan_config="ds_config.json"
    )
    trainer.train()                      # trainer.train(resume_from_checkpoint=True) resumes

The Trainer's own extension points do the rest, as the Trainer's DeepSpeed integration does:

* ``create_optimizer`` (run by ``train()`` after ``TrainingArguments`` made the process group,
  and after the Trainer computed the number of training steps) resolves the config with every
  ``"auto"`` filled from the arguments and the computed steps
  (:func:`dtypeplan.auto_values_from` with ``num_training_steps``), readies the model
  (``plan.prepare_model``: one dtype, ZeRO-3 sharding) and builds the optimizer: the config's
  ``optimizer`` block on the trainable parameters in one group (DeepSpeed's), or without one the
  optimizer the Trainer would make (``optim``, its weight-decay groups), or the one passed in
  ``optimizers=``, taken over with ``plan.wrap``.
* ``create_scheduler``: the config's ``scheduler`` block (DeepSpeed's formulas), else the
  Trainer's own (``lr_scheduler_type``) on the dtypeplan optimizer.
* No DistributedDataParallel and no Accelerate mixed precision (see
  :mod:`dtypeplan.integrations`): the model is handed to Accelerate marked as prepared.
* Clipping (``max_grad_norm``) and the logged ``grad_norm`` come from
  ``optimizer.clip_grad_norm_``: the global norm before clipping, the one the step uses.
* Checkpoints (``save_steps``, ``resume_from_checkpoint``): the optimizer state is written with
  :func:`dtypeplan.checkpoint.save` by every rank into ``checkpoint-N/dtypeplan_optimizer``
  and read back with :func:`dtypeplan.checkpoint.load` (any world size or stage); the scheduler
  state, RNG and trainer state as the Trainer writes them.
* ``save_model`` (and the model in every checkpoint) writes the fp32 master weights by
  parameter name (:func:`dtypeplan.checkpoint.export_model_state`, gathered on every rank at
  ZeRO 1-3) with ``save_pretrained``, and ``config.json`` names their dtype (``"float32"``;
  ``save_pretrained`` alone records the live model's bf16): ``from_pretrained(dir)``, with no
  dtype argument, reloads the fp32 masters, at every ZeRO stage. Before the optimizer exists
  it saves the model as the Trainer does.
* Precision follows the Trainer's own setting: ``--bf16`` / ``--fp16`` (``bf16=True`` ...)
  fill ``"bf16": {"enabled": "auto"}`` and ``"fp16": {"enabled": "auto"}``, as the HF
  DeepSpeed integration fills them; a config without the block gets it as Accelerate adds it
  for DeepSpeed (:func:`trainer_precision_config`); a config value that disagrees is refused,
  and so is a plan that would train in another dtype than the Trainer was told
  (:func:`check_trainer_precision`).

fp16 plans are refused (loss scaling inside the Trainer's backward is not wired).

Unedited scripts: ``dtypeplan run``
-----------------------------------
A script written for the plain Trainer (transformers' ``run_clm.py``, TRL scripts) that a
DeepSpeed user starts with ``torchrun ... script.py --deepspeed ds_config.json`` is started
unedited with::

    dtypeplan run [torchrun options] script.py --deepspeed ds_config.json [script args]
    # e.g. dtypeplan run --nproc_per_node 8 run_clm.py --deepspeed ds_config.json --bf16 ...

``dtypeplan run`` is torchrun with the same options (``python -m torch.distributed.run``, its
exit code), each rank starting :mod:`dtypeplan.integrations.hf_trainer_run`, which calls
:func:`use_for_unedited_scripts` and then runs the script as ``python script.py ARGS`` would
(``runpy``; ``-m module`` works too). ``dtypeplan run --rules RULES ...`` resolves the config
with the rules file RULES instead of the shipped table. So, in every rank, before the
script's first line:

* ``TrainingArguments`` (and subclasses) take ``deepspeed`` (``--deepspeed``, or
  ``deepspeed=`` in code, a path or a dict) as the dtypeplan config: the value moves to
  ``args.dtypeplan_config`` and ``args.deepspeed`` is None, so DeepSpeed is neither imported
  nor enabled (it need not be installed); ``--rules RULES`` is ``args.dtypeplan_rules``;
* ``transformers.Trainer`` is :class:`DtypeplanTrainer` (which reads
  ``args.dtypeplan_config`` and ``args.dtypeplan_rules`` when no ``dtypeplan_config=`` and
  ``dtypeplan_rules=`` are given), and
  ``transformers.Seq2SeqTrainer`` a subclass of both; Trainer subclasses defined after that
  (the script's own, or a library's imported by the script) inherit from it.

The same config file works with both launchers; what dtypeplan does with DeepSpeed's keys is
in the config's ``dtypeplan check`` output. Other launchers (``srun``, ``mpirun``) start
``python -m dtypeplan.integrations.hf_trainer_run [--rules RULES] script.py ARGS`` in each
rank themselves.

A plain ``transformers.Trainer`` given a dtypeplan optimizer (``optimizers=(opt, sched)``)
does not work: it wraps the model in DDP and clips with ``torch.nn.utils.clip_grad_norm_``,
which cannot see the optimizer's gradients (the error names this class); use
``DtypeplanTrainer`` (``optimizers=`` is taken over there) or ``dtypeplan run``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

import dtypeplan
from dtypeplan._quiet_imports import torchao_import_quiet
from dtypeplan.errors import OptimizerUsageError, PrecisionConfigError, RegistryError
from dtypeplan.integrations._common import (
    config_document,
    find_optimizer,
    optimizer_dir,
    record_saved_dtype,
    refuse_loss_scaling,
)
from dtypeplan.optimizers import MixedPrecisionOptimizer
from dtypeplan.resolver import PrecisionPlan

# transformers' Trainer module imports torchao, which logs lines no user acts on (see
# dtypeplan/_quiet_imports.py).
with torchao_import_quiet():
    from transformers import Trainer
    from transformers.optimization import Adafactor as TransformersAdafactor

__all__ = [
    "DtypeplanTrainer",
    "check_trainer_precision",
    "trainer_auto_values",
    "trainer_precision_config",
    "use_for_unedited_scripts",
]

SCHEDULER_FILE = "scheduler.pt"
"""The Trainer's name for the scheduler state in a checkpoint (transformers' SCHEDULER_NAME)."""


ARGS_CONFIG = "dtypeplan_config"
"""The ``TrainingArguments`` attribute that holds the config under ``dtypeplan run`` (the value
of ``--deepspeed``, taken by :func:`use_for_unedited_scripts`)."""

ARGS_RULES = "dtypeplan_rules"
"""The ``TrainingArguments`` attribute that holds the rules file under ``dtypeplan run --rules
RULES`` (:func:`use_for_unedited_scripts`' ``rules``)."""


def _register_transformers_adafactor() -> None:
    """``TrainingArguments(optim="adafactor")`` makes transformers' own Adafactor (not
    ``torch.optim.Adafactor``): its factored second moment and its update clipped by the
    update's RMS read each parameter whole, so it runs as the whole-tensor classes do (each
    parameter owned by one rank). A program that registered it first keeps its registration."""
    try:
        dtypeplan.register_optimizer(TransformersAdafactor, kind="whole")
    except RegistryError:  # registered already: by the program, or by an earlier import
        pass


_register_transformers_adafactor()


def trainer_dtype(args: Any) -> torch.dtype:
    """The dtype the Trainer was told to train in: ``--bf16`` (or ``bf16_full_eval``), ``--fp16``
    (or ``fp16_full_eval``), else fp32 (what the HF DeepSpeed integration fills
    ``bf16.enabled`` / ``fp16.enabled`` from)."""
    if getattr(args, "bf16", False) or getattr(args, "bf16_full_eval", False):
        return torch.bfloat16
    if getattr(args, "fp16", False) or getattr(args, "fp16_full_eval", False):
        return torch.float16
    return torch.float32


def check_trainer_precision(plan: PrecisionPlan, args: Any) -> None:
    """Refuse a plan that trains in another dtype than ``args`` ask for.

    ``"auto"`` precision keys are filled from the arguments and a config value that disagrees
    is refused already (:func:`dtypeplan.resolve`); this catches what is left: a config
    without a ``bf16`` / ``fp16`` block while the Trainer was told ``--bf16`` or ``--fp16``
    (the plan would train in fp32, and the Trainer's own autocast is off under dtypeplan).
    """
    from dtypeplan._dtypes import dtype_name

    trains = plan.autocast_dtype if plan.autocast_dtype is not None else plan.param_dtype
    told = trainer_dtype(args)
    if trains != told:
        flag = {torch.bfloat16: "--bf16", torch.float16: "--fp16"}.get(told, "no --bf16/--fp16")
        raise PrecisionConfigError(
            f"DtypeplanTrainer: the config trains in {dtype_name(trains)} but TrainingArguments "
            f"ask for {dtype_name(told)} ({flag}); make them agree, e.g. "
            '"bf16": {"enabled": "auto"} and "fp16": {"enabled": "auto"} in the config, '
            "which the Trainer's setting fills"
        )


def trainer_precision_config(
    config: dict[str, Any] | str | os.PathLike[str], args: Any
) -> dict[str, Any] | str | os.PathLike[str]:
    """``config`` with the precision block the Trainer adds for ``--bf16`` / ``--fp16`` where the
    config has none, as Accelerate's ``DeepSpeedPlugin.set_mixed_precision`` does under the HF
    DeepSpeed integration: ``"bf16": {"enabled": true}`` (no ``bf16`` / ``bfloat16`` block) or
    ``"fp16": {"enabled": true, "auto_cast": true}`` (no ``fp16`` block). So a file without the
    block (the HF docs' ds_config_zero3.json has only ``fp16``) trains in the dtype the Trainer
    was told, as under DeepSpeed. Otherwise ``config`` itself."""
    told = trainer_dtype(args)
    document = config_document(config)
    if told == torch.bfloat16 and not {"bf16", "bfloat16"} & set(document):
        return {**document, "bf16": {"enabled": True}}  # a copy: the caller's stays as given
    if told == torch.float16 and "fp16" not in document:
        return {**document, "fp16": {"enabled": True, "auto_cast": True}}
    return config


def trainer_auto_values(args: Any, num_training_steps: int) -> dict[str, Any]:
    """What the HF Trainer's DeepSpeed integration fills each ``"auto"`` with, for ``args``
    (a ``TrainingArguments``) and the number of optimizer steps the Trainer computed
    (:func:`dtypeplan.auto_values_from`, plus the global batch size it writes)."""
    auto = dtypeplan.auto_values_from(args, num_training_steps=num_training_steps)
    auto["train_batch_size"] = (
        args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps
    )
    return auto


def _point_at_prepared_parameters(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], model: torch.nn.Module
) -> None:
    """Point the param groups of ``optimizer`` (passed in ``optimizers=``, so made on the
    model's parameters before the plan readied it) at the readied model's parameters, by name:
    ZeRO-3's FSDP2 replaced each parameter with a sharded one of the same name, and the
    optimizer would train the replaced ones. ``names``: parameter id -> name before readying.
    The optimizer has not stepped (``plan.wrap`` refuses one that has), so no state moves."""
    current = dict(model.named_parameters())
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            name = names.get(id(param))
            if name is None or name not in current:
                raise OptimizerUsageError(
                    "DtypeplanTrainer: the optimizer passed in optimizers= trains a parameter "
                    "that is not the model's; make it on model.parameters() (or named groups "
                    "of them)"
                )
            params.append(current[name])
        group["params"] = params


class DtypeplanTrainer(Trainer):
    """A ``transformers.Trainer`` whose optimizer is dtypeplan's, from ``dtypeplan_config``
    (a DeepSpeed-style config: dict or ``.json`` / ``.yaml`` path, ``"auto"`` values allowed),
    resolved with the rules file ``dtypeplan_rules`` (a path; None: the shipped table).

    After ``train()`` starts, ``trainer.plan`` is the resolved plan and
    ``trainer.dtypeplan_optimizer`` the optimizer (``trainer.optimizer`` is Accelerate's
    wrapper around it).
    """

    def __init__(
        self,
        *args: Any,
        dtypeplan_config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        dtypeplan_rules: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        self.plan: PrecisionPlan | None = None
        self.dtypeplan_optimizer: MixedPrecisionOptimizer | None = None
        super().__init__(*args, **kwargs)
        if dtypeplan_config is None:
            # Under ``dtypeplan run`` TrainingArguments' --deepspeed value is the config.
            dtypeplan_config = getattr(self.args, ARGS_CONFIG, None)
        if dtypeplan_config is None:
            raise ValueError(
                "DtypeplanTrainer: no dtypeplan config: pass dtypeplan_config=... (a "
                "DeepSpeed-style dict or .json/.yaml path), or, for a script started with "
                "`dtypeplan run`, give TrainingArguments the config as deepspeed "
                "(--deepspeed ds_config.json)"
            )
        self.dtypeplan_config: dict[str, Any] | str | os.PathLike[str] = (
            dict(dtypeplan_config) if isinstance(dtypeplan_config, Mapping) else dtypeplan_config
        )
        if dtypeplan_rules is None:
            # Under ``dtypeplan run --rules RULES`` TrainingArguments hold the rules file.
            dtypeplan_rules = getattr(self.args, ARGS_RULES, None)
        self.dtypeplan_rules = dtypeplan_rules
        """The rules file the plan is resolved with (None: the shipped one)."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "DtypeplanTrainer: TrainingArguments also enable "
                f"{'DeepSpeed' if self.is_deepspeed_enabled else 'FSDP'}, which would wrap "
                "the model and own the optimizer; pass the config as dtypeplan_config only"
            )

    # --- the accelerator: no autocast, no GradScaler (the plan decides every dtype) ----------
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args: dict[str, Any] = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"
        return args

    # --- optimizer and scheduler ---------------------------------------------------------------
    def resolve_plan(self, num_training_steps: int) -> PrecisionPlan:
        """The plan of ``dtypeplan_config`` with its ``"auto"`` values filled as the HF
        DeepSpeed integration fills them."""
        auto = trainer_auto_values(self.args, num_training_steps)
        config = trainer_precision_config(self.dtypeplan_config, self.args)
        plan = dtypeplan.resolve(config, auto=auto, rules=self.dtypeplan_rules)
        check_trainer_precision(plan, self.args)
        return plan

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.dtypeplan_optimizer is not None:
            return self.dtypeplan_optimizer
        # train() has computed the steps by now (state.max_steps); a direct call before
        # train() gets a plan without them.
        plan = self.resolve_plan(self.state.max_steps)
        given = self.optimizer
        target = self.model if model is None else model
        assert target is not None, "the Trainer was given a model"
        names = {id(p): name for name, p in target.named_parameters()}
        # The model is readied before any optimizer sees its parameters: prepare_model keeps
        # their fp32 values for build (ZeRO-3 replaces them with FSDP2's sharded ones).
        prepared = plan.prepare_model(target)
        if "optimizer" in config_document(self.dtypeplan_config):
            trainable = [p for p in prepared.parameters() if p.requires_grad]
            optimizer = find_optimizer(plan.build(trainable))
        else:
            if given is None:
                self.optimizer = None
                given = super().create_optimizer(prepared)
            else:
                _point_at_prepared_parameters(given, names, prepared)
            optimizer = find_optimizer(plan.wrap(given))
        assert optimizer is not None, "build and wrap make dtypeplan optimizers"
        refuse_loss_scaling(optimizer, "DtypeplanTrainer")
        # Accelerate returns a model marked as prepared unchanged: no DDP (the optimizer
        # reduces), no autocast, no device move (a ZeRO-3 model lives on its mesh's device).
        setattr(prepared, "_is_accelerate_prepared", True)  # noqa: B010 - not a Module field
        self.model = self.model_wrapped = prepared
        self.plan, self.dtypeplan_optimizer, self.optimizer = plan, optimizer, optimizer
        return optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        if self.lr_scheduler is None and self.plan is not None:
            target = find_optimizer(optimizer if optimizer is not None else self.optimizer)
            scheduler = None if target is None else self.plan.build_scheduler(target)
            if scheduler is not None:
                self.lr_scheduler = scheduler  # type: ignore[assignment]
                self._created_lr_scheduler = True
                return scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    # --- clipping and the logged norm ----------------------------------------------------------
    def _owned_optimizer(self) -> MixedPrecisionOptimizer:
        optimizer = find_optimizer(self.optimizer)
        assert optimizer is not None, "create_optimizer builds the dtypeplan optimizer first"
        return optimizer

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        return self._owned_optimizer().clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> float:
        if grad_norm is None:  # max_grad_norm <= 0: the norm is logged, nothing is clipped
            grad_norm = self._owned_optimizer().clip_grad_norm_(float("inf"))
        return float(grad_norm)

    # --- checkpoints ---------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        optimizer = find_optimizer(self.optimizer)
        if optimizer is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        # Every rank writes its own shard (collective); rank 0 alone would write one shard.
        dtypeplan.checkpoint.save(optimizer, optimizer_dir(output_dir))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        optimizer = find_optimizer(self.optimizer)
        if checkpoint is None or optimizer is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        if not os.path.isdir(optimizer_dir(checkpoint)):
            raise FileNotFoundError(
                f"DtypeplanTrainer: {checkpoint} holds no {optimizer_dir(checkpoint)!r}: it was "
                "not written by DtypeplanTrainer, so the optimizer state cannot be resumed "
                "(resume from a DtypeplanTrainer checkpoint, or start without "
                "resume_from_checkpoint)"
            )
        dtypeplan.checkpoint.load(optimizer, optimizer_dir(checkpoint))
        scheduler_file = os.path.join(checkpoint, SCHEDULER_FILE)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        optimizer = find_optimizer(self.optimizer)
        if optimizer is None:
            super().save_model(output_dir, _internal_call)
            return
        output_dir = self.args.output_dir if output_dir is None else output_dir
        assert self.model is not None, "the optimizer exists, so the Trainer has its model"
        # Collective at ZeRO 1-3: every rank gathers, rank 0 keeps and writes.
        state = dtypeplan.checkpoint.export_model_state(optimizer, self.model, rank0_only=True)
        # Read before saving: save_pretrained empties the dict it writes.
        dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
        self._save(output_dir, state_dict=state)
        if self.args.should_save and output_dir is not None and len(dtypes) == 1:
            record_saved_dtype(output_dir, dtypes.pop())
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


# --- unedited scripts (``dtypeplan run``) ---------------------------------------------------------
_PATCHED = "_dtypeplan_takes_deepspeed"


def _config_value(value: Any) -> Any:
    """``--deepspeed``'s value as dtypeplan reads it: a dict or a path; a JSON text (which the
    HF integration also takes) as its dict."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        return json.loads(value)
    return value


_unedited_rules: str | None = None
"""The rules file of :func:`use_for_unedited_scripts` (``dtypeplan run --rules RULES``)."""


def use_for_unedited_scripts(rules: str | os.PathLike[str] | None = None) -> None:
    """Make this process's HF Trainer scripts train with dtypeplan, unedited: what
    ``dtypeplan run`` does in each rank before the script starts (idempotent; ``rules``, a
    rules file, replaces an earlier call's).

    * ``TrainingArguments`` (and every subclass: ``Seq2SeqTrainingArguments``, TRL's configs)
      take their ``deepspeed`` value (``--deepspeed ds_config.json``, or
      ``deepspeed=`` in code) as the dtypeplan config: it moves to ``args.dtypeplan_config``
      and ``args.deepspeed`` becomes None before ``__post_init__`` runs, so DeepSpeed is
      neither imported nor enabled; ``rules`` (``dtypeplan run --rules RULES``) goes to
      ``args.dtypeplan_rules``, the rules file the Trainer resolves the config with;
    * ``transformers.Trainer`` (also ``transformers.trainer.Trainer``) is
      :class:`DtypeplanTrainer`, and ``transformers.Seq2SeqTrainer`` a subclass of both;
      classes defined after this (a script's own ``class MyTrainer(Trainer)``, libraries
      imported later) inherit from it. A Trainer whose arguments hold no config refuses to
      start, naming ``--deepspeed``.
    """
    import transformers
    import transformers.trainer
    import transformers.trainer_seq2seq
    from transformers.training_args import TrainingArguments

    global _unedited_rules
    _unedited_rules = None if rules is None else os.fspath(rules)
    original = TrainingArguments.__post_init__
    if not getattr(original, _PATCHED, False):

        def __post_init__(self: Any) -> None:
            if self.deepspeed:
                setattr(self, ARGS_CONFIG, _config_value(self.deepspeed))
                self.deepspeed = None
            if _unedited_rules is not None:
                setattr(self, ARGS_RULES, _unedited_rules)
            original(self)

        setattr(__post_init__, _PATCHED, True)
        TrainingArguments.__post_init__ = __post_init__  # type: ignore[method-assign]

    transformers.Trainer = DtypeplanTrainer  # type: ignore[misc]
    transformers.trainer.Trainer = DtypeplanTrainer  # type: ignore[misc]
    seq2seq = transformers.trainer_seq2seq.Seq2SeqTrainer
    if not issubclass(seq2seq, DtypeplanTrainer):

        class Seq2SeqTrainer(DtypeplanTrainer, seq2seq):  # type: ignore[misc, valid-type]
            """``transformers.Seq2SeqTrainer`` on dtypeplan (``dtypeplan run``)."""

        Seq2SeqTrainer.__module__ = seq2seq.__module__
        transformers.Seq2SeqTrainer = Seq2SeqTrainer  # type: ignore[misc]
        transformers.trainer_seq2seq.Seq2SeqTrainer = Seq2SeqTrainer  # type: ignore[misc]
