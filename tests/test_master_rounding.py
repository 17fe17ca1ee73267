"""The rounding of fp32 updates into bf16 master weights (optimizers/kernels/rounding.py)."""

from __future__ import annotations

import math
from typing import Any

import torch

import dtypeplan
from dtypeplan.optimizers.kernels.rounding import (
    kahan_load,
    kahan_store,
    noise_key,
    round_nearest,
    round_stochastic_hashed,
    round_stochastic_keyed,
)
from tests._helpers import make_batch, make_model, mse

ULP_AT_ONE = 2.0**-7  # bf16 keeps 7 explicit mantissa bits


def _key(seed: int, step: int = 1) -> torch.Tensor:
    return torch.tensor(noise_key(seed, 0, step), dtype=torch.int64)


def _sr(values: torch.Tensor, seed: int = 0) -> torch.Tensor:
    out = torch.empty(values.shape, dtype=torch.bfloat16)
    round_stochastic_keyed(values.clone(), out, _key(seed), 0)
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


def test_stochastic_rounding_is_reproducible_from_the_key() -> None:
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(_sr(values, seed=7), _sr(values, seed=7))
    assert not torch.equal(_sr(values, seed=7), _sr(values, seed=8))


def test_in_place_keyed_rounding_gives_the_hashed_bits() -> None:
    """The eager in-place form (the pieces, torch's step of a class, a piece with its own
    history) draws the functional form's noise (the one-pass update, compiled): one run's
    paths agree bit for bit, specials and every offset included."""
    values = torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 1e3
    values[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.0e38])
    for seed, step, offset in [(0x5EED, 1, 0), (0x5EEE, 7, 12_345), (3, 2**24 + 1, 2**31)]:
        key = torch.tensor(noise_key(seed, 4, step), dtype=torch.int64)
        out = torch.empty(values.shape, dtype=torch.bfloat16)
        round_stochastic_keyed(values.clone(), out, key, offset)
        want = round_stochastic_hashed(values.clone(), key, torch.tensor(offset))
        assert torch.equal(out.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))


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
    for step in range(1, steps + 1):
        round_stochastic_keyed(weights.float() + delta, weights, _key(3, step), 0)
    # Each weight is a random walk with mean 1 + steps * delta; the mean over n weights is tight.
    assert abs(float(weights.double().mean()) - (1.0 + steps * delta)) <= 0.02 * steps * delta


def test_torch_fused_bf16_step_gives_the_bits_of_the_fp32_pieces(monkeypatch: Any) -> None:
    """bf16 masters rounded to nearest, bf16 moments and a bf16 accumulator go to torch's
    fused kernel on the bf16 tensors in one pass: the same bits as the fp32 pieces (upcast,
    fused fp32 update, round each back), with and without clipping and weight decay."""
    from dtypeplan.optimizers.update.pieces import LowPrecisionAdamUpdate

    original = LowPrecisionAdamUpdate._torch_runs_it

    def train(handed_off: bool, optimizer: str, clip: float) -> list[torch.Tensor]:
        calls: list[bool] = []

        def decide(self: Any, *args: Any) -> bool:
            calls.append(original(self, *args))
            return handed_off and calls[-1]

        monkeypatch.setattr(LowPrecisionAdamUpdate, "_torch_runs_it", decide)
        # The fp32 pieces, not the one-pass kernel (whose math is not torch's bit for bit).
        monkeypatch.setattr(LowPrecisionAdamUpdate, "one_pass", lambda *args: False)
        config = {
            "bf16": {"enabled": True, "bf16_optimizer_states": True},
            "master_weights": {"dtype": "bf16", "rounding": "nearest"},
            "gradient_accumulation_dtype": "bf16",
            "optimizer": {"type": optimizer, "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "gradient_clipping": clip,
        }
        model = make_model(0)
        opt = dtypeplan.resolve(config).build(model.parameters())
        for step in range(4):
            x, y = make_batch(step, 8)
            opt.backward(mse(model, x, y))
            opt.step()
            opt.zero_grad()
        assert calls and all(calls), "the cell should qualify for torch's bf16 kernel"
        states = [v for s in opt.state_dict()["state"].values() for v in s.values()]
        return [p.detach().clone() for p in model.parameters()] + [
            v for v in states if torch.is_tensor(v)
        ]

    for optimizer, clip in (("AdamW", 0.0), ("AdamW", 0.05), ("Adam", 1.0)):
        fused = train(True, optimizer, clip)
        pieces = train(False, optimizer, clip)
        assert len(fused) == len(pieces)
        for a, b in zip(fused, pieces, strict=True):
            assert torch.equal(a, b), (optimizer, clip)
