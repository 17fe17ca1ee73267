"""The rounding of fp32 updates into bf16 master weights (optimizers/_master_rounding.py)."""

from __future__ import annotations

import math

import torch

from dtypeplan.optimizers._master_rounding import (
    kahan_load,
    kahan_store,
    round_nearest,
    round_stochastic,
)

ULP_AT_ONE = 2.0**-7  # bf16 keeps 7 explicit mantissa bits


def _sr(values: torch.Tensor, seed: int = 0) -> torch.Tensor:
    out = torch.empty(values.shape, dtype=torch.bfloat16)
    round_stochastic(values.clone(), out, torch.Generator().manual_seed(seed))
    return out


def test_stochastic_rounding_is_unbiased() -> None:
    # Values a fraction p of an ulp above a bf16 number, at several exponents and both signs.
    n = 200_000
    for base in (1.0, -3.0, 2.0**-20, 1000.0):
        ulp = 2.0 ** (math.floor(math.log2(abs(base))) - 7)
        for p in (0.01, 0.25, 0.5, 0.9):
            exact = base + math.copysign(p * ulp, base)
            rounded = _sr(torch.full((n,), exact)).double()
            # Each rounding is base or base + ulp: a Bernoulli(p) number of ulps.
            assert set(rounded.unique().tolist()) <= {base, base + math.copysign(ulp, base)}
            sigma = ulp * math.sqrt(p * (1 - p) / n)
            assert abs(float(rounded.mean()) - exact) <= 5 * sigma, (base, p)


def test_stochastic_rounding_keeps_representable_and_special_values() -> None:
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 2.0**127, float("inf"), -float("inf")])
    out = _sr(exact)
    assert torch.equal(out.float(), exact)
    assert math.copysign(1.0, float(out[1])) == -1.0
    assert torch.isnan(_sr(torch.tensor([float("nan")]))).all()


def test_stochastic_rounding_is_reproducible_from_the_seed() -> None:
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(_sr(values, seed=7), _sr(values, seed=7))
    assert not torch.equal(_sr(values, seed=7), _sr(values, seed=8))


def test_nearest_loses_small_updates_that_kahan_keeps() -> None:
    # 1000 updates of 1e-4 on a weight of 1.0: each is below half a bf16 ulp (2**-8 = 3.9e-3).
    steps, delta = 1000, 1e-4
    nearest = torch.ones(1, dtype=torch.bfloat16)
    master = torch.ones(1, dtype=torch.bfloat16)
    compensation = torch.zeros(1, dtype=torch.bfloat16)
    scratch = torch.empty(1)
    for _ in range(steps):
        round_nearest(nearest.float() + delta, nearest)
        kahan_load(master, compensation, scratch)
        scratch += delta
        kahan_store(scratch, master, compensation)
    assert float(nearest) == 1.0  # stalled
    kahan_value = float(master.float() + compensation.float())
    # Each step rounds the compensation (below half a master ulp, 2**-8 on [1, 2)) to bf16: an
    # error of at most 2**-8 * 2**-9 per step, far below the 1e-4 that nearest drops whole.
    assert abs(kahan_value - (1.0 + steps * delta)) <= steps * 2.0**-17
    assert abs(float(master) - (1.0 + steps * delta)) <= ULP_AT_ONE


def test_stochastic_rounding_tracks_small_updates_on_average() -> None:
    steps, delta, n = 1000, 1e-4, 4096
    weights = torch.ones(n, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        round_stochastic(weights.float() + delta, weights, generator)
    # Each weight is a random walk with mean 1 + steps * delta; the mean over n weights is tight.
    assert abs(float(weights.double().mean()) - (1.0 + steps * delta)) <= 0.02 * steps * delta
