"""The programs the README points to run and do what it says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=400, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_checkpoint_example_resumes_identically() -> None:
    out = _run("examples/checkpoint_resume.py")
    worst = float(out.rsplit("largest relative difference:", 1)[1].split()[0])
    assert worst < 1e-5, out


def test_pipeline_example_trains_at_zero3() -> None:
    out = _run("examples/pipeline_zero.py", "--stage", "3", "--schedule", "gpipe")
    assert "status: OK (implementation 'fsdp2')" in out, out
    steps = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and steps[-1] < steps[0], out
