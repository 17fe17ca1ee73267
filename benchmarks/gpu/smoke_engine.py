"""The engine on one GPU from a fresh optimizer: every update kernel, 3 steps from step 1.

    python3 -m benchmarks.gpu.smoke_engine [--dry-run] [--out DIR]

For each cell (a config and the update kernel the registry must pick for it on CUDA; some
with ``DTYPEPLAN_FUSED_KERNEL=0``, which turns the Triton kernels off so that the kernels they
preempt run too):

1. a fresh model and optimizer on the device, 3 steps from step 1 (the step counts at which
   Triton's launcher specializes its integer arguments), each under
   ``torch.cuda.set_sync_debug_mode("error")``: a step that waits for the device fails (the
   host offload waits for its copies by design: there the mode is ``"warn"`` and the waits
   are counted);
2. the same 3 steps on the host (CPU) from the same weights and gradients: the gradients are
   exact (``loss = sum(p * g)``, so ``p.grad`` is ``g`` in the parameters' dtype on both), so
   where a kernel claims the host's bits (the one-pass Triton update of 16-bit masters against
   the host's one-pass update, run eagerly with a correctly rounded square root, as
   ``bench_low_precision_step`` does) every parameter must be equal bit for bit (and bf16
   masters rounded to nearest with bf16 moments and accumulator must give the bits of
   ``torch.optim.AdamW(fused=True)`` on bf16 tensors on the same device); elsewhere
   the difference must stay within ``steps x (4 eps_state lr (1 + 3 max|g|) + 2 eps_param
   max|p|)`` (the update's rounding, and the parameter's own);
3. the device memory right before each ``step()`` (above what was allocated before the model)
   against ``plan.memory()["total"]`` (within 5 % + 4 MiB), and the peak during the steps.

Every kernel of the registry must be reached by some cell. ``--dry-run`` runs the same on the
CPU at a tiny size (both runs on the host; the CUDA kernel names are not checked). Writes
``results/gpu_smoke_engine-<date>.json/.md``.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from benchmarks._common import base_parser, environment, finish, format_table, write_result

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}
SGD = {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}}
BF16 = {"bf16": {"enabled": True}}
OFF = {"DTYPEPLAN_FUSED_KERNEL": "0"}
STEPS = 3

# (expected kernel on CUDA, config, environment, bits claimed against the host)
CELLS: list[tuple[str, dict[str, Any], dict[str, str], bool]] = [
    ("triton", {"optimizer": ADAMW}, {}, False),
    ("triton", {**BF16, "optimizer": ADAMW}, {}, False),
    ("torch-fused", {"optimizer": ADAMW}, OFF, False),
    ("torch-fused", {**BF16, "optimizer": ADAMW}, OFF, False),
    (
        "torch-fused-16bit",
        {**BF16, "gradient_accumulation_dtype": "bf16", "master_weights": {"dtype": "bf16"},
         "optimizer_states": "bf16", "optimizer": ADAMW},
        {}, False,
    ),
    (
        "triton-low-precision",
        {**BF16, "master_weights": {"dtype": "bf16", "rounding": "stochastic"},
         "optimizer_states": "bf16", "optimizer": ADAMW},
        {}, True,
    ),
    (
        "triton-low-precision",
        {**BF16, "master_weights": {"dtype": "bf16"}, "optimizer": ADAMW},
        {}, True,
    ),
    (
        "triton-low-precision",
        {**BF16, "master_weights": {"dtype": "bf16", "rounding": "kahan"},
         "optimizer_states": "bf16", "optimizer": ADAMW},
        {}, True,
    ),
    ("triton-low-precision", {**BF16, "optimizer_states": "bf16", "optimizer": ADAMW}, {}, False),
    (
        "low-precision",
        {**BF16, "master_weights": {"dtype": "bf16", "rounding": "stochastic"},
         "optimizer_states": "bf16", "optimizer": ADAMW},
        OFF, False,
    ),
    ("quantized", {"optimizer_states": "int8", "optimizer": ADAMW}, {}, False),
    (
        "quantized",
        {**BF16, "master_weights": {"dtype": "bf16"}, "optimizer_states": "fp8",
         "optimizer": ADAMW},
        {}, False,
    ),
    (
        "host-offload",
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
         "optimizer": ADAMW},
        {}, False,
    ),
    ("generic", {"optimizer": SGD}, {}, False),
    ("torch-class-low-precision", {"optimizer": SGD, "optimizer_states": "bf16"}, {}, False),
    (
        "torch-class-low-precision",
        {**BF16, "master_weights": {"dtype": "bf16", "rounding": "kahan"},
         "optimizer": {"type": "Adagrad", "params": {"lr": 0.05}}},
        {}, False,
    ),
]  # fmt: skip

STATE_EPS = {"fp32": 2.0**-23, "bf16": 2.0**-7, "fp16": 2.0**-10, "fp8": 2.0**-3, "int8": 1 / 127}


def log(msg: str) -> None:
    print(msg, flush=True)


class _IeeeSqrtTorch:
    """``torch`` with a correctly rounded fp32 square root (CPU's vectorized one misrounds near
    midpoints; CUDA's, the kernel's ``sqrt_rn`` and Inductor's do not)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def sqrt(x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x.double()).float()


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class Weights(torch.nn.Module):
    """Parameters of odd sizes (unaligned tails, a bucket boundary), used only as ``p * g``."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.1) for shape in shapes
        )

    def loss(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return sum(
            (p * g.to(device=p.device, dtype=p.dtype)).sum()
            for p, g in zip(self.weights, grads, strict=True)
        )  # type: ignore[return-value]


def gradients(shapes: list[tuple[int, ...]], step: int) -> list[torch.Tensor]:
    """Step ``step``'s gradients, bf16 values (exact in every parameter dtype)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=generator).bfloat16() for shape in shapes]


def train(
    config: dict[str, Any], shapes: list[tuple[int, ...]], device: torch.device, sync_mode: str
) -> dict[str, Any]:
    import dtypeplan

    plan = dtypeplan.resolve(config)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    model = plan.prepare_model(Weights(shapes).to(device))
    opt = plan.build(model.parameters())
    kernel = opt.update_kernel.name
    boundary = []
    syncs = 0
    for step in range(1, STEPS + 1):
        grads = gradients(shapes, step)
        opt.zero_grad()
        opt.backward(model.loss(grads))
        if cuda:
            torch.cuda.synchronize()
            boundary.append(torch.cuda.memory_allocated() - base)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode(sync_mode)
            try:
                opt.step()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        syncs += sum("synchroniz" in str(w.message) for w in caught)
    if opt.update_kernel.name != kernel:
        raise AssertionError(
            f"the kernel changed during the steps: {kernel} -> {opt.update_kernel.name}"
        )
    numels = [p.numel() for p in model.parameters()]
    predicted = plan.memory(sum(numels), 1, param_numels=numels)["total"]
    out: dict[str, Any] = {
        "kernel": kernel,
        "params": [p.detach().cpu() for p in model.parameters()],
        "param_dtype": str(plan.param_dtype).removeprefix("torch."),
        "predicted_bytes": predicted,
        "sync_mode": sync_mode,
        "syncs_in_steps": syncs,
    }
    if cuda:
        torch.cuda.synchronize()
        out["boundary_bytes"] = max(boundary)
        out["peak_bytes"] = torch.cuda.max_memory_allocated() - base
    opt.close()
    return out


def torch_fused_bf16(
    shapes: list[tuple[int, ...]], device: torch.device, hyper: dict[str, Any]
) -> list[torch.Tensor]:
    """``torch.optim.AdamW(fused=True)`` on bf16 copies of the same weights, same gradients."""
    params = [
        p.detach().to(device=device, dtype=torch.bfloat16).requires_grad_()
        for p in Weights(shapes).parameters()
    ]
    opt = torch.optim.AdamW(params, fused=True, **hyper)
    for step in range(1, STEPS + 1):
        for p, g in zip(params, gradients(shapes, step), strict=True):
            p.grad = g.to(device)
        opt.step()
    return [p.detach().cpu() for p in params]


def compare(
    device_run: dict[str, Any], host_run: dict[str, Any], config: dict[str, Any], bits: bool,
    shapes: list[tuple[int, ...]],
) -> dict[str, Any]:  # fmt: skip
    diffs = [
        (a.double() - b.double()).abs().max().item()
        for a, b in zip(device_run["params"], host_run["params"], strict=True)
    ]
    if bits:
        differing = sum(
            int((a.view(torch.int16 if a.element_size() == 2 else torch.int32)
                 != b.view(torch.int16 if b.element_size() == 2 else torch.int32)).sum())
            for a, b in zip(device_run["params"], host_run["params"], strict=True)
        )  # fmt: skip
        return {"claim": "bits", "values_differing": differing, "ok": differing == 0}
    states = config.get("optimizer_states", "fp32")
    eps_state = STATE_EPS.get(states if isinstance(states, str) else "fp8", 2.0**-3)
    lr = config["optimizer"]["params"]["lr"]
    eps_param = STATE_EPS[device_run["param_dtype"].replace("bfloat16", "bf16").replace(
        "float32", "fp32")]  # fmt: skip
    g_max = max(
        float(g.float().abs().max()) for s in range(1, STEPS + 1) for g in gradients(shapes, s)
    )
    p_max = max(float(p.float().abs().max()) for p in host_run["params"])
    bound = STEPS * (4 * eps_state * lr * (1 + 3 * g_max) + 2 * eps_param * p_max)
    worst = max(diffs)
    return {"claim": f"<= {bound:.3g}", "max_abs_diff": worst, "ok": worst <= bound}


def run_cell(
    index: int, expected: str, config: dict[str, Any], env: dict[str, str], bits: bool,
    args: Any,
) -> dict[str, Any]:  # fmt: skip
    from dtypeplan.optimizers.kernels import one_pass

    device = torch.device(args.device)
    shapes = [((1 << 20) + 37,), (333, 257), (5,)] if not args.dry_run else [(1031,), (7, 9), (5,)]
    record: dict[str, Any] = {"cell": index, "expected": expected, "env": env, "config": config}

    def host_path() -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        stack.enter_context(environ({"DTYPEPLAN_EAGER_UPDATE": "1"}))
        stack.enter_context(mock.patch.object(one_pass, "torch", _IeeeSqrtTorch()))
        return stack

    with environ(env):
        # a dry run's "device" is the host: the same path for both runs
        with host_path() if device.type == "cpu" else contextlib.nullcontext():
            sync_mode = "warn" if expected == "host-offload" else "error"
            device_run = train(config, shapes, device, sync_mode)
        with host_path():
            host_run = train(config, shapes, torch.device("cpu"), "default")
    record["kernel"] = device_run["kernel"]
    record["sync_mode"] = device_run["sync_mode"]
    record["syncs_in_steps"] = device_run["syncs_in_steps"]
    record["host_kernel"] = host_run["kernel"]
    record["kernel_ok"] = args.dry_run or device_run["kernel"] == expected
    record.update(compare(device_run, host_run, config, bits, shapes))
    if expected == "torch-fused-16bit":
        # the cell torch's fused AdamW on bf16 tensors computes exactly: its bits, same device
        peer = torch_fused_bf16(shapes, device, config["optimizer"]["params"])
        differing = sum(
            int((a.view(torch.int16) != b.view(torch.int16)).sum())
            for a, b in zip(device_run["params"], peer, strict=True)
        )
        record["vs_torch_fused_bf16"] = {"values_differing": differing}
        record["ok"] = record["ok"] and differing == 0
    if "boundary_bytes" in device_run:
        predicted = device_run["predicted_bytes"]
        record["predicted_MiB"] = round(predicted / 2**20, 2)
        record["boundary_MiB"] = round(device_run["boundary_bytes"] / 2**20, 2)
        record["peak_MiB"] = round(device_run["peak_bytes"] / 2**20, 2)
        record["memory_ok"] = device_run["boundary_bytes"] <= predicted * 1.05 + 4 * 2**20
    else:
        record["memory_ok"] = None  # no device allocator on the host
    record["passed"] = bool(
        record["ok"] and record["kernel_ok"] and record["memory_ok"] is not False
    )
    return record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (logic only)")
    parser.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    parser.add_argument("--cells", default=None, help="comma-separated cell indices (default all)")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = "gpu_smoke_engine" + ("_dryrun" if args.dry_run else "")
    env = environment()
    started = time.perf_counter()
    chosen = [int(i) for i in args.cells.split(",")] if args.cells else range(len(CELLS))
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for index in chosen:
        expected, config, cell_env, bits = CELLS[index]
        log(f"== cell {index}: {expected} {cell_env or ''}")
        try:
            row = run_cell(index, expected, config, cell_env, bits, args)
        except Exception as exc:  # noqa: BLE001 - recorded per cell, the next one runs
            errors.append({"cell": index, "expected": expected, "error": repr(exc)[:2000],
                           "traceback": traceback.format_exc(limit=-6)})  # fmt: skip
            log(f"   FAILED: {exc!r}"[:600])
            continue
        rows.append(row)
        log(f"   {row['kernel']} (host {row['host_kernel']}): {row['claim']} ok={row['ok']}, "
            f"memory ok={row['memory_ok']}")  # fmt: skip
    from dtypeplan.optimizers.update import KERNELS

    reached = {row["kernel"] for row in rows}
    unreached = sorted({k.name for k in KERNELS} - reached) if not args.dry_run else []
    summary = {
        "benchmark": name,
        "device": args.device,
        "cells": len(chosen),
        "passed": sum(row["passed"] for row in rows),
        "failed": [row["cell"] for row in rows if not row["passed"]] + [e["cell"] for e in errors],
        "unreached_kernels": unreached,
        "ok": not errors and all(row["passed"] for row in rows) and not unreached,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if not args.no_write:
        table = [{k: v for k, v in row.items() if k not in ("config", "env")} for row in rows]
        sections = [("Cells", format_table(table))]
        if errors:
            listed = [f"- cell {e['cell']} ({e['expected']}): `{e['error'][:400]}`" for e in errors]
            sections.append(("Errors", "\n".join(listed)))
        write_result(
            name, out=args.out, env=env,
            config={"device": args.device, "steps": STEPS, "dry_run": args.dry_run},
            sections=sections, data={"rows": rows, "errors": errors, "summary": summary},
            notes=["DRY RUN on CPU: both runs on the host."] if args.dry_run else [],
        )  # fmt: skip
    finish(summary)
    if not summary["ok"]:
        raise SystemExit(1)
    return summary


if __name__ == "__main__":
    main()
