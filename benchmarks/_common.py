"""What every benchmark shares: the environment record, tables, and the dated result files.

A benchmark calls :func:`write_result` once at the end; it writes
``benchmarks/results/<name>-<YYYY-MM-DD>.json`` (everything, machine-readable) and ``.md`` (the
hardware, versions, config and the tables), and :func:`finish` prints the last JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "RESULTS_DIR",
    "base_parser",
    "environment",
    "finish",
    "format_table",
    "gpu",
    "hardware",
    "result_stem",
    "write_result",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parents[1]


class _Parser(argparse.ArgumentParser):
    """With ``--check-args``: parse the arguments, print them as one JSON line, exit 0 (what
    ``run_all.sh``'s dry run checks of each entry point: it imports, and its arguments parse)."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed = super().parse_args(args, namespace)
        if getattr(parsed, "check_args", False):
            print(json.dumps({**vars(parsed), "check_args": self.prog}, default=str), flush=True)
            sys.exit(0)
        return parsed


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = _Parser(description=description)
    parser.add_argument(
        "--check-args", action="store_true", help="parse the arguments, print them, exit 0"
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR,
        help=f"folder for the dated .json/.md/.png results (default {RESULTS_DIR})",
    )
    parser.add_argument("--no-write", action="store_true", help="print only; write no files")
    return parser


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return ""


def hardware() -> dict[str, Any]:
    """CPU model, core count, memory and OS, from the standard library and /proc."""
    cpu_model = ""
    flags: list[str] = []
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name") and not cpu_model:
            cpu_model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")
            flags = [f for f in line.split(":", 1)[1].split() if f in wanted]
    mem_kib = 0
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu": cpu_model or platform.processor() or "unknown",
        "cpu_flags": flags,
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "memory_gib": round(mem_kib / 2**20, 1) if mem_kib else None,
        "machine": platform.machine(),
        "os": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def gpu() -> dict[str, Any] | None:
    """The CUDA device and the versions of the GPU stack; ``None`` without CUDA.

    Kept apart from :func:`hardware` so that a CPU run records exactly what it always did.
    """
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    try:
        nccl: str | None = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # a torch built without NCCL
        nccl = None
    try:
        import triton

        triton_version: str | None = triton.__version__
    except Exception:  # Triton missing or broken: the kernel benchmark records why
        triton_version = None
    return {
        "name": props.name,
        "count": torch.cuda.device_count(),
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "triton": triton_version,
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def environment() -> dict[str, Any]:
    """Hardware, versions and the moment of the run (and the GPU stack where CUDA is present)."""
    import dtypeplan

    now = datetime.datetime.now(datetime.timezone.utc)
    record: dict[str, Any] = {
        "date": now.date().isoformat(),
        "time_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "hardware": hardware(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "dtypeplan": dtypeplan.__version__,
        "git_commit": _git_commit(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    cuda = gpu()
    if cuda is not None:
        record["gpu"] = cuda
    return record


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "nan"
        if value == 0.0:
            return "0"
        if abs(value) >= 1000 or abs(value) < 1e-3:
            return f"{value:.3g}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    if value is None:
        return "-"
    return str(value)


def format_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Iterable[str] | None = None,
    formats: Mapping[str, str] | None = None,
) -> str:
    """A GitHub markdown table of ``rows`` (also readable as plain text).

    ``formats`` maps a column to a format string (``"{:.5f}"``) used instead of the default.
    """
    if not rows:
        return "(no rows)"
    cols = list(columns) if columns is not None else list(rows[0])
    formats = formats or {}

    def cell(row: Mapping[str, Any], col: str) -> str:
        value = row.get(col)
        if col in formats and isinstance(value, (int, float)):
            return formats[col].format(value)
        return _cell(value)

    cells = [[cell(row, c) for c in cols] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]

    def line(values: list[str]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    lines = [line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells]
    return "\n".join(lines)


def result_stem(name: str, out: Path, date: str) -> Path:
    return out / f"{name}-{date}"


def write_result(
    name: str,
    *,
    out: Path,
    env: Mapping[str, Any],
    config: Mapping[str, Any],
    sections: Sequence[tuple[str, str]],
    data: Mapping[str, Any],
    notes: Sequence[str] = (),
) -> Path:
    """Write ``<out>/<name>-<date>.json`` and ``.md``; return the stem (without suffix).

    ``sections`` are (title, markdown body) pairs for the .md; ``data`` goes to the .json
    together with ``env`` and ``config``.
    """
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(name, out, env["date"])
    record = {"benchmark": name, "environment": dict(env), "config": dict(config), **data}
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    hw = env["hardware"]
    lines = [
        f"# {name} ({env['date']})",
        "",
        f"- hardware: {hw['cpu']} ({', '.join(hw['cpu_flags']) or 'no listed SIMD flags'}), "
        f"{hw['cpus_usable']} usable of {hw['cpu_count']} CPUs, {hw['memory_gib']} GiB, "
        f"{hw['os']}" + (f", GPU {hw['cuda']}" if hw["cuda"] else ""),
        *(
            [
                f"- GPU stack: {g['count']} x {g['name']} (sm {g['capability']}, "
                f"{g['memory_gib']} GiB), CUDA {g['cuda']}, NCCL {g['nccl']}, "
                f"Triton {g['triton']}"
            ]
            if (g := env.get("gpu"))
            else []
        ),
        f"- versions: python {env['python']}, torch {env['torch']}, dtypeplan {env['dtypeplan']} "
        f"(commit {env['git_commit']})",
        f"- run at {env['time_utc']}; 1-minute load average at the start "
        f"{env.get('load_average_1m')} (other work on the machine skews timings)",
        f"- config: `{json.dumps(dict(config), default=str)}`",
        "",
    ]
    for title, body in sections:
        lines += [f"## {title}", "", body.rstrip(), ""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    return stem


def save_figure(fig: Any, out: Path, name: str, date: str) -> Path:
    """Save a matplotlib figure as ``<out>/<name>-<date>.png`` and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{date}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish(summary: Mapping[str, Any]) -> None:
    """Print the summary as the last line of output, one JSON object."""
    print(json.dumps(dict(summary), default=str, sort_keys=True), flush=True)


def pattern_tokens(generator: torch.Generator, size: int, vocab: int, seq_len: int) -> torch.Tensor:
    """``size`` sequences of ``seq_len`` tokens, each a random pattern of 3-8 tokens out of
    ``vocab`` repeated: a language a tiny model learns in a few hundred steps (the trade-off
    benchmarks' data)."""
    rows = []
    for _ in range(size):
        period = int(torch.randint(3, 9, (1,), generator=generator))
        pattern = torch.randint(0, vocab, (period,), generator=generator)
        rows.append(pattern.repeat(seq_len // period + 1)[:seq_len])
    return torch.stack(rows)
