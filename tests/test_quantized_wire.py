"""The block-quantized wire (dtypeplan/comm/_quantized_wire.py): an all-reduce whose
contributions travel as int8 / fp8 codes with one fp32 scale per 256 elements, summed in fp32.

On 2 and 4 ranks (one spawned group each): every rank gets the same bits; the error against the
exact sum stays within the bound of the two quantizations; the bytes counted are those of the
formula and of the buffers really handed to the collectives; a non-finite input stays
non-finite (nan over its block) so that the overflow check sees it; zeros stay zeros.

The bound, per element of block ``b`` (``a_r``: the absmax of block ``b`` of rank ``r``'s input;
``s``: the fp32 sum that is quantized the second time, ``|s| <= |exact| + first``; ``a_s``: its
block absmax):

* int8 (half a code step per rounding): ``first = sum_r a_r / 254``, ``second = a_s / 254``.
* fp8 e4m3 (3 mantissa bits; subnormal spacing 2**-9 in code units):
  ``first = sum_r (|x_r| / 16 + a_r / (448 * 1024))``, ``second = |s| / 16 + a_s / (448 * 1024)``.

plus fp32 rounding of the divisions, products and the W-term sum (a relative 1e-4 of the bound
and ``W * 2**-23 * sum_r |x_r|``), and for a bf16 tensor its final rounding (2**-8 relative).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from dtypeplan.comm import Communicator
from dtypeplan.comm._quantized_wire import BLOCK, dequantize_blocks, quantize_blocks
from dtypeplan.launch import spawn
from tests.workers.quantized_wire import quantized_cases, wire_input

INF, NAN = float("inf"), float("nan")


def _cases(world: int) -> list[dict[str, Any]]:
    unit = world * BLOCK
    cases: list[dict[str, Any]] = []
    for fmt in ("int8", "fp8"):
        for seed, numel in enumerate([1, 255, 257, unit, unit + 3, 5000]):
            cases.append(
                {
                    "name": f"{fmt} n={numel}",
                    "fmt": fmt,
                    "numel": numel,
                    "seed": seed,
                    # Ranks of very different sizes: the small ones drown in the large one's step.
                    "magnitudes": [1.0, 1e-3, 30.0, 0.5],
                    "dtype": "float32",
                }
            )
        cases.append({**cases[-1], "name": f"{fmt} bf16", "dtype": "bfloat16", "seed": 11})
        cases.append({**cases[-1], "name": f"{fmt} zeros", "magnitudes": [0.0], "seed": 12})
        cases.append(
            {
                "name": f"{fmt} non-finite",
                "fmt": fmt,
                "numel": 3 * unit + 10,
                "seed": 13,
                "magnitudes": [1.0],
                "dtype": "float32",
                # An inf alone, a nan alone, and +inf meeting -inf (a nan sum) in three blocks.
                "specials": [
                    (0, 3, INF),
                    (world - 1, 2 * unit + 300, NAN),
                    (0, unit + 5, INF),
                    (1, unit + 5, -INF),
                ],
            }
        )
    return cases


def _padded(numel: int, world: int) -> int:
    unit = world * BLOCK
    return math.ceil(numel / unit) * unit


def _bound(case: dict[str, Any], world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact sum, per-element bound) in float64, from the inputs rebuilt here."""
    numel, padded = case["numel"], _padded(case["numel"], world)
    x = torch.zeros(world, padded, dtype=torch.float64)
    for rank in range(world):
        values = wire_input({**case, "specials": []}, rank).double()
        x[rank, :numel] = values
    x = x.view(world, -1, BLOCK)
    exact = x.sum(0)
    a_r = x.abs().amax(-1, keepdim=True)
    if case["fmt"] == "int8":
        first = (a_r / 254).sum(0).expand_as(exact)
        s_abs = exact.abs() + first
        second = (s_abs.amax(-1, keepdim=True) / 254).expand_as(exact)
    else:
        subnormal = 1 / (448 * 1024)
        first = (x.abs() / 16 + a_r * subnormal).sum(0)
        s_abs = exact.abs() + first
        second = s_abs / 16 + s_abs.amax(-1, keepdim=True) * subnormal
    bound = (first + second) * (1 + 1e-4) + world * 2**-23 * x.abs().sum(0)
    if case["dtype"] == "bfloat16":
        bound += (exact.abs() + first + second) * 2**-8
    return exact.reshape(-1)[:numel], bound.reshape(-1)[:numel]


def _check(world: int, cases: list[dict[str, Any]], per_rank: list[list[dict[str, Any]]]) -> None:
    for index, case in enumerate(cases):
        name = f"{case['name']} on {world} ranks"
        results = [rank_results[index] for rank_results in per_rank]
        first = results[0]["result"]
        assert first.shape == (case["numel"],), name
        assert {r["dtype"] for r in results} == {f"torch.{case['dtype']}"}, name
        # Every rank the same bits (nan included).
        for other in results[1:]:
            assert torch.equal(other["result"].view(torch.int32), first.view(torch.int32)), name
        # The bytes: codes (1 byte) + one fp32 scale per block of the padded tensor, of which a
        # ring sends (W - 1) / W, in the all-to-all and again in the all-gather.
        padded = _padded(case["numel"], world)
        expected = (padded + padded // BLOCK * 4) * (world - 1) // world
        for r in results:
            assert r["bytes"] == {"all_to_all": expected, "all_gather": expected}, (name, r)
            assert r["calls"] == {"all_to_all": 1, "all_gather": 1}, (name, r)
            (a2a,) = [numel for op, dtype, numel in r["log"] if op == "all_to_all"]
            (gather,) = [numel for op, dtype, numel in r["log"] if op == "all_gather"]
            assert {dtype for _, dtype, _ in r["log"]} == {"torch.uint8"}, (name, r["log"])
            assert a2a * (world - 1) // world == expected == gather * (world - 1), (name, r)
        exact, bound = _bound(case, world)
        got = first.double()
        if case.get("specials"):
            blocks = torch.zeros(case["numel"], dtype=torch.bool)
            for _, position, _ in case["specials"]:
                start = position // BLOCK * BLOCK
                blocks[start : start + BLOCK] = True
            assert torch.equal(~torch.isfinite(got), blocks), name
            assert torch.isnan(got[blocks]).all(), name
            got, exact, bound = got[~blocks], exact[~blocks], bound[~blocks]
        error = (got - exact).abs()
        excess = error - bound
        assert (excess <= 0).all(), (name, float(excess.max()), int(excess.argmax()))
        if case["magnitudes"] == [0.0]:
            assert not got.any(), name
        else:
            # The wire did quantize: a random fp32 sum does not survive 8-bit codes exactly.
            assert float(error.max()) > 0, name


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_quantized_all_reduce(world: int) -> None:
    cases = _cases(world)
    per_rank = spawn(quantized_cases, world, cases, timeout_s=300)
    _check(world, cases, per_rank)


def test_one_rank_sends_nothing_and_changes_nothing() -> None:
    comm = Communicator()
    tensor = torch.randn(1000)
    before = tensor.clone()
    comm.start_all_reduce_quantized(tensor, "int8")()
    assert torch.equal(tensor, before)
    assert comm.stats.total_bytes == 0
    with pytest.raises(ValueError, match=r"'int4'.*\['fp8', 'int8'\]"):
        comm.start_all_reduce_quantized(tensor, "int4")


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_block_codes(fmt: str) -> None:
    values = torch.randn(4 * BLOCK)
    values[BLOCK : 2 * BLOCK] = 0.0
    values[2 * BLOCK + 7] = INF
    values[3 * BLOCK + 1] = -9.5  # this block's absmax
    values[3 * BLOCK + 2] = 9.0
    codes, scales = quantize_blocks(values, fmt)
    assert codes.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[fmt]
    assert scales.dtype == torch.float32 and scales.shape == (4,)
    top = {"int8": 127.0, "fp8": 448.0}[fmt]
    assert float(scales[3]) == pytest.approx(9.5 / top, rel=1e-7)
    back = dequantize_blocks(codes, scales)
    assert float(back[3 * BLOCK + 1]) == pytest.approx(-9.5, rel=1e-6)  # the absmax is exact
    assert scales[1] == 0 and not back[BLOCK : 2 * BLOCK].any()
    assert torch.isnan(back[2 * BLOCK : 3 * BLOCK]).all()
    # The scale alone carries the non-finite; the codes are 0, not a cast of nan.
    assert not torch.isfinite(scales[2]) and not codes[2 * BLOCK : 3 * BLOCK].float().any()
    step = 9.5 / top
    if fmt == "int8":
        assert (back[3 * BLOCK :] - values[3 * BLOCK :]).abs().max() <= step / 2 * (1 + 1e-5)
    else:
        bound = values[3 * BLOCK :].abs() / 16 + step * 2**-10
        assert ((back[3 * BLOCK :] - values[3 * BLOCK :]).abs() <= bound * (1 + 1e-5)).all()
