"""Every Triton kernel compiled for sm_90 (H100/H200) without a GPU, with the arguments its
launcher passes at run time (``tests/_triton_compile.py``): steps 1, 2 and 16, noise keys and
offsets of 1 and beyond 2**31, aligned and unaligned pointers.

What it guards against: Triton's JIT turns an int argument equal to 1 into a constexpr Python
int and one divisible by 16 into another variant. The interpreter specializes nothing, so the
interpreter tests passed while every first step on a GPU failed to compile
(``'int' object has no attribute 'to'``) and steps 2 and 16 compiled new variants. The limits
checked of the compiled code, and why:

* no local memory (spills or stack): a spill in a streaming kernel is extra traffic per element;
* at most 128 registers a thread: 16 warps (half of an SM's 64) stay resident, which keeps
  enough 128-bit loads in flight to stream from HBM;
* aligned launches (every flat-engine chunk: ``buffers/layout.ALIGN``) access every element
  stream with 128-bit instructions only (``ld/st.global.v4``), the multi-chunk kernels
  included, whose addresses come from a table.

About 10 s here (one compile a variant, ~1 s each; Triton's cache makes a rerun quick).
"""

from __future__ import annotations

import importlib.util
import platform
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or (platform.system(), platform.machine()) != ("Linux", "x86_64"),
    reason="Triton (pyproject's test extra installs it on Linux x86_64)",
)

MAX_REGISTERS = 128
ALIGNED_WIDTH = "128"
STEPS = (1, 2, 16)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The launches the launchers make, recorded instead of run (CPU tensors)."""
    from dtypeplan.optimizers.kernels import triton_adamw, triton_one_pass
    from tests._triton_compile import Recorder

    recorded: list[Any] = []
    # Only the launchers' device check reads this; the kernels were made as JIT functions.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for module, name in [
        (triton_adamw, "_mixed_adamw_kernel"),
        (triton_adamw, "_mixed_adamw_multi_kernel"),
        (triton_one_pass, "_adam_one_pass_kernel"),
        (triton_one_pass, "_adam_one_pass_multi_kernel"),
    ]:
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), recorded))
    return recorded


def _check(compiled: Any, aligned: bool, what: str) -> None:
    assert compiled.local_bytes == 0, (what, "spills", compiled)
    assert compiled.registers <= MAX_REGISTERS, (what, "registers", compiled)
    if aligned:
        for op in (compiled.global_loads, compiled.global_stores):
            assert op and set(op) == {ALIGNED_WIDTH}, (what, "access widths", compiled)


def _compile_all(launches: list[Any]) -> dict[str, Any]:
    from tests._triton_compile import compile_launch, specialize

    compiled: dict[str, Any] = {}
    for launch in launches:
        key, _ = specialize(launch)
        if key not in compiled:
            compiled[key] = compile_launch(launch)
    return compiled


def _flat(n: int, dtype: torch.dtype, misalign: int = 0) -> torch.Tensor:
    """``n`` elements; ``misalign`` of them before, so the address is not 16-byte aligned."""
    return torch.zeros(n + misalign, dtype=dtype)[misalign:]


HYPER: dict[str, Any] = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}


def test_one_pass_kernels_compile_at_every_step_without_recompiling(launches: list[Any]) -> None:
    """The 16-bit cells' kernels (bf16 masters, stochastic rounding: the noise key and the
    counter offset reach the kernel) at steps 1, 2 and 16, one compiled variant each."""
    from dtypeplan.optimizers.kernels import triton_one_pass as kernel

    hyper, scale = torch.zeros(8), torch.ones(())
    n = 3 * kernel.BLOCK
    for misalign in (0, 1):
        for step in STEPS:
            # Single chunk: key and offset 1, and beyond 2**31 (int64 by value in Triton).
            for key, offset in [(1, 1), (step, 16), (2**32 - step, 2**20)]:
                kernel.adam_one_pass_triton_(
                    *(
                        _flat(n, dt, misalign)
                        for dt in (torch.bfloat16,) * 2 + (torch.float32,) * 2
                    ),
                    None,
                    None,
                    hyper,
                    scale,
                    key,
                    offset,
                    decoupled=True,
                    weight_decay=True,
                    rounding="stochastic",
                )
            chunks = [n, n + 16 * (1 - misalign) + misalign]
            kernel.adam_one_pass_triton_multi_(
                [_flat(c, torch.bfloat16) for c in chunks],
                [_flat(c, torch.bfloat16) for c in chunks],
                [_flat(c, torch.float32) for c in chunks],
                [_flat(c, torch.bfloat16) for c in chunks],
                [_flat(c, torch.bfloat16) for c in chunks],
                [None, None],
                hyper,
                scale,
                [3, 2**32 - 5],
                step,
                decoupled=True,
                weight_decay=True,
                rounding="kahan",
            )
    _expect_variants(launches, per_alignment=2)


def test_fp32_kernels_compile_aligned_and_not(launches: list[Any]) -> None:
    """fp32 masters and moments, a bf16 gradient and bf16 parameters written; a tensor clip
    factor (what the engine passes)."""
    from dtypeplan.optimizers.kernels import triton_adamw as kernel

    n = 3 * kernel.DEFAULT_BLOCK
    factor = torch.ones(())
    for misalign in (0, 1):
        for step in STEPS:
            f32 = [_flat(n, torch.float32, misalign) for _ in range(3)]
            bf16 = [_flat(n, torch.bfloat16, misalign) for _ in range(2)]
            kernel.fused_mixed_adamw_(
                *f32, *bf16, step=step, grad_factor=factor, weight_decay=0.1, **HYPER
            )
            chunks = [n, n + 16 * (1 - misalign) + misalign]
            kernel.fused_mixed_adamw_multi_(
                [_flat(c, torch.float32) for c in chunks],
                [_flat(c, torch.float32) for c in chunks],
                [_flat(c, torch.float32) for c in chunks],
                [_flat(c, torch.bfloat16) for c in chunks],
                [_flat(c, torch.bfloat16) for c in chunks],
                step=step,
                grad_factor=factor,
                weight_decay=0.1,
                **HYPER,
            )
    _expect_variants(launches, per_alignment=2)


def _expect_variants(launches: list[Any], per_alignment: int) -> None:
    """One compiled variant per kernel and alignment, whatever the step, key or offset; the
    aligned ones within every limit, the unaligned ones without spills."""
    from tests._triton_compile import specialize

    half = len(launches) // 2
    for aligned, part in ((True, launches[:half]), (False, launches[half:])):
        by_kernel: dict[str, set[str]] = {}
        for launch in part:
            by_kernel.setdefault(launch.kernel.__name__, set()).add(specialize(launch)[0])
        assert len(by_kernel) == per_alignment, by_kernel.keys()
        for name, keys in by_kernel.items():
            assert len(keys) == 1, (name, aligned, "recompiles", len(keys))
        for key, compiled in _compile_all(part).items():
            name = next(x.kernel.__name__ for x in part if specialize(x)[0] == key)
            if aligned:
                _check(compiled, True, name)
            else:
                assert compiled.local_bytes == 0, (name, compiled)


@pytest.mark.parametrize(
    "cell",
    [
        # fp32 masters, bf16 parameters: the fp32 kernel (update/triton.py)
        ({"bf16": {"enabled": True}}, "triton"),
        # bf16 masters rounded stochastically, fp32 moments: the one-pass kernel
        (
            {
                "bf16": {"enabled": True},
                "master_weights": {"dtype": "bf16", "rounding": "stochastic"},
            },
            "triton-low-precision",
        ),
        # fp32 masters with bf16 moments
        ({"optimizer_states": "bf16"}, "triton-low-precision"),
    ],
)
def test_engine_launches_compile_for_sm90(launches: list[Any], cell: Any) -> None:
    """The registry's kernels from a real engine (several buckets, the flat layout's chunks):
    16 steps, one compiled variant, within every limit."""
    import dtypeplan

    config, name = cell
    config = {
        **config,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 300},
    }
    plan = dtypeplan.resolve(config)
    torch.manual_seed(0)
    model = plan.prepare_model(
        torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    )
    opt = plan.build(model.parameters())
    assert opt.update_kernel.name == name
    for _ in range(16):
        opt.zero_grad()
        opt.backward(model(torch.randn(4, 8, dtype=plan.param_dtype)).float().square().sum())
        opt.step()
    assert len(launches) == 16, len(launches)  # one param group: one launch a step
    compiled = _compile_all(launches)
    assert len(compiled) == 1, f"{len(compiled)} variants over 16 steps"
    _check(next(iter(compiled.values())), True, name)
