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
states        ``S * N / D`` with fp32 moments; each moment counts its own dtype:
              4 bytes a value in fp32, 2 in bf16, and for int8 / fp8 (torchao's
              blockwise codes) 1 byte a value plus one fp32 scale per 256 values
              (``1 + 4/256``), and 1 KiB per int8 moment for its code table; see
              ``state_bytes``. Quantized blocks never span two parameters: each
              parameter's values are padded to whole blocks (up to 255 zero values each),
              counted when ``param_numels`` gives the parameter sizes
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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

__all__ = [
    "HOST_MEMORY_KEYS",
    "INT8_CODE_TABLE_BYTES",
    "MEMORY_KEYS",
    "QUANTIZED",
    "QUANTIZED_BLOCK",
    "memory_model",
    "state_bytes",
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

QUANTIZED_BLOCK = 256
"""Values per fp32 scale in int8 and fp8 states (torchao's default block for both)."""

INT8_CODE_TABLE_BYTES = 256 * 4
"""torchao's 8-bit dynamic-tree map: 256 fp32 values, one table per sign, shared by chunks."""

QUANTIZED = ("int8", "fp8")
"""The ``states`` dtypes stored as blockwise codes."""


def state_bytes(dtype: str, numel: int) -> int:
    """Bytes of one optimizer state of ``numel`` values stored as ``dtype`` (a ``states`` name).

    int8 and fp8 states are torchao tensors over ``numel`` padded to whole blocks: one code
    byte a value and one fp32 scale a block. Each parameter's values start a block of their
    own (``optimizers/state/storage.BlockLayout``), so a state of several parameters is the sum
    of this over their sizes; ``memory_model`` adds the int8 code tables (1 KiB per moment).
    """
    if dtype == "fp32":
        return 4 * numel
    if dtype == "bf16":
        return 2 * numel
    blocks = -(-numel // QUANTIZED_BLOCK)
    return blocks * QUANTIZED_BLOCK + 4 * blocks


def _moment_bytes(
    dtype: str, shard: int, param_numels: Sequence[int] | None, zero_stage: int, w: int
) -> int:
    """One moment's bytes on a rank holding ``shard`` values. With the parameter sizes, a
    quantized moment pads each parameter to whole blocks: at ZeRO-3 every parameter's local
    shard (``numel / W``, one state each); else each parameter's share of the flat chunks
    (exact on one rank; on ``W`` ranks a parameter split between ranks is padded on each, which
    adds under 256 values per split)."""
    if dtype not in QUANTIZED or param_numels is None:
        return state_bytes(dtype, shard)
    # A model's parameters come in a few sizes: each size is counted once.
    sizes = Counter(param_numels)
    if zero_stage >= 3:
        return sum(count * state_bytes(dtype, -(-n // w)) for n, count in sizes.items())
    total = sum(count * state_bytes(dtype, n) for n, count in sizes.items())
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
    # One int8 code table per moment's sign (the first moment's is signed), shared by chunks.
    states += INT8_CODE_TABLE_BYTES * sum(dtype == "int8" for dtype in moments)
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
