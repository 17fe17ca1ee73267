"""ZeRO-3 (FSDP2) checkpoints reshard like the others: into ZeRO-3 again and into ZeRO-1."""

from __future__ import annotations

from pathlib import Path

from dtypeplan._launch import spawn
from tests.checkpoint_cases import zero3_round_trip


def test_zero3_checkpoint_resumes_at_zero3_and_at_zero1(tmp_path: Path) -> None:
    results = spawn(zero3_round_trip, 2, str(tmp_path / "ckpt"))[0]
    expected = results["uninterrupted"][3:]
    for name in ("resumed_zero3", "resumed_zero1"):
        for got, want in zip(results[name], expected, strict=True):
            # bf16 forward passes: the gradient norms agree to bf16-model noise.
            assert abs(got - want) <= 1e-3 * want, (name, results[name], expected)
