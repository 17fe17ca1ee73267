"""The one-pass Triton update of the 16-bit cells (``kernels/triton_one_pass.py``) and its
registry entry (``update/triton_low_precision.py``).

The kernel must give the bits of the host's eager one-pass update
(``one_pass.adam_one_pass``) for every master rounding x moment dtypes x (parameter
written or aliased), in Triton's CPU interpreter (a subprocess, skipped without Triton) and on
CUDA (skipped without a GPU). The eager path takes a correctly rounded square root (in double:
torch's fp32 ``sqrt`` misrounds about one value in five here, one ulp each), as the kernel's
``sqrt_rn``, CUDA's ``sqrt`` and the host's compiled update (Inductor) do.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from dtypeplan.optimizers.kernels import one_pass as update_kernel
from dtypeplan.optimizers.kernels import rounding as master_rounding
from dtypeplan.optimizers.kernels import triton_one_pass as triton_kernel
from tests._helpers import full_only

_HAS_TRITON = importlib.util.find_spec("triton") is not None
_HAS_CUDA_TRITON = torch.cuda.is_available() and _HAS_TRITON
_REPO_ROOT = Path(__file__).resolve().parents[1]

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16
GROUP: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.999), "eps": 1e-8}
STEPS = 3


def _cases() -> list[dict[str, Any]]:
    """Every rounding x moment dtypes x parameter for bf16 masters, every moment dtypes x
    parameter for fp32 masters; gradient dtype and weight decay cycle through the cases."""
    moments = [(FP32, FP32), (BF16, BF16), (FP32, BF16)]
    decays = [(True, True), (True, False), (False, True)]  # (weight decay, decoupled)
    grads = [FP32, BF16, FP16]
    cases: list[dict[str, Any]] = []
    cells = [
        (BF16, r, m, p)
        for r in ("nearest", "stochastic", "kahan")
        for m in moments
        for p in (None, BF16)
    ]
    cells += [(FP32, "nearest", m, p) for m in moments for p in (None, BF16, FP32)]
    for k, (master, rounding, (m, v), param) in enumerate(cells):
        weight_decay, decoupled = decays[k % 3]
        cases.append(
            {
                "master": master,
                "rounding": rounding,
                "exp_avg": m,
                "exp_avg_sq": v,
                "param": param,
                "grad": grads[(k // 3) % 3],
                "weight_decay": weight_decay,
                "decoupled": decoupled,
                # Sizes not a multiple of the block, a noise counter that does not start at 0.
                "n": 2 * triton_kernel.BLOCK + 37 + k,
                "offset": 4099 * (k % 2),
                "number": k,
            }
        )
    return cases


def _tensors(case: dict[str, Any], device: str) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(case["number"])
    n = case["n"]
    master = torch.randn(n, generator=gen).to(case["master"])
    master[:4] = torch.tensor([1e-30, -3e38, 0.0, -0.0])[:n]  # subnormal range, near overflow
    kahan = case["rounding"] == "kahan" and case["master"] == BF16
    return {
        "master": master.to(device),
        "exp_avg": (torch.randn(n, generator=gen) * 0.1).to(case["exp_avg"]).to(device),
        "exp_avg_sq": (torch.rand(n, generator=gen) * 1e-2).to(case["exp_avg_sq"]).to(device),
        "compensation": (
            (torch.randn(n, generator=gen) * 1e-3).to(BF16).to(device) if kahan else None
        ),
        "param": None if case["param"] is None else torch.zeros(n, dtype=case["param"]).to(device),
    }


def _grad(case: dict[str, Any], step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * case["number"] + step)
    grad = torch.randn(case["n"], generator=gen) * (3.0 + step)
    if step == 2:  # a non-finite gradient: NaN and infinities propagate as in eager
        grad[-3:] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    return grad.to(case["grad"])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, except that a NaN need only be a NaN (torch's own bf16 conversion gives
    0x7FC0 or 0xFFFF, depending on the CPU's vector width)."""
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    return (
        a.dtype == b.dtype
        and torch.equal(nan_a, nan_b)
        and torch.equal(a[~nan_a].view(-1).cpu(), b[~nan_b].view(-1).cpu())
    )


def check_case(case: dict[str, Any], device: str) -> None:
    """STEPS updates of one case by the kernel on ``device`` and by the eager path on the host;
    every tensor compared after every step."""
    mine = _tensors(case, device)
    ref = {k: None if t is None else t.cpu().clone() for k, t in mine.items()}
    scale = torch.tensor(0.75)  # the step's clip and loss-scale factor's inverse
    for step in range(1, STEPS + 1):
        grad = _grad(case, step)
        hyper = update_kernel.hyperparameters(GROUP, step, case["decoupled"], torch.device("cpu"))
        key = master_rounding.noise_key(0x5EED + 1, case["number"], step)
        kahan = ref["compensation"]
        update_kernel.adam_one_pass(
            ref["master"],  # type: ignore[arg-type]
            grad,
            ref["exp_avg"],  # type: ignore[arg-type]
            ref["exp_avg_sq"],  # type: ignore[arg-type]
            kahan,
            ref["param"],
            hyper,
            scale,
            torch.tensor(key),
            torch.tensor(case["offset"]),
            decoupled=case["decoupled"],
            weight_decay=case["weight_decay"],
            rounding=case["rounding"],
        )
        grad_on_device = grad.to(device)
        before = grad_on_device.clone()
        triton_kernel.adam_one_pass_triton_(
            mine["master"],  # type: ignore[arg-type]
            grad_on_device,
            mine["exp_avg"],  # type: ignore[arg-type]
            mine["exp_avg_sq"],  # type: ignore[arg-type]
            mine["compensation"],
            mine["param"],
            hyper.to(device),
            scale.to(device),
            key,
            case["offset"],
            decoupled=case["decoupled"],
            weight_decay=case["weight_decay"],
            rounding=case["rounding"],
        )
        assert _same(grad_on_device, before), "the kernel wrote the gradient"
        for name, want in ref.items():
            got = mine[name]
            if want is None or got is None:
                continue
            if name == "param" and case["master"] == BF16:
                # adam_one_pass leaves it (there the master is the parameter); the kernel
                # writes the rounded master's value.
                want = ref["master"].to(got.dtype)  # type: ignore[union-attr]
            assert _same(got, want), (name, step, case)


def _bad_arguments() -> None:
    """The kernel refuses what it cannot do, naming it."""
    n = 8
    hyper = update_kernel.hyperparameters(GROUP, 1, True, torch.device("cpu"))
    scale = torch.ones(())

    def call(master: torch.Tensor, m: torch.Tensor, **kwargs: Any) -> None:
        triton_kernel.adam_one_pass_triton_(
            master,
            torch.zeros(n),
            m,
            torch.zeros(n),
            kwargs.get("compensation"),
            None,
            hyper,
            scale,
            0,
            0,
            decoupled=True,
            weight_decay=True,
            rounding=kwargs.get("rounding", "nearest"),
        )

    for bad, message in [
        ({"master": torch.zeros(n, dtype=FP16)}, "serves bf16 or fp32 masters"),
        ({"m": torch.zeros(n, dtype=FP16)}, "serves bf16 or fp32 masters"),
        ({"m": torch.zeros(n + 1)}, "must be contiguous with master's 8 elements"),
        ({"master": torch.zeros(n, dtype=BF16), "rounding": "kahan"}, "compensation"),
        ({"rounding": "up"}, "rounding must be one of"),
    ]:
        args = {"master": torch.zeros(n), "m": torch.zeros(n), **bad}
        with pytest.raises(ValueError, match=message):
            call(args.pop("master"), args.pop("m"), **args)


def check_multi(device: str) -> None:
    """One launch over three chunks of one group (sizes off the block, one smaller than a
    block) gives each chunk the bits of its own eager update, with its own noise key."""
    sizes = [2 * triton_kernel.BLOCK + 7, 5, triton_kernel.BLOCK - 1]
    moments = [(FP32, FP32), (BF16, BF16)]
    cells = [(BF16, r, m, None) for r in ("nearest", "stochastic", "kahan") for m in moments]
    cells += [(FP32, "nearest", (BF16, BF16), BF16), (FP32, "nearest", (FP32, BF16), None)]
    seed = 0x5EED + 3
    for master, rounding, (m, v), param in cells:
        cases = [
            {"master": master, "rounding": rounding, "exp_avg": m, "exp_avg_sq": v,
             "param": param, "grad": BF16, "weight_decay": True, "decoupled": True,
             "n": n, "offset": 0, "number": 40 + i}
            for i, n in enumerate(sizes)
        ]  # fmt: skip
        mine = [_tensors(case, device) for case in cases]
        ref = [{k: None if t is None else t.cpu().clone() for k, t in x.items()} for x in mine]
        scale = torch.tensor(1.25)
        for step in range(1, STEPS + 1):
            grads = [_grad(case, step) for case in cases]
            hyper = update_kernel.hyperparameters(GROUP, step, True, torch.device("cpu"))
            for case, r, grad in zip(cases, ref, grads, strict=True):
                key = master_rounding.noise_key(seed, case["number"], step)
                update_kernel.adam_one_pass(
                    r["master"], grad, r["exp_avg"], r["exp_avg_sq"], r["compensation"],
                    r["param"], hyper, scale, torch.tensor(key), torch.tensor(0),
                    decoupled=True, weight_decay=True, rounding=rounding,
                )  # type: ignore[arg-type]  # fmt: skip
            triton_kernel.adam_one_pass_triton_multi_(
                [x["master"] for x in mine],  # type: ignore[misc]
                [g.to(device) for g in grads],
                [x["exp_avg"] for x in mine],  # type: ignore[misc]
                [x["exp_avg_sq"] for x in mine],  # type: ignore[misc]
                [x["compensation"] for x in mine],
                [x["param"] for x in mine],
                hyper.to(device),
                scale.to(device),
                [triton_kernel.noise_key_base(seed, case["number"]) for case in cases],
                step,
                decoupled=True,
                weight_decay=True,
                rounding=rounding,
            )
            for case, got, want in zip(cases, mine, ref, strict=True):
                for name, value in want.items():
                    if value is not None and got[name] is not None:
                        assert _same(got[name], value), (name, step, case)  # type: ignore[arg-type]


def run_all(device: str) -> None:
    for case in _cases():
        check_case(case, device)
    check_multi(device)
    _bad_arguments()


def test_noise_key_base_gives_noise_key() -> None:
    for seed, number, step in [(0x5EED, 0, 1), (0x5EED + 7, 12345, 2**31 + 5), (1, 2**31, 7)]:
        base = triton_kernel.noise_key_base(seed, number)
        key = master_rounding.noise_key(seed, number, step)
        assert master_rounding._mix32_int(base + step) == key


_KERNEL_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from tests.test_low_precision_triton import run_all
run_all("cpu")
print("KERNEL-OK")
"""


def _interpret(script: str, marker: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", script.format(root=str(_REPO_ROOT))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0 and marker in proc.stdout, proc.stdout + proc.stderr[-5000:]


@pytest.mark.skipif(not _HAS_TRITON, reason="needs Triton (its CPU interpreter)")
@pytest.mark.slow
def test_kernel_gives_the_eager_bits_in_triton_interpreter() -> None:
    _interpret(_KERNEL_SCRIPT, "KERNEL-OK")


@pytest.mark.skipif(not _HAS_CUDA_TRITON, reason="needs CUDA and Triton")
def test_kernel_gives_the_eager_bits_cuda() -> None:
    run_all("cuda")


def test_kernel_without_triton_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_kernel, "triton", None)
    t = torch.zeros(4)
    with pytest.raises(RuntimeError, match="needs Triton"):
        triton_kernel.adam_one_pass_triton_(
            t,
            t,
            t,
            t,
            None,
            None,
            torch.zeros(8),
            torch.ones(()),
            0,
            0,
            decoupled=True,
            weight_decay=True,
            rounding="nearest",
        )


def test_bytes_per_param() -> None:
    # bf16 gradient; bf16 master + Kahan and bf16 moments read and written: 2 + 2 * 8.
    assert triton_kernel.bytes_per_param(BF16, BF16, BF16, BF16, None, kahan=True) == 18
    # fp32 accumulator, fp32 master, bf16 moments, bf16 parameter: 4 + 2 * 8 + 2.
    assert triton_kernel.bytes_per_param(FP32, BF16, BF16, FP32, BF16, kahan=False) == 22


def test_cases_cover_every_cell() -> None:
    cases = _cases()
    seen = {(c["master"], c["rounding"], c["exp_avg"], c["exp_avg_sq"], c["param"]) for c in cases}
    assert len(seen) == len(cases) == 3 * 3 * 2 + 3 * 3
    for key in ("grad", "weight_decay", "decoupled"):
        assert len({c[key] for c in cases}) > 1, key
    assert all(c["n"] % triton_kernel.BLOCK for c in cases)


_PREAMBLE = """
import os, sys
sys.path.insert(0, {root!r})
os.environ["DTYPEPLAN_EAGER_UPDATE"] = "1"
import torch
import dtypeplan
from dtypeplan.optimizers.kernels import one_pass as update_kernel

ADAMW = {{"type": "AdamW", "params": {{"lr": 1e-2, "weight_decay": 0.1}}}}
BF16 = {{"bf16": {{"enabled": True}}}}
BUCKETS = {{"zero_optimization": {{"stage": 1, "reduce_bucket_size": 40}}}}

def bf16_master(rounding, states, accum="fp32"):
    return {{**BF16, **BUCKETS, "gradient_accumulation_dtype": accum,
             "master_weights": {{"dtype": "bf16", "rounding": rounding}},
             "optimizer_states": states, "optimizer": ADAMW}}
"""
"""What the interpreter scripts below share (a format string: {root} is the repository)."""

_ENGINE_SCRIPT = (
    _PREAMBLE
    + """
def build(plan):
    torch.manual_seed(0)
    model = plan.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)))
    return model, plan.build(model.parameters())

def train(config, fused, resume_at=None, same=False):
    os.environ["DTYPEPLAN_FUSED_KERNEL"] = "1" if fused else "0"
    plan = dtypeplan.resolve(config)
    model, opt = build(plan)
    torch.manual_seed(1)
    batches = [torch.randn(4, 8, dtype=plan.param_dtype) for _ in range(4)]
    for k, batch in enumerate(batches):
        if k == resume_at:  # a fresh model and optimizer loaded from the state so far
            saved = opt.state_dict()
            weights = {{name: t.clone() for name, t in model.state_dict().items()}}
            if same:  # or the same ones, after a step that the load undoes
                opt.zero_grad()
                opt.backward(model(batch).float().sum())
                opt.step()
            else:
                model, opt = build(plan)
            model.load_state_dict(weights)
            opt.load_state_dict(saved)
        opt.zero_grad()
        loss = model(batch).float().square().sum()
        opt.backward(loss)
        opt.step()
    states = [s[name].float() for s in opt.inner.state.values() for name in sorted(s)
              if torch.is_tensor(s[name]) and s[name].dim()]
    return opt.update_kernel.name, [p.detach().clone() for p in model.parameters()], states

for rounding in ("nearest", "stochastic", "kahan"):
    for states in ("fp32", "bf16"):
        config = bf16_master(rounding, states)
        name, params, moments = train(config, True)
        assert name == "triton-low-precision", (config, name)
        host_name, host_params, host_moments = train(config, False)
        assert host_name == "low-precision", host_name
        for a, b in zip(params + moments, host_params + host_moments, strict=True):
            assert torch.equal(a, b), (rounding, states, (a - b).abs().max())

# A resumed run gives the bits of the uninterrupted one: the kernel reads the loaded step
# counter again (the bias corrections and the noise key depend on it), also in the optimizer
# that stepped past the saved state.
for rounding in ("stochastic", "kahan"):
    config = bf16_master(rounding, "bf16")
    straight = train(config, True)
    for same in (False, True):
        resumed = train(config, True, resume_at=2, same=same)
        assert resumed[0] == "triton-low-precision"
        for a, b in zip(straight[1] + straight[2], resumed[1] + resumed[2], strict=True):
            assert torch.equal(a, b), ("resume", rounding, same, (a - b).abs().max())

# fp32 masters with bf16 moments: the host runs the one-pass update too (tiled by bf16), and
# the kernel gives its bits, moments included.
config = {{**BUCKETS, "optimizer_states": "bf16", "optimizer": ADAMW}}
name, params, moments = train(config, True)
assert name == "triton-low-precision", name
host_name, host_params, host_moments = train(config, False)
assert host_name == "low-precision", host_name
for a, b in zip(params + moments, host_params + host_moments, strict=True):
    assert torch.equal(a, b), ("fp32 masters", (a - b).abs().max())

# The registry: torch's fused kernel keeps the cell it does exactly, quantized moments keep
# theirs, and DTYPEPLAN_FUSED_KERNEL=0 turns the Triton kernel off.
assert train(bf16_master("nearest", "bf16", "bf16"), True)[0] == "torch-fused-16bit"
assert train({{**BUCKETS, "optimizer_states": "int8", "optimizer": ADAMW}}, True)[0] == "quantized"
print("ENGINE-OK")
"""
)


# Slow: about 14 s here (the engine in the interpreter). The default run keeps the
# kernel-level interpreter test; tests/test_triton_sm90.py compiles the engine's launches.
@pytest.mark.slow
@pytest.mark.skipif(not _HAS_TRITON, reason="needs Triton (its CPU interpreter)")
def test_engine_runs_the_kernel_with_the_host_bits_in_triton_interpreter() -> None:
    """The engine picks the kernel for the 16-bit cells; with bf16 masters its steps give the
    bits of the host's one-pass update (the same noise per master and step), several
    buckets per group, and a run resumed from ``state_dict`` the bits of the uninterrupted
    one."""
    _interpret(_ENGINE_SCRIPT, "ENGINE-OK")


_SHARDED_SCRIPT = (
    _PREAMBLE
    + """
# Two ranks, ZeRO-2, several buckets: each rank's chunks in one launch, the noise of its own
# seed (SEED + shard rank), strided parameter chunks written and all-gathered. The host path
# (DTYPEPLAN_FUSED_KERNEL=0, eager) ends at the same parameters, bit for bit.
from dtypeplan.launch import spawn
from tests.workers.parity import run_cases
sharded = [
    {{"name": rounding, "steps": 3, "config": {{
        **bf16_master(rounding, "bf16"),
        "zero_optimization": {{"stage": 2, "reduce_bucket_size": 300}}}}}}
    for rounding in ("stochastic", "kahan")
]
digests = {{}}
for fused in ("1", "0"):
    os.environ["DTYPEPLAN_FUSED_KERNEL"] = fused
    results = spawn(run_cases, 2, sharded)
    for result in results:
        for case in result:
            assert case["master_rel_error"] <= 2e-2, case
    digests[fused] = [[case["params_digest"] for case in result] for result in results]
assert digests["1"] == digests["0"], digests

# ZeRO-3 on two ranks: each param group's local shards in one launch per step count, the
# bits of the host's one-pass update (bf16 masters stochastic and Kahan; an fp32 master
# with bf16 moments); with DTYPEPLAN_FUSED_KERNEL=0 no launch.
from tests.test_low_precision_triton import run_cases_counting_launches
zero3 = [
    {{"name": rounding, "steps": 3, "param_groups": 2, "config": {{
        **bf16_master(rounding, "bf16"), "zero_optimization": {{"stage": 3}}}}}}
    for rounding in ("stochastic", "kahan")
] + [{{"name": "fp32 masters", "steps": 3, "config": {{
    "optimizer_states": "bf16", "optimizer": ADAMW, "zero_optimization": {{"stage": 3}}}}}}]
digests = {{}}
for fused in ("1", "0"):
    os.environ["DTYPEPLAN_FUSED_KERNEL"] = fused
    results = spawn(run_cases_counting_launches, 2, zero3)
    for result, launches in results:
        for case in result:
            assert "error" not in case, case
            assert case["master_rel_error"] <= 2e-2, case
        # One launch per step and param group: every shard of a group at one step count.
        per_group = sum(case["steps"] * case.get("param_groups", 1) for case in zero3)
        assert launches == (per_group if fused == "1" else 0), (fused, launches)
    digests[fused] = [[case["params_digest"] for case in result] for result, _ in results]
assert digests["1"] == digests["0"], digests

print("SHARDED-OK")
"""
)


def run_cases_counting_launches(
    rank: int, world_size: int, cases: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], int]:
    """``tests.workers.parity.run_cases``, and how many one-pass Triton launches ZeRO-3's
    shard update made (``fsdp2/shard_update.py``)."""
    from dtypeplan.optimizers.fsdp2 import shard_update
    from tests.workers.parity import run_cases

    launches = [0]
    launch = shard_update.launch_one_pass

    def counted(*args: Any, **kwargs: Any) -> None:
        launches[0] += 1
        launch(*args, **kwargs)

    shard_update.launch_one_pass = counted  # type: ignore[assignment]
    try:
        return run_cases(rank, world_size, cases), launches[0]
    finally:
        shard_update.launch_one_pass = launch  # type: ignore[assignment]


@pytest.mark.slow
@pytest.mark.skipif(not _HAS_TRITON, reason="needs Triton (its CPU interpreter)")
@full_only("test_engine_runs_the_kernel_with_the_host_bits_in_triton_interpreter, on one rank")
def test_two_ranks_run_the_kernel_with_the_host_bits_in_triton_interpreter() -> None:
    """ZeRO-2 and ZeRO-3 on two ranks (two spawned groups each under the interpreter)."""
    _interpret(_SHARDED_SCRIPT, "SHARDED-OK")


def test_explain_names_the_cuda_update(monkeypatch: pytest.MonkeyPatch) -> None:
    import dtypeplan

    def row(config: dict[str, Any]) -> str | None:
        config = {"optimizer": {"type": "AdamW"}, **config}
        lines = [
            ln for ln in dtypeplan.resolve(config).explain().splitlines() if "CUDA update" in ln
        ]
        return lines[0] if lines else None

    bf16 = {"enabled": True, "bf16_optimizer_states": True}
    stochastic = {"bf16": bf16, "master_weights": {"dtype": "bf16", "rounding": "stochastic"}}
    monkeypatch.setenv("DTYPEPLAN_FUSED_KERNEL", "1")
    want = "one pass, Triton" if _HAS_TRITON else "fp32 pieces around torch's fused Adam/AdamW"
    assert want in str(row(stochastic))
    assert want in str(row({"optimizer_states": "bf16"}))  # fp32 masters, bf16 moments
    monkeypatch.setenv("DTYPEPLAN_FUSED_KERNEL", "0")
    assert "(DTYPEPLAN_FUSED_KERNEL=0)" in str(row(stochastic))
    monkeypatch.setenv("DTYPEPLAN_FUSED_KERNEL", "1")
    handed_off = {
        "bf16": bf16,
        "master_weights": {"dtype": "bf16", "rounding": "nearest"},
        "gradient_accumulation_dtype": "bf16",
    }
    assert "torch's fused Adam/AdamW on the bf16 tensors" in str(row(handed_off))
    assert "quantized" in str(row({"bf16": {"enabled": True}, "master_weights": {"dtype": "bf16"},
                                   "optimizer_states": "int8"}))  # fmt: skip
    fp16 = {"fp16": {"enabled": True}, "optimizer_states": "bf16"}
    assert "rounds to bf16 only" in str(row(fp16))
    assert row({}) is None


def test_host_steps_read_the_device_once_and_follow_every_change() -> None:
    """ZeRO-3's launches take each shard's step count from the host: read once, advanced
    with each launch, read again after anything else wrote the tensor (a load, a user)."""
    from dtypeplan.optimizers.update.triton_low_precision import HostSteps

    steps = HostSteps()
    step = torch.tensor(4.0)
    assert steps.count(step) == 4
    torch._foreach_add_([step], 1.0)  # what launch_one_pass does
    steps.advance([step], [4])
    with mock.patch.object(torch.Tensor, "item", side_effect=AssertionError("read again")):
        assert steps.count(step) == 5
    step.copy_(torch.tensor(2.0))  # a load
    assert steps.count(step) == 2
