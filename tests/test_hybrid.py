"""The hybrid layout at ZeRO-1/2: 4 ranks as 2 shard groups of 2 (issue 22).

States (ZeRO-2: the accumulator too) are sharded within a shard group and replicated across
the two groups; the gradient reduction is a reduce-scatter within the group and an all-reduce
of each chunk across the groups. Every case runs in one spawned group of 4 ranks
(``tests/workers/hybrid.py``); the checks are here.

Bounds. fp32: the two layouts add the same four gradients in another order (``(a+b)+(c+d)``
against the ring's), which moves a sum by a few fp32 ulps, so the masters agree within 1e-6.
16-bit wires: SGD with momentum (linear in the gradient, so a rounding of the gradient shows
as it is; Adam normalizes it away or, near a zero gradient, flips a sign) moves a master by at
most ``lr * M * max |g error|`` over ``K`` steps, ``M = sum_k sum_j<=k beta**(k-j)`` (9.05 for
K = 4, beta = 0.9). Each rounding of a partial sum to bf16 errs by at most ``u * |partial|``
with ``u = 2**-8``, and the clipped mean gradient is at most 1 per element; the flat ring
rounds 3 times (W - 1 hops), the hybrid twice (one hop within, one across) and once more into
the wire dtype, so the two differ by at most 6 roundings: ``lr * M * 6 * u``; with a bf16
sharded accumulator each adds the second micro-batch once more, rounded (8 roundings); fp16
(``u = 2**-11``) as bf16. Across the groups alone (fp32 within), a bf16 wire rounds each of
the 2 contributions and their sum: ``lr * M * 3 * u`` against the fp32 flat run. A
block-quantized wire across (``_quantized_wire.py``) errs by half a code step of the block's
absmax per rounding, 2 contributions and the requantized sum: ``3 / 254`` for int8; fp8 e4m3
by ``|x| / 16`` per rounding: ``3 / 16``; so ``lr * M * 3 / 254`` and ``lr * M * 3 / 16``.
Measured (SGD, 4 steps, largest master difference to the flat run): bf16 across 1.2e-4 (bound
5.3e-3), int8 3.1e-4 (bound 5.3e-3), fp8 1.7e-3 (bound 8.5e-2); bf16 params and wire on both
levels 2.8e-4 (bound 1.1e-2), with a bf16 accumulator 3.0e-4 (bound 1.4e-2). Adam moves each
element by at most about ``lr`` per step whatever the gradient, so a sign flipped by a
rounding costs at most ``2 * lr`` per step: ``2 * lr * K``, a bound that still catches a wrong
master or a missed step (measured: up to 2.1e-2 of 8e-2, fp8 across).
"""

from __future__ import annotations

import glob
import itertools
import math
import os
from typing import Any

import pytest
import torch

import dtypeplan
import dtypeplan.checkpoint
from dtypeplan.errors import PrecisionConfigError
from dtypeplan.launch import spawn
from tests._helpers import make_model
from tests.workers.hybrid import hybrid_cases

W, S = 4, 2
R = W // S
ADAM_LR, SGD_LR, BETA, STEPS = 1e-2, 0.05, 0.9, 4
ADAM = {"optimizer": {"type": "AdamW", "params": {"lr": ADAM_LR, "weight_decay": 0.01}}}
SGD = {"optimizer": {"type": "SGD", "params": {"lr": SGD_LR, "momentum": BETA}}}
BF16_U = 2.0**-8
MOMENTUM_SUM = sum(sum(BETA ** (k - j) for j in range(k + 1)) for k in range(STEPS))
OPTS = {"sgd": SGD, "adam": ADAM}
STOCHASTIC = {"master_weights": {"dtype": "bf16", "rounding": "stochastic"}}
# (stage, gradient_accumulation_dtype.sharded): stage 1 whole, stage 1 sharded, stage 2.
LAYOUTS = ((1, False), (1, True), (2, None))


def config(
    stage: int,
    sharded: bool | None,
    *,
    model: str = "fp32",
    comm: str | None = None,
    accum: str = "fp32",
    opt: dict[str, Any] = SGD,
) -> dict[str, Any]:
    out: dict[str, Any] = {**opt, "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0}
    if model == "bf16":
        out["bf16"] = {"enabled": True}
    if model == "fp16":
        out["fp16"] = {"enabled": True}
    accumulation: dict[str, Any] = {"dtype": accum}
    if sharded is not None:
        accumulation["sharded"] = sharded
    out["gradient_accumulation_dtype"] = accumulation
    if comm is not None:
        out["communication_data_type"] = comm
    return out


def _parity_cases(slow: bool) -> list[dict[str, Any]]:
    """Default: every layout with SGD and AdamW in fp32, and SGD in the 16-bit and quantized
    cells at stage 1 (whole accumulator) and stage 2. Slow: the rest, and everything with the
    last micro-batch marked (the step's reductions, both levels, start inside the last
    backward)."""
    cases = []
    for (stage, sharded), boundary, opt in itertools.product(
        LAYOUTS, (False, True), ("sgd", "adam")
    ):
        cells = {
            "fp32": (config(stage, sharded, opt=OPTS[opt]), None),
            "bf16": (config(stage, sharded, model="bf16", comm="bf16", opt=OPTS[opt]), None),
            "across_bf16": (config(stage, sharded, opt=OPTS[opt]), "bf16"),
            "across_int8": (config(stage, sharded, opt=OPTS[opt]), "int8"),
            "across_fp8": (config(stage, sharded, opt=OPTS[opt]), "fp8"),
            # A bf16 sharded accumulator sums the group's sums, then goes across once.
            "bf16_accum": (
                config(stage, sharded, model="bf16", comm="bf16", accum="bf16", opt=OPTS[opt]),
                None,
            ),
        }
        for cell, (cfg, across) in cells.items():
            if cell == "bf16_accum" and stage == 1 and not sharded:
                continue  # a whole accumulator goes across per step anyway (stage 1 cases)
            # Stage 1 with a sharded accumulator takes stage 2's path: fp32 only by default.
            is_slow = boundary or (opt == "adam" or sharded is True) and cell != "fp32"
            if is_slow != slow:
                continue
            cases.append(
                {
                    "kind": "parity",
                    "name": f"stage{stage}-sharded{sharded}-{opt}-{cell}-boundary{boundary}",
                    "opt": opt,
                    "cell": cell,
                    "boundary": boundary,
                    "config": cfg,
                    "across": across,
                }
            )
    return cases


def _offload_cases() -> list[dict[str, Any]]:
    """offload_optimizer cpu: the host update between the two levels' reduction and the
    all-gather within the group (the table decides whether the combination is offered)."""
    cases = []
    for stage, sharded, model in ((1, False, "bf16"), (2, None, "fp32")):
        cfg = config(stage, sharded, model=model)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        name = f"offload-stage{stage}-{model}"
        cases.append({"kind": "parity", "name": name, "cell": "fp32", "opt": "sgd", "config": cfg})
    return cases


def _other_cases() -> list[dict[str, Any]]:
    bf16_adam = config(2, None, model="bf16", opt=ADAM)
    fp16 = config(2, None, model="fp16", comm="fp16")
    # 2**18 overflows fp16 gradients at first: the inf of one rank's chunk must reach every
    # rank's norm (across groups too), and every rank skip the same steps. One micro-batch:
    # with more, the wire across carries the step's sum, M times what the flat wire carries
    # per micro-batch, and may overflow (and back off) once more than the flat layout.
    fp16["fp16"] = {"enabled": True, "initial_scale_power": 18, "hysteresis": 1}
    return [
        {
            "kind": "parity",
            "name": "fp16",
            "cell": "fp16",
            "opt": "sgd",
            "config": fp16,
            "steps": 6,
            "micro": 1,
        },
        # bf16 masters, stochastic rounding: seeded by the shard rank, so replicas draw alike.
        {
            "kind": "parity",
            "name": "bf16-masters",
            "cell": "bf16_masters",
            "opt": "adam",
            "config": {**config(2, None, model="bf16", comm="bf16", opt=ADAM), **STOCHASTIC},
        },
        # One rank per shard group: every rank holds everything, the reduction is across only.
        {
            "kind": "parity",
            "name": "size1",
            "cell": "fp32",
            "opt": "sgd",
            "size": 1,
            "config": config(1, False),
        },
        # Stage 1, whole fp32 accumulator, fp32 wire on both levels.
        {"kind": "traffic", "name": "stage1", "config": config(1, False), "micro": 2},
        # Stage 2, bf16 within, fp32 across, 3 micro-batches: within per micro-batch,
        # across once per step.
        {
            "kind": "traffic",
            "name": "stage2",
            "config": config(2, None, model="bf16", comm="bf16"),
            "across": "fp32",
            "micro": 3,
        },
        {"kind": "held", "name": "stage1", "config": config(1, False, model="bf16", opt=ADAM)},
        {"kind": "held", "name": "stage2", "config": bf16_adam},
        {"kind": "checkpoints", "name": "bf16", "config": bf16_adam, "across": "bf16"},
        {"kind": "refusal", "name": "size", "config": config(1, False), "size": 3},
        {
            "kind": "refusal",
            "name": "wire",
            "config": config(1, False),
            "size": 2,
            "across": "int4",
            "by_hand": True,  # the config is refused at resolve (test below)
        },
        # The block-quantized wire across: an all-to-all and an all-gather of codes + scales.
        {
            "kind": "traffic",
            "name": "int8",
            "config": config(2, None, model="bf16", comm="bf16"),
            "across": "int8",
            "micro": 2,
        },
        {"kind": "stage0", "name": "stage0", "config": config(0, None, opt=ADAM)},
    ]


def _run(cases: list[dict[str, Any]], root: str) -> dict[str, dict[str, Any]]:
    results = spawn(hybrid_cases, W, cases, root, timeout_s=600)
    out: dict[str, dict[str, Any]] = {}
    for case, result in zip(cases, results[0], strict=True):
        assert "error" not in result, (case["name"], result["error"])
        out[f"{case['kind']}:{case['name']}"] = {**result, "case": case}
    # The ranks of a replica group (rank r and r + S) hold the same chunks and parameters,
    # bit for bit, after every step.
    for index, case in enumerate(cases):
        if case["kind"] == "parity":
            size = case.get("size", S)
            digests = [results[rank][index]["hybrid_digest"] for rank in range(W)]
            assert all(digests[r] == digests[r % size] for r in range(W)), case["name"]
            # ... and, within a shard group, different chunks.
            assert len(set(digests)) == size, case["name"]
    return out


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("hybrid"))
    return _run(_parity_cases(slow=False) + _other_cases(), root)


def _bound(case: dict[str, Any]) -> float:
    if case["cell"] == "fp32":
        return 1e-6
    if case["opt"] == "adam":
        # Stochastically rounded bf16 masters: the layouts draw other roundings, up to one
        # bf16 step (2**-7 below 1) per step on each.
        rounding = 2 * STEPS * 2.0**-7 if case["cell"] == "bf16_masters" else 0.0
        return 2 * ADAM_LR * STEPS + rounding
    # Per element of the clipped mean gradient (at most 1): the largest error of the wire.
    error = {
        "bf16": 6 * BF16_U,
        "fp16": 6 * 2.0**-11,
        "bf16_accum": 8 * BF16_U,
        "across_bf16": 3 * BF16_U,
        "across_int8": 3 / 254,
        "across_fp8": 3 / 16,
    }[case["cell"]]
    return SGD_LR * MOMENTUM_SUM * error


def _close(flat: float, hybrid: float, rel: float) -> bool:
    """Gradient norms alike; a skipped step's (an overflow: nan or inf) on both layouts."""
    if not math.isfinite(flat):
        return not math.isfinite(hybrid)
    return math.isclose(flat, hybrid, rel_tol=rel)


def _check_parity(results: dict[str, dict[str, Any]]) -> None:
    parity = [r for key, r in results.items() if key.startswith("parity:")]
    assert parity
    for result in parity:
        case = result["case"]
        assert result["flat_is_flat"] and result["hybrid_is_hybrid"], case["name"]
        assert result["skipped"] == result["hybrid_skipped"], (case["name"], result)
        bound = _bound(case)
        if case["cell"] == "fp32":
            # Relative to the largest master (about 1): the sums' order only.
            assert result["max_abs_diff"] <= bound * result["max_abs_master"], (case, result)
            # The gradient norm counts every element once (slot per shard group), as flat.
            for flat, hybrid in zip(result["norms"], result["hybrid_norms"], strict=True):
                assert _close(flat, hybrid, 1e-6), (case["name"], flat, hybrid)
        else:
            assert result["max_abs_diff"] <= bound, (case["name"], result["max_abs_diff"], bound)
            for flat, hybrid in zip(result["norms"], result["hybrid_norms"], strict=True):
                assert _close(flat, hybrid, 8 * BF16_U), (case["name"], flat, hybrid)


@pytest.mark.slow
def test_parity_with_flat(default_run: dict[str, dict[str, Any]]) -> None:
    _check_parity(default_run)
    # The fp16 case overflowed and skipped steps, then stepped (the same ones on every layout).
    fp16 = default_run["parity:fp16"]
    assert 0 < fp16["hybrid_skipped"] < fp16["case"]["steps"], fp16


@pytest.mark.slow
def test_parity_with_flat_slow(tmp_path: Any) -> None:
    _check_parity(_run(_parity_cases(slow=True) + _offload_cases(), str(tmp_path)))


def _padded(numel: int) -> int:
    """One bucket, padded to a multiple of W * ALIGN (64) elements."""
    unit = W * 64
    return -(-numel // unit) * unit


@pytest.mark.slow
def test_bytes_per_level(default_run: dict[str, dict[str, Any]]) -> None:
    numel = _padded(sum(p.numel() for p in make_model(0).parameters()))
    ring = lambda n, size, ranks: n * size * (ranks - 1) // ranks  # noqa: E731
    stage1 = default_run["traffic:stage1"]
    assert stage1["numel"] == numel
    # Within: the fp32 accumulator reduce-scattered once, the fp32 params all-gathered once.
    assert stage1["within"] == {
        "reduce_scatter": ring(numel, 4, S),
        "all_gather": ring(numel, 4, S),
    }
    # Across: this rank's chunk (numel / S) all-reduced, fp32: 2 (R-1)/R of it.
    assert stage1["across"] == {"all_reduce": 2 * ring(numel // S, 4, R)}
    assert stage1["across_calls"] == {"all_reduce": 1}
    assert stage1["world"] == {}  # the step summary only (not counted as traffic)
    # int8 across (_quantized_wire.py): the chunk padded to whole blocks of 256 per rank of
    # the replica group, one byte per code and an fp32 scale per block, (R-1)/R of it in the
    # all-to-all and again in the all-gather of the requantized sums.
    padded = -(-(numel // S) // (R * 256)) * (R * 256)
    packed = padded + padded // 256 * 4
    int8 = default_run["traffic:int8"]
    assert int8["across"] == {"all_to_all": ring(packed, 1, R), "all_gather": ring(packed, 1, R)}
    assert int8["across_calls"] == {"all_to_all": 1, "all_gather": 1}
    assert int8["within"] == {
        "reduce_scatter": 2 * ring(numel, 2, S),
        "all_gather": ring(numel, 2, S),
    }
    stage2 = default_run["traffic:stage2"]
    # Within: a bf16 reduce-scatter per micro-batch (3), the bf16 params all-gathered once.
    assert stage2["within"] == {
        "reduce_scatter": 3 * ring(numel, 2, S),
        "all_gather": ring(numel, 2, S),
    }
    assert stage2["within_calls"] == {"reduce_scatter": 3, "all_gather": 1}
    # Across: once per step, not per micro-batch, in fp32.
    assert stage2["across"] == {"all_reduce": 2 * ring(numel // S, 4, R)}
    assert stage2["across_calls"] == {"all_reduce": 1}


@pytest.mark.slow
def test_held_bytes_as_flat_at_world_s(default_run: dict[str, dict[str, Any]]) -> None:
    for name, accumulator in (("stage1", "whole"), ("stage2", "sharded")):
        result = default_run[f"held:{name}"]
        n = result["numel"]  # 512: a multiple of W * 64, no padding on either layout
        assert result["hybrid"] == result["flat_world_2"], name
        held = result["hybrid"]
        assert held["params"] == n * 2  # bf16, whole
        assert held["accumulator"] == (n * 4 if accumulator == "whole" else n * 4 // S)
        assert held["master"] == n * 4 // S
        assert held["optimizer_states"] == 2 * n * 4 // S + 4  # exp_avg, exp_avg_sq, step


@pytest.mark.slow
def test_checkpoints_between_flat_and_hybrid(
    default_run: dict[str, dict[str, Any]], tmp_path: Any
) -> None:
    result = default_run["checkpoints:bf16"]
    assert result["flat_to_hybrid"] == [], result["flat_to_hybrid"]
    assert result["hybrid_to_flat"] == [], result["hybrid_to_flat"]
    assert result["step"] == 4
    # state_dict: the other shard group's rank with the same place loads bit for bit; a flat
    # layout's is refused naming both layouts.
    assert result["state_dict"] == [], result["state_dict"]
    refused = result["flat_state_dict"]
    assert refused.startswith("OptimizerUsageError") and "'shards': 2" in refused, refused
    # The weights by name, gathered within the shard group (across, they are the same).
    assert result["export"] == [], result["export"]
    # Each piece written once: the second shard group's ranks (2 and 3) wrote no data.
    snapshot = _snapshot(result["hybrid_dir"])
    sizes = {os.path.basename(f): os.path.getsize(f) for f in glob.glob(f"{snapshot}/*.distcp")}
    assert sizes.get("__2_0.distcp", 0) == 0 and sizes.get("__3_0.distcp", 0) == 0, sizes
    # ... and it loads into one process, as every other checkpoint does.
    plan = dtypeplan.resolve(result["case"]["config"])
    model = plan.prepare_model(make_model(3))
    one = plan.build(model.parameters())
    dtypeplan.checkpoint.load(one, result["hybrid_dir"])
    state = {k: v for k, v in one.full_state().items() if torch.is_tensor(v)}
    saved = result["hybrid_state"]
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], saved[k]) for k in saved)


def _snapshot(path: str) -> str:
    with open(os.path.join(path, dtypeplan.checkpoint.LATEST)) as handle:
        return os.path.join(path, handle.read().strip())


def test_the_table_refuses_what_the_engine_defends() -> None:
    """Stage 0 with shard groups is the table's Error; an unknown wire is the config's."""
    stage0 = config(0, None)
    stage0["zero_optimization"]["shard_group_size"] = 2
    plan = dtypeplan.resolve(stage0)
    assert plan.status == "Error" and plan.rule_id == "stage0-shard-groups", plan.explain()
    wire = config(1, False)
    wire["zero_optimization"]["shard_group_size"] = 2
    wire["communication_data_type_across_groups"] = "int4"
    with pytest.raises(PrecisionConfigError, match="int4"):
        dtypeplan.resolve(wire)


@pytest.mark.slow
def test_refusals(default_run: dict[str, dict[str, Any]]) -> None:
    size = default_run["refusal:size"]
    assert size["type"] == "PrecisionConfigError"
    assert "shard_group_size 3" in size["message"] and "world size 4" in size["message"]
    wire = default_run["refusal:wire"]
    assert wire["type"] == "NotSupportedError" and "wire_across_groups 'int4'" in wire["message"]


@pytest.mark.slow
def test_stage0_stays_flat(default_run: dict[str, dict[str, Any]]) -> None:
    result = default_run["stage0:stage0"]
    assert result["is_flat"] and result["same"]
