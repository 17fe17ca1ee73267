"""The resolved precision plan: inert, hashable data saying exactly what will run.

The plan holds effective values only (``check_nonfinite`` is True under fp16, which always
checks; ``loss_scaling`` is None without fp16), so ``explain()`` and the optimizer read one
derivation; the text of ``explain()`` is written by ``_explain.py``. The table's dimensions are
held once, as the point (:attr:`PrecisionPlan.point`); each dimension's record
(``_dimensions.py``) names the plan attributes derived from its value (``param_dtype``,
``master_dtype``, ``offload_optimizer``, ...), which are generated here. It imports nothing of
``dtypeplan.optimizers``: :meth:`PrecisionPlan.build` and :meth:`PrecisionPlan.prepare_model`
call the builder that ``dtypeplan/_api.py`` installs with :func:`install_builder`
(``dtypeplan.optimizers.build_optimizer`` / ``prepare_model``, as torchtitan's
``build_optimizers``). Imports so run one way, optimizers -> resolver, and ``_api.py``, which
imports both, is the one place the two layers are joined; a plan that builds before anything
imported it (a plan unpickled on a spawned rank) loads it by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from dtypeplan import schedulers
from dtypeplan._autocast import DeviceLike, autocast_context
from dtypeplan._dtypes import DTYPE_NAMES, DTYPES
from dtypeplan.comm._groups import check_shard_group_size
from dtypeplan.errors import NotSupportedError, PrecisionConfigError
from dtypeplan.resolver._auto import AutoValue
from dtypeplan.resolver._batch import (
    AccumulationSteps,
    accumulation_steps,
    batch_size_mismatch,
    counted_sizes,
)
from dtypeplan.resolver._client_optimizer import client_optimizer_config
from dtypeplan.resolver._config import LossScaleConfig, OptimizerConfig, PrecisionConfig
from dtypeplan.resolver._dimensions import DIMENSIONS
from dtypeplan.resolver._explain import explain
from dtypeplan.resolver._frozen import FrozenDict
from dtypeplan.resolver._memory import memory_model
from dtypeplan.resolver._optimizer_kind import FAST_PATH_ARGS
from dtypeplan.resolver._owner_cost import ParamShapes, owner_memory, owner_traffic
from dtypeplan.resolver._rules import Status
from dtypeplan.resolver._traffic import Traffic, traffic_model

__all__ = ["Alternative", "PrecisionPlan", "Resolution", "install_builder"]


class _BuildOptimizer(Protocol):
    def __call__(
        self,
        plan: PrecisionPlan,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        process_group: dist.ProcessGroup | None = None,
        *,
        pipeline_group: Any = None,
    ) -> torch.optim.Optimizer: ...


class _PrepareModel(Protocol):
    def __call__(
        self,
        plan: PrecisionPlan,
        model: torch.nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        wrap: Any = None,
        pipeline_group: Any = None,
    ) -> torch.nn.Module: ...


@dataclass(frozen=True)
class _Builder:
    build_optimizer: _BuildOptimizer
    prepare_model: _PrepareModel


_builder: _Builder | None = None


def install_builder(*, build_optimizer: _BuildOptimizer, prepare_model: _PrepareModel) -> None:
    """Set what :meth:`PrecisionPlan.build` and :meth:`PrecisionPlan.prepare_model` call.

    ``dtypeplan/_api.py`` installs ``dtypeplan.optimizers``'s builder when it is imported
    (``dtypeplan.resolve`` and ``dtypeplan.load_rules`` import it); :func:`_installed` imports
    it where nothing did, so a plan can always build.
    """
    global _builder
    _builder = _Builder(build_optimizer=build_optimizer, prepare_model=prepare_model)


def _installed() -> _Builder:
    """The installed builder, importing ``dtypeplan._api`` (which installs it) where nothing
    has: a rank that received its plan pickled may never have touched ``dtypeplan.resolve``.
    Loaded by name, so that the resolver holds no import of the optimizers' side."""
    if _builder is None:
        importlib.import_module("dtypeplan._api")
    assert _builder is not None, "importing dtypeplan._api installs the optimizer builder"
    return _builder


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """A nearby combination the table calls OK, and the config changes that reach it."""

    changes: tuple[str, ...]
    rule_id: str
    implementation: str


@dataclass(frozen=True, kw_only=True)
class Resolution:
    """What a plan was resolved from, kept so that it can be resolved again for the optimizer
    a program passes (:meth:`PrecisionPlan.with_optimizer`)."""

    config: PrecisionConfig
    resolve: Callable[[PrecisionConfig], PrecisionPlan]
    """``resolve_config`` with the plan's rules table and ``pipeline_parallel``."""


class _PointAttributes:
    """The plan's attributes derived from its point, one per entry of a dimension record's
    ``attributes`` (``_dimensions.py``): generated below as read-only properties, so a new
    dimension's value is a plan attribute and a ``to_dict`` key with no edit here.

    The declarations are for type checkers only (``tests/test_dimension_records.py`` checks
    that each names a generated attribute); an undeclared one reads as well at run time.
    """

    point: FrozenDict[str, Any]
    if TYPE_CHECKING:
        param_dtype: torch.dtype
        """The model's parameters and their ``.grad``."""
        grad_accum_dtype: torch.dtype
        """Where micro-batch gradients are summed."""
        accumulator_sharded: bool
        """Whether each rank keeps only its shard of the accumulator."""
        zero_stage: int
        pipeline_parallel: bool
        comm_dtype: torch.dtype
        """Gradients on the wire; FSDP2's ``MixedPrecisionPolicy.reduce_dtype``."""
        comm_reduction: str
        """``"collective"`` or ``"fp32_sum"`` (see ``dtypeplan.comm``)."""
        master_dtype: torch.dtype
        """The master weights: fp32, or bf16 / fp16 where the parameters are the masters."""
        master_rounding: str
        """How each fp32 update is rounded into 16-bit masters: ``"nearest"``,
        ``"stochastic"`` or ``"kahan"``; ``"nearest"`` for fp32 masters."""
        optimizer_states: str
        """The ``states`` value: one dtype name when both moments agree, else
        ``"exp_avg/exp_avg_sq"`` (``"bf16/fp32"``)."""
        exp_avg_dtype: str
        """How Adam's first moment is stored: ``"fp32"``, ``"bf16"``, ``"int8"`` or
        ``"fp8"`` (blockwise codes); each step computes it in fp32 and stores it back."""
        exp_avg_sq_dtype: str
        """How Adam's second moment is stored (the same choices)."""
        autocast_dtype: torch.dtype | None
        """``torch_autocast``'s dtype; None without it (see :meth:`PrecisionPlan.autocast`)."""
        shard_groups: str
        offload_optimizer: str
        offload_param: str
        quantized_communication: str
        hierarchical_partitioning: bool
        gradient_prescaling: str
        fp8: bool
        """fp8 compute: ``prepare_model`` converts the eligible linear layers."""
        optimizer_kind: str
        """``"elementwise"`` or ``"shaped"`` (see ``resolver/_optimizer_kind.py``)."""
        state_kind: str
        fp8_recipe: str
        fp8_all_gather: str
        fp8_execution: str

    def attributes(self) -> dict[str, Any]:
        """Every attribute the dimension records derive from :attr:`point`, by name, in the
        dimensions' order."""
        return {name: getattr(self, name) for name in ATTRIBUTES}


ATTRIBUTES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    attribute: (dim.name, derive)
    for dim in DIMENSIONS.values()
    for attribute, derive in dim.attributes.items()
}
"""Each plan attribute derived from the point: (its dimension, the function of the value)."""


def _derived(dimension: str, derive: Callable[[Any], Any], doc: str) -> property:
    def read(plan: _PointAttributes) -> Any:
        return derive(plan.point[dimension])

    return property(read, doc=doc)


def _generate() -> None:
    for name, (dimension, derive) in ATTRIBUTES.items():
        doc = f"Derived from the point's ``{dimension}`` (``_dimensions.py``)."
        setattr(_PointAttributes, name, _derived(dimension, derive, doc))


_generate()


@dataclass(frozen=True, kw_only=True)
class PrecisionPlan(_PointAttributes):
    """What dtypeplan will do for one config. Built by :func:`dtypeplan.resolve`."""

    status: Status
    implementation: str | None
    """Registry name of the optimizer ``build`` makes with a process group (torch.distributed
    initialized); None unless OK."""
    single_process_implementation: str | None
    """Registry name of the optimizer ``build`` makes without torch.distributed (one process,
    no group): the same as ``implementation`` unless the rule names another (ZeRO-3: FSDP2
    needs a group; one process runs the flat sharded optimizer). None unless OK."""
    rule_id: str
    rule_location: str
    """``file:line`` of the deciding rule."""
    reason: str
    point: FrozenDict[str, Any]
    """The table's point: the value of every dimension (``_dimensions.DIMENSIONS``). The
    attributes each dimension's record names (``Dimension.attributes``: :attr:`param_dtype`,
    :attr:`master_dtype`, :attr:`offload_optimizer`, ...) are derived from it."""
    hpz_partition_size: int = 1
    """ZeRO++ hpZ's ``zero_hpz_partition_size``: at ZeRO-3 each unit's parameters are kept
    sharded over groups of this many consecutive ranks from its forward to its backward
    (FSDP2's ``reshard_after_forward``), whose all-gathers then stay within the group. 1: off."""
    shard_group_size: int | None = None
    """Ranks each shard group spans (``zero_optimization.shard_group_size``): states (ZeRO-2:
    the accumulator, ZeRO-3: the parameters) are sharded within groups of this many
    consecutive ranks and replicated across the ``world / shard_group_size`` groups. None: one
    group, the whole data-parallel group (flat)."""
    wire_across_groups: str | None = None
    """The gradients' wire format between shard groups: a dtype name (``"fp32"``, ``"bf16"``,
    ``"fp16"``) or a block-quantized one (``"int8"``, ``"fp8"``, summed in fp32). None: the same
    as :attr:`comm_dtype` (within the group)."""
    fp8_exclude_modules: tuple[str, ...] = ()
    """Names or fnmatch patterns of linear layers fp8 compute leaves unconverted."""
    loss_scaling: LossScaleConfig | None
    """fp16 loss scaling (fp16 parameters or fp16 autocast); None otherwise, where nothing is
    scaled."""
    optimizer: OptimizerConfig
    gradient_clipping: float
    reduce_bucket_size: int | None
    check_nonfinite: bool
    """Whether a step with a non-finite gradient norm is skipped: always under fp16."""
    collective_timeout_s: float = 600.0
    """Seconds a collective may wait for a peer (``collective_timeout_s``); see dtypeplan.launch."""
    origins: FrozenDict[str, str] = field(default_factory=FrozenDict)
    """Where each effective value came from (a config key or a default's location)."""
    warnings: tuple[str, ...] = ()
    ignored_keys: tuple[str, ...] = ()
    alternatives: tuple[Alternative, ...] = ()
    """For a plan that is not OK: the nearest OK configs (fewest changed settings)."""
    scheduler: FrozenDict[str, Any] | None = None
    """DeepSpeed's ``scheduler`` block (validated), for :meth:`build_scheduler`; None without
    one."""
    gradient_accumulation_steps: int | None = None
    """DeepSpeed's ``gradient_accumulation_steps``: micro-batches per step, run by the caller."""
    train_batch_size: int | None = None
    """DeepSpeed's ``train_batch_size`` (see :meth:`accumulation_steps`)."""
    train_micro_batch_size_per_gpu: int | None = None
    """DeepSpeed's ``train_micro_batch_size_per_gpu`` (see :meth:`accumulation_steps`)."""
    auto_values: tuple[AutoValue, ...] = ()
    """Every ``"auto"`` of the config, the value used and where it came from."""
    config_warnings: tuple[str, ...] = ()
    """About the config as read: unknown top-level keys, model-side settings, DeepSpeed's
    optimizer spellings."""
    deepspeed_differences: tuple[str, ...] = ()
    """Where this plan does not do what DeepSpeed 0.19.8 would, and how to get DeepSpeed's."""
    resolution: Resolution | None = field(default=None, compare=False, repr=False)
    """What the plan was resolved from (None for a plan built by hand)."""

    @property
    def reduce_dtype(self) -> torch.dtype:
        """FSDP2's name (``MixedPrecisionPolicy.reduce_dtype``) for :attr:`comm_dtype`."""
        return self.comm_dtype

    def implementation_for(self, distributed: bool) -> str | None:
        """The registry name ``build`` makes with (``True``) or without a process group."""
        return self.implementation if distributed else self.single_process_implementation

    # --- reporting ----------------------------------------------------------------------------
    @property
    def optimizer_states_dtype(self) -> torch.dtype | None:
        """The torch dtype both moments are held in, where they share a plain float dtype
        (fp32 or bf16); None for int8 / fp8 codes or moments in different dtypes."""
        return (
            DTYPES.get(self.optimizer_states) if self.optimizer_states in ("fp32", "bf16") else None
        )

    def to_dict(self) -> dict[str, Any]:
        """Everything about the plan as JSON-serializable data: the decision, every attribute
        the dimensions' records derive from :attr:`point` (dtypes by name), the settings."""
        attributes = {
            name: DTYPE_NAMES[value] if isinstance(value, torch.dtype) else value
            for name, value in self.attributes().items()
        }
        # The states' value under its first key (the attribute holds the torch dtype).
        attributes["optimizer_states_dtype"] = attributes.pop("optimizer_states")
        return {
            "status": str(self.status),
            "implementation": self.implementation,
            "single_process_implementation": self.single_process_implementation,
            "rule_id": self.rule_id,
            "rule_location": self.rule_location,
            "reason": self.reason,
            **attributes,
            "hpz_partition_size": self.hpz_partition_size,
            "shard_group_size": self.shard_group_size,
            "wire_across_groups": self.wire_across_groups,
            "fp8_exclude_modules": list(self.fp8_exclude_modules),
            "loss_scaling": None if self.loss_scaling is None else vars(self.loss_scaling).copy(),
            "optimizer": {"type": self.optimizer.type, "params": _jsonable(self.optimizer.params)},
            "gradient_clipping": self.gradient_clipping,
            "reduce_bucket_size": self.reduce_bucket_size,
            "check_nonfinite": self.check_nonfinite,
            "scheduler": None if self.scheduler is None else _jsonable(self.scheduler),
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "train_batch_size": self.train_batch_size,
            "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
            "auto_values": [
                {"path": a.path, "value": _jsonable(a.value), "source": a.source}
                for a in self.auto_values
            ],
            "config_warnings": list(self.config_warnings),
            "deepspeed_differences": list(self.deepspeed_differences),
            "origins": dict(self.origins),
            "warnings": list(self.warnings),
            "ignored_keys": list(self.ignored_keys),
            "alternatives": [
                {
                    "changes": list(a.changes),
                    "rule_id": a.rule_id,
                    "implementation": a.implementation,
                }
                for a in self.alternatives
            ],
        }

    def rank_facts(self) -> dict[str, Any]:
        """What must agree across the ranks of one group (not where each value came from)."""
        data = self.to_dict()
        for key in (
            "origins",
            "warnings",
            "ignored_keys",
            "alternatives",
            "rule_location",
            "auto_values",
            "config_warnings",
            "deepspeed_differences",
        ):
            data.pop(key)
        # What the optimizer counts by depends on where an "auto" came from (dropped above).
        data["counted_batch_sizes"] = list(self._batch_sizes())
        return data

    def accumulation_steps(self, ranks: int) -> AccumulationSteps | None:
        """Micro-batches per step on ``ranks`` data-parallel ranks, where the config says or
        DeepSpeed would work it out (``_batch.py``); None where it does not."""
        return accumulation_steps(*self._batch_sizes(), ranks)

    def batch_size_mismatch(self, ranks: int) -> str | None:
        """Why DeepSpeed would refuse the config's batch sizes on ``ranks`` ranks (None: it
        would not); the optimizer warns with it at build."""
        return batch_size_mismatch(*self._batch_sizes(), ranks)

    def _batch_sizes(self) -> tuple[int | None, int | None, int | None]:
        """The batch sizes the optimizer counts by (``_batch.counted_sizes``)."""
        given = (
            self.gradient_accumulation_steps,
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
        )
        return counted_sizes(given, self.auto_values)

    def digest(self) -> str:
        """A hash of :meth:`rank_facts`."""
        return hashlib.sha256(json.dumps(self.rank_facts(), sort_keys=True).encode()).hexdigest()

    def memory(
        self,
        num_params: int,
        world_size: int,
        *,
        param_numels: Sequence[int] | None = None,
        fp8_weights: Sequence[int] | None = None,
        param_shapes: ParamShapes | None = None,
    ) -> dict[str, int]:
        """Predicted bytes per rank at the accumulation boundary (see ``resolver/_memory.py``).

        ``param_numels``: the size of each parameter (summing to ``num_params``), optional.
        int8 / fp8 optimizer states pad every parameter to whole blocks of 256 values (no block
        spans two parameters); without the sizes that padding is left out, like bucket
        padding, which matters only for models with many small parameters.

        The six keys of shared/API.md are device bytes; ``host_params``,
        ``host_accumulator``, ``host_master``, ``host_optimizer_states`` and ``host_total`` are
        what ``offload_optimizer: cpu`` (and at ZeRO-3 ``offload_param: cpu`` with it) keeps in
        host memory (0 without it). Raises :class:`NotSupportedError` for an offload dtypeplan
        does not implement (NVMe; ``offload_param`` below ZeRO-3 or without
        ``offload_optimizer``): no figure would be true.
        Under ``torch_autocast`` the figures are those of fp32 parameters: autocast's 16-bit
        copies of weights and activations live only during forward and backward, like the
        activations themselves, and are not optimizer memory.

        ``fp8_weights``: the sizes of the weights computed in fp8
        (``dtypeplan.optimizers.contract.fp8_weight_numels(model, plan)``), needed where the
        plan gathers them in fp8 (ZeRO-3 on several ranks, ``fp8.all_gather: fp8``): each
        rank then holds one fp32 scale per such weight for its next gather (under
        ``params``); the gathered fp8 weights themselves live only while a layer runs.

        ``param_shapes``: each parameter's shape, or ``{name: shape}``
        (``named_parameters``), needed where the optimizer runs on whole parameters
        (``param_access: owner``: Muon, Adafactor), whose states depend on each shape
        (``resolver/_owner_cost.py``); the figures are then those of the rank that holds the
        most. Without it such a plan raises :class:`PrecisionConfigError`.
        """
        if self.optimizer.param_access == "owner":
            return owner_memory(self, num_params, world_size, param_shapes, param_numels)
        offload = (self.offload_optimizer, self.offload_param)
        served = offload in (("none", "none"), ("cpu", "none")) or (
            offload == ("cpu", "cpu") and self.zero_stage >= 3
        )
        if not served:
            offloaded = [
                f"{what} to {where}"
                for what, where in zip(("offload_optimizer", "offload_param"), offload, strict=True)
                if where != "none"
            ]
            raise NotSupportedError(
                f"memory(): the plan asks for {' and '.join(offloaded)} at ZeRO stage "
                f"{self.zero_stage}, which dtypeplan does not implement, so no device figure "
                "would be true: the device would not hold what is offloaded, and dtypeplan "
                "cannot offload it. dtypeplan offloads offload_optimizer cpu at stages 1-3 and "
                "offload_optimizer with offload_param cpu at stage 3; use one of them (or "
                "remove the settings) to see what the device and host hold."
            )
        shard_group_size = check_shard_group_size(self.shard_group_size, world_size)
        return memory_model(
            num_params=num_params,
            world_size=world_size,
            shard_group_size=shard_group_size,
            param_dtype=self.param_dtype,
            accum_dtype=self.grad_accum_dtype,
            accumulator_sharded=self.accumulator_sharded and world_size > 1,
            zero_stage=self.zero_stage,
            state_bytes_per_param=self.optimizer.state_bytes_per_param,
            master_dtype=self.master_dtype,
            master_rounding=self.master_rounding,
            exp_avg_dtype=self.exp_avg_dtype,
            exp_avg_sq_dtype=self.exp_avg_sq_dtype,
            offload_optimizer=self.offload_optimizer == "cpu",
            offload_param=self.offload_param == "cpu",
            param_numels=param_numels,
            fp8_scales=len(self._fp8_gathered(fp8_weights, num_params, world_size, "memory")),
        )

    def traffic(
        self,
        num_params: int,
        world_size: int,
        *,
        micro_batches: int | None = None,
        buckets: Sequence[int] | None = None,
        fp8_weights: Sequence[int] | None = None,
        param_numels: Sequence[int] | None = None,
    ) -> Traffic:
        """Predicted bytes each rank sends per optimizer step, within its shard group and
        across the groups, by collective (see ``resolver/_traffic.py``), counted as
        :class:`dtypeplan.comm.CommStats` counts them.

        ``micro_batches``: backward passes per step; by default what the config says
        (:meth:`accumulation_steps`), else 1. ZeRO-2 (and ZeRO-1 with a sharded accumulator)
        reduce-scatters within the group every micro-batch and all-reduces across the groups
        once per step; ZeRO-3 (FSDP2) gathers and reduces every micro-batch. Raises
        :class:`PrecisionConfigError` when the shard group size does not divide
        ``world_size``. ``buckets``: the sizes of the buckets an optimizer laid out (each
        chunk crosses the groups on its own, padded to whole blocks on an int8/fp8 wire), for
        exact figures with ``num_params`` their sum; by default ``num_params`` cut into
        buckets of ``reduce_bucket_size``. ``fp8_weights``: the sizes of the weights computed
        in fp8 (``dtypeplan.optimizers.contract.fp8_weight_numels(model, plan)``), needed
        where the plan gathers them in fp8 (ZeRO-3 on several ranks, ``fp8.all_gather:
        fp8``): FSDP2 gathers those as one byte a value, and each step all-reduces one fp32
        maximum per weight for their scales. Without them such a plan raises
        :class:`PrecisionConfigError` (the figure depends on the model). ``param_numels``:
        each parameter's size, needed where the optimizer runs on whole parameters
        (``param_access: owner``: one collective per parameter, to or from its owner).
        """
        if micro_batches is None:
            steps = self.accumulation_steps(world_size)
            micro_batches = 1 if steps is None else steps.micro_batches
        if self.optimizer.param_access == "owner":
            return owner_traffic(self, num_params, world_size, micro_batches, param_numels)
        shard_group_size = check_shard_group_size(self.shard_group_size, world_size)
        comm = DTYPE_NAMES[self.comm_dtype]
        return traffic_model(
            num_params=num_params,
            world_size=world_size,
            shard_group_size=shard_group_size,
            micro_batches=micro_batches,
            zero_stage=self.zero_stage,
            accumulator_sharded=self.accumulator_sharded,
            param_dtype=self.param_dtype,
            comm_dtype=comm,
            comm_reduction=self.comm_reduction,
            wire_across=self.wire_across_groups or comm,
            buckets=tuple(buckets) if buckets is not None else None,
            bucket_numel=self.reduce_bucket_size,
            fp8_gathered=self._fp8_gathered(fp8_weights, num_params, world_size, "traffic"),
            hpz_partition_size=self.hpz_partition_size,
        )

    def _fp8_gathered(
        self, fp8_weights: Sequence[int] | None, num_params: int, world_size: int, what: str
    ) -> tuple[int, ...]:
        """The sizes of the weights FSDP2 gathers in fp8 on ``world_size`` ranks (none unless
        ZeRO-3 runs FSDP2 with ``fp8.all_gather: fp8``: one process runs the flat optimizer)."""
        if not (
            self.fp8 and self.fp8_all_gather == "fp8" and self.zero_stage >= 3 and world_size > 1
        ):
            return ()
        if fp8_weights is None:
            raise PrecisionConfigError(
                f"{what}(): this plan gathers the weights it computes in fp8 as one byte a "
                "value (ZeRO-3, fp8.all_gather: fp8), so the figure depends on which weights "
                f"those are; pass fp8_weights=fp8_weight_numels(model, plan) (from "
                "dtypeplan.optimizers.contract: the sizes of the weights prepare_model "
                "converts)"
            )
        sizes = tuple(fp8_weights)
        if any(n < 0 for n in sizes) or sum(sizes) > num_params:
            raise ValueError(
                f"{what}(): fp8_weights sum to {sum(sizes)}, more than num_params {num_params}"
            )
        return sizes

    def explain(self, num_params: int | None = None, world_size: int | None = None) -> str:
        """A human-readable account of the decision and of every effective setting; with
        ``num_params`` and ``world_size``, also the bytes each rank sends per step
        (:meth:`traffic`). The text is written by ``resolver/_explain.py``."""
        return explain(self, num_params, world_size)

    # --- running ------------------------------------------------------------------------------
    def autocast(self, device: DeviceLike = None) -> contextlib.AbstractContextManager[Any]:
        """The ``torch.autocast`` context of ``torch_autocast``, or one that does nothing
        without it (so a training loop can use it whatever the config says).

        ``device``: a device type (``"cuda"``), a ``torch.device``, or a module (the device of
        its parameters); by default the current accelerator, else the CPU. The model's own
        forward needs no call: :meth:`prepare_model` runs it under this context (a pipeline
        stage's too). Use it for code outside the model that should run under autocast as
        well, such as the loss; backward needs none.
        """
        return autocast_context(self.autocast_dtype, device)

    # --- building (delegated: see the module docstring) ---------------------------------------
    def prepare_model(
        self,
        model: torch.nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        wrap: Any = None,
        pipeline_group: Any = None,
    ) -> torch.nn.Module:
        """Ready ``model`` for :meth:`build`, in place, and return it.

        Every stage casts it whole to :attr:`param_dtype` (parameters, frozen ones too, and
        floating-point buffers; the trainable parameters' fp32 values are kept for the master
        weights that ``build`` takes). ZeRO-3 also shards it with FSDP2, one unit per block;
        ``wrap`` (a set of module classes, or a callable ``module -> bool``) chooses the units
        and is ignored at other stages. With ``torch_autocast`` the parameters stay fp32 and
        every call of ``model`` runs under :meth:`autocast` (forward hooks: names and class are
        kept), as DeepSpeed's engine runs forward. Call it before ``build`` and before the
        model is handed to a pipeline stage. ``pipeline_group``: the group of the other pipeline
        stages (as :meth:`build` takes it), noted for the model's parameters so that ``build``
        on them takes it.
        """
        return _installed().prepare_model(
            self, model, process_group, wrap=wrap, pipeline_group=pipeline_group
        )

    def with_optimizer(
        self,
        optimizer: type[torch.optim.Optimizer],
        hyperparameters: Mapping[str, Any] | None = None,
    ) -> PrecisionPlan:
        """The plan resolved again with ``optimizer`` (a ``torch.optim`` class) and its
        ``hyperparameters`` in place of the config's ``optimizer`` block.

        The table decides the optimizer's kind: an elementwise class keeps the plan's status; a
        class that needs each parameter's shape (Adafactor, Muon, LBFGS, SparseAdam) or that
        dtypeplan does not know gives a NotSupported plan saying why. Raises
        :class:`PrecisionConfigError` for hyperparameters the class does not take.
        """
        if self.resolution is None:
            raise ValueError("with_optimizer() needs a plan made by dtypeplan.resolve")
        client = client_optimizer_config(optimizer, hyperparameters or {})
        config = dataclasses.replace(self.resolution.config, optimizer=client)
        return self.resolution.resolve(config)

    def build(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        process_group: dist.ProcessGroup | None = None,
        optimizer: type[torch.optim.Optimizer] | None = None,
        *,
        pipeline_group: Any = None,
        **hyperparameters: Any,
    ) -> torch.optim.Optimizer:
        """The optimizer for ``params`` on ``process_group`` (default: the default group).

        ``optimizer``: a ``torch.optim`` class that replaces the config's ``optimizer`` block,
        with ``hyperparameters`` (torch's defaults for the rest). Without it, keyword
        ``hyperparameters`` override the config's. Raises :class:`NotSupportedError` or
        :class:`PrecisionConfigError` for a plan that is not OK (for ``optimizer``: the plan
        :meth:`with_optimizer` gives).

        ``pipeline_group``: under pipeline parallelism, the group that holds one rank of every
        stage (a ``ProcessGroup``, ``mesh["pp"]``, the ``PipelineStage`` or the schedule); the
        step's gradient norm and fp16 overflow decision then span the whole model. By default
        the one :meth:`prepare_model` was given. A pipeline plan with clipping or fp16 refuses
        to build without it where the data-parallel group is not the whole world.
        """
        plan = self
        # capturable may not apply where the parameters live: it goes with every param group,
        # for the optimizer to refuse there with the reason (it knows the devices).
        if hyperparameters.pop("capturable", False):
            params = _with_group_defaults(params, {"capturable": True})
        if optimizer is not None:
            plan = self.with_optimizer(optimizer, hyperparameters)
        elif hyperparameters:
            merged = {**self.optimizer.params, **hyperparameters}
            plan = self.with_optimizer(self.optimizer.torch_class, merged)
        return _installed().build_optimizer(
            plan, params, process_group, pipeline_group=pipeline_group
        )

    def wrap(
        self,
        torch_optimizer: torch.optim.Optimizer,
        process_group: dist.ProcessGroup | None = None,
        *,
        pipeline_group: Any = None,
    ) -> torch.optim.Optimizer:
        """The optimizer of this plan with the class, param groups and hyperparameters of
        ``torch_optimizer``, one the program made and has not stepped (DeepSpeed's
        ``initialize(optimizer=...)``). Its own fast-path choices (``foreach``, ``fused``) give
        way to dtypeplan's. Raises as :meth:`build` does; ``pipeline_group`` as there.
        """
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            raise TypeError(f"wrap() takes a torch.optim.Optimizer, not {type(torch_optimizer)}")
        if any(_stepped(slot) for slot in torch_optimizer.state.values()):
            raise NotSupportedError(
                f"wrap(): the {type(torch_optimizer).__name__} has already stepped; its state "
                "(moments, step counts) is kept per parameter, not in dtypeplan's layout, and "
                "would be lost. Wrap the optimizer before its first step."
            )
        # capturable / differentiable stay in the groups: the optimizer refuses them where
        # they cannot apply (build refuses them in the defaults too).
        groups = [
            {k: v for k, v in group.items() if k not in FAST_PATH_ARGS or k in _GROUP_SWITCHES}
            for group in torch_optimizer.param_groups
        ]
        torch_class = type(torch_optimizer)
        # Only what the constructor takes: a class may keep more in its defaults (AdamW
        # records decoupled_weight_decay=True, which its constructor sets itself).
        accepted = inspect.signature(torch_class.__init__).parameters
        defaults = {k: v for k, v in torch_optimizer.defaults.items() if k in accepted}
        return self.build(
            groups, process_group, torch_class, pipeline_group=pipeline_group, **defaults
        )

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> LRScheduler | None:
        """The config's DeepSpeed ``scheduler`` block on ``optimizer`` (see
        ``dtypeplan.schedulers``), or None when the config has none. A step the optimizer
        skipped (fp16 overflow) does not advance it, as in DeepSpeed."""
        if self.scheduler is None:
            return None
        return schedulers.build_scheduler(_thaw(self.scheduler), optimizer)


_GROUP_SWITCHES = ("capturable", "differentiable")
"""torch.optim switches that change what can run, not only how fast; checked per param group
by the optimizer, which knows where the update runs."""


def _with_group_defaults(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], defaults: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """``params`` as param group dicts, each with ``defaults`` where it sets no value itself."""
    items: list[Any] = list(params)
    if not items or not isinstance(items[0], dict):
        return [{**defaults, "params": items}]
    return [{**defaults, **group} for group in items]


def _stepped(slot: Mapping[str, Any]) -> bool:
    """Whether a parameter's optimizer state shows a step (Adagrad fills its state at
    construction, with step 0)."""
    if not slot:
        return False
    step = slot.get("step")
    return step is None or float(step) != 0.0


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
