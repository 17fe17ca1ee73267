"""The benchmark of DeepSpeed's own Muon against dtypeplan's (``benchmarks/
bench_whole_tensor_deepspeed.py``): its arguments parse without DeepSpeed; with DeepSpeed
importable, a quick run on 2 gloo ranks gives the two libraries the same first update up to
what their bf16 Newton-Schulz iterations alone differ by on one gradient (the floor, measured
in the run: 5% on the quick model), the same losses within 1e-3, and every rank the same
weights."""

from __future__ import annotations

import os

import pytest

from benchmarks import bench_whole_tensor_deepspeed as bench


def test_arguments_parse_without_deepspeed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--check-args", "--quick"])
    assert exit_info.value.code == 0
    assert '"quick": true' in capsys.readouterr().out


@pytest.mark.slow
def test_quick_run_agrees_with_deepspeed() -> None:
    if not bench.deepspeed_importable():
        pytest.skip("deepspeed is not importable (it is never a dependency of dtypeplan)")
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        # DeepSpeed torch.compile's muon_update; inductor's CPU C++ then fails to build
        # ("'at::vec' has not been declared") under the default capability.
        pytest.skip("DeepSpeed's compiled Muon update does not build under ATEN_CPU_CAPABILITY")
    summary = bench.main(["--quick", "--no-write", "--steps", "2"])
    for row in summary["agreement"]:
        # The rest of the step is fp32: the first update may differ by little beyond the floor.
        assert row["step-1 update rel diff"] <= 1.2 * row["NS floor"] + 1e-3, row
        ours, theirs = row["final loss dtypeplan"], row["final loss DeepSpeed"]
        assert abs(ours - theirs) <= 1e-3 * abs(theirs), row
        assert row["rank spread DS / plan"] == "0.0e+00 / 0.0e+00", row
    assert [row["ZeRO"] for row in summary["timing"]] == list(bench.STAGES)
