"""The one-pass Triton update of the 16-bit cells on one GPU, against its bytes floor.

    python3 -m benchmarks.gpu.bench_low_precision_step [--numel 268435456] [--dry-run]

For each cell the registry's ``triton-low-precision`` kernel serves (bf16 masters rounded to
nearest, stochastically or with Kahan compensation, with fp32 or bf16 moments; fp32 masters
with bf16 moments and bf16 parameters; an fp32 accumulator):

1. check: 3 steps of ``triton_one_pass.adam_one_pass_triton_`` on the device against
   the host's eager one-pass update (``one_pass.adam_one_pass``, with a correctly
   rounded square root: ``tests/test_low_precision_triton.py`` says why) on CPU copies:
   the values that differ in any bit (a NaN counts as equal to a NaN), which must be 0;
2. copy bandwidth: a device-to-device fp32 copy, (bytes read + written) / time;
3. the kernel at ``--numel``: median time, the floor = numel x bytes per parameter / copy
   bandwidth, and the ratio (issue 21's goal: <= 1.15x the floor);
4. for scale, the same cell without the kernel (``LowPrecisionAdamUpdate.bucket``: on CUDA the
   fp32 pieces around torch's fused AdamW that ran before it) and torch's fused AdamW on bf16
   parameters and states (the cell it does exactly).

Peak memory at the default 2**28 values is about 5 GB. ``--dry-run`` runs on CPU at a tiny
size with ``TRITON_INTERPRET=1`` (where Triton is installed): the logic is exercised, the
timings mean nothing. Writes ``results/gpu_low_precision_step-<date>.json/.md``.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

from benchmarks._common import base_parser, environment, finish, format_table, write_result

BF16, FP32 = torch.bfloat16, torch.float32
GROUP: dict[str, Any] = {"lr": 1e-4, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
GOAL_RATIO = 1.15
CELLS: dict[str, tuple[torch.dtype, str, torch.dtype, torch.dtype, torch.dtype | None]] = {
    # name: master, rounding, exp_avg, exp_avg_sq, parameter written (None: the master is it)
    "bf16 nearest / fp32 states": (BF16, "nearest", FP32, FP32, None),
    "bf16 stochastic / bf16 states": (BF16, "stochastic", BF16, BF16, None),
    "bf16 stochastic / fp32 states": (BF16, "stochastic", FP32, FP32, None),
    "bf16 kahan / bf16 states": (BF16, "kahan", BF16, BF16, None),
    "fp32 / bf16 states, bf16 params": (FP32, "nearest", BF16, BF16, BF16),
}


_NAMES = {FP32: "fp32", BF16: "bf16"}


def log(msg: str) -> None:
    print(msg, flush=True)


class _IeeeSqrtTorch:
    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def sqrt(x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x.double()).float()


class Bench:
    def __init__(self, args: Any) -> None:
        from dtypeplan.optimizers.kernels import one_pass, rounding, triton_one_pass

        self.k = triton_one_pass
        self.eager = one_pass
        self.rounding = rounding
        self.args = args
        self.device = torch.device(args.device)
        self.errors: list[dict[str, str]] = []
        self.res: dict[str, Any] = {"check": {}, "cells": {}}

    def section(self, name: str, fn: Callable[[], None]) -> None:
        log(f"\n== {name}")
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # keep going: every section is optional
            log(f"!! {name} failed: {exc!r}\n{traceback.format_exc()}")
            self.errors.append({"section": name, "error": repr(exc)[:2000]})
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        log(f"   ({time.perf_counter() - t0:.1f} s)")

    def time_ms(self, fn: Callable[[], None]) -> dict[str, float]:
        for _ in range(self.args.warmup):
            fn()
        times: list[float] = []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            pairs = []
            for _ in range(self.args.iters):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                fn()
                end.record()
                pairs.append((start, end))
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) for s, e in pairs]
        else:
            for _ in range(self.args.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return {"median_ms": statistics.median(times), "min_ms": min(times)}

    def _tensors(self, cell: str, n: int, device: torch.device) -> dict[str, Any]:
        master, rounding, m, v, param = CELLS[cell]
        gen = torch.Generator().manual_seed(0)
        return {
            "master": (torch.randn(n, generator=gen) * 0.02).to(master).to(device),
            "exp_avg": torch.zeros(n, dtype=m, device=device),
            "exp_avg_sq": torch.zeros(n, dtype=v, device=device),
            "compensation": (
                torch.zeros(n, dtype=BF16, device=device)
                if rounding == "kahan" and master == BF16
                else None
            ),
            "param": None if param is None else torch.empty(n, dtype=param, device=device),
        }

    def _run(self, fn: Callable[..., None], t: dict[str, Any], grad: torch.Tensor,
             step: int, rounding: str, key: Any, offset: Any) -> None:  # fmt: skip
        hyper = self.eager.hyperparameters(GROUP, step, True, grad.device)
        fn(
            t["master"], grad, t["exp_avg"], t["exp_avg_sq"], t["compensation"], t["param"],
            hyper, torch.tensor(0.5, device=grad.device), key, offset,
            decoupled=True, weight_decay=True, rounding=rounding,
        )  # fmt: skip

    def check(self) -> None:
        n = min(self.args.check_numel, self.args.numel)
        for cell, (_, rounding, *_rest) in CELLS.items():
            mine = self._tensors(cell, n, self.device)
            ref = self._tensors(cell, n, torch.device("cpu"))
            for step in range(1, 4):
                grad = torch.randn(n, generator=torch.Generator().manual_seed(step))
                key = self.rounding.noise_key(0x5EED, 0, step)
                self._run(self.k.adam_one_pass_triton_, mine, grad.to(self.device), step,
                          rounding, key, 0)  # fmt: skip
                with mock.patch.object(self.eager, "torch", _IeeeSqrtTorch()):
                    self._run(self.eager.adam_one_pass, ref, grad, step, rounding,
                              torch.tensor(key), torch.tensor(0))  # fmt: skip
            differ = 0
            for name, want in ref.items():
                if want is None or (name == "param" and CELLS[cell][0] == BF16):
                    continue
                got = mine[name].cpu()
                same = (got == want) | (got.float().isnan() & want.float().isnan())
                differ += int((~same).sum())
            self.res["check"][cell] = {"numel": n, "values_differing": differ, "ok": differ == 0}
            log(f"   {cell}: {differ} values differ")

    def copy_bandwidth(self) -> None:
        src = torch.randn(self.args.numel, device=self.device)
        dst = torch.empty_like(src)
        t = self.time_ms(lambda: dst.copy_(src))
        nbytes = 2 * src.numel() * 4
        self.res["copy"] = {**t, "bandwidth_TBps": nbytes / (t["median_ms"] * 1e-3) / 1e12}
        log(f"   copy: {t['median_ms']:.3f} ms, {self.res['copy']['bandwidth_TBps']:.3f} TB/s")

    def cells(self) -> None:
        n = self.args.numel
        grad = torch.randn(n, device=self.device).mul_(1e-3)  # the fp32 accumulator
        for cell, (master, rounding, m, v, param) in CELLS.items():
            t = self._tensors(cell, n, self.device)
            key = self.rounding.noise_key(0x5EED, 0, 10)
            timed = self.time_ms(
                lambda t=t, r=rounding, key=key: self._run(
                    self.k.adam_one_pass_triton_, t, grad, 10, r, key, 0
                )
            )
            nbytes = self.k.bytes_per_param(master, m, v, FP32, param, rounding == "kahan")
            self.res["cells"][cell] = {**timed, "bytes_per_param": nbytes}
            log(f"   {cell}: {timed['median_ms']:.3f} ms ({nbytes} B/param)")
            del t
            before = self._torch_path(cell, grad)
            self.res["cells"][cell]["torch_path_ms"] = before
            self.res["cells"][cell]["torch_path_x_kernel"] = before / timed["median_ms"]
            log(f"   {cell}, torch path: {before:.3f} ms ({before / timed['median_ms']:.2f}x)")
        # torch's fused AdamW on bf16 parameters, gradient and states: 2 + 2 * 6 B/param.
        p = torch.nn.Parameter(torch.randn(n, device=self.device, dtype=BF16))
        p.grad = grad.to(BF16)
        opt = torch.optim.AdamW([p], lr=1e-4, fused=self.device.type == "cuda")
        timed = self.time_ms(lambda: opt.step())
        self.res["cells"]["torch fused AdamW, bf16 everything"] = {**timed, "bytes_per_param": 14}

    def _torch_path(self, cell: str, grad: torch.Tensor) -> float:
        """Median ms of the same cell's update without the kernel (what the registry ran on
        CUDA before it: fp32 pieces around torch's fused AdamW; on the host, the one pass)."""
        from dtypeplan.optimizers.update.pieces import LowPrecisionAdamUpdate

        master, rounding, m, v, param = CELLS[cell]
        t = self._tensors(cell, self.args.numel, self.device)
        weights = t["master"]
        inner = torch.optim.AdamW([weights], lr=GROUP["lr"], betas=GROUP["betas"],
                                  eps=GROUP["eps"], weight_decay=GROUP["weight_decay"])  # fmt: skip
        update = LowPrecisionAdamUpdate(
            inner, torch.optim.AdamW, rounding=rounding, exp_avg_dtype=_NAMES[m],
            exp_avg_sq_dtype=_NAMES[v], shard_rank=0,
        )  # fmt: skip
        scale = torch.tensor(0.5, device=self.device)
        group = inner.param_groups[0]
        timed = self.time_ms(lambda: update.bucket(group, weights, grad, t["param"], scale))
        update.release_scratch()
        return timed["median_ms"]

    def summarize(self) -> list[dict[str, Any]]:
        bw = self.res.get("copy", {}).get("bandwidth_TBps")
        rows = []
        for cell, r in self.res["cells"].items():
            floor = r["bytes_per_param"] * self.args.numel / (bw * 1e12) * 1e3 if bw else None
            r["floor_ms"] = floor
            r["ratio_to_floor"] = r["median_ms"] / floor if floor else None
            rows.append({"cell": cell, "B/param": r["bytes_per_param"], "median ms": r["median_ms"],
                         "floor ms": floor, "x floor": r["ratio_to_floor"]})  # fmt: skip
        return rows

    def run(self) -> list[dict[str, Any]]:
        if self.device.type != "cuda":
            log("   no CUDA: dry run on CPU, timings are meaningless")
        if self.k.triton is None:
            self.errors.append({"section": "setup", "error": "triton is not importable"})
            return []
        if not self.args.skip_check:
            self.section("check vs the host's eager one-pass update", self.check)
        self.section("copy bandwidth", self.copy_bandwidth)
        self.section("cells", self.cells)
        return self.summarize()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (logic only)")
    parser.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    parser.add_argument("--numel", type=int, default=1 << 28, help="parameters (default 2**28)")
    parser.add_argument("--check-numel", type=int, default=(1 << 20) + 37)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args(argv)
    if args.dry_run or args.quick:
        args.numel, args.check_numel, args.iters, args.warmup = 2085, 1031, 2, 1
    if args.dry_run:
        args.device = "cpu"
        # Triton reads this when the kernel is defined: before dtypeplan's kernel module loads.
        os.environ["TRITON_INTERPRET"] = "1"
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = "gpu_low_precision_step" + ("_dryrun" if args.dry_run else "")
    env = environment()
    started = time.perf_counter()
    bench = Bench(args)
    rows = bench.run()
    res = bench.res
    table = format_table(rows)
    log(f"\n{table}")
    ratios = {cell: r.get("ratio_to_floor") for cell, r in res["cells"].items()}
    summary = {
        "benchmark": name,
        "device": args.device,
        "numel": args.numel,
        "copy_TBps": res.get("copy", {}).get("bandwidth_TBps"),
        "ratio_to_floor": ratios,
        "goal_met": all(r is not None and r <= GOAL_RATIO for r in ratios.values())
        if ratios and args.device == "cuda"
        else None,
        "check_ok": {k: v["ok"] for k, v in res["check"].items()},
        "errors": [e["section"] for e in bench.errors],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if not args.no_write:
        sections = [("Median time per step", table)]
        if res["check"]:
            checks = [{"cell": k, **v} for k, v in res["check"].items()]
            sections.append(
                ("Check against the host's eager one-pass update", format_table(checks))
            )
        if bench.errors:
            errors = [f"- {e['section']}: `{e['error'][:300]}`" for e in bench.errors]
            sections.append(("Errors", "\n".join(errors)))
        write_result(
            name,
            out=args.out,
            env=env,
            config={
                "device": args.device,
                "numel": args.numel,
                "check_numel": args.check_numel,
                "iters": args.iters,
                "warmup": args.warmup,
                "group": GROUP,
                "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
                "dry_run": args.dry_run,
            },
            sections=sections,
            data={k: v for k, v in res.items()} | {"errors": bench.errors, "summary": summary},
            notes=[
                "floor ms = numel x B/param / copy bandwidth (bytes read + written per second of "
                f"a device-to-device fp32 copy); the goal: <= {GOAL_RATIO}x the floor per cell.",
                "B/param: fp32 accumulator read; master (+ bf16 Kahan compensation) and moments "
                "read and written; the bf16 parameter written where it is not the master.",
            ]
            + (
                ["DRY RUN on CPU at a tiny size: its timings mean nothing."] if args.dry_run else []
            ),
        )
    finish(summary)
    return summary


if __name__ == "__main__":
    main()
