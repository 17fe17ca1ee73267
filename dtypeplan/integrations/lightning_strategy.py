"""Lightning on a dtypeplan optimizer: ``DtypeplanStrategy``, a Lightning ``Strategy``.

As Lightning's DeepSpeed and FSDP strategies, it takes the config and owns what the framework
would otherwise do with the model and the optimizer::

    trainer = lightning.Trainer(strategy=DtypeplanStrategy("ds_config.json"), ...)
    trainer.fit(module)                           # trainer.fit(module, ckpt_path=...) resumes

It is Lightning's ``DDPStrategy`` (process group, launcher, samplers, collectives) with these
changes, and works with automatic and manual optimization:

* setup readies the ``LightningModule`` with ``plan.prepare_model`` (one dtype; ZeRO-3 shards
  it with FSDP2) after moving it to the device, and does not wrap it in DDP (the optimizer
  reduces the gradients itself). ``configure_optimizers`` runs after that, on the readied
  parameters; each optimizer it returns is taken over with ``plan.wrap`` (class, param groups,
  hyperparameters) and its LR schedulers are pointed at the new one. ``configure_optimizers``
  returning None trains with the config's ``optimizer`` block (DeepSpeed's types: ``"Muon"``,
  ``"Lion"``, ...) on the module's trainable parameters, as Lightning's DeepSpeedStrategy
  does. fp16 plans are refused.
* ``lightning.Trainer(precision=...)`` ("bf16-true" or "bf16-mixed", "32-true", ...) fills the
  config's ``"auto"`` precision keys: the plan's parameters are in that dtype, no autocast
  runs, and a config that says another dtype than a 16-bit flag is refused. ``strategy.plan``
  is, after setup, the plan of the optimizer that runs: ``configure_optimizers``' class and
  hyperparameters (not the config's ``optimizer`` block), and no config scheduler (Lightning
  steps ``configure_optimizers``' schedulers; a plan warning says so).
* fp8: a module that converts its own layers with torchao (``convert_to_float8_training`` in
  ``configure_model``) gives the config the ``fp8`` block of their recipe, and
  ``prepare_model`` takes the layers as they are; ``precision="transformer-engine"`` is
  refused (Transformer Engine's modules and scaling are no dtypeplan plan).
* the precision plugin is a plain 32-bit one (the plan decides every dtype: no autocast, no
  cast by Lightning); ``gradient_clip_val`` (and ``self.clip_gradients`` under manual
  optimization) clips through ``optimizer.clip_grad_norm_``; the norm is the optimizer's
  ``grad_norm`` after the step (log it from there). Clipping by value is refused.
* checkpoints: the optimizer state goes through :func:`dtypeplan.checkpoint.save` on every
  rank into ``<file>.dtypeplan/dtypeplan_optimizer`` beside Lightning's file, and is read back
  with :func:`dtypeplan.checkpoint.load`; the file's ``state_dict`` holds the fp32 master
  weights by name (and the buffers), so it loads into the module before the plan readies it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy

import dtypeplan
from dtypeplan._dtypes import dtype_name
from dtypeplan.errors import NotSupportedError, OptimizerUsageError, PrecisionConfigError
from dtypeplan.integrations._common import (
    config_document,
    fills_for_auto,
    find_optimizer,
    fp8_block_from_torchao,
    optimizer_dir,
    refuse_loss_scaling,
    stage_of,
    with_fp8_block,
)
from dtypeplan.optimizers import MixedPrecisionOptimizer
from dtypeplan.resolver import PrecisionPlan

__all__ = ["DtypeplanPrecision", "DtypeplanStrategy"]

_PRECISION_FILLS: dict[str, dict[str, bool]] = {
    "fp32": {"bf16.enabled": False, "fp16.enabled": False},
    "bf16": {"bf16.enabled": True, "fp16.enabled": False},
    "fp16": {"bf16.enabled": False, "fp16.enabled": True},
}
_LIGHTNING_PRECISION = {
    "32-true": "fp32", "32": "fp32",
    "bf16-true": "bf16", "bf16-mixed": "bf16", "bf16": "bf16",
    "16-true": "fp16", "16-mixed": "fp16", "16": "fp16",
}  # fmt: skip
"""Lightning's precision flags as the dtype of the plan's parameters (the plan decides every
dtype: "-mixed" runs no autocast here, the parameters are in that dtype)."""

CHECKPOINT_SUFFIX = ".dtypeplan"
"""The directory beside a Lightning checkpoint file that holds its dtypeplan optimizers."""


class DtypeplanPrecision(Precision):
    """Lightning's 32-bit precision plugin (no cast, no autocast: the plan decides), clipping
    through the dtypeplan optimizer."""

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        owned = find_optimizer(optimizer)
        if owned is None:
            super().clip_grad_by_norm(optimizer, clip_val)
            return
        owned.clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        if find_optimizer(optimizer) is None:
            super().clip_grad_by_value(optimizer, clip_val)
            return
        raise OptimizerUsageError(
            "DtypeplanStrategy: gradient_clip_algorithm='value' would clamp each gradient "
            "element, but the gradients live in the optimizer's buffers; use "
            "gradient_clip_algorithm='norm' (the global L2 norm) or gradient_clipping in the "
            "config"
        )


class DtypeplanStrategy(DDPStrategy):
    """Lightning's DDP strategy with a dtypeplan optimizer (see the module docstring).

    ``config`` is a DeepSpeed-style config (dict or path); ``auto`` fills its ``"auto"``
    values and ``rules`` is the rules file it is resolved with (see :func:`dtypeplan.resolve`;
    None: the shipped table); other keyword arguments go to ``DDPStrategy``. After setup
    ``strategy.plan`` is the resolved plan.
    """

    strategy_name = "dtypeplan"

    def __init__(
        self,
        config: Mapping[str, Any] | str | os.PathLike[str],
        *,
        auto: Mapping[str, Any] | None = None,
        rules: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("precision_plugin", DtypeplanPrecision())
        super().__init__(**kwargs)
        self.dtypeplan_config: dict[str, Any] | str | os.PathLike[str] = (
            dict(config) if isinstance(config, Mapping) else config
        )
        self.dtypeplan_auto = dict(auto or {})
        self.dtypeplan_rules = rules
        self.plan: PrecisionPlan | None = None
        self._checkpoint_path: str | None = None
        self._replaced_config_optimizer = False
        """Whether ``configure_optimizers`` returned an optimizer although the config has an
        ``optimizer`` block (the plan's warnings say which runs)."""

    # --- setup ---------------------------------------------------------------------------------
    def configure_ddp(self) -> None:
        # Called by DDPStrategy.setup after the module moved to the device and before
        # configure_optimizers: ready it for the plan instead of wrapping it in DDP.
        told = self._told_precision()
        told_fills = fills_for_auto(self.dtypeplan_config, _PRECISION_FILLS[told])
        auto = {**told_fills, **self.dtypeplan_auto}
        assert self.model is not None
        self.plan = dtypeplan.resolve(
            self._config_with_fp8_of(self.model), auto=auto, rules=self.dtypeplan_rules
        )
        shown = dtype_name(self.plan.param_dtype)
        if told != "fp32" and shown != told:
            raise PrecisionConfigError(
                f"DtypeplanStrategy: lightning.Trainer(precision=...) asks for {told} but the "
                f'plan trains {shown} parameters: set {told}.enabled to true (or "auto") in '
                "the config"
            )
        assert self.model is not None
        self.model = self.plan.prepare_model(self.model)

    def _config_with_fp8_of(self, model: torch.nn.Module) -> Any:
        """The config, with the ``fp8`` block of the torchao ``Float8Linear`` layers the
        module converted itself (Lightning's fp8 recipe: ``convert_to_float8_training`` in
        ``configure_model``), which ``prepare_model`` then takes as they are."""
        import sys

        float8 = sys.modules.get("torchao.float8.float8_linear")
        configs = (
            {
                repr(m.config): m.config
                for m in model.modules()
                if isinstance(m, float8.Float8Linear)
            }
            if float8 is not None
            else {}
        )
        if not configs:
            return self.dtypeplan_config
        source = "DtypeplanStrategy: the module's Float8Linear layers"
        if len(configs) > 1:
            raise NotSupportedError(
                f"{source} were converted with {len(configs)} different torchao configs; a "
                "plan has one fp8 recipe: convert them with one"
            )
        (config,) = configs.values()
        stage = stage_of(self.dtypeplan_config)
        block = fp8_block_from_torchao(config, all_gather_fp8=stage == 3, source=source)
        # A converted layer keeps its own emulate: the plan must compute as it does.
        block["emulate"] = bool(config.emulate)
        return with_fp8_block(self.dtypeplan_config, block, source)

    def _told_precision(self) -> str:
        """The dtype ``lightning.Trainer(precision=...)`` asked for: it fills the config's
        ``"auto"`` precision keys (the plan's parameters are in it; no autocast runs)."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        # The Trainer keeps the flag on its connector only: the strategy's own precision
        # plugin (DtypeplanPrecision, 32-bit, no autocast) replaced the one it would make.
        connector = getattr(trainer, "_accelerator_connector", None)
        flag = str(getattr(connector, "_precision_flag", "32-true"))
        told = _LIGHTNING_PRECISION.get(flag)
        if flag.startswith("transformer-engine"):
            raise NotSupportedError(
                f"DtypeplanStrategy: lightning.Trainer(precision={flag!r}) computes in fp8 with "
                "Transformer Engine's own modules and its delayed-scaling recipe, which no "
                "dtypeplan plan describes (dtypeplan's fp8 compute is torchao's float8 and MX "
                "training): use precision='bf16-true' with the config's fp8 block (e.g. "
                '"fp8": {"enabled": true, "recipe": "tensorwise"}), or convert the layers with '
                "torchao's convert_to_float8_training in configure_model"
            )
        if told is None:
            raise NotSupportedError(
                f"DtypeplanStrategy: lightning.Trainer(precision={flag!r}) has no dtypeplan "
                f"plan; use one of {sorted(_LIGHTNING_PRECISION)}"
            )
        return told

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        assert self.plan is not None, "configure_ddp resolves the plan first"
        taken: list[Any] = []
        self._replaced_config_optimizer = False
        for optimizer in self.optimizers:
            if isinstance(optimizer, _MockOptimizer):
                # configure_optimizers returned None: the config's optimizer block trains the
                # module, as under Lightning's DeepSpeedStrategy (none: nothing trains, as
                # Lightning warned).
                taken.append(self._config_optimizer() or optimizer)
                continue
            self._replaced_config_optimizer = "optimizer" in config_document(self.dtypeplan_config)
            if find_optimizer(optimizer) is not None:
                taken.append(optimizer)
                continue
            wrapped = find_optimizer(self.plan.wrap(optimizer))
            assert wrapped is not None, "plan.wrap makes a dtypeplan optimizer"
            refuse_loss_scaling(wrapped, "DtypeplanStrategy")
            for config in self.lr_scheduler_configs:
                if getattr(config.scheduler, "optimizer", None) is optimizer:
                    config.scheduler.optimizer = wrapped
            taken.append(wrapped)
        self.optimizers = taken
        self.plan = self._plan_that_runs()

    def _config_optimizer(self) -> MixedPrecisionOptimizer | None:
        """The config's ``optimizer`` block on the module's trainable parameters (None: the
        config has none)."""
        assert self.plan is not None and self.model is not None
        if "optimizer" not in config_document(self.dtypeplan_config):
            return None
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        built = find_optimizer(self.plan.build(trainable))
        assert built is not None, "build makes a dtypeplan optimizer"
        refuse_loss_scaling(built, "DtypeplanStrategy")
        return built

    def _plan_that_runs(self) -> PrecisionPlan:
        """The plan as ``explain()`` should tell it: the optimizer ``configure_optimizers``
        made (its class and hyperparameters, which replace the config's ``optimizer`` block),
        and its schedulers, not the config's ``scheduler`` block, which Lightning does not
        step."""
        assert self.plan is not None
        owned = self._owned()
        plan = owned[0].plan if len(owned) == 1 else self.plan
        notes = []
        if self._replaced_config_optimizer:
            notes.append(
                "optimizer: the config's optimizer block is replaced by the optimizer "
                "configure_optimizers returns (Lightning's DeepSpeedStrategy runs the config's: "
                "return None from configure_optimizers to run it here)"
            )
        if plan.scheduler is not None:
            notes.append(
                "scheduler: the config's scheduler block is not run under Lightning; the "
                "schedulers configure_optimizers returns are (none: a constant learning rate)"
                if not self.lr_scheduler_configs
                else "scheduler: the config's scheduler block is not run under Lightning; the "
                "schedulers configure_optimizers returns are"
            )
        if not notes:
            return plan
        return dataclasses.replace(plan, scheduler=None, warnings=(*plan.warnings, *notes))

    def _owned(self) -> list[MixedPrecisionOptimizer]:
        return [o for o in (find_optimizer(x) for x in self.optimizers) if o is not None]

    # --- checkpoints ---------------------------------------------------------------------------
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if find_optimizer(optimizer) is None:
            return dict(super().optimizer_state(optimizer))
        # The state is in the dtypeplan.checkpoint directory beside the file (every rank's
        # shard); Lightning's file keeps only where it is.
        return {"dtypeplan": CHECKPOINT_SUFFIX}

    def lightning_module_state_dict(self) -> dict[str, Any]:
        owned = self._owned()
        module = self.lightning_module
        if len(owned) != 1 or module is None:
            return dict(super().lightning_module_state_dict())
        # Collective at ZeRO 1-3: Lightning builds the checkpoint on every rank.
        weights = dtypeplan.checkpoint.export_model_state(owned[0], module, rank0_only=True)
        if not weights:
            return {}
        names = set(weights)
        buffers = {
            name: value.detach().cpu().clone()
            for name, value in module.state_dict().items()
            if name not in names and isinstance(value, torch.Tensor)
        }
        return {**buffers, **weights}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        for index, optimizer in enumerate(self._owned()):
            target = optimizer_dir(os.fspath(filepath) + CHECKPOINT_SUFFIX, index)
            dtypeplan.checkpoint.save(optimizer, target)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            shutil.rmtree(os.fspath(filepath) + CHECKPOINT_SUFFIX, ignore_errors=True)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        self._checkpoint_path = os.fspath(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        owned = self._owned()
        if not owned:
            super().load_optimizer_state_dict(checkpoint)
            return
        if self._checkpoint_path is None:
            raise OptimizerUsageError(
                "DtypeplanStrategy: the optimizer state is restored from the directory beside "
                "the checkpoint file, and no file was loaded through this strategy"
            )
        for index, optimizer in enumerate(owned):
            target = optimizer_dir(self._checkpoint_path + CHECKPOINT_SUFFIX, index)
            dtypeplan.checkpoint.load(optimizer, target)
