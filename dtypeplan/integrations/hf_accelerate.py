"""Accelerate on a dtypeplan optimizer: ``DtypeplanAccelerator``, an ``Accelerator`` subclass.

A plain Accelerate loop changes in its first line only (``Accelerator()`` ->
``DtypeplanAccelerator()``) and builds its optimizer from the plan::

    accelerator = DtypeplanAccelerator()            # the process group exists from here on
    plan = dtypeplan.resolve("ds_config.json")
    model = plan.prepare_model(model)
    optimizer = plan.build(model.parameters())
    scheduler = plan.build_scheduler(optimizer)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        accelerator.backward(model(**batch).loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")                   # on every rank; load_state("ckpt") resumes

What it changes in Accelerate, for the models and optimizers handed to ``prepare`` together:

* ``prepare`` does not wrap a model that a dtypeplan optimizer trains in
  DistributedDataParallel (the optimizer reduces), nor move it (``build`` fixed its device:
  move the model before ``plan.prepare_model``); it refuses Accelerate's
  ``mixed_precision`` with such an optimizer (the plan decides every dtype; autocast over
  bf16 parameters is not the plan) and fp16 plans (loss scaling in ``backward`` is not
  wired). A scheduler from ``plan.build_scheduler`` steps once
  per optimizer step, as DeepSpeed steps it (Accelerate steps others once per process).
* ``clip_grad_norm_(model.parameters(), max_norm)`` clips through the optimizer
  (``optimizer.clip_grad_norm_``) and returns the global norm before clipping; a strict subset
  of the optimizer's parameters is refused (it clips the global norm of all of them).
* ``save_state`` / ``load_state``: each dtypeplan optimizer is written with
  :func:`dtypeplan.checkpoint.save` by every rank into ``<dir>/dtypeplan_optimizer`` (``_1``,
  ... for more) instead of Accelerate's rank-0 ``optimizer.bin``, and read back with
  :func:`dtypeplan.checkpoint.load`; the model file holds the fp32 master weights by name
  (:func:`dtypeplan.checkpoint.export_model_state`, in safetensors by default) and
  ``load_state`` takes the weights from the optimizer checkpoint (bitwise, every stage).
  Schedulers, RNG states, samplers and registered objects are Accelerate's as usual.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler

import dtypeplan
from dtypeplan.errors import NotSupportedError, OptimizerUsageError
from dtypeplan.integrations._common import find_optimizer, optimizer_dir, refuse_loss_scaling
from dtypeplan.optimizers import MixedPrecisionOptimizer

__all__ = ["DtypeplanAccelerator"]


class DtypeplanAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` that drives dtypeplan optimizers (see the module
    docstring); takes every ``Accelerator`` argument. Models and optimizers that are not
    dtypeplan's are prepared as ``Accelerator`` prepares them."""

    # Accelerator's own lists of what prepare() returned (untyped upstream).
    _models: list[Any]
    _optimizers: list[Any]
    _schedulers: list[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dtypeplan_models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._dtypeplan_owner: dict[int, MixedPrecisionOptimizer] = {}
        """Trainable parameter id -> the dtypeplan optimizer that owns it."""

    # --- prepare -------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        optimizers = [o for o in (find_optimizer(a) for a in args) if o is not None]
        for optimizer in optimizers:
            refuse_loss_scaling(optimizer, "DtypeplanAccelerator")
            if self.native_amp or self.scaler is not None:
                raise ValueError(
                    f"DtypeplanAccelerator(mixed_precision={self.mixed_precision!r}): Accelerate "
                    "would run the forward under autocast (and a GradScaler), which the plan "
                    "does not expect; the plan decides every dtype. Use "
                    'mixed_precision="no" and set bf16 in the dtypeplan config'
                )
            for param in optimizer.trainable_parameters():
                self._dtypeplan_owner[id(param)] = optimizer
        for arg in args:
            if isinstance(arg, torch.nn.Module) and self._owning_optimizer(arg) is not None:
                self._dtypeplan_models.add(arg)
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        if model in self._dtypeplan_models:
            # evaluation_mode skips only the DistributedDataParallel wrapper (torch.compile,
            # if configured, still applies); the optimizer reduces the gradients itself.
            evaluation_mode = True
            # The optimizer's buffers fixed the device at build. Accelerate's device is
            # "cpu:0" on CPU ranks, and .to() to it copies every parameter out of the flat
            # buffer: a checkpoint loaded before the next step would then not reach them.
            device_placement = False
        prepared: torch.nn.Module = super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> Any:
        optimizer = find_optimizer(getattr(scheduler, "optimizer", None))
        if optimizer is None or not type(scheduler).__module__.startswith("dtypeplan."):
            return super().prepare_scheduler(scheduler)
        # A DeepSpeed schedule counts optimizer steps (DeepSpeed's engine steps it once per
        # step); Accelerate would step it once per process.
        wrapped = next((o for o in self._optimizers if find_optimizer(o) is optimizer), optimizer)
        prepared = AcceleratedScheduler(
            scheduler, wrapped, step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=True,
        )  # fmt: skip
        self._schedulers.append(prepared)
        return prepared

    def _owning_optimizer(self, model: torch.nn.Module) -> MixedPrecisionOptimizer | None:
        """The dtypeplan optimizer that trains every trainable parameter of ``model``."""
        owners = {
            id(self._dtypeplan_owner.get(id(p))) for p in model.parameters() if p.requires_grad
        }
        found = [self._dtypeplan_owner.get(id(p)) for p in model.parameters() if p.requires_grad]
        if len(owners) != 1 or found[0] is None:
            return None
        return found[0]

    # --- clipping ------------------------------------------------------------------------------
    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor] | torch.Tensor,
        max_norm: float,
        norm_type: float = 2,
    ) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        owners = {
            id(self._dtypeplan_owner.get(id(p))): self._dtypeplan_owner.get(id(p)) for p in params
        }
        if list(owners.values()) == [None]:
            return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        optimizer = next(iter(owners.values()))
        given = {id(p) for p in params}
        if (
            len(owners) != 1
            or optimizer is None
            or any(id(p) not in given for p in optimizer.trainable_parameters())
        ):
            raise OptimizerUsageError(
                "DtypeplanAccelerator.clip_grad_norm_: the parameters given are not all the "
                "parameters of one dtypeplan optimizer; it clips the global norm of all of its "
                "parameters at once, so pass model.parameters() (or call "
                "optimizer.clip_grad_norm_(max_norm))"
            )
        return optimizer.clip_grad_norm_(max_norm, norm_type)

    # --- checkpoints ---------------------------------------------------------------------------
    def _dtypeplan_optimizers(self) -> list[MixedPrecisionOptimizer]:
        return [o for o in (find_optimizer(x) for x in self._optimizers) if o is not None]

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        owned = self._dtypeplan_optimizers()
        if not owned:
            return str(super().save_state(output_dir, safe_serialization, **kwargs))

        def write_optimizers(models: list[Any], weights: list[Any], directory: str) -> None:
            # Runs on every rank, before Accelerate writes (rank 0) the model files.
            for index, optimizer in enumerate(owned):
                dtypeplan.checkpoint.save(optimizer, optimizer_dir(directory, index))
            for i, model in enumerate(models):
                owner = self._owning_optimizer(self.unwrap_model(model))
                if owner is not None:
                    weights[i] = _untied(
                        dtypeplan.checkpoint.export_model_state(
                            owner, self.unwrap_model(model), rank0_only=True
                        )
                    )

        handle = self.register_save_state_pre_hook(write_optimizers)
        kept: list[Any] = self._optimizers
        self._optimizers = [o for o in kept if find_optimizer(o) is None]
        try:
            return str(super().save_state(output_dir, safe_serialization, **kwargs))
        finally:
            self._optimizers = kept
            handle.remove()

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        owned = self._dtypeplan_optimizers()
        if not owned:
            super().load_state(input_dir, load_kwargs, **kwargs)
            return
        models: list[Any] = self._models
        optimizers: list[Any] = self._optimizers
        plain_models = [m for m in models if self._owning_optimizer(self.unwrap_model(m)) is None]
        if plain_models and len(plain_models) != len(models):
            raise NotSupportedError(
                "DtypeplanAccelerator.load_state: Accelerate numbers the model files by position, "
                "and this accelerator holds dtypeplan models next to others; prepare them with "
                "separate accelerators, or load the others yourself"
            )
        found: list[str] = []

        def remember(models: list[Any], directory: str) -> None:
            found.append(directory)

        handle = self.register_load_state_pre_hook(remember)
        # The model files hold the fp32 masters; the optimizer checkpoint writes the same
        # values into the parameters (and the masters, which a model load would round).
        self._models = plain_models
        self._optimizers = [o for o in optimizers if find_optimizer(o) is None]
        try:
            super().load_state(input_dir, load_kwargs, **kwargs)
        finally:
            self._models, self._optimizers = models, optimizers
            handle.remove()
        directory = found[0] if found else os.fspath(input_dir or "")
        for index, optimizer in enumerate(owned):
            dtypeplan.checkpoint.load(optimizer, optimizer_dir(directory, index))


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied names keep their own tensor: safetensors refuses (and Accelerate drops) names that
    share memory, and a model file should hold every name."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        out[name] = tensor.clone() if id(tensor) in seen else tensor
        seen.add(id(tensor))
    return out
