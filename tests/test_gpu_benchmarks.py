"""The GPU benchmark script runs end to end on a CPU: ``run_all.sh --dry-run``.

No CI machine has a GPU, so this is what keeps ``benchmarks/gpu/run_all.sh`` and the two
benchmarks it runs from rotting: every step must pass at tiny sizes on CPU, write its dated
results, and report a correctness check that passed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_optimizer_step
from benchmarks._optimizer_step import REFERENCE_BYTES_PER_PARAM, step_bytes_per_param

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_run_all_dry_run_passes_and_writes_dated_results(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu/run_all.sh"), "--dry-run", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    (summary,) = tmp_path.glob("gpu_run_all-*.md")
    rows = [line for line in summary.read_text().splitlines() if line.startswith("| ")]
    # rows[0] is the header, rows[1] the separator
    statuses = {row.split("|")[1].strip(): row.split("|")[2].strip() for row in rows[2:]}
    assert statuses == {
        "install": "skipped: dry run",
        "tests": "ok",
        "kernel": "ok",
        "lowprec": "ok",
        "engine": "ok",
        "offload": "ok",
    }, summary.read_text()
    (offload_json,) = tmp_path.glob("offload_dryrun-*.json")
    offload = json.loads(offload_json.read_text())
    assert offload["ok"] and offload["max_rel_param_diff"] == 0.0, offload

    (engine_json,) = tmp_path.glob("gpu_engine_step_dryrun-*.json")
    engine = json.loads(engine_json.read_text())
    assert engine["errors"] == [], engine["errors"]
    assert all(result["ok"] for result in engine["check"].values()), engine["check"]
    assert set(engine["cases"]) == {
        "torch AdamW fused fp32",
        "dtypeplan kernel",
        "dtypeplan kernel, boundary told",
        "dtypeplan torch path",
    }
    assert engine["cases"]["dtypeplan kernel"]["bytes_per_param"] == 30
    assert engine["cases"]["torch AdamW fused fp32"]["bytes_per_param"] == 28
    assert engine["summary"]["kernel_x_floor"] is not None

    (kernel_json,) = tmp_path.glob("gpu_fused_step_dryrun-*.json")
    kernel = json.loads(kernel_json.read_text())
    assert "composed" in kernel, kernel["errors"]
    # Without Triton the kernel's sections are recorded as errors; with it (its CPU
    # interpreter) they must pass, the check against torch's AdamW included.
    if importlib.util.find_spec("triton") is not None:
        assert kernel["errors"] == [], kernel["errors"]
        assert all(case["ok"] for case in kernel["check"].values()), kernel["check"]
    (low_json,) = tmp_path.glob("gpu_low_precision_step_dryrun-*.json")
    low = json.loads(low_json.read_text())
    if importlib.util.find_spec("triton") is not None:
        assert low["errors"] == [], low["errors"]
        assert low["check"] and all(case["ok"] for case in low["check"].values()), low["check"]
        assert len(low["cells"]) == 6, low["cells"]
    else:
        assert [e["section"] for e in low["errors"]] == ["setup"], low["errors"]
    # The last line of each benchmark's output is its JSON summary.
    assert '"benchmark": "gpu_engine_step_dryrun"' in output


@pytest.mark.parametrize(
    ("param", "accum", "expected"),
    [
        # read accumulator + read/write fp32 master 8 + read/write 2 moments 16 + write param
        (torch.bfloat16, torch.float32, 4 + 8 + 16 + 2),
        (torch.bfloat16, torch.bfloat16, 2 + 8 + 16 + 2),
        (torch.float16, torch.float32, 4 + 8 + 16 + 2),
        # fp32 parameters are their own master: nothing more to write
        (torch.float32, torch.float32, 4 + 8 + 16),
        (torch.float32, torch.bfloat16, 2 + 8 + 16),
    ],
)
def test_step_bytes_per_param(param: torch.dtype, accum: torch.dtype, expected: int) -> None:
    assert step_bytes_per_param(param, accum, torch.float32) == expected
    assert REFERENCE_BYTES_PER_PARAM == 28


def test_cpu_optimizer_step_benchmark_reports_every_pair() -> None:
    pairs = ["bf16/fp32", "fp16/fp16", "fp32/fp32"]
    summary = bench_optimizer_step.main(
        ["--no-write", "--width", "64", "--layers", "2", "--rounds", "1",
         "--steps-per-round", "2", "--warmup", "2", "--pairs", ",".join(pairs)]
    )  # fmt: skip
    assert summary["num_params"] == 2 * 64 * 64
    assert set(summary["ratios"]) == {f"dtypeplan {pair}" for pair in pairs}
    assert all(ratio is not None and ratio > 0 for ratio in summary["ratios"].values())
