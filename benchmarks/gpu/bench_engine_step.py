#!/usr/bin/env python
"""The optimizer step of dtypeplan's flat engine on one GPU, against torch's fused AdamW.

    python benchmarks/gpu/bench_engine_step.py [--numel 1073741824] [--out DIR]

1. check: 5 steps of dtypeplan (bf16 params, fp32 accumulation, AdamW, clipping) on a small
   CUDA model against ``torch.optim.AdamW(fused=True)`` on an fp32 copy; relative error of the
   master weights, through the Triton kernel path and through the torch path.
2. time of ``optimizer.step()`` at ``--numel`` parameters (one process, so no collective),
   gradients already accumulated, median over iterations:
   * dtypeplan, kernel path (one pass: accumulator -> master, moments, bf16 params);
   * dtypeplan, torch path (``DTYPEPLAN_FUSED_KERNEL=0``: fp32 view, fused AdamW, cast);
   * reference: fp32 parameters with ``torch.optim.AdamW(fused=True)`` (the plain fp32 model).
   Ratios against the reference and against the copy-bandwidth floor of 34 bytes/param
   (fp32 accumulator read, master/moments read+written, bf16 param written; the engine does
   not zero the accumulator, so 30 B of the kernel's table plus the norm's 4 B read).
Prints a table and a last JSON line; writes DIR/engine_step.json with --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

import dtypeplan  # noqa: E402

CONFIG = {
    "bf16": {"enabled": True},
    "gradient_accumulation_dtype": "fp32",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1},
    },
    "gradient_clipping": 1.0,
}


def cuda_time(fn: Any, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check(kernel: bool) -> float:
    os.environ["DTYPEPLAN_FUSED_KERNEL"] = "1" if kernel else "0"
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)
    ).cuda()
    reference = __import__("copy").deepcopy(model)
    plan = dtypeplan.resolve(CONFIG)
    optimizer = plan.build(model.parameters())
    assert optimizer._use_fused_kernel() == kernel
    ref_opt = torch.optim.AdamW(
        reference.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    for step in range(5):
        x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), x[:, :64]).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        optimizer.zero_grad()
        for part in x.chunk(2):
            optimizer.backward(
                torch.nn.functional.mse_loss(model(part.bfloat16()).float(), part[:, :64]) / 2
            )
        optimizer.step()
    state = optimizer.full_state()
    num = den = 0.0
    for index, param in enumerate(reference.parameters()):
        num += float((state[f"param.{index}.master"] - param.detach()).square().sum())
        den += float(param.detach().square().sum())
    return (num / den) ** 0.5


def engine_step_ms(numel: int, kernel: bool, iters: int) -> float:
    os.environ["DTYPEPLAN_FUSED_KERNEL"] = "1" if kernel else "0"
    rows = 8192
    param = torch.nn.Parameter(torch.randn(rows, numel // rows, device="cuda") * 0.02)
    optimizer = dtypeplan.resolve(CONFIG).build([param])
    assert optimizer._use_fused_kernel() == kernel
    optimizer.backward((param.float() * 1e-3).sum())  # fills the fp32 accumulator once
    optimizer._fresh = False  # keep the accumulated gradient for every timed step

    def one_step() -> None:
        optimizer.step()
        optimizer._fresh = False

    return cuda_time(one_step, iters)


def reference_step_ms(numel: int, iters: int) -> float:
    rows = 8192
    param = torch.nn.Parameter(torch.randn(rows, numel // rows, device="cuda") * 0.02)
    param.grad = torch.randn_like(param) * 1e-3
    optimizer = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return cuda_time(optimizer.step, iters)


def copy_bandwidth(numel: int) -> float:
    src = torch.empty(numel, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time(lambda: dst.copy_(src), 10)
    return 2 * numel * 4 / (ms * 1e-3)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=1 << 30)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "numel": args.numel,
        "config": CONFIG,
    }
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    sections = [
        ("check_kernel_rel_error", lambda: check(True)),
        ("check_torch_rel_error", lambda: check(False)),
        ("copy_bandwidth_Bps", lambda: copy_bandwidth(args.numel)),
        ("reference_fp32_fused_adamw_ms", lambda: reference_step_ms(args.numel, args.iters)),
        ("dtypeplan_kernel_ms", lambda: engine_step_ms(args.numel, True, args.iters)),
        ("dtypeplan_torch_path_ms", lambda: engine_step_ms(args.numel, False, args.iters)),
    ]
    for name, fn in sections:
        try:
            results[name] = fn()
        except Exception:  # report and go on: one failure must not lose the other figures
            results[name] = None
            results[name + "_error"] = traceback.format_exc()[-2000:]
            print(results[name + "_error"], file=sys.stderr)
        print(f"{name:34s} {results[name]}", flush=True)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if results.get("copy_bandwidth_Bps"):
        floor = args.numel * 34 / results["copy_bandwidth_Bps"] * 1e3
        results["floor_ms_34B"] = floor
        for name in (
            "dtypeplan_kernel_ms",
            "dtypeplan_torch_path_ms",
            "reference_fp32_fused_adamw_ms",
        ):
            if results.get(name):
                results[name.replace("_ms", "_over_floor")] = results[name] / floor
    if results.get("reference_fp32_fused_adamw_ms"):
        for name in ("dtypeplan_kernel_ms", "dtypeplan_torch_path_ms"):
            if results.get(name):
                results[name.replace("_ms", "_over_reference")] = (
                    results[name] / results["reference_fp32_fused_adamw_ms"]
                )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "engine_step.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if not k.endswith("_error")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
