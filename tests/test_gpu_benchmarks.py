"""The GPU benchmark script checked on a CPU: ``run_all.sh`` parsed, dry-run and CPU-run.

No CI machine has a GPU, so this is what keeps ``benchmarks/gpu/run_all.sh`` and the
benchmarks it runs from rotting: ``bash -n``; ``DRY_RUN=1`` prints every step within the time
budget and checks that each entry point imports and parses its arguments; its install step,
from a bare virtual environment (no pip, no torch), prints the pinned CUDA torch and torchao;
``--cpu-run`` runs every step at tiny sizes on CPU, writes its dated results, and reports
correctness checks that passed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_optimizer_step
from benchmarks._optimizer_step import REFERENCE_BYTES_PER_PARAM, step_bytes_per_param

REPO = Path(__file__).resolve().parents[1]


SCRIPT = REPO / "benchmarks/gpu/run_all.sh"
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> str:
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


@needs_bash
def test_run_all_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


@pytest.mark.slow
@needs_bash
def test_dry_run_prints_the_steps_and_checks_every_entry_point(tmp_path: Path) -> None:
    output = _run(["--out", str(tmp_path)], dict(os.environ, PYTHON=sys.executable, DRY_RUN="1"))
    limits = {
        name: int(limit)
        for name, limit in re.findall(r"^=== (\w+) \(limit (\d+) s\)", output, re.MULTILINE)
    }
    steps = [
        "install", "smoke", "zero3", "tests", "kernel", "lowprec", "multichunk", "engine",
        "offload", "fp8",
    ]  # fmt: skip
    assert list(limits) == steps, output[-3000:]
    # Under 10 minutes, the install included; the fp8 step comes last and runs in what the
    # others leave of the 590 s budget (its compiles are the least certain cost).
    assert sum(limits.values()) - limits["fp8"] <= 590, limits
    assert "--numel 268435456" in output  # the kernels at 2^28
    assert "bench_multi_chunk_step --ranks 8,64" in output  # and on a 7B Llama's chunks
    modules = re.findall(r"^    modules: ok     (\S+)", output, re.MULTILINE)
    assert modules == [
        "benchmarks.gpu.smoke_engine",
        "benchmarks.gpu.zero3_one_rank",
        "benchmarks.gpu.bench_fused_step",
        "benchmarks.gpu.bench_low_precision_step",
        "benchmarks.gpu.bench_multi_chunk_step",
        "benchmarks.gpu.bench_engine_step",
        "benchmarks.bench_offload",
        "benchmarks.gpu.bench_fp8_step",
    ], output[-3000:]
    # only the CUDA tests are collected, and some are
    collected = re.search(r"tests: (\d+)/(\d+) tests collected \((\d+) deselected\)", output)
    assert collected is not None, output[-3000:]
    assert 0 < int(collected[1]) < int(collected[2]), collected[0]
    (record,) = tmp_path.glob("gpu_run_all-*.json")
    written = json.loads(record.read_text())
    assert [s["step"] for s in written["steps"]] == steps
    assert {s["status"] for s in written["steps"]} == {"printed"}
    (summary,) = tmp_path.glob("gpu_run_all-*.md")
    assert "## What one GPU cannot reach" in summary.read_text()


@needs_bash
def test_the_install_step_from_a_bare_environment_names_the_pins(tmp_path: Path) -> None:
    """A virtual environment without pip or torch (a bare machine's Python): the install step
    would bootstrap pip, install the pinned CUDA torch with its dependencies, torchao without
    (it builds against the torch there), and dtypeplan; nothing is downloaded here."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    python = str(bare / "bin" / "python")
    env = dict(os.environ, PYTHON=python, DRY_RUN="1")
    env.pop("PIP_INDEX_URL", None)
    output = _run(["--install-only"], env, timeout=60)
    assert f"would run: {python} -m ensurepip --upgrade" in output, output
    assert f"would run: {python} -m pip install torch==2.13.0\n" in output, output
    assert f"would run: {python} -m pip install --no-deps torchao==0.18.0\n" in output, output
    assert "index: https://pypi.org/simple, the default" in output, output
    assert "pytest" in output and "hypothesis" in output and "-e ." in output, output
    url = "https://download.pytorch.org/whl/cu128"
    output = _run(["--install-only"], dict(env, TORCH_INDEX_URL=url), timeout=60)
    assert f"pip install --index-url {url} torch==2.13.0" in output, output
    # The pins are the project's: torch as README installs it, torchao inside pyproject's range
    assert "torch==2.13.0" in (REPO / "README.md").read_text()
    assert '"torchao>=0.18,<0.19"' in (REPO / "pyproject.toml").read_text()


@pytest.mark.slow
@needs_bash
def test_run_all_cpu_run_passes_and_writes_dated_results(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--cpu-run", "--out", str(tmp_path)],
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
        "install": "skipped: cpu run",
        "smoke": "ok",
        "zero3": "ok",
        "tests": "ok",
        "kernel": "ok",
        "lowprec": "ok",
        "multichunk": "ok",
        "engine": "ok",
        "offload": "ok",
        "fp8": "ok",
    }, summary.read_text()
    (smoke_json,) = tmp_path.glob("gpu_smoke_engine_dryrun-*.json")
    smoke = json.loads(smoke_json.read_text())
    assert smoke["summary"]["ok"] and smoke["errors"] == [], smoke["summary"]
    assert {row["claim"] for row in smoke["rows"]} >= {"bits"}
    (zero3_json,) = tmp_path.glob("gpu_zero3_one_rank_dryrun-*.json")
    zero3 = json.loads(zero3_json.read_text())
    assert zero3["summary"]["ok"] and zero3["record"]["sharded_on_device"], zero3["record"]
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
    (multi_json,) = tmp_path.glob("gpu_multi_chunk_step_dryrun-*.json")
    multi = json.loads(multi_json.read_text())
    # The host's tile table build at the 7B layout, measured in every mode: one tile per
    # block of every chunk, 6.7e9 elements on one rank.
    builds = multi["table_build"]
    assert {(b["ranks"], b["block"]) for b in builds} >= {(1, 1024), (1, 4096)}, builds
    one_rank = next(b for b in builds if b["ranks"] == 1 and b["block"] == 1024)
    assert one_rank["numel"] == 6_738_415_616 and one_rank["tiles"] >= one_rank["numel"] // 1024
    if importlib.util.find_spec("triton") is not None:
        assert multi["errors"] == [], multi["errors"]
        assert len(multi["check"]) == 3, multi["check"]
        assert all(case["ok"] for case in multi["check"].values()), multi["check"]
        cases = multi["layouts"]["2"]["cases"]
        assert all("first_step_ms" in r for k, r in cases.items() if "one launch" in k), cases
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
