"""Sharding a model with FSDP2 for a plan: the mesh, the units, the policies, the collectives.

What ``plan.prepare_model`` does at ZeRO-3 (``FSDP2Optimizer.prepare_model`` calls
:func:`shard_model`): the mesh on the process group's device, one ``fully_shard`` unit per block
(``fsdp2/units.py``), each unit's trainable parameters in the master dtype just before it is
sharded, FSDP2's mixed-precision and offload policies from the plan, and FSDP2's all-gather and
reduce-scatter wrapped so that a failure is a ``CollectiveError`` naming them. The
reduce-scatter also keeps its output for the 16-bit-master accumulation hook
(:func:`as_reduced`). The optimizer that steps the sharded model is ``fsdp2/optimizer.py``'s.

A hybrid layout (``plan.shard_group_size`` ``S`` below the world ``W``) is FSDP2's HSDP: a 2-D
mesh of ``W / S`` rows (``"replicate"``, the replica groups of ``comm/_groups.py``) by ``S``
columns (``"shard"``, the shard groups), placements ``(Replicate(), Shard(0))``. FSDP2 then
all-gathers and reduce-scatters within the shard group and all-reduces the reduced shards
across the replica group, in ``reduce_dtype``, inside its own reduction: no hook replaces that
all-reduce, so the wire across groups is ``communication_data_type`` and nothing else
(:func:`check_wire_across_groups`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.distributed.tensor import DTensor

from dtypeplan._dtypes import dtype_name
from dtypeplan.comm import Communicator
from dtypeplan.comm._groups import HybridGroups, hybrid_groups
from dtypeplan.comm._quantized_wire import WIRE_FORMATS
from dtypeplan.errors import NotSupportedError, OptimizerUsageError, PrecisionConfigError
from dtypeplan.optimizers.contract.base import WrapPolicy, make_replicas_equal
from dtypeplan.optimizers.contract.model import cast_floating_buffers
from dtypeplan.optimizers.fsdp2.caches import follow_the_shards
from dtypeplan.optimizers.fsdp2.units import choose_units, uncovered_parameters
from dtypeplan.optimizers.grads.ownership import ParamWeakMap

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from dtypeplan.resolver._plan import PrecisionPlan

__all__ = [
    "REDUCE_SCATTER_OF",
    "NamedReduceScatter",
    "BEFORE_REDUCE",
    "CLEARS_OWNED",
    "as_reduced",
    "SCALAR_NAMES",
    "broadcast_unit_from_first",
    "scalars_as_vectors",
    "show_scalars_in_forward",
    "check_wire_across_groups",
    "check_sharded_on",
    "clear_owned_before_reduce",
    "hybrid_layout",
    "hpz_reshard",
    "gatherable",
    "mesh_compute_device",
    "mesh_device",
    "mesh_device_type",
    "shard_mesh",
    "shard_model",
]

REDUCE_SCATTER_OF = ParamWeakMap()
"""Sharded parameter -> the reduce-scatter of its model (:func:`shard_model` sets it); weak
through the local shard, so that ``model.to(...)`` can still swap the parameter."""


def shard_model(
    model: torch.nn.Module,
    *,
    plan: PrecisionPlan,
    process_group: dist.ProcessGroup | None = None,
    wrap: WrapPolicy | None = None,
) -> torch.nn.Module:
    """Shard ``model`` with ``fully_shard`` for ``plan``, in place (see
    ``FSDP2Optimizer.prepare_model``); without torch.distributed, return it as it is."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        return model  # one process: nothing to shard (the builder runs another class)
    if isinstance(model, FSDPModule):
        raise PrecisionConfigError(
            "plan.prepare_model: this model is sharded already (prepare_model ran on it); "
            "call it once, on the unsharded model"
        )
    group = process_group or dist.group.WORLD
    assert group is not None  # torch.distributed is initialized here
    device = mesh_device(dist.get_backend(group), model)
    layout = hybrid_layout(group, plan)
    check_wire_across_groups(plan, layout)
    mesh = shard_mesh(group, layout, device.type)
    policy = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.comm_dtype)
    low_precision_masters = plan.master_dtype != torch.float32
    own = [name for name, p in model.named_parameters(recurse=False) if p.requires_grad]
    if plan.pipeline_parallel and own:
        raise PrecisionConfigError(
            f"under pipeline parallelism ZeRO-3 shards the stage module's children, but the "
            f"stage module holds parameters of its own ({', '.join(own)}); wrap it, e.g. "
            "torch.nn.Sequential(stage_module), before plan.prepare_model"
        )
    scalars = scalars_as_vectors(model)
    paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
    # Read back by checkpoint.export_model_state, which gives these their 0-dim shape again.
    model.__dict__[SCALAR_NAMES] = frozenset(
        f"{paths[id(m)]}.{name}" if paths[id(m)] else name for m, name in scalars
    )
    units = choose_units(model, wrap)
    if plan.pipeline_parallel:
        # Under torch.distributed.pipelining the stage module itself stays unwrapped: the
        # schedule turns gradient sync off for all but the last micro-batch of a module
        # that is an FSDPModule, which would accumulate whole gradients; the units, the
        # outermost of each its own FSDP root, reduce-scatter every micro-batch.
        left = uncovered_parameters(model, units)
        if left:
            raise PrecisionConfigError(
                "under pipeline parallelism ZeRO-3 shards units below the stage module, and "
                f"no unit holds these trainable parameters: {', '.join(left)} (tied across "
                "units, or chosen by no wrap policy). Wrap the modules that share them in "
                "one module, or pass wrap= so that one unit holds each"
            )
    _cast_frozen_and_buffers(model, plan.param_dtype)
    offload = _offload_policy(plan, device)
    broadcast = Communicator(group)
    hpz = hpz_reshard(plan, dist.get_world_size(group) if layout is None else layout.shard_size)
    for unit in units:
        broadcast_unit_from_first(broadcast, unit, device)
        _masters_to(unit, plan.master_dtype)
        fully_shard(unit, mesh=mesh, mp_policy=policy, **hpz, **offload)
    if not plan.pipeline_parallel:
        # The root keeps FSDP2's default: its parameters stay gathered from forward to
        # backward (FSDP2 does not reshard the root after forward).
        broadcast_unit_from_first(broadcast, model, device)
        _masters_to(model, plan.master_dtype)
        fully_shard(model, mesh=mesh, mp_policy=policy, **offload)
    show_scalars_in_forward(model, scalars)
    # FSDP2's all-gathers and reduce-scatters run within the shard group.
    comm = Communicator(layout.shard if layout is not None else group)
    # One reduce-scatter for the whole model: the 16-bit-master hook reads its last output.
    reduce_scatter = NamedReduceScatter(comm, keep_output=low_precision_masters)
    for param in model.parameters():
        if isinstance(param, DTensor):
            REDUCE_SCATTER_OF[param] = reduce_scatter
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # NCCL averages natively (no divide kernel); elsewhere SUM and an explicit
            # divide, as gloo's AVG has been reported to return sums.
            module.set_force_sum_reduction_for_comms(comm.backend != "nccl")
            # FSDP2's own collectives fail as CollectiveError naming them, like ours.
            module.set_custom_all_gather(NamedAllGather(comm))
            module.set_custom_reduce_scatter(reduce_scatter)
            clear_owned_before_reduce(module)
    # A forward under no_grad reshards every unit, the fp8 scales follow the shards at each
    # forward (fsdp2/caches.py).
    follow_the_shards(model)
    # Frameworks wrap the models they receive in DDP, which would broadcast and all-reduce
    # DTensors it has no rule for. DDP reads its ignore list first thing: reading this one
    # refuses the wrap with what to use instead (FSDP2 reduces the gradients already).
    model._ddp_params_and_buffers_to_ignore = _NotForDDP()  # type: ignore[assignment]
    return model


def broadcast_unit_from_first(
    comm: Communicator, unit: torch.nn.Module, device: torch.device
) -> None:
    """Replicas equal by construction (as DDP): ``unit``'s parameters not sharded yet take the
    group's first rank's values, on ``device`` (the mesh's), right before ``unit`` is sharded.

    A model built on the CPU with an NCCL group has its parameters on a device the group has no
    backend for ("No backend type associated with device type cpu"), so each parameter moves to
    the mesh device first (where ``fully_shard`` would move it anyway), one unit at a time: no
    more than one unit is whole on the device. Parameters of units sharded already (DTensors)
    are skipped, and so are parameters on the meta device (deferred initialisation: FSDP2 keeps
    them there, and the loop initialises them after sharding).
    """
    params = [
        p for p in unit.parameters() if not isinstance(p, DTensor) and p.device.type != "meta"
    ]
    with torch.no_grad():
        for param in params:
            if param.device != device:
                param.data = param.data.to(device)  # as FSDP2's _move_states_to_device
    make_replicas_equal(comm, params)


SCALAR_NAMES = "_dtypeplan_scalar_names"
"""The attribute of a ZeRO-3 model naming its parameters that were 0-dim (see
:func:`scalars_as_vectors`)."""


def scalars_as_vectors(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """Hold each 0-dim parameter (CLIP's ``logit_scale``) as a 1-element one, in place.

    FSDP2 shards every parameter along dim 0 and its ``fully_shard`` refuses a scalar. A
    1-element parameter under the same name, in the same place (so ``named_parameters`` and
    the checkpoints' numbering keep their order), is sharded, gathered, reduced and updated
    like every other (one rank holds its value, the others an empty shard), so it trains
    exactly as a scalar would; :func:`show_scalars_in_forward` makes the model's forward see a
    0-dim view of it. Outside forward the parameter reads as its 1-element shard (its
    ``state_dict`` entry has shape ``[1]``; ``dtypeplan.checkpoint.export_model_state`` gives
    it back 0-dim). Returns ``(module, name)`` of each such entry
    (a scalar shared by several modules is one parameter).
    """
    held: list[tuple[torch.nn.Module, str]] = []
    vectors: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.dim() != 0:
                continue
            vector = vectors.get(id(param))
            if vector is None:
                vector = torch.nn.Parameter(
                    param.detach().reshape(1), requires_grad=param.requires_grad
                )
                vectors[id(param)] = vector
            module._parameters[name] = vector
            held.append((module, name))
    return held


def show_scalars_in_forward(
    model: torch.nn.Module, scalars: list[tuple[torch.nn.Module, str]]
) -> None:
    """While the FSDP2 unit holding each former scalar runs its forward, the module's
    attribute is a 0-dim view of the gathered 1-element parameter (gradients flow through the
    view into it, and FSDP2 reduces them with the unit's); after the forward, the parameter.

    The view sits in the module's ``__dict__``, which Python reads before ``nn.Module``'s
    parameter lookup; it is set after FSDP2's own pre-forward hook (which gathers the unit and
    registers the gathered parameters) and removed after the unit's forward.
    """
    from torch.distributed.fsdp import FSDPModule

    paths = {id(module): path for path, module in model.named_modules()}
    units = [(path, m) for path, m in model.named_modules() if isinstance(m, FSDPModule)]
    for module, name in scalars:
        path = paths[id(module)]
        inside = [
            (unit_path, unit)
            for unit_path, unit in units
            if unit_path == "" or path == unit_path or path.startswith(unit_path + ".")
        ]
        # The innermost unit holding the module: its forward gathers the parameter.
        _, unit = max(inside, key=lambda pair: len(pair[0]) + bool(pair[0]))
        assert isinstance(unit, torch.nn.Module)  # an FSDPModule is its module's class too
        unit.register_forward_pre_hook(_showing(module, name))
        unit.register_forward_hook(_hiding(module, name))


def _showing(module: torch.nn.Module, name: str) -> Any:
    def show(*_: Any) -> None:
        module.__dict__[name] = module._parameters[name].view(())  # type: ignore[union-attr]

    return show


def _hiding(module: torch.nn.Module, name: str) -> Any:
    def hide(*_: Any) -> None:
        module.__dict__.pop(name, None)

    return hide


class _NotForDDP(list[str]):
    """DDP's ignore list on a ZeRO-3 model: DDP's constructor reads it (``set(...)``) and gets
    the reason a dtypeplan ZeRO-3 model takes no DDP wrapper, naming the integrations (the
    frameworks that wrap every model they prepare)."""

    def __iter__(self) -> Iterator[str]:
        raise OptimizerUsageError(
            "DistributedDataParallel around a model dtypeplan shards at ZeRO-3: FSDP2 reduces "
            "its gradients already, so it takes no DDP wrapper. A framework that wraps every "
            "model it prepares needs its dtypeplan integration: "
            "dtypeplan.integrations.DtypeplanTrainer instead of transformers.Trainer (or "
            "`dtypeplan run [torchrun options] script.py --deepspeed CONFIG` for an unedited "
            "script), DtypeplanAccelerator instead of accelerate.Accelerator, "
            "DtypeplanStrategy for Lightning"
        )


def hybrid_layout(group: dist.ProcessGroup | None, plan: PrecisionPlan) -> HybridGroups | None:
    """The shard and replica groups of ``plan``'s hybrid layout over ``group``; None for the
    flat layout (``shard_group_size`` unset, or the whole group), where no subgroup is made."""
    if plan.shard_group_size is None:
        return None
    layout = hybrid_groups(group, plan.shard_group_size)
    return layout if layout.hybrid else None


def shard_mesh(
    group: dist.ProcessGroup, layout: HybridGroups | None, device_type: str
) -> DeviceMesh:
    """The mesh ZeRO-3 shards on: 1-D over ``group`` (flat), or HSDP's 2-D mesh, dim 0
    ``"replicate"`` (size ``W / S``) over the replica groups and dim 1 ``"shard"`` (size ``S``)
    over the shard groups that ``comm/_groups.py`` made (no other subgroups are created)."""
    from torch.distributed.device_mesh import DeviceMesh

    if layout is None:
        return DeviceMesh.from_group(group, device_type=device_type)
    assert layout.replica is not None and layout.shard is not None  # distributed here
    ranks = torch.tensor(dist.get_process_group_ranks(group), dtype=torch.int64)
    return DeviceMesh.from_group(
        [layout.replica, layout.shard],
        device_type,
        mesh=ranks.view(layout.replicas, layout.shard_size),
        mesh_dim_names=("replicate", "shard"),
    )


def check_wire_across_groups(plan: PrecisionPlan, layout: HybridGroups | None) -> None:
    """Refuse a wire across shard groups other than ``communication_data_type`` at ZeRO-3.

    FSDP2 (HSDP) all-reduces the reduced gradient shards across the replica groups with
    ``dist.all_reduce`` in its ``reduce_dtype``, inside its reduction, with no hook that could
    replace it: neither a block-quantized (int8 / fp8) wire nor another dtype can be put there.
    """
    wire = plan.wire_across_groups
    comm = dtype_name(plan.comm_dtype)
    if layout is None or wire is None or wire == comm:
        return
    where = (
        f"ZeRO-3 with shard_group_size {layout.shard_size} ({layout.replicas} shard groups) "
        f"and the gradients' wire across groups {wire}"
    )
    why = (
        "FSDP2 (HSDP) all-reduces the gradient shards across the shard groups inside its own "
        f"reduction, in communication_data_type ({comm}), and offers no hook to replace that "
        "collective"
    )
    if wire in WIRE_FORMATS:
        fix = (
            "use a block-quantized wire at ZeRO stage 1 or 2 (whose two-level reduction is "
            "dtypeplan's), or leave the wire across groups unset at ZeRO-3"
        )
    else:
        fix = (
            f"set communication_data_type to {wire} (the wire within and across groups), or "
            "leave the wire across groups unset"
        )
    raise NotSupportedError(f"{where}: {why}; {fix}")


def check_sharded_on(
    params: list[torch.Tensor], mesh_shape: tuple[int, ...], plan: PrecisionPlan, world_size: int
) -> None:
    """ZeRO-3: each parameter is FSDP2's, sharded on a mesh of ``mesh_shape`` (this plan's
    layout: ``(replicas, shard group size)`` in shard groups, else ``(world_size,)``), as
    ``prepare_model`` with this plan shards it."""
    for param in params:
        if not isinstance(param, DTensor):
            raise ValueError(
                "ZeRO-3 needs the model sharded before the optimizer is built: call "
                "model = plan.prepare_model(model) and then plan.build(model.parameters())"
            )
        got = tuple(param.device_mesh.shape)
        if got != mesh_shape:
            raise ValueError(
                f"ZeRO-3: the model is sharded on a mesh of shape {got}, but this plan's "
                f"layout (shard_group_size {plan.shard_group_size}, world {world_size}) needs "
                f"{mesh_shape}; build the optimizer with the plan whose prepare_model sharded "
                "the model"
            )


BEFORE_REDUCE = ParamWeakMap()
"""Sharded parameter -> a callback run with it right before its unit's reduce-scatter, while
``.grad`` still shows what the loop did to the placeholder (the optimizer's discard check)."""

CLEARS_OWNED = ParamWeakMap()
"""Sharded parameter -> True where :func:`clear_owned_before_reduce` covers its unit: only
there may the optimizer leave an :class:`OwnedGradient` placeholder in ``.grad``."""


def clear_owned_before_reduce(module: torch.nn.Module) -> None:
    """Before each reduce-scatter of ``module``'s FSDP2 unit, drop the ``OwnedGradient``
    placeholders (``grads/owned.py``) of the unit's parameters.

    FSDP2 adds a new reduced shard into a sharded ``.grad`` it finds (``grad += new``), which
    on a placeholder would raise; the optimizer holds the earlier sums in its accumulator, so
    the new shard must start a fresh ``.grad``. FSDP2 offers no public hook before its
    reduce-scatter, so each parameter group's ``post_backward`` (which reduces) is wrapped on
    the instance; where this torch's FSDP2 lays its state out otherwise, nothing is wrapped,
    no parameter enters :data:`CLEARS_OWNED`, and the optimizer leaves no placeholder there.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    state = get_state() if get_state is not None else None
    groups = getattr(state, "_fsdp_param_groups", None)
    if not isinstance(groups, list):
        return
    for group in groups:
        post_backward = getattr(group, "post_backward", None)
        fsdp_params = getattr(group, "fsdp_params", None)
        if post_backward is None or not isinstance(fsdp_params, list):
            continue
        params = [getattr(fp, "sharded_param", None) for fp in fsdp_params]
        sharded = [p for p in params if isinstance(p, DTensor)]
        if len(sharded) != len(params):
            continue
        group.post_backward = _clearing(group, post_backward)
        for param in sharded:
            CLEARS_OWNED[param] = True


def _clearing(group: Any, post_backward: Any) -> Any:
    """``post_backward`` run after clearing the group's placeholders, when it will reduce
    (without gradient sync FSDP2 keeps unsharded sums and leaves ``.grad`` alone)."""
    from dtypeplan.optimizers.grads.owned import is_owned_gradient

    def run(*args: Any) -> Any:
        if getattr(group, "reduce_grads", True):
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                check = BEFORE_REDUCE.get(param)
                if check is not None:
                    check(param)
                if is_owned_gradient(param.grad):
                    param.grad = None
        return post_backward(*args)

    return run


def _current_accelerator() -> str | None:
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return accelerator.type if accelerator is not None else None


def mesh_device_type(backend: str, accelerator: str | None = None) -> str | None:
    """The device type a process group with ``backend`` communicates on; None if ambiguous.

    ``backend`` is what ``dist.get_backend(group)`` says: one name (``"nccl"``, ``"gloo"``)
    or a device map (``"cpu:gloo,cuda:nccl"``); ``accelerator`` is this machine's
    (``torch.accelerator``'s device type, None without one). A group serving this machine's
    accelerator runs on it (NCCL hands CPU tensors nothing but errors); else one serving the
    CPU (gloo) on the CPU; else the one device it serves (``nccl`` -> ``cuda``).
    """
    backend = backend.lower()
    if ":" in backend:
        devices = [pair.split(":", 1)[0].strip() for pair in backend.split(",")]
    else:
        devices = [d for d, b in dist.Backend.default_device_backend_map.items() if b == backend]
    if accelerator is not None and accelerator in devices:
        return accelerator
    if "cpu" in devices:
        return "cpu"
    return devices[0] if len(devices) == 1 else None


def mesh_device(backend: str, model: torch.nn.Module) -> torch.device:
    """Where ZeRO-3's mesh, and so the sharded model, lives for a group with ``backend``.

    An accelerator means its current device (``torch.cuda.current_device()``: set it before
    ``prepare_model``, as FSDP2 expects). A backend of unknown kind keeps the model's device.
    """
    kind = mesh_device_type(backend, _current_accelerator())
    if kind is None:
        return next(model.parameters(), torch.empty(0)).device
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def hpz_reshard(plan: PrecisionPlan, shard_size: int) -> dict[str, Any]:
    """``fully_shard``'s ``reshard_after_forward`` for ZeRO++ hpZ (``zero_hpz_partition_size``
    ``H``): after its forward each unit keeps its parameters (in the parameter dtype) sharded
    over groups of ``H`` consecutive ranks, and its backward all-gathers within that group, as
    DeepSpeed's secondary partition does. FSDP2 builds that mesh (and its process groups) for
    each unit. ``H`` must divide the ranks the parameters are sharded over; ``H`` equal to
    them is plain ZeRO-3 (FSDP2 reads it as True)."""
    size = plan.hpz_partition_size
    if size <= 1:
        return {}
    if shard_size % size:
        raise PrecisionConfigError(
            f"zero_optimization.zero_hpz_partition_size {size} does not divide the "
            f"{shard_size} ranks ZeRO-3 shards over: hpZ keeps each unit's parameters sharded "
            "within groups of that many consecutive ranks (one node). Set it to the ranks per "
            "node, a divisor of the world size"
        )
    return {"reshard_after_forward": size}


def _offload_policy(plan: PrecisionPlan, device: torch.device) -> dict[str, Any]:
    """``fully_shard``'s offload argument for ``offload_param: cpu`` (with ``offload_optimizer:
    cpu``, which the table requires): FSDP2's CPUOffloadPolicy keeps the shards (the master
    weights), their gradients and so the optimizer's states and step in host memory, copies
    each unit's shards to the device for its all-gather and each reduced gradient shard
    back. The host memory is pinned where the mesh is on CUDA (pinned memory exists only
    there; DeepSpeed's ``pin_memory`` key is read as that, see explain()'s differences)."""
    if plan.offload_param == "none":
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    if plan.offload_param != "cpu" or plan.offload_optimizer != "cpu":
        raise NotSupportedError(
            f"offload_param {plan.offload_param} with offload_optimizer "
            f"{plan.offload_optimizer}: FSDP2 offloads to host memory only (CPUOffloadPolicy), "
            "the shards and the optimizer together; use device cpu for both"
        )
    pin = device.type == "cuda" and torch.cuda.is_available()
    return {"offload_policy": CPUOffloadPolicy(pin_memory=pin)}


def mesh_compute_device(mesh: DeviceMesh) -> torch.device:
    """The device ``mesh`` communicates on (an accelerator's current device, or the CPU)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def gatherable(value: DTensor) -> DTensor:
    """``value`` with its local tensor on its mesh's device, so that a collective can read it.

    Under CPUOffloadPolicy the shards (and the states made like them) live in host memory while
    the mesh is on the accelerator, whose collectives (NCCL) take device tensors only; the
    copy is one shard at a time. Where the local tensor already is there, ``value`` itself.
    """
    device = mesh_compute_device(value.device_mesh)
    local = value.to_local()
    if local.device == device:
        return value
    return DTensor.from_local(
        local.to(device), value.device_mesh, value.placements, shape=value.shape,
        stride=value.stride(),
    )  # fmt: skip


def _cast_frozen_and_buffers(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Frozen parameters and floating buffers to ``dtype`` (they have no fp32 masters)."""
    _cast_parameters(model, dtype, trainable=False)
    cast_floating_buffers(model, dtype)


def _masters_to(unit: torch.nn.Module, dtype: torch.dtype) -> None:
    """The trainable parameters of ``unit`` not sharded yet to the master dtype, just before
    sharding (fp32; bf16 master weights round to nearest, as at stages 0-2)."""
    _cast_parameters(unit, dtype, trainable=True)


def _cast_parameters(module: torch.nn.Module, dtype: torch.dtype, *, trainable: bool) -> None:
    """``module``'s floating parameters that train (or are frozen) and are not sharded yet, to
    ``dtype``, in place; a parameter held by several modules stays one.

    A plain tensor changes its ``.data``. A tensor subclass that wraps another (torchao's
    ``WeightWithDynamicFloat8CastTensor``, the weight FSDP2 gathers in fp8) would keep its
    inner tensor's dtype under ``.data =``: it is cast through its own dispatch (which wraps
    the cast inner tensor anew) and put in a new parameter, in every module that holds it.
    """
    replaced: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad():
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is None or isinstance(param, DTensor):
                    continue
                if param.requires_grad != trainable or not param.is_floating_point():
                    continue
                if id(param) in replaced:
                    owner._parameters[name] = replaced[id(param)]
                elif param.dtype == dtype:
                    continue
                elif type(param.data) is torch.Tensor:
                    param.data = param.data.to(dtype)
                else:
                    cast = torch.nn.Parameter(param.detach().to(dtype), param.requires_grad)
                    replaced[id(param)] = cast
                    owner._parameters[name] = cast


class NamedAllGather(DefaultAllGather):
    """FSDP2's default all-gather, whose failure (a dead or stalled peer) is a CollectiveError.

    FSDP2 all-gathers synchronously unless explicit prefetching asks otherwise; an asynchronous
    one fails later, in FSDP2's wait, with the backend's own error.

    A unit whose gathered inputs are all fp8 (torchao's fp8 weight all-gather, no bf16
    parameter beside them) reaches here as a float8 tensor, which gloo refuses ("Invalid
    scalar type"); the same bytes travel as uint8 (NCCL takes float8 as it is).
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        dtype = output_tensor.dtype
        if self.comm.backend != "nccl" and dtype.is_floating_point and dtype.itemsize == 1:
            output_tensor, input_tensor = (
                t.view(torch.uint8) for t in (output_tensor, input_tensor)
            )
        with self.comm._guard("FSDP2 all_gather", output_tensor.numel(), dtype):
            return super().__call__(output_tensor, input_tensor, group, async_op)


class NamedReduceScatter(DefaultReduceScatter):
    """FSDP2's default gradient reduce-scatter, failing as a CollectiveError.

    With ``keep_output`` it also keeps the last tensor it allocated (the reduced shards in
    the communication dtype, before FSDP2 casts them to the sharded parameters' dtype) until
    the end of the backward pass, for the 16-bit-master accumulation hook
    (:meth:`FSDP2Optimizer._fold`). FSDP2 allocates that output last, right before the
    collective (or, on one rank, the copy standing for it), and runs the hooks of its
    parameters before the next reduce-scatter allocates anything.
    """

    def __init__(self, comm: Communicator, keep_output: bool = False) -> None:
        self.comm = comm
        self.keep_output = keep_output
        self.last_output: torch.Tensor | None = None
        self._release_queued = False

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = super().allocate(size, dtype=dtype, device=device)
        if self.keep_output:
            self.last_output = tensor
            if not self._release_queued:
                # Dropped when backward ends, so that between steps no gradient buffer of
                # FSDP2's outlives the accumulator (what plan.memory() counts). A reduction
                # outside backward keeps it until the optimizer's zero_grad or step.
                try:
                    torch.autograd.Variable._execution_engine.queue_callback(self.release)
                    self._release_queued = True
                except RuntimeError:
                    pass
        return tensor

    def release(self) -> None:
        """Drop the kept output (at the end of backward; at ``zero_grad`` and ``step``)."""
        self.last_output = None
        self._release_queued = False

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work:
        with self.comm._guard("FSDP2 reduce_scatter", input_tensor.numel(), input_tensor.dtype):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)


def as_reduced(shard: torch.Tensor, reduce_scatter: NamedReduceScatter | None) -> torch.Tensor:
    """``shard`` (a micro-batch's sharded gradient, cast by FSDP2 to the sharded parameter's
    dtype) as the reduce-scatter produced it, in the communication dtype.

    FSDP2 casts its whole reduce-scatter output at once and hands each parameter a view of
    the cast copy at the same offset, so the same view of the kept output is the uncast value.
    """
    output = reduce_scatter.last_output if reduce_scatter is not None else None
    if output is not None and output.dtype == shard.dtype:
        return shard  # nothing was cast
    if output is None or shard.untyped_storage().nbytes() != output.numel() * shard.element_size():
        raise NotSupportedError(
            "ZeRO-3 with 16-bit master weights reads each reduced gradient shard before FSDP2 "
            "casts it to the masters' dtype, and this torch's FSDP2 handed the gradient hook a "
            "shard that is not a view of its reduce-scatter output. Use "
            "communication_data_type equal to the master dtype (nothing is cast then), or "
            "stage 2 with bf16 masters"
        )
    return torch.as_strided(output, shard.size(), shard.stride(), shard.storage_offset())
