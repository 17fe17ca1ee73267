"""The one-pass Adam/AdamW update of bf16 masters (optimizers/kernels/one_pass.py): compiled and
eager give the same bits, the fallback, its difference from torch's fused kernel, explain()."""

from __future__ import annotations

import math
import os
import shutil
import warnings
from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan import _update_path as update_path
from dtypeplan.optimizers.kernels import one_pass as kernel
from dtypeplan.optimizers.kernels import rounding as master_rounding
from tests._helpers import make_batch, make_model, mse

GROUP = {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
CPU = torch.device("cpu")
needs_compiler = pytest.mark.skipif(
    (shutil.which("g++") is None and shutil.which("c++") is None)
    # torch 2.13's Inductor emits at::vec code that does not compile under this setting (the
    # update then falls back to eager with its warning, tested below with a failing compile).
    or os.environ.get("ATEN_CPU_CAPABILITY") == "default",
    reason="no C++ compiler for Inductor's code, or ATEN_CPU_CAPABILITY=default (which torch "
    "2.13's Inductor code does not compile under): the update runs eagerly only",
)


def _tensors(
    n: int, grad: torch.dtype, states: torch.dtype, seed: int, master: torch.dtype = torch.bfloat16
) -> list[Any]:
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(n, generator=generator).to(master)
    g = torch.randn(n, generator=generator) * 1e-2
    g[:3] = torch.tensor([float("nan"), float("inf"), 0.0])  # non-finite values keep to IEEE
    exp_avg = (torch.randn(n, generator=generator) * 1e-3).to(states)
    exp_avg_sq = (torch.rand(n, generator=generator) * 1e-5).to(states)
    compensation = (torch.randn(n, generator=generator) * 1e-4).to(torch.bfloat16)
    return [weights, g.to(grad), exp_avg, exp_avg_sq, compensation]


def _run(fn: Any, tensors: list[Any], rounding: str, step: int, offset: int) -> list[Any]:
    master, grad, exp_avg, exp_avg_sq, compensation = (t.clone() for t in tensors)
    fn(
        master,
        grad,
        exp_avg,
        exp_avg_sq,
        compensation if rounding == "kahan" else None,
        None,
        kernel.hyperparameters(GROUP, step, True, CPU),
        torch.tensor(0.5),
        torch.tensor(master_rounding.noise_key(7, 1, step)),
        torch.tensor(offset),
    )
    return [master, exp_avg, exp_avg_sq, compensation]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.slow
@needs_compiler
def test_compiled_and_eager_give_the_same_bits() -> None:
    """Every rounding, fp32 and bf16 gradients and moments, AdamW and Adam (L2), with and
    without weight decay, at lengths that do and do not fill the vector width (one compiled
    kernel per combination; the length is dynamic). Slow: six compiles, ~23 s on two cores;
    the default run compiles one (the optimizer test below)."""
    cases = [
        ("stochastic", torch.bfloat16, torch.bfloat16, True, True),
        ("kahan", torch.float32, torch.bfloat16, False, True),
        ("nearest", torch.float32, torch.float32, True, False),
        ("nearest", torch.float32, torch.bfloat16, True, True),
        ("stochastic", torch.float32, torch.float32, False, True),
        ("kahan", torch.bfloat16, torch.float32, True, False),
    ]
    for rounding, grad, states, decoupled, decay in cases:
        _same_bits(rounding, grad, states, decoupled, decay, torch.bfloat16)
    # An fp32 master with bf16 moments: tiled by bf16 (one_pass._tiled_by); nothing rounds
    # the master, so an ulp of the root would show.
    _same_bits("nearest", torch.float32, torch.bfloat16, True, True, torch.float32)


def _same_bits(
    rounding: str,
    grad: torch.dtype,
    states: torch.dtype,
    decoupled: bool,
    decay: bool,
    master: torch.dtype,
) -> None:
    options = {"decoupled": decoupled, "weight_decay": decay, "rounding": rounding}
    narrow = states if master == torch.float32 and states != torch.float32 else None
    compiled = kernel._compiled(decoupled, decay, rounding, narrow is not None)

    def eager(*args: Any) -> None:
        kernel.adam_one_pass(*args, **options)

    def hinted(*args: Any) -> None:
        with kernel._tiled_by(narrow):
            compiled(*args)

    for n, step, offset in ((1000, 1, 0), (4099, 5, 12345)):
        tensors = _tensors(n, grad, states, seed=n, master=master)
        want = _run(eager, tensors, rounding, step, offset)
        got = _run(hinted, tensors, rounding, step, offset)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(_bits(a), _bits(b)), (rounding, grad, states, master, n)


def test_only_kahan_rounding_emulates_precision_casts() -> None:
    """Kahan reads its rounded bf16 weights back (the error term), so Inductor must round them;
    nearest and stochastic rounding read nothing back and skip the emulation's casts (the
    bits compiled and eager give are compared above)."""
    for rounding, emulated in (("kahan", True), ("nearest", False), ("stochastic", False)):
        options = kernel.compile_options(rounding)
        assert options["emulate_precision_casts"] is emulated
        assert options["cpp.enable_floating_point_contract_flag"] == "off"
        assert options["cpp.enable_unsafe_math_opt_flag"] is False


_BF16_STOCHASTIC = {
    "bf16": {"enabled": True, "bf16_optimizer_states": True},
    "master_weights": {"dtype": "bf16", "rounding": "stochastic"},
}
_FP32_MASTERS_BF16_STATES = {"optimizer_states": "bf16"}
"""fp32 parameters (their own masters) with bf16 moments: the kernel tiled by bf16
(``one_pass._tiled_by``), where no rounding of the master hides an ulp."""


@needs_compiler
@pytest.mark.parametrize(
    "cell", [_BF16_STOCHASTIC, _FP32_MASTERS_BF16_STATES], ids=["bf16-stochastic", "fp32-bf16"]
)
def test_compiled_optimizer_steps_like_the_eager_one(
    monkeypatch: Any, cell: dict[str, Any]
) -> None:
    """The optimizer on the compiled kernel (conftest forces eager elsewhere) against eager,
    bit for bit: compiled in one call a bucket, eager in pieces of 7 values (the noise
    counter and the roundings do not see the pieces)."""
    from dtypeplan.optimizers.update import pieces

    monkeypatch.setattr(pieces, "PIECE", 7)

    def train(eager: bool) -> list[torch.Tensor]:
        monkeypatch.setenv(update_path.EAGER_ENV, "1" if eager else "0")
        config = {
            **cell,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        }
        model = make_model(0)
        opt = dtypeplan.resolve(config).build(model.parameters())
        for step in range(3):
            x, y = make_batch(step, 8)
            opt.backward(mse(model, x, y))
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    monkeypatch.setattr(update_path, "_failures", [])
    compiled = train(eager=False)
    assert update_path.path() == "compiled"
    for a, b in zip(train(eager=True), compiled, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_the_tiling_hint_finds_inductors_hook() -> None:
    """``one_pass._tiled_by`` replaces Inductor's ``get_loop_body_lowp_fp`` while compiling the
    fp32-master kernel, and leaves the module as it was; a torch without that function (an
    upgrade) fails here rather than running the kernel at half speed unnoticed."""
    from torch._inductor.codegen import cpp as inductor_cpp

    original = inductor_cpp.get_loop_body_lowp_fp
    with kernel._tiled_by(torch.bfloat16):
        assert inductor_cpp.get_loop_body_lowp_fp is not original
    assert inductor_cpp.get_loop_body_lowp_fp is original


def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch: Any) -> None:
    monkeypatch.delenv(update_path.EAGER_ENV, raising=False)
    monkeypatch.setattr(update_path, "_failures", [])

    def no_compiler(*args: Any) -> Any:
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(kernel, "_compiled", no_compiler)
    update = kernel.OnePassUpdate()
    tensors = _tensors(300, torch.float32, torch.bfloat16, seed=0)
    options = {"decoupled": True, "weight_decay": True, "rounding": "kahan"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(lambda *a: update(*a, **options), tensors, "kahan", 1, 0)
        _run(lambda *a: update(*a, **options), tensors, "kahan", 2, 0)
    assert [str(w.message) for w in caught if "compiling" in str(w.message)][:2] == [
        str(caught[0].message)
    ], "one warning, not one a call"
    assert "no C++ compiler found" in str(caught[0].message)
    assert update_path.path() == "eager"
    want = _run(lambda *a: kernel.adam_one_pass(*a, **options), tensors, "kahan", 1, 0)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_the_environment_variable_forces_eager(monkeypatch: Any) -> None:
    monkeypatch.setenv(update_path.EAGER_ENV, "1")

    def must_not_compile(*args: Any) -> Any:
        raise AssertionError("compiled although forced eager")

    monkeypatch.setattr(kernel, "_compiled", must_not_compile)
    assert update_path.path() == "eager"
    tensors = _tensors(64, torch.float32, torch.bfloat16, seed=1)
    options = {"decoupled": True, "weight_decay": True, "rounding": "nearest"}
    _run(lambda *a: kernel.OnePassUpdate()(*a, **options), tensors, "nearest", 1, 0)


def test_hashed_stochastic_rounding_is_unbiased_and_reproducible() -> None:
    n = 200_000
    key, offset = torch.tensor(master_rounding.noise_key(1, 0, 1)), torch.tensor(0)
    for base in (1.0, -3.0, 2.0**-20):
        ulp = 2.0 ** (math.floor(math.log2(abs(base))) - 7)
        for p in (0.01, 0.25, 0.5, 0.9):
            exact = base + math.copysign(p * ulp, base)
            rounded = master_rounding.round_stochastic_hashed(
                torch.full((n,), exact), key, offset
            ).double()
            assert set(rounded.unique().tolist()) <= {base, base + math.copysign(ulp, base)}
            sigma = ulp * math.sqrt(p * (1 - p) / n)
            assert abs(float(rounded.mean()) - exact) <= 5 * sigma, (base, p)
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    first = master_rounding.round_stochastic_hashed(values, key, offset)
    assert torch.equal(first, master_rounding.round_stochastic_hashed(values, key, offset))
    other_step = torch.tensor(master_rounding.noise_key(1, 0, 2))
    assert not torch.equal(
        first, master_rounding.round_stochastic_hashed(values, other_step, offset)
    )
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])
    out = master_rounding.round_stochastic_hashed(special.clone(), key, offset)
    assert torch.equal(out[:4], special[:4]) and math.copysign(1.0, float(out[1])) == -1.0
    assert bool(torch.isnan(out[4]))


def test_difference_from_torch_fused_after_100_steps_is_bounded() -> None:
    """The bound the module docstring states: against the fp32 pieces around torch's fused
    AdamW (the path before the kernel) after 100 steps, rounded to nearest at most one value
    in 2,000 differs, by at most 2 bf16 ulps or lr / 4; with Kahan the pair's value differs by less
    than one bf16 ulp everywhere."""
    n = 1 << 14
    for rounding, states in (
        ("nearest", torch.bfloat16),
        ("nearest", torch.float32),
        ("kahan", torch.bfloat16),
    ):
        start = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        ours = [start.clone(), torch.zeros(n, dtype=states), torch.zeros(n, dtype=states)]
        theirs = [t.clone() for t in ours]
        comp_ours, comp_theirs = torch.zeros_like(start), torch.zeros_like(start)
        generator = torch.Generator().manual_seed(4)
        one = torch.tensor(1.0)
        for step in range(1, 101):
            grad = torch.randn(n, generator=generator) * 1e-2
            kernel.adam_one_pass(
                *ours[:1],
                grad,
                *ours[1:],
                comp_ours if rounding == "kahan" else None,
                None,
                kernel.hyperparameters(GROUP, step, True, CPU),
                one,
                torch.tensor(0),
                torch.tensor(0),
                decoupled=True,
                weight_decay=True,
                rounding=rounding,
            )
            w = theirs[0].float() + comp_theirs.float()
            m, v = theirs[1].float(), theirs[2].float()
            torch._fused_adamw_(
                [w], [grad], [m], [v], [], [torch.tensor(float(step))],
                lr=GROUP["lr"], beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                amsgrad=False, maximize=False, grad_scale=one,
            )  # fmt: skip
            rounded = w.to(torch.bfloat16)
            if rounding == "kahan":
                comp_theirs.copy_(w - rounded.float())
            theirs[0].copy_(rounded)
            theirs[1].copy_(m)
            theirs[2].copy_(v)
        a = ours[0].float() + comp_ours.float()
        b = theirs[0].float() + comp_theirs.float()
        ulp = torch.exp2(torch.floor(torch.log2(b.abs())) - 7)
        diff = (a - b).abs()
        if rounding == "kahan":
            assert bool((diff < ulp).all()), float((diff / ulp).max())
        else:
            assert int((diff > 0).sum()) <= n // 2_000, int((diff > 0).sum())
            # A rounding decided the other way walks on by whole ulps of a small weight.
            bad = diff > torch.clamp(2 * ulp, min=GROUP["lr"] / 4)
            assert not bool(bad.any()), (a[bad], b[bad], rounding, states)


def test_explain_names_the_host_update(monkeypatch: Any) -> None:
    def row(config: dict[str, Any]) -> str | None:
        config = {"optimizer": {"type": "AdamW"}, **config}
        lines = [
            ln for ln in dtypeplan.resolve(config).explain().splitlines() if "host update" in ln
        ]
        return lines[0] if lines else None

    bf16 = {"enabled": True, "bf16_optimizer_states": True}
    stochastic = {"bf16": bf16, "master_weights": {"dtype": "bf16", "rounding": "stochastic"}}
    monkeypatch.setenv(update_path.EAGER_ENV, "1")
    assert "one pass, eager" in str(row(stochastic))
    monkeypatch.setenv(update_path.EAGER_ENV, "0")
    monkeypatch.setattr(update_path, "_failures", [])
    assert "one pass, compiled" in str(row(stochastic))
    assert "one pass, compiled" in str(row({"optimizer_states": "bf16"}))  # fp32 masters
    handed_off = {
        "bf16": bf16,
        "master_weights": {"dtype": "bf16", "rounding": "nearest"},
        "gradient_accumulation_dtype": "bf16",
    }
    assert "torch's fused Adam/AdamW on the bf16 tensors" in str(row(handed_off))
    assert "fp32 pieces" in str(row({"optimizer_states": "int8"}))
    assert row({}) is None


@pytest.mark.slow
@needs_compiler
def test_more_variants_than_dynamos_default_limit_stay_compiled(monkeypatch: Any) -> None:
    """Ten variants of the kernel in one process (Dynamo's default limit is 8 per code
    object, shared by every variant): each still runs compiled, with eager's bits. Slow: ten
    compiles."""
    monkeypatch.setenv(update_path.EAGER_ENV, "0")
    monkeypatch.setattr(update_path, "_failures", [])
    update = kernel.OnePassUpdate()
    variants = [
        (rounding, grad, states, decoupled)
        for rounding in ("nearest", "stochastic")
        for grad, states in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16))
        for decoupled in (True, False)
    ] + [
        ("kahan", torch.float32, torch.float32, True),
        ("kahan", torch.float32, torch.bfloat16, True),
    ]
    for rounding, grad, states, decoupled in variants:
        options = {"decoupled": decoupled, "weight_decay": True, "rounding": rounding}
        tensors = _tensors(515, grad, states, seed=3)

        def eager(*args: Any, options: dict[str, Any] = options) -> None:
            kernel.adam_one_pass(*args, **options)

        def compiled(*args: Any, options: dict[str, Any] = options) -> None:
            update(*args, **options)

        want = _run(eager, tensors, rounding, 2, 0)
        got = _run(compiled, tensors, rounding, 2, 0)
        assert update_path.path() == "compiled", (rounding, grad, states, decoupled)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(_bits(a), _bits(b)), (rounding, grad, states, decoupled)
