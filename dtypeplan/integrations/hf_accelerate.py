"""Accelerate on a dtypeplan optimizer: ``DtypeplanAccelerator``, an ``Accelerator`` subclass.

A plain Accelerate loop changes in its first line only (``Accelerator()`` ->
``DtypeplanAccelerator()``) and builds its optimizer from the plan::

    accelerator = DtypeplanAccelerator(mixed_precision="bf16")   # the process group exists
    plan = accelerator.resolve("ds_config.json")    # "auto" filled as Accelerate means it
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

* ``mixed_precision`` (or ``accelerate launch --mixed_precision``) says which dtype the plan
  trains in, not an autocast: :meth:`DtypeplanAccelerator.resolve` fills the config's
  ``"auto"`` precision keys with it (and ``gradient_accumulation_steps``), Accelerate itself
  runs with ``mixed_precision="no"`` (no autocast, no GradScaler; ``accelerator.mixed_precision``
  reads ``"no"``, ``accelerator.dtypeplan_precision`` what it was told), and ``prepare`` refuses
  a plan whose parameters are in another dtype than the one it was told.
* ``mixed_precision="fp8"``: bf16 parameters, and the config's ``fp8`` block read from
  torchao's recipe (``AORecipeKwargs``' ``Float8LinearConfig``, or Accelerate's default), see
  :meth:`DtypeplanAccelerator.resolve`; dtypeplan converts the layers, not Accelerate.
* Launched as several processes on a machine without an accelerator (``torchrun``, or
  ``accelerate launch --multi_gpu --num_processes N``, which starts them through torchrun), it
  takes ``cpu=True`` unless told otherwise, so the run is distributed on gloo (Accelerate
  itself would see one process per rank). ``accelerate launch --cpu --num_processes N`` starts
  one process (Accelerate's several-CPU path is mpirun); a launcher's world that Accelerate
  does not see is refused.

* A ``DeepSpeedPlugin`` (``deepspeed_plugin=``, or what ``accelerate launch --use_deepspeed
  --deepspeed_config_file ds_config.json`` sets) is not run: its config is the plan's
  (``accelerator.resolve()`` with no argument), its ``gradient_accumulation_steps`` (a number)
  the accelerator's, as under Accelerate's DeepSpeed; DeepSpeed need not be installed.
* ``prepare`` does not wrap a model that dtypeplan optimizers train (one, or several prepared
  together: ``torch.optim.Muon`` on the matrices and AdamW on the rest) in
  DistributedDataParallel (the optimizers reduce), nor move it (``build`` fixed its device:
  move the model before ``plan.prepare_model``); it refuses fp16 plans (loss scaling in
  ``backward`` is not wired). A scheduler from ``plan.build_scheduler`` steps once
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
* ``get_state_dict(model)`` and ``save_model(model, dir)`` give the fp32 master weights by name
  at every stage (gathered: call them on every rank); an HF model's ``save_pretrained`` with
  that state dict records ``"dtype": "float32"`` in ``config.json``, so ``from_pretrained(dir)``
  reloads the masters in fp32.
"""

from __future__ import annotations

import inspect
import os
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import AORecipeKwargs

import dtypeplan
from dtypeplan._dtypes import dtype_name
from dtypeplan.errors import NotSupportedError, OptimizerUsageError, PrecisionConfigError
from dtypeplan.integrations._common import (
    fills_for_auto,
    find_optimizer,
    fp8_block_from_torchao,
    optimizer_dir,
    record_state_dtype_on_save,
    refuse_loss_scaling,
    stage_of,
    with_fp8_block,
)
from dtypeplan.optimizers import MixedPrecisionOptimizer
from dtypeplan.resolver import PrecisionPlan

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
        bound = inspect.signature(Accelerator.__init__).bind_partial(None, *args, **kwargs)
        settings = dict(bound.arguments)
        settings.pop("self", None)
        settings.update(settings.pop("kwargs", {}))
        requested = settings.get("mixed_precision")
        if requested is None:
            requested = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        self.dtypeplan_precision: str = str(getattr(requested, "value", requested)).lower()
        """What Accelerate was told (``mixed_precision=`` or ``accelerate launch
        --mixed_precision``): :meth:`resolve` fills the config's "auto" precision keys with it,
        and the parameters of a dtypeplan model are in that dtype (the plan casts them; no
        autocast runs)."""
        if self.dtypeplan_precision not in _PRECISION_FILLS:
            raise NotSupportedError(
                f"DtypeplanAccelerator(mixed_precision={self.dtypeplan_precision!r}): dtypeplan "
                f"plans take {sorted(_PRECISION_FILLS)} here"
            )
        self.dtypeplan_fp8_config: Any = None
        """torchao's ``Float8LinearConfig`` that ``mixed_precision="fp8"`` came with
        (``AORecipeKwargs``, or Accelerate's default one): :meth:`resolve` reads it into the
        config's ``fp8`` block; None without fp8."""
        if self.dtypeplan_precision == "fp8":
            handlers = list(settings.get("kwargs_handlers") or [])
            self.dtypeplan_fp8_config = _fp8_recipe_config(handlers)
            # dtypeplan converts the layers (plan.prepare_model); Accelerate would again.
            settings["kwargs_handlers"] = [h for h in handlers if not isinstance(h, AORecipeKwargs)]
        self.dtypeplan_deepspeed_config: dict[str, Any] | None = _deepspeed_plugin_config(settings)
        """The config of a ``DeepSpeedPlugin`` (``deepspeed_plugin=``, or ``accelerate launch
        --use_deepspeed --deepspeed_config_file ds.json``): what :meth:`resolve` resolves when
        given no config. DeepSpeed itself is not enabled (it need not be installed)."""
        if self.dtypeplan_deepspeed_config is not None:
            steps = self.dtypeplan_deepspeed_config.get("gradient_accumulation_steps")
            if isinstance(steps, int) and steps != settings.get("gradient_accumulation_steps", 1):
                # Accelerate's DeepSpeed path takes the config's value (and warns) as well.
                warnings.warn(
                    f"DtypeplanAccelerator: gradient accumulation steps: the DeepSpeed config "
                    f"has {steps}, the accelerator "
                    f"{settings.get('gradient_accumulation_steps', 1)}; using the config's",
                    stacklevel=2,
                )
                settings["gradient_accumulation_steps"] = steps
        # The plan decides every dtype: Accelerate runs no autocast and no GradScaler.
        settings["mixed_precision"] = "no"
        if "cpu" not in settings and _launched_on_cpu():
            # Accelerate takes a multi-process CPU run for a single process unless told cpu=True
            # (its launcher says so only for its mpirun path): torchrun and accelerate launch
            # --multi_gpu on a machine without an accelerator would train undistributed.
            settings["cpu"] = True
        super().__init__(**settings)
        launched = _launched_world_size()
        if launched > 1 and self.num_processes != launched:
            raise OptimizerUsageError(
                f"DtypeplanAccelerator: the launcher started {launched} processes "
                f"(WORLD_SIZE={launched}) but Accelerate sees {self.num_processes} "
                f"({self.distributed_type}); each would train alone on the whole data. On CPU "
                "pass cpu=True (or leave cpu unset: it is chosen when no accelerator is present)"
            )
        self._dtypeplan_models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._dtypeplan_owner: dict[int, MixedPrecisionOptimizer] = {}
        """Trainable parameter id -> the dtypeplan optimizer that owns it."""

    # --- the plan ------------------------------------------------------------------------------
    def resolve(
        self, config: Mapping[str, Any] | str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> PrecisionPlan:
        """:func:`dtypeplan.resolve` with the config's ``"auto"`` values filled as Accelerate
        means them: the precision keys from ``mixed_precision`` (``"bf16"`` fills
        ``bf16.enabled`` true and ``fp16.enabled`` false), ``gradient_accumulation_steps`` from
        the accelerator's, then whatever ``auto=`` gives. ``mixed_precision="fp8"`` fills them
        as ``"bf16"`` does and gives the config its ``fp8`` block from torchao's recipe
        (``AORecipeKwargs(config=Float8LinearConfig.from_recipe_name(...))``, or Accelerate's
        default: tensorwise, the fp8 all-gather at ZeRO-3), keys the config's own block sets
        kept where they agree. Keyword arguments are :func:`dtypeplan.resolve`'s (``rules=``:
        a rules file instead of the shipped table). Without ``config``: the config of the
        ``DeepSpeedPlugin`` the accelerator was given."""
        if config is None:
            config = self.dtypeplan_deepspeed_config
            if config is None:
                raise ValueError(
                    "DtypeplanAccelerator.resolve(): no config given and no DeepSpeedPlugin "
                    "(deepspeed_plugin=, or accelerate launch --use_deepspeed "
                    "--deepspeed_config_file); pass the config (a dict or a .json/.yaml path)"
                )
        document = dict(config) if isinstance(config, Mapping) else config
        if self.dtypeplan_fp8_config is not None:
            source = "DtypeplanAccelerator(mixed_precision='fp8')"
            block = fp8_block_from_torchao(
                self.dtypeplan_fp8_config, all_gather_fp8=stage_of(document) == 3, source=source
            )
            document = with_fp8_block(document, block, source)
        told = {
            **_PRECISION_FILLS[self.dtypeplan_precision],
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }
        auto = {**fills_for_auto(document, told), **dict(kwargs.pop("auto", None) or {})}
        return dtypeplan.resolve(document, auto=auto, **kwargs)

    # --- prepare -------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        optimizers = [o for o in (find_optimizer(a) for a in args) if o is not None]
        for optimizer in optimizers:
            refuse_loss_scaling(optimizer, "DtypeplanAccelerator")
            self._check_precision(optimizer)
            for param in optimizer.trainable_parameters():
                self._dtypeplan_owner[id(param)] = optimizer
        for arg in args:
            if isinstance(arg, torch.nn.Module) and self._trained_by_dtypeplan(arg):
                self._dtypeplan_models.add(arg)
        return super().prepare(*args, device_placement=device_placement)

    def _check_precision(self, optimizer: MixedPrecisionOptimizer) -> None:
        """The plan's parameters are in the dtype Accelerate was told (when told one)."""
        told = self.dtypeplan_precision
        if told == "no":
            return
        if told == "fp8":
            if not optimizer.plan.fp8:
                raise PrecisionConfigError(
                    "DtypeplanAccelerator(mixed_precision='fp8') but the plan computes without "
                    "fp8: resolve the config with accelerator.resolve(config), which gives it "
                    "the fp8 block of the recipe, or set the block yourself"
                )
            told = "bf16"  # Accelerate's fp8 runs the rest of the model in bf16
        shown = dtype_name(optimizer.plan.param_dtype)
        if shown != told:
            raise PrecisionConfigError(
                f"DtypeplanAccelerator(mixed_precision={told!r}) but the plan trains {shown} "
                f'parameters: set {told}.enabled to true in the config, or to "auto" and '
                "resolve it with accelerator.resolve(config), which fills it from "
                "mixed_precision"
            )

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
            record_state_dtype_on_save(model)
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

    def _trained_by_dtypeplan(self, model: torch.nn.Module) -> bool:
        """Whether dtypeplan optimizers (one, or several: ``torch.optim.Muon`` on the matrices
        and AdamW on the rest) train every trainable parameter of ``model``: they reduce its
        gradients, so no DistributedDataParallel wraps it."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        return bool(trainable) and all(id(p) in self._dtypeplan_owner for p in trainable)

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
                "optimizer.clip_grad_norm_(max_norm)). A model trained by several optimizers "
                "(torch.optim.Muon on the matrices, AdamW on the rest) is clipped per optimizer "
                '(optimizer.clip_grad_norm_ on each), or by one: DeepSpeed\'s "Muon" type '
                "in the config runs both"
            )
        return optimizer.clip_grad_norm_(max_norm, norm_type)

    # --- model weights -------------------------------------------------------------------------
    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """A dtypeplan model's weights are the fp32 master weights by name, every tensor full
        (:func:`dtypeplan.checkpoint.export_model_state`: gathered, so call it on every rank,
        as ``save_model`` is); other models' as Accelerate gives them."""
        inner = self.unwrap_model(model)
        owner = self._owning_optimizer(inner)
        if owner is None:
            return dict(super().get_state_dict(model, unwrap))
        return _untied(dtypeplan.checkpoint.export_model_state(owner, inner))

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


_PRECISION_FILLS: dict[str, dict[str, bool]] = {
    "no": {"bf16.enabled": False, "fp16.enabled": False},
    "bf16": {"bf16.enabled": True, "fp16.enabled": False},
    "fp16": {"bf16.enabled": False, "fp16.enabled": True},
    "fp8": {"bf16.enabled": True, "fp16.enabled": False},
}
"""Accelerate's ``mixed_precision`` as the config's precision keys (fp8: bf16 parameters, the
eligible linear layers computing in fp8: the ``fp8`` block, :func:`_fp8_recipe_config`)."""


def _fp8_recipe_config(handlers: list[Any]) -> Any:
    """torchao's ``Float8LinearConfig`` of Accelerate's fp8 with these ``kwargs_handlers``:
    ``AORecipeKwargs``' config, or the one Accelerate makes without it (``AORecipeKwargs()``:
    tensorwise, padded inner dimensions, the FSDP2 fp8 all-gather; its ``ACCELERATE_FP8_*``
    environment read). Transformer Engine's and MS-AMP's recipes are refused: dtypeplan's fp8
    compute is torchao's, and those libraries' modules and scaling have no block here."""
    from accelerate.utils import AORecipeKwargs

    others = [type(h).__name__ for h in handlers if type(h).__name__ in _OTHER_FP8_RECIPES]
    backend = os.environ.get("ACCELERATE_FP8_BACKEND", "AO").upper()
    if others or backend not in ("AO", "NO"):
        raise NotSupportedError(
            "DtypeplanAccelerator(mixed_precision='fp8'): dtypeplan computes fp8 with torchao "
            f"(AORecipeKwargs), not {', '.join(others) or 'ACCELERATE_FP8_BACKEND=' + backend}, "
            "whose modules and scaling no dtypeplan plan describes; pass "
            "AORecipeKwargs(config=Float8LinearConfig.from_recipe_name(...)) or none"
        )
    found = [h for h in handlers if isinstance(h, AORecipeKwargs)]
    handler = found[0] if found else AORecipeKwargs()
    if handler.module_filter_func is not None:
        raise NotSupportedError(
            "DtypeplanAccelerator(mixed_precision='fp8'): AORecipeKwargs(module_filter_func=...) "
            "is a function dtypeplan cannot state in a plan; name the layers to leave in bf16 "
            'in the config\'s "fp8": {"exclude_modules": [names or patterns]}'
        )
    return handler.config


_OTHER_FP8_RECIPES = ("TERecipeKwargs", "MSAMPRecipeKwargs")


def _deepspeed_plugin_config(settings: dict[str, Any]) -> dict[str, Any] | None:
    """Take the ``DeepSpeedPlugin`` out of the accelerator's ``settings`` (``deepspeed_plugin``
    or ``deepspeed_plugins``, else the one ``accelerate launch --use_deepspeed`` describes in
    the environment) and return its config; None without one. Accelerate would run DeepSpeed's
    engine around the optimizer: here the config is the plan's, so Accelerate's switch
    (``ACCELERATE_USE_DEEPSPEED``) is turned off for this process."""
    from accelerate.utils import DeepSpeedPlugin

    plugin = settings.pop("deepspeed_plugin", None)
    plugins = settings.pop("deepspeed_plugins", None)
    plugin = plugin if plugin is not None else plugins
    if isinstance(plugin, Mapping):
        if len(plugin) != 1:
            raise NotSupportedError(
                f"DtypeplanAccelerator: {len(plugin)} DeepSpeed plugins ({sorted(plugin)}); a "
                "dtypeplan accelerator trains with one config: pass one plugin, or the config "
                "to accelerator.resolve(config)"
            )
        (plugin,) = plugin.values()
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        if plugin is None:
            plugin = DeepSpeedPlugin()  # reads ACCELERATE_DEEPSPEED_CONFIG_FILE and the rest
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"
    if plugin is None:
        return None
    return dict(plugin.deepspeed_config)


def _launched_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _launched_on_cpu() -> bool:
    """Several processes started by a launcher on a machine without an accelerator."""
    several = _launched_world_size() > 1 or "LOCAL_RANK" in os.environ
    return several and not torch.accelerator.is_available()


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied names keep their own tensor: safetensors refuses (and Accelerate drops) names that
    share memory, and a model file should hold every name."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        out[name] = tensor.clone() if id(tensor) in seen else tensor
        seen.add(id(tensor))
    return out
