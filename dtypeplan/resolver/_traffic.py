"""The byte model behind ``plan.traffic()``: what one rank sends per optimizer step.

Bytes are counted as :class:`dtypeplan.comm.CommStats` counts them: a ring reduce-scatter or
all-gather of ``n`` bytes over ``g`` ranks sends ``n * (g - 1) // g`` from each rank, an
all-reduce twice that, and the ``fp32_sum`` reduction (an all-to-all) as much as the
reduce-scatter it replaces. For ``N`` parameters on ``W`` ranks in shard groups of ``S``
(``R = W / S`` groups; flat: ``S = W``, ``R = 1``), ``k`` micro-batches per step, ``P`` and
``C`` the bytes per element of the parameter and communication dtypes and ``A`` that of the
wire across groups (``C`` unless ``communication_data_type_across_groups`` says otherwise):

=========  ============================================  ==================================
stage      within the shard group (flat: the group)      across the groups (hybrid only)
=========  ============================================  ==================================
0          all-reduce of ``C * N``, once                 none: nothing is sharded, the
                                                         layout stays flat
1 whole    reduce-scatter ``C * N`` once, all-gather     all-reduce of the ``N / S`` shard
           of the parameters ``P * N``                   in ``A``, once
1 sharded  reduce-scatter ``C * N`` per micro-batch,     as ZeRO-1
and 2      all-gather ``P * N`` once
3 (FSDP2)  per micro-batch: all-gathers ``P * N`` for    all-reduce of the ``N / S`` shard
           forward and again for backward, a             in ``A`` per micro-batch (FSDP2's
           reduce-scatter ``C * N``                      HSDP reduces every backward)
3 with     per micro-batch: all-gather ``P * N`` over    none (hpZ is flat only)
hpZ ``H``  the group for forward, ``P * N`` within the
           ``H`` ranks of the secondary partition for
           backward (``all_gather_secondary``: each
           rank sends ``(H - 1) / H`` of it), a
           reduce-scatter ``C * N``
=========  ============================================  ==================================

fp8 compute at ZeRO-3 with ``fp8.all_gather: fp8`` (``F`` values in ``L`` weights gathered in
fp8, ``fp8_gathered``): each all-gather sends those weights as one e4m3 byte a value,
``P * (N - F) + F`` bytes instead of ``P * N`` (about half for bf16 parameters), and the
``L`` weights' fp32 maxima are all-reduced for the gathers' scales after each step and at the
start of each forward, so that weights changed outside ``step()`` are followed (torchao's
``precompute_float8_dynamic_scale_for_fsdp``: ``4 * L`` bytes each, counted as all-reduces).

int8 / fp8 across the groups (``_quantized_wire.py``): the engine all-reduces each bucket's
chunk (``bucket / S`` values) on its own, each padded to whole blocks of 256 per rank's slice
(a multiple of ``R * 256`` values) and sent as one code byte a value plus one fp32 scale a
block, once in an all-to-all and once in an all-gather (each ``(R - 1) / R`` of it):
``2 * (1 + 4/256)`` bytes a value against ``2 * A`` for a dtype wire, plus each chunk's
padding. The buckets are the engine's (``buckets``: their sizes, as an optimizer lays them
out) or, not given, ``N`` cut into buckets of ``reduce_bucket_size`` (default
:data:`DEFAULT_BUCKET_NUMEL`) elements.

Not counted, as ``CommStats`` does not count them: the step's small summary all-reduce (a few
scalars) and one-off broadcasts at build. Bucket padding (the flat buffer is padded to whole
buckets of a multiple of ``W`` elements) is left out: pass the padded size for exact figures,
and on an int8/fp8 wire across the groups the bucket sizes too.
ZeRO-3's figures are FSDP2's collectives as its defaults run them (every unit resharded after
forward; the root unit's, kept for backward, make the backward figure slightly high).

The owners' whole-tensor layout (``param_access: owner``, ``optimizers/whole/``;
:func:`owner_traffic_model`) sends one collective per parameter, from or to its owner. A
reduce to one rank and a broadcast from one rank of ``n`` bytes are counted as their ring (a
chain through the ``W`` ranks) sends them, ``n * (W - 1) / W`` per rank, as a reduce-scatter
and an all-gather are: per rank it is the mean, whichever rank owns the parameter. With ``L``
parameters of ``n_i`` values (``N`` in all) and ``M``, ``A`` the bytes of the master and
accumulation dtypes:

=========  ===========================================================================
stage      per step
=========  ===========================================================================
0          all-reduce of each gradient ``C * n_i``, once (every rank updates everything)
1 whole    reduce of each gradient ``C * n_i`` to its owner, once; broadcast of each
           updated parameter ``P * n_i`` from its owner
1 sharded  reduce of each gradient to its owner at each micro-batch's backward, ``k``
and 2      times; broadcast ``P * n_i``
3 (FSDP2)  FSDP2's all-gathers ``P * N`` (forward and backward) and reduce-scatter
           ``C * N`` per micro-batch, as above; at the step an all-gather of each
           parameter's accumulated gradient ``A * n_i`` (every rank receives it, the owner
           uses it) and a broadcast of the updated parameter ``M * n_i`` (FSDP2's shards
           are in the master dtype)
=========  ===========================================================================

Each step also all-reduces which parameters got a gradient on any rank (one fp32 flag a
parameter, ``4 * L`` bytes) and, from ZeRO-1 on, the owners' squared norms (one fp32 value):
both counted under ``all_reduce``, over the whole group (within, with shard groups too).

With shard groups of ``S`` ranks (``R = W / S`` groups; ZeRO 1-3) the reduces, broadcasts,
gathers and reduce-scatters above run within the shard group (``S`` for ``W``: the owners are
assigned over its ranks), and across the groups: at ZeRO 1-2 the owners of each parameter
(one rank per group) all-reduce its reduced gradient ``C * n_i`` once per step, only they take
part, so the figure is the busiest owner's (the one whose owned parameters send the most); at
ZeRO-3 FSDP2's HSDP all-reduces the ``N / S`` reduced shard per micro-batch, as above.

At ZeRO-3 FSDP2 (and DTensor's gather of a gradient) pads a first dimension the ranks do not
divide to a multiple of ``W`` (``S``) rows; the figures count the unpadded sizes, exact where
``W`` (``S``) divides every parameter's first dimension.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dtypeplan._dtypes import DTYPES
from dtypeplan.comm._quantized_wire import BLOCK, WIRE_FORMATS, quantized_wire_bytes
from dtypeplan.resolver._frozen import FrozenDict
from dtypeplan.resolver._owners import owner_ranks

__all__ = [
    "DEFAULT_BUCKET_NUMEL",
    "QUANTIZED_WIRES",
    "QUANTIZED_WIRE_BLOCK",
    "Traffic",
    "quantized_bytes",
    "owner_traffic_model",
    "traffic_model",
]

DEFAULT_BUCKET_NUMEL = 1 << 22
"""Elements per bucket unless ``zero_optimization.reduce_bucket_size`` says otherwise (16 MiB
of fp32): small enough that the first buckets' reductions overlap the rest of backward. The
flat engine's; here for the traffic model."""

QUANTIZED_WIRES = tuple(WIRE_FORMATS)
QUANTIZED_WIRE_BLOCK = BLOCK
"""Values per fp32 scale on a block-quantized wire."""


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """Bytes one rank sends per optimizer step, by level and by collective."""

    num_params: int
    world_size: int
    shard_group_size: int
    """Ranks per shard group (the world size when flat)."""
    micro_batches: int
    within: FrozenDict[str, int]
    """Collective -> bytes over the shard group (flat: the whole group)."""
    across: FrozenDict[str, int]
    """Collective -> bytes over the replica group, across the shard groups (empty when flat)."""

    @property
    def hybrid(self) -> bool:
        return self.shard_group_size < self.world_size

    @property
    def within_bytes(self) -> int:
        return sum(self.within.values())

    @property
    def across_bytes(self) -> int:
        return sum(self.across.values())

    @property
    def total_bytes(self) -> int:
        return self.within_bytes + self.across_bytes

    def to_dict(self) -> dict[str, object]:
        return {
            "num_params": self.num_params,
            "world_size": self.world_size,
            "shard_group_size": self.shard_group_size,
            "micro_batches": self.micro_batches,
            "within": dict(self.within),
            "across": dict(self.across),
            "within_bytes": self.within_bytes,
            "across_bytes": self.across_bytes,
            "total_bytes": self.total_bytes,
        }

    def report(self) -> str:
        """The figures as lines of text (for ``explain`` and ``dtypeplan check``)."""
        groups = self.world_size // self.shard_group_size
        layout = (
            f"{groups} shard groups of {self.shard_group_size}"
            if self.hybrid
            else f"flat, {self.world_size} ranks"
        )
        lines = [
            f"traffic per rank per step ({_count(self.num_params)} parameters, {layout}, "
            f"{self.micro_batches} micro-batch{'es' if self.micro_batches != 1 else ''}):"
        ]
        for level, ops in (("within the shard group", self.within), ("across groups", self.across)):
            if level == "across groups" and not self.hybrid:
                continue
            detail = ", ".join(f"{op} {_size(n)}" for op, n in ops.items()) or "nothing"
            lines.append(f"  {level:<22}  {_size(sum(ops.values())):>10}  ({detail})")
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _count(n: int) -> str:
    for scale, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= scale:
            return f"{n / scale:g}{suffix}"
    return str(n)


def _ring(nbytes: int, group: int) -> int:
    return nbytes * (group - 1) // group


def quantized_bytes(numel: int, group: int) -> int:
    """Bytes of one collective step (all-to-all or all-gather) of a block-quantized all-reduce
    of ``numel`` values over ``group`` ranks: padded to whole blocks per rank's slice, counted
    by the wire itself (``comm/_quantized_wire.py``)."""
    return quantized_wire_bytes(numel, group).get("all_to_all", 0)


def _add(ops: dict[str, int], op: str, nbytes: int) -> None:
    if nbytes:
        ops[op] = ops.get(op, 0) + nbytes


def _reduce(ops: dict[str, int], nbytes: int, group: int, fp32_sum: bool, times: int) -> None:
    """A reduce-scatter (``fp32_sum``: the all-to-all that replaces it) ``times`` times."""
    _add(ops, "all_to_all" if fp32_sum else "reduce_scatter", times * _ring(nbytes, group))


def _all_reduce(
    ops: dict[str, int],
    numel: int,
    wire: str,
    group: int,
    fp32_sum: bool,
    times: int,
    chunks: tuple[int, ...] | None = None,
) -> None:
    """An all-reduce of ``numel`` values ``times`` times; ``chunks``: the sizes it is sent in,
    one collective each (a quantized wire pads each to whole blocks on its own)."""
    if wire in QUANTIZED_WIRES:
        # Buckets are mostly of one size: each distinct chunk size is counted once.
        sizes = Counter(chunks or (numel,))
        sent = sum(count * quantized_bytes(chunk, group) for chunk, count in sizes.items())
        _add(ops, "all_to_all", times * sent)
        _add(ops, "all_gather", times * sent)
        return
    nbytes = numel * DTYPES[wire].itemsize
    if fp32_sum and wire != "fp32":
        # _collectives.py: an fp32-summing all-reduce is its reduce-scatter and an all-gather.
        _add(ops, "all_to_all", times * _ring(nbytes, group))
        _add(ops, "all_gather", times * _ring(nbytes, group))
        return
    _add(ops, "all_reduce", times * 2 * _ring(nbytes, group))


def traffic_model(
    *,
    num_params: int,
    world_size: int,
    shard_group_size: int,
    micro_batches: int,
    zero_stage: int,
    accumulator_sharded: bool,
    param_dtype: torch.dtype,
    comm_dtype: str,
    comm_reduction: str,
    wire_across: str,
    buckets: tuple[int, ...] | None = None,
    bucket_numel: int | None = None,
    fp8_gathered: tuple[int, ...] = (),
    hpz_partition_size: int = 1,
) -> Traffic:
    """See the module docstring; ``shard_group_size`` already checked to divide the world.
    ``buckets``: the engine's bucket sizes (summing to ``num_params``); None: ``num_params``
    cut into buckets of ``bucket_numel`` (default :data:`DEFAULT_BUCKET_NUMEL`).
    ``fp8_gathered``: the sizes of the weights ZeRO-3 gathers in fp8."""
    if num_params < 0 or world_size < 1 or micro_batches < 1:
        raise ValueError("traffic() needs num_params >= 0, world_size >= 1, micro_batches >= 1")
    if buckets is None:
        size = bucket_numel or DEFAULT_BUCKET_NUMEL
        buckets = (size,) * (num_params // size) + (
            (num_params % size,) if num_params % size else ()
        )
    elif sum(buckets) != num_params:
        raise ValueError(f"traffic(): buckets sum to {sum(buckets)}, not num_params {num_params}")
    n, w, k = num_params, world_size, micro_batches
    s = shard_group_size if zero_stage >= 1 else w
    replicas = w // s
    fp32_sum = comm_reduction == "fp32_sum" and comm_dtype != "fp32"
    within: dict[str, int] = {}
    across: dict[str, int] = {}
    c, p = DTYPES[comm_dtype].itemsize, param_dtype.itemsize
    if w > 1:
        if zero_stage == 0:
            _all_reduce(within, n, comm_dtype, s, fp32_sum, 1)
        elif zero_stage in (1, 2):
            per_micro_batch = accumulator_sharded or zero_stage == 2
            _reduce(within, c * n, s, fp32_sum, k if per_micro_batch else 1)
            _add(within, "all_gather", _ring(p * n, s))
            if replicas > 1:
                # The across level takes the same method; it is its own wire that decides
                # whether fp32_sum changes the collective (_all_reduce checks it).
                quantized = wire_across in QUANTIZED_WIRES
                chunks = tuple(b // s for b in buckets) if quantized else None
                _all_reduce(
                    across, n // s, wire_across, replicas, comm_reduction == "fp32_sum", 1, chunks
                )
        elif 1 < hpz_partition_size < s:
            # hpZ: forward gathers over the group, backward within the secondary partition
            # (in the parameter dtype: the table refuses hpZ with the fp8 all-gather).
            _add(within, "all_gather", k * _ring(p * n, s))
            _add(within, "all_gather_secondary", k * _ring(p * n, hpz_partition_size))
            _reduce(within, c * n, s, False, k)
        else:
            f = sum(fp8_gathered)
            _add(within, "all_gather", 2 * k * _ring(p * (n - f) + f, s))
            _reduce(within, c * n, s, False, k)
            # The scales after each step and at each forward (weights may change between).
            _add(within, "all_reduce", (1 + k) * 2 * _ring(4 * len(fp8_gathered), s))
            if replicas > 1:
                _all_reduce(across, n // s, wire_across, replicas, False, k)
    return Traffic(
        num_params=n,
        world_size=w,
        shard_group_size=s,
        micro_batches=k,
        within=_frozen(within),
        across=_frozen(across),
    )


def _frozen(ops: Mapping[str, int]) -> FrozenDict[str, int]:
    return FrozenDict(dict(ops))


def owner_traffic_model(
    *,
    param_numels: tuple[int, ...],
    world_size: int,
    micro_batches: int,
    zero_stage: int,
    accumulator_sharded: bool,
    param_dtype: torch.dtype,
    master_dtype: torch.dtype,
    accum_dtype: torch.dtype,
    comm_dtype: str,
    shard_group_size: int | None = None,
) -> Traffic:
    """The owners' whole-tensor layout (module docstring); ``param_numels`` in the optimizer's
    parameter order (each parameter is its own collective, rounded as CommStats rounds it).
    ``shard_group_size``: the ranks of a shard group (checked to divide ``world_size``; None:
    flat)."""
    if world_size < 1 or micro_batches < 1:
        raise ValueError("traffic() needs world_size >= 1, micro_batches >= 1")
    n, w, k = sum(param_numels), world_size, micro_batches
    s = w if shard_group_size is None or zero_stage == 0 else shard_group_size
    replicas = w // s
    within: dict[str, int] = {}
    across: dict[str, int] = {}
    c, p = DTYPES[comm_dtype].itemsize, param_dtype.itemsize

    def each(nbytes_per_value: int) -> int:
        return sum(_ring(nbytes_per_value * n_i, s) for n_i in param_numels)

    if w > 1:
        # The step's flags and norm span the whole group; counted within.
        _add(within, "all_reduce", 2 * _ring(4 * len(param_numels), w))
        if zero_stage == 0:
            _add(within, "all_reduce", 2 * each(c))
        else:
            _add(within, "all_reduce", 2 * _ring(4, w))
        if zero_stage in (1, 2):
            _add(within, "reduce", (k if accumulator_sharded else 1) * each(c))
            _add(within, "broadcast", each(p))
            if replicas > 1:
                # Only the owners of a parameter sum it across: the busiest owner's bytes.
                owners = owner_ranks(param_numels, s)
                sent = [0] * s
                for owner, n_i in zip(owners, param_numels, strict=True):
                    sent[owner] += 2 * _ring(c * n_i, replicas)
                _add(across, "all_reduce", max(sent))
        elif zero_stage >= 3:
            _add(within, "all_gather", 2 * k * _ring(p * n, s) + each(accum_dtype.itemsize))
            _reduce(within, c * n, s, False, k)
            _add(within, "broadcast", each(master_dtype.itemsize))
            if replicas > 1:
                _all_reduce(across, n // s, comm_dtype, replicas, False, k)
    return Traffic(
        num_params=n,
        world_size=w,
        shard_group_size=s,
        micro_batches=k,
        within=_frozen(within),
        across=_frozen(across),
    )
