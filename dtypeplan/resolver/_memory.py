"""The byte model behind ``plan.memory()``: what one rank holds at the accumulation boundary.

For ``N`` parameters on ``W`` ranks, with ``P`` and ``A`` the bytes per element of the
parameter and accumulation dtypes and ``S`` the optimizer's fp32 state bytes per parameter
(AdamW and Adam 8, SGD with momentum 4, plain SGD 0):

============  =====================================================================
params        ``P * N``; at stage 3 ``M * N / W``: FSDP2's shards in the master dtype
              (``M`` = 4, or 2 for bf16 master weights), gathered in the parameter dtype
              only while a layer runs
grads         ``0``: the parameters' own ``.grad`` is consumed by a hook the moment
              autograd produces it (DeepSpeed counts ``P * N`` here; in dtypeplan those
              bytes are the accumulator when ``A == P``)
accumulator   ``A * N`` whole, ``A * N / W`` sharded
master        ``4 * N / D``, ``D = W`` from ZeRO-1 on, else 1; ``0`` for fp32 parameters,
              at stage 3, and for bf16 master weights, where the master weights are the
              parameters themselves; bf16 masters with Kahan rounding hold a bf16
              compensation buffer, ``2 * N / D``
states        ``S * N / D`` with fp32 moments; each moment counts its own format's bytes
              (``StateFormat.stored_bytes``, ``dtypeplan/_formats.py``): 4 bytes a value
              in fp32, 2 in bf16, and for int8 / fp8 (torchao's blockwise codes) 1 byte a
              value plus one fp32 scale per 256 values (``1 + 4/256``), and the format's
              code table (1 KiB per int8 moment). Quantized blocks never span two
              parameters: each parameter's values are padded to whole blocks (up to 255
              zero values each), counted when ``param_numels`` gives the parameter sizes
============  =====================================================================

ZeRO-3 with the fp8 all-gather (``fp8.all_gather: fp8``): ``params`` adds 4 bytes for each
weight gathered in fp8 (``L`` of them: the fp32 scale the next gather casts it with); the
gathered e4m3 weights live only while their layer runs, like the gathered parameters.

With ``offload_optimizer: cpu`` the master weights (``4 * N / D``, never aliased: fp32
parameters get a host copy too) and the states live in host memory: they count under
``host_master`` and ``host_optimizer_states`` (and ``host_total``), and ``master`` and
``optimizer_states`` are 0. At ZeRO-3 with ``offload_param: cpu`` too (FSDP2's
CPUOffloadPolicy, which needs both) the shards ``M * N / W`` (the master weights) and the
sharded accumulator ``A * N / W`` live in host memory as well, under ``host_params`` and
``host_accumulator``, with the states under ``host_optimizer_states`` (a Kahan compensation
under ``host_master``): the device holds none of it between steps, only the gathered unit
(``P`` bytes for each of its parameters) while it runs, which is not counted, like activations.
At ZeRO-3 with ``offload_optimizer: cpu`` alone (``optimizers/fsdp2/host_update.py``) the
shards ``4 * N / W`` and the accumulator stay on the device and an fp32 host master
``4 * N / W`` sits beside the states on the host. One process with ``offload_param`` runs
FSDP2 on a one-rank group (``W = 1``). The six device keys mean device bytes for every plan;
the host keys are 0 when nothing is offloaded.

ZeRO++ hpZ at ZeRO-3 (``zero_hpz_partition_size`` ``H``, FSDP2's ``reshard_after_forward=H``)
adds nothing at the boundary: from each unit's forward to its backward the unit holds its
parameters sharded over ``H`` ranks in the parameter dtype (``P * n / H`` for a unit of ``n``,
``P * N / H`` at most, after the last forward), freed by its backward, like activations.
(DeepSpeed holds its secondary partition, ``P * N / H``, as a tensor of each parameter,
``ds_secondary_tensor``; these figures are FSDP2's.)

In a hybrid layout (``zero_optimization.shard_group_size`` ``S``) everything sharded is sharded
over the ``S`` ranks of a shard group and replicated across the ``W / S`` groups: ``W`` above
reads ``S``.

With bf16 parameters, bf16 accumulation and AdamW this is ZeRO's anchor of 2 + 2 + 12 bytes
per parameter at stage 0, and 2 + 2 + 12/W at stage 1. Bucket padding (under
``W * 64`` elements per bucket), without ``param_numels`` the per-parameter block padding of
int8 / fp8 states, and transient buffers during ``step()`` (with offload: the two
host gradient slots of at most one bucket chunk each) are not counted.
ZeRO-3 without ``torch.distributed`` (one process) runs the flat sharded optimizer instead of
FSDP2 and holds what stage 2 holds at ``W = 1``: ``P * N`` parameters plus a ``4 * N`` master;
``W = 1`` at stage 3 is counted so. (A one-rank process group would run FSDP2 and hold
``M * N``, 2 bytes per parameter less for 16-bit parameters with fp32 masters.)

The owners' whole-tensor layout (``param_access: owner``: Muon, Adafactor, DeepSpeed's Muon;
``optimizers/whole/``) is counted parameter by parameter (:func:`owner_memory_model`), from
each parameter's shape, on the rank that holds the most (the figures are that rank's). Each
parameter is owned by one rank (every rank at ZeRO 0), balanced by size (``_owners.py``);
``n_i`` its values, ``O`` the set a rank owns:

============  =====================================================================
params        ``P * N``; at ZeRO-3 (FSDP2) each parameter's local shard in the master
              dtype, its first dimension split in ``ceil(d0 / W)`` rows (FSDP2 pads the
              last rank's shard to that size)
grads         ``0``
accumulator   ``A * N`` at ZeRO 0 and ZeRO-1 with a whole accumulator; ``A * n_i`` over
              ``O`` where the gradient is reduced to its owner at each backward (ZeRO-1
              sharded, ZeRO-2); at ZeRO-3 each parameter's local gradient shard (its rows
              on this rank)
master        ``M * n_i`` over ``O``: a copy even of fp32 parameters (the owner's); a
              Kahan compensation adds ``M * n_i`` (``optimizer.held_tensors()`` lists it
              with the states)
states        over ``O``, the class's states of each shape (``_optimizer_kind.whole_states``:
              Adafactor's row and column factors of a matrix, the variance of a vector;
              Muon's momentum; AdamW's two moments on DeepSpeed's Muon's other
              parameters), each in its dtype (fp32, or bf16 as ``exp_avg_dtype`` says for
              the signed ones and ``exp_avg_sq_dtype`` for the others), plus the fp32
              ``step`` of Adafactor and AdamW (4 bytes) and, under stochastic rounding,
              each parameter's rounding count (8 bytes)
============  =====================================================================

With shard groups of ``S`` ranks (ZeRO 1-3) the owners are assigned over a group's ``S`` ranks
and ZeRO-3 shards over them (FSDP2's HSDP mesh), so ``W`` reads ``S`` above: each rank holds
what the flat layout on ``S`` ranks would.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from dtypeplan._formats import state_format
from dtypeplan.resolver._optimizer_kind import SIGNED_WHOLE_STATES, whole_states
from dtypeplan.resolver._owners import owner_ranks

__all__ = [
    "HOST_MEMORY_KEYS",
    "MEMORY_KEYS",
    "memory_model",
    "owner_memory_model",
]

MEMORY_KEYS = ("params", "grads", "accumulator", "master", "optimizer_states", "total")
"""Device bytes (shared/API.md)."""
HOST_MEMORY_KEYS = (
    "host_params",
    "host_accumulator",
    "host_master",
    "host_optimizer_states",
    "host_total",
)
"""Host bytes of an offloaded optimizer (and, at ZeRO-3 with ``offload_param``, of the shards
and their gradients); 0 without offload."""


def _moment_bytes(
    dtype: str, shard: int, param_numels: Sequence[int] | None, zero_stage: int, w: int
) -> int:
    """One moment's bytes on a rank holding ``shard`` values. With the parameter sizes, a
    quantized moment pads each parameter to whole blocks: at ZeRO-3 every parameter's local
    shard (``numel / W``, one state each); else each parameter's share of the flat chunks
    (exact on one rank; on ``W`` ranks a parameter split between ranks is padded on each, which
    adds under a block per split). Each parameter's values start a block of their own
    (``optimizers/state/storage.BlockLayout``), so a state of several is the sum over them."""
    fmt = state_format(dtype)
    if not fmt.quantized or param_numels is None:
        return fmt.stored_bytes(shard)
    # A model's parameters come in a few sizes: each size is counted once.
    sizes = Counter(param_numels)
    if zero_stage >= 3:
        return sum(count * fmt.stored_bytes(-(-n // w)) for n, count in sizes.items())
    total = sum(count * fmt.stored_bytes(n) for n, count in sizes.items())
    return total * shard // max(sum(param_numels), 1)


def memory_model(
    *,
    num_params: int,
    world_size: int,
    param_dtype: torch.dtype,
    accum_dtype: torch.dtype,
    accumulator_sharded: bool,
    zero_stage: int,
    state_bytes_per_param: int,
    master_dtype: torch.dtype = torch.float32,
    master_rounding: str = "nearest",
    exp_avg_dtype: str = "fp32",
    exp_avg_sq_dtype: str = "fp32",
    offload_optimizer: bool = False,
    offload_param: bool = False,
    param_numels: Sequence[int] | None = None,
    shard_group_size: int | None = None,
    fp8_scales: int = 0,
) -> dict[str, int]:
    if num_params < 0 or world_size < 1:
        raise ValueError("memory() needs num_params >= 0 and world_size >= 1")
    if param_numels is not None and sum(param_numels) != num_params:
        raise ValueError(
            f"memory(): param_numels sum to {sum(param_numels)}, not num_params {num_params}"
        )
    n = num_params
    # A hybrid layout shards over the S ranks of a shard group and replicates across groups:
    # every "/ W" of the flat layout becomes "/ S".
    w = shard_group_size if shard_group_size is not None and world_size > 1 else world_size
    state_divisor = w if zero_stage >= 1 else 1
    if zero_stage >= 3 and world_size == 1 and not offload_param:
        zero_stage = 2  # one process: the flat sharded optimizer, not FSDP2
    if zero_stage >= 3:
        # FSDP2 keeps the shards in the master dtype: they are the master weights; the
        # parameter-dtype copies exist only while a layer runs.
        params = master_dtype.itemsize * n // w
    else:
        params = param_dtype.itemsize * n
    accumulator = accum_dtype.itemsize * n // (w if accumulator_sharded else 1)
    # ZeRO-3 with offload_param (FSDP2's CPUOffloadPolicy): the shards, masters, gradient
    # shards and states all live on the host; the device holds only the unit being run.
    zero3_offload = zero_stage >= 3 and offload_param
    # The optimizer alone offloaded keeps an fp32 host master even where the parameters are
    # the masters on the device (fp32 parameters, FSDP2's shards at ZeRO-3).
    aliased = (param_dtype == master_dtype or zero_stage >= 3) and not (
        offload_optimizer and not zero3_offload
    )
    master = 0 if aliased else 4 * n // state_divisor
    if master_dtype != torch.float32 and master_rounding == "kahan":
        master = master_dtype.itemsize * n // state_divisor
    # S counts fp32 states, 4 bytes a value: Adam's two moments (8), or SGD's momentum (4),
    # which is stored like a first moment. A third state (amsgrad's max_exp_avg_sq) stays fp32.
    shard = n // state_divisor
    moments = (exp_avg_dtype, exp_avg_sq_dtype)[: min(state_bytes_per_param // 4, 2)]
    states = sum(_moment_bytes(dtype, shard, param_numels, zero_stage, w) for dtype in moments)
    # A code table per quantized moment (int8: one per sign), shared by its chunks.
    states += sum(state_format(dtype).codebook_bytes for dtype in moments)
    states += max(state_bytes_per_param - 4 * len(moments), 0) * shard
    # The fp8 all-gather: one fp32 scale per weight gathered in fp8, precomputed after each
    # step for the next gather (torchao's precompute_float8_dynamic_scale_for_fsdp).
    params += 4 * fp8_scales
    figures = {
        "params": params,
        "grads": 0,
        "accumulator": accumulator,
        "master": master,
        "optimizer_states": states,
    }
    host = dict.fromkeys(HOST_MEMORY_KEYS[:-1], 0)
    moved: tuple[str, ...] = ("master", "optimizer_states") if offload_optimizer else ()
    if zero3_offload:
        moved = ("params", "accumulator", "master", "optimizer_states")
    for component in moved:
        host[f"host_{component}"] = figures[component]
        figures[component] = 0
    figures["total"] = sum(figures.values())
    figures.update(host)
    figures["host_total"] = sum(host.values())
    return figures


def owner_memory_model(
    *,
    shapes: Sequence[tuple[int, ...]],
    takes_muon: Sequence[bool],
    torch_class: type,
    world_size: int,
    zero_stage: int,
    param_dtype: torch.dtype,
    accum_dtype: torch.dtype,
    accumulator_sharded: bool,
    master_dtype: torch.dtype,
    master_rounding: str,
    exp_avg_dtype: str,
    exp_avg_sq_dtype: str,
    shard_group_size: int | None = None,
) -> dict[str, int]:
    """The owners' whole-tensor layout (module docstring): the figures of the rank whose
    total is largest. ``shapes`` in the optimizer's parameter order; ``takes_muon``: each
    parameter's DeepSpeed ``use_muon`` tag (read by DeepSpeed's Muon only).
    ``shard_group_size``: the ranks of a shard group (checked to divide ``world_size``; None:
    flat), over which the owners are assigned and ZeRO-3 shards: each rank holds what the flat
    layout on that many ranks would."""
    if world_size < 1:
        raise ValueError("memory() needs world_size >= 1")
    numels = [math.prod(shape) for shape in shapes]
    fsdp2 = zero_stage >= 3 and world_size > 1
    group = world_size if shard_group_size is None or zero_stage == 0 else shard_group_size
    ranks = owner_ranks(numels, group) if zero_stage >= 1 else None
    reduced_to_owner = accumulator_sharded and ranks is not None and not fsdp2
    stored = _whole_state_bytes(master_dtype, exp_avg_dtype, exp_avg_sq_dtype)
    per_param_scalars = (
        8 if master_dtype != torch.float32 and master_rounding == "stochastic" else 0
    )
    kahan = master_dtype != torch.float32 and master_rounding == "kahan"
    ranks_figures = []
    for rank in range(group if ranks is not None or fsdp2 else 1):
        figures = dict.fromkeys(MEMORY_KEYS[:-1], 0)
        for index, (shape, n) in enumerate(zip(shapes, numels, strict=True)):
            owned = ranks is None or ranks[index] == rank
            if fsdp2:
                padded, local = _shard_numels(shape, rank, group)
                figures["params"] += master_dtype.itemsize * padded
                figures["accumulator"] += accum_dtype.itemsize * local
            else:
                figures["params"] += param_dtype.itemsize * n
                if owned or not reduced_to_owner:
                    figures["accumulator"] += accum_dtype.itemsize * n
            if not owned:
                continue
            figures["master"] += master_dtype.itemsize * n * (2 if kahan else 1)
            states = whole_states(torch_class, shape, takes_muon[index])
            figures["optimizer_states"] += states.scalar_bytes + per_param_scalars
            figures["optimizer_states"] += sum(
                stored(name, values) for name, values in states.values.items()
            )
        figures["total"] = sum(figures.values())
        ranks_figures.append(figures)
    largest = max(ranks_figures, key=lambda figures: figures["total"])
    return {**largest, **dict.fromkeys(HOST_MEMORY_KEYS, 0)}


def _shard_numels(shape: tuple[int, ...], rank: int, world_size: int) -> tuple[int, int]:
    """FSDP2's shard of a parameter on ``rank``: the values its storage holds (``ceil(d0 /
    W)`` rows, padded) and the values that are the parameter's (its rows on this rank)."""
    if not shape:
        return 1, 1
    rows = -(-shape[0] // world_size)
    rest = math.prod(shape[1:])
    mine = max(0, min(rows, shape[0] - rank * rows))
    return rows * rest, mine * rest


def _whole_state_bytes(
    master_dtype: torch.dtype, exp_avg_dtype: str, exp_avg_sq_dtype: str
) -> Callable[[str, int], int]:
    """Bytes of a whole-tensor state of ``values`` values, by its name: torch's fp32 unless
    the masters or states are 16-bit (``optimizers/whole/low_precision.py`` stores each state in
    its dtype then)."""
    low_precision = master_dtype != torch.float32 or (exp_avg_dtype, exp_avg_sq_dtype) != (
        "fp32",
        "fp32",
    )

    def stored(name: str, values: int) -> int:
        if not low_precision:
            return 4 * values
        dtype = exp_avg_dtype if name in SIGNED_WHOLE_STATES else exp_avg_sq_dtype
        return state_format(dtype).stored_bytes(values)

    return stored
