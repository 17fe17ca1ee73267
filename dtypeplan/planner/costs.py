"""What one combination costs on a fleet: memory per rank, traffic per step, time, drift.

The figures of the model states and of the traffic are those of ``plan.memory()`` and
``plan.traffic()``: the same byte models (``resolver/_memory.py``, ``resolver/_traffic.py``)
called with the combination's values, so that tens of thousands of combinations are costed
without resolving each; the finalists are resolved and their figures checked equal to the
plan's (``planner/__init__.py``). Added here, beside the model states:

* activations (``activations.py``, Korthikanti et al. 2022) for one micro-batch;
* at ZeRO-3, the units FSDP2 holds gathered: two transformer blocks (the one running and the
  one prefetched) in the parameter dtype;
* the compute time: ``6 * N * tokens`` flops at the fleet's sustained rate (more with full
  recomputation, less for the fp8 layers, more for fp32 without autocast);
* the communication time: each level's bytes over the link it runs on (a collective whose
  ranks fit in one node runs on the intra-node links; one that spans nodes waits on the
  inter-node link); with offload, the copies between device and host over the host link. No
  latency, no overlap of communication with compute: a comparison of combinations, not a
  step-time forecast.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dtypeplan._dtypes import DTYPES
from dtypeplan.muon import muon_by_name
from dtypeplan.planner.activations import RECOMPUTE, activation_bytes
from dtypeplan.planner.fleet import Fleet
from dtypeplan.planner.model_sizes import ModelSizes
from dtypeplan.planner.numerics import NumericalCost, numerical_cost
from dtypeplan.resolver import Traffic
from dtypeplan.resolver._dimensions import MASTER_ROUNDING, STATE_PAIRS
from dtypeplan.resolver._memory import memory_model, owner_memory_model
from dtypeplan.resolver._traffic import owner_traffic_model, traffic_model

__all__ = ["Candidate", "Coster", "Workload"]

# Plain dicts: these are read for every combination costed (tens of thousands).
_ROUNDING = dict(MASTER_ROUNDING)
_PAIRS = dict(STATE_PAIRS)
_ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What a step runs: the model, its batch, the optimizer's fp32 state bytes."""

    sizes: ModelSizes
    micro_batch: int = 1
    """Sequences per micro-batch per GPU (for the activations)."""
    seq: int = 2048
    micro_batches: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    recompute: str = "auto"
    """none, selective, full, or auto: for each combination the least that fits."""
    state_bytes_per_param: int = 8
    """fp32 optimizer-state bytes per parameter (AdamW 8, SGD with momentum 4)."""
    whole_class: type | None = None
    """The optimizer class where it runs on whole parameters (``param_access: owner``: Muon,
    Adafactor), whose states and owners depend on each parameter
    (``resolver/_memory.owner_memory_model``); None: the flat layouts."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One OK combination with its figures on one fleet."""

    values: Mapping[str, Any]
    """The combination: one value per choice dimension of the table."""
    shard_group_size: int | None
    rule_id: str
    implementation: str | None
    memory: Mapping[str, int]
    """``plan.memory()``'s keys for this combination."""
    activations: int
    recompute: str
    """The activation recomputation counted (``activations.py``)."""
    gathered: int
    """ZeRO-3's gathered units (two blocks in the parameter dtype); 0 below stage 3."""
    traffic: Traffic
    intra_node_bytes: int
    inter_node_bytes: int
    compute_seconds: float
    """The step's matmul flops over the fleet's sustained flops (``Coster.compute_seconds``)."""
    comm_seconds: float
    host_link_seconds: float
    numerics: NumericalCost
    rejected: str | None = None
    """Why it does not fit the fleet (None: it fits)."""
    pareto: bool = field(default=False, compare=False)

    @property
    def device_bytes(self) -> int:
        return self.memory["total"] + self.activations + self.gathered

    @property
    def host_bytes(self) -> int:
        return self.memory["host_total"]

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds + self.host_link_seconds

    @property
    def fits(self) -> bool:
        return self.rejected is None


class Coster:
    """Costs combinations on one fleet for one workload, caching each part by the values it
    depends on (the memory by the memory model's arguments, the traffic by the traffic
    model's, the drift by the dtypes), so that tens of thousands of combinations cost
    microseconds each. :meth:`key` is what equal costs share; :meth:`candidate` builds the
    full record."""

    def __init__(self, workload: Workload, fleet: Fleet) -> None:
        self.workload = workload
        self.fleet = fleet
        self._memory: dict[tuple[Any, ...], dict[str, int]] = {}
        self._traffic: dict[tuple[Any, ...], tuple[Traffic, int, int]] = {}
        self._numerics: dict[tuple[Any, ...], NumericalCost] = {}
        self._activations: dict[tuple[int, str], int] = {}
        self._fitted: dict[tuple[int, int], tuple[str, int]] = {}
        self._compute: dict[tuple[bool, bool, str], float] = {}

    def _parts(
        self, values: Mapping[str, Any], group: int | None
    ) -> tuple[dict[str, int], tuple[Traffic, int, int], NumericalCost, int, str, int, float]:
        workload, fleet = self.workload, self.fleet
        margs = _memory_args(values, group, workload, fleet)
        memory = self._memory.get(margs)
        if memory is None:
            memory = self._memory[margs] = _memory_model(margs, workload)
        targs = _traffic_args(values, group, workload, fleet)
        traffic = self._traffic.get(targs)
        if traffic is None:
            t = _traffic_model(targs, workload)
            traffic = self._traffic[targs] = (t, *_by_link(t, values, fleet))
        nargs = _numeric_values(values)
        numerics = self._numerics.get(nargs)
        if numerics is None:
            numerics = self._numerics[nargs] = numerical_cost(values)
        param_bytes = _ITEMSIZE[values["params"]]
        gathered = 2 * workload.sizes.largest_block * param_bytes if values["stage"] == 3 else 0
        compute_bytes = 2 if values["params"] != "fp32" or values["autocast"] != "none" else 4
        base = memory["total"] + gathered
        fitted = self._fitted.get((compute_bytes, base))
        if fitted is None:
            fitted = self._fitted[compute_bytes, base] = self._recompute(compute_bytes, base)
        recompute, activations = fitted
        host_seconds = _host_link_bytes(values, group, workload, fleet) / fleet.host_link_bandwidth
        return memory, traffic, numerics, gathered, recompute, activations, host_seconds

    def _recompute(self, compute_bytes: int, base: int) -> tuple[str, int]:
        """The least recomputation whose activations fit beside ``base`` device bytes (the
        given one when the workload names one; full when none fits)."""
        options = RECOMPUTE if self.workload.recompute == "auto" else (self.workload.recompute,)
        activations = 0
        for option in options:
            key = (compute_bytes, option)
            cached = self._activations.get(key)
            if cached is None:
                cached = self._activations[key] = activation_bytes(
                    self.workload.sizes,
                    micro_batch=self.workload.micro_batch,
                    seq=self.workload.seq,
                    recompute=option,
                    bytes_per_value=compute_bytes,
                )
            activations = cached
            if base + activations <= self.fleet.usable_gpu_memory:
                break
        return option, activations

    def _compute_seconds(self, values: Mapping[str, Any], recompute: str) -> float:
        """``6 * N * tokens`` flops per step (forward 2, backward 4), plus the forward again
        under full recomputation, at the fleet's sustained rate: the layers computed in fp8 at
        twice it, everything at half of it for fp32 parameters without autocast (TF32)."""
        key = (
            values["params"] == "fp32" and values["autocast"] == "none",
            bool(values["fp8"]),
            recompute,
        )
        seconds = self._compute.get(key)
        if seconds is None:
            seconds = self._compute[key] = self._compute_model(*key)
        return seconds

    def _compute_model(self, tf32: bool, fp8: bool, recompute: str) -> float:
        sizes, workload = self.workload.sizes, self.workload
        tokens = workload.micro_batch * workload.seq * workload.micro_batches
        passes = 8 if recompute == "full" else 6
        flops = float(passes * sizes.num_params * tokens)
        rate = self.fleet.gpu_flops
        if tf32:
            rate /= 2
        elif fp8:
            share = sum(sizes.fp8_weights) / max(sizes.num_params, 1)
            flops *= 1 - share / 2
        return flops / rate

    def key(self, values: Mapping[str, Any], group: int | None) -> tuple[Any, ...]:
        """Equal keys: equal costs on every axis (the planner keeps the first of each)."""
        memory, (_, intra, inter), numerics, gathered, recompute, activations, host_seconds = (
            self._parts(values, group)
        )
        return (
            memory["total"] + gathered + activations,
            memory["host_total"],
            intra,
            inter,
            host_seconds,
            recompute,
            numerics.total,
            bool(numerics.unmeasured),
            self._compute_seconds(values, recompute),
        )

    def candidate(
        self,
        values: Mapping[str, Any],
        group: int | None,
        rule_id: str,
        implementation: str | None,
    ) -> Candidate:
        memory, (traffic, intra, inter), numerics, gathered, recompute, activations, host_s = (
            self._parts(values, group)
        )
        fleet = self.fleet
        candidate = Candidate(
            values=dict(values),
            shard_group_size=group,
            rule_id=rule_id,
            implementation=implementation,
            memory=dict(memory),
            activations=activations,
            recompute=recompute,
            gathered=gathered,
            traffic=traffic,
            intra_node_bytes=intra,
            inter_node_bytes=inter,
            compute_seconds=self._compute_seconds(values, recompute),
            comm_seconds=intra / fleet.intra_node_bandwidth + inter / fleet.inter_node_bandwidth,
            host_link_seconds=host_s,
            numerics=numerics,
        )
        return _with_fit(candidate, fleet)


_NUMERIC_DIMENSIONS = (
    "params",
    "master",
    "states",
    "accum",
    "comm",
    "shard_groups",
    "autocast",
    "fp8",
    "fp8_recipe",
)
"""The dimensions ``numerics.numerical_cost`` reads."""
_numeric_values = operator.itemgetter(*_NUMERIC_DIMENSIONS)


def _memory_args(
    values: Mapping[str, Any], shard_group_size: int | None, workload: Workload, fleet: Fleet
) -> tuple[Any, ...]:
    master_dtype, rounding = _ROUNDING[values["master"]]
    exp_avg, exp_avg_sq = _PAIRS[values["states"]]
    fp8_gathered = _fp8_gathered(values, fleet)
    return (
        fleet.gpus,
        values["params"],
        values["accum"],
        values["sharded"] and fleet.gpus > 1,
        values["stage"],
        workload.state_bytes_per_param,
        master_dtype,
        rounding,
        exp_avg,
        exp_avg_sq,
        values["offload_optimizer"] == "cpu",
        values["offload_param"] == "cpu",
        shard_group_size,
        fp8_gathered,
    )


def _fp8_gathered(values: Mapping[str, Any], fleet: Fleet) -> bool:
    return bool(
        values["fp8"]
        and values["fp8_all_gather"] == "fp8"
        and values["stage"] >= 3
        and fleet.gpus > 1
    )


def _memory_model(args: tuple[Any, ...], workload: Workload) -> dict[str, int]:
    (w, params, accum, sharded, stage, state_bytes, master, rounding, m, v, off_opt, off_par,
     group, fp8) = args  # fmt: skip
    sizes = workload.sizes
    if workload.whole_class is not None:
        # The table gives the owners' layout neither offload nor fp8 (shard groups: yes).
        shapes = [shape for _, shape in sizes.param_shapes]
        return owner_memory_model(
            shapes=shapes,
            takes_muon=[muon_by_name(name, len(shape)) for name, shape in sizes.param_shapes],
            torch_class=workload.whole_class,
            world_size=w,
            zero_stage=stage,
            param_dtype=DTYPES[params],
            accum_dtype=DTYPES[accum],
            accumulator_sharded=sharded,
            master_dtype=DTYPES[master],
            master_rounding=rounding,
            exp_avg_dtype=m,
            exp_avg_sq_dtype=v,
            shard_group_size=group,
        )
    return memory_model(
        num_params=sizes.num_params,
        world_size=w,
        shard_group_size=group,
        param_dtype=DTYPES[params],
        accum_dtype=DTYPES[accum],
        accumulator_sharded=sharded,
        zero_stage=stage,
        state_bytes_per_param=state_bytes,
        master_dtype=DTYPES[master],
        master_rounding=rounding,
        exp_avg_dtype=m,
        exp_avg_sq_dtype=v,
        offload_optimizer=off_opt,
        offload_param=off_par,
        param_numels=sizes.param_numels,
        fp8_scales=len(sizes.fp8_weights) if fp8 else 0,
    )


def _traffic_args(
    values: Mapping[str, Any], shard_group_size: int | None, workload: Workload, fleet: Fleet
) -> tuple[Any, ...]:
    wire = values["shard_groups"].partition("_")[2] or values["comm"]
    hpz = fleet.ranks_per_node if values["hierarchical_partitioning"] else 1
    return (
        fleet.gpus,
        shard_group_size or fleet.gpus,
        workload.micro_batches,
        values["stage"],
        values["sharded"] and fleet.gpus > 1,
        values["params"],
        values["comm"],
        values["reduction"],
        wire,
        _fp8_gathered(values, fleet),
        hpz,
        _ROUNDING[values["master"]][0],
        values["accum"],
    )


def _traffic_model(args: tuple[Any, ...], workload: Workload) -> Traffic:
    w, group, k, stage, sharded, params, comm, reduction, wire, fp8, hpz, master, accum = args
    sizes = workload.sizes
    if workload.whole_class is not None:
        return owner_traffic_model(
            param_numels=sizes.param_numels,
            world_size=w,
            micro_batches=k,
            zero_stage=stage,
            accumulator_sharded=sharded,
            param_dtype=DTYPES[params],
            master_dtype=DTYPES[master],
            accum_dtype=DTYPES[accum],
            comm_dtype=comm,
            shard_group_size=group,
        )
    return traffic_model(
        num_params=sizes.num_params,
        world_size=w,
        shard_group_size=group,
        micro_batches=k,
        zero_stage=stage,
        accumulator_sharded=sharded,
        param_dtype=DTYPES[params],
        comm_dtype=comm,
        comm_reduction=reduction,
        wire_across=wire,
        fp8_gathered=sizes.fp8_weights if fp8 else (),
        hpz_partition_size=hpz,
    )


def _by_link(traffic: Traffic, values: Mapping[str, Any], fleet: Fleet) -> tuple[int, int]:
    """Bytes on the intra-node and the inter-node links: each level's collectives on the link
    that its group's ring waits on (the secondary all-gather of hpZ stays within a node)."""
    intra = inter = 0
    for op, nbytes in traffic.within.items():
        ranks = fleet.ranks_per_node if op == "all_gather_secondary" else traffic.shard_group_size
        if ranks <= fleet.gpus_per_node:
            intra += nbytes
        else:
            inter += nbytes
    # Across the groups: the replicas of a shard sit in different nodes unless all fit in one.
    if fleet.gpus <= fleet.gpus_per_node:
        intra += traffic.across_bytes
    else:
        inter += traffic.across_bytes
    return intra, inter


def _host_link_bytes(
    values: Mapping[str, Any], shard_group_size: int | None, workload: Workload, fleet: Fleet
) -> int:
    """Bytes an offloaded optimizer copies between device and host per step: the gradient
    shard down and the updated parameters up; with ``offload_param`` at ZeRO-3 also the
    shards up for each gather (forward and backward, every micro-batch)."""
    if values["offload_optimizer"] != "cpu":
        return 0
    n = workload.sizes.num_params
    shard = n // (shard_group_size or fleet.gpus)
    accum = _ITEMSIZE[values["accum"]]
    params = _ITEMSIZE[values["params"]]
    if values["offload_param"] == "cpu":
        master = _ITEMSIZE[_ROUNDING[values["master"]][0]]
        return workload.micro_batches * (2 * master + accum) * shard
    return (accum + params) * shard


def _with_fit(candidate: Candidate, fleet: Fleet) -> Candidate:
    usable = fleet.usable_gpu_memory
    reason = None
    if candidate.device_bytes > usable:
        reason = (
            f"device {candidate.device_bytes / 1e9:.1f} GB > {usable / 1e9:.1f} GB usable "
            f"(model states {candidate.memory['total'] / 1e9:.1f}, activations "
            f"{candidate.activations / 1e9:.1f}"
            + (f", gathered units {candidate.gathered / 1e9:.1f}" if candidate.gathered else "")
            + ")"
        )
    host = fleet.usable_host_memory_per_rank
    if reason is None and host is not None and candidate.host_bytes > host:
        reason = (
            f"host {candidate.host_bytes / 1e9:.1f} GB per rank > {host / 1e9:.1f} GB "
            f"({fleet.ranks_per_node} ranks share a node's host memory)"
        )
    if reason is None:
        return candidate
    return Candidate(**{**candidate.__dict__, "rejected": reason})
