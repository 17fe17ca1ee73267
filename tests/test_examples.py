"""The programs the README points to run and do what it says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=400, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_checkpoint_example_resumes_identically() -> None:
    out = _run("examples/checkpoint_resume.py")
    worst = float(out.rsplit("largest relative difference:", 1)[1].split()[0])
    assert worst < 1e-5, out


@pytest.mark.slow
def test_pipeline_example_trains_at_zero3() -> None:
    out = _run("examples/pipeline_zero.py", "--stage", "3", "--schedule", "gpipe")
    assert "status: OK (implementation 'fsdp2')" in out, out
    steps = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and steps[-1] < steps[0], out


def _quick_start_code() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Quick start\n", 1)[1]
    return section.split("```python\n", 1)[1].split("\n```", 1)[0]


def test_readme_quick_start_runs_verbatim_on_float_inputs() -> None:
    """The quick start as printed, on a small model fed fp32 batches (what a data loader
    yields): ``prepare_model`` makes the model bf16, and its inputs must follow."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    )
    before = [p.detach().clone() for p in model.parameters()]
    target = torch.randn(4)
    namespace = {
        "model": model,
        "loader": [torch.randn(8, 16) for _ in range(3)],
        "micro_batch_size": 4,
        "loss_fn": lambda out: (out.float() - target).pow(2).mean(),
    }
    exec(compile(_quick_start_code(), "README.md quick start", "exec"), namespace)
    trained = namespace["model"]
    assert all(p.dtype == torch.bfloat16 for p in trained.parameters())
    assert any(
        not torch.equal(p.float(), b) for p, b in zip(trained.parameters(), before, strict=True)
    )
