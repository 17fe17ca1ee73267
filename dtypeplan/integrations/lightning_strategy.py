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
  hyperparameters) and its LR schedulers are pointed at the new one. fp16 plans are refused.
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

import os
import shutil
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy

import dtypeplan
from dtypeplan.errors import OptimizerUsageError
from dtypeplan.integrations._common import find_optimizer, optimizer_dir, refuse_loss_scaling
from dtypeplan.optimizers import MixedPrecisionOptimizer
from dtypeplan.resolver import PrecisionPlan

__all__ = ["DtypeplanPrecision", "DtypeplanStrategy"]

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
    values (see :func:`dtypeplan.resolve`); other keyword arguments go to ``DDPStrategy``.
    After setup ``strategy.plan`` is the resolved plan.
    """

    strategy_name = "dtypeplan"

    def __init__(
        self,
        config: Mapping[str, Any] | str | os.PathLike[str],
        *,
        auto: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("precision_plugin", DtypeplanPrecision())
        super().__init__(**kwargs)
        self.dtypeplan_config: dict[str, Any] | str | os.PathLike[str] = (
            dict(config) if isinstance(config, Mapping) else config
        )
        self.dtypeplan_auto = dict(auto or {})
        self.plan: PrecisionPlan | None = None
        self._checkpoint_path: str | None = None

    # --- setup ---------------------------------------------------------------------------------
    def configure_ddp(self) -> None:
        # Called by DDPStrategy.setup after the module moved to the device and before
        # configure_optimizers: ready it for the plan instead of wrapping it in DDP.
        self.plan = dtypeplan.resolve(self.dtypeplan_config, auto=self.dtypeplan_auto)
        assert self.model is not None
        self.model = self.plan.prepare_model(self.model)

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        assert self.plan is not None, "configure_ddp resolves the plan first"
        taken: list[Any] = []
        for optimizer in self.optimizers:
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
