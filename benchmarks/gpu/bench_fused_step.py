#!/usr/bin/env python
"""Benchmark of the one-pass mixed-precision AdamW step (Triton) on one GPU.

Run from anywhere (the repo root is put on sys.path)::

    python benchmarks/gpu/bench_fused_step.py [--numel 1073741824] [--out DIR]

1. check: K steps of the kernel against the CPU path (torch.optim.AdamW(fused=True) on CPU
   copies) for an fp32 accumulator + bf16 params and a bf16 grad + bf16 params; max relative
   error (max |a - b| / max |b|) of master, exp_avg, exp_avg_sq and the bf16 params.
2. copy bandwidth: device-to-device copy of a large fp32 buffer, (bytes read + written) / time.
3. composed torch path at --numel: accumulator *= grad_factor, AdamW(fused=True).step() on the
   fp32 master with .grad = accumulator, copy master -> bf16 params, zero the accumulator (46 B
   per parameter); and the same preceded by accumulating a bf16 grad into the fp32 accumulator
   (56 B).
4. the kernel at --numel: fp32 accumulator + bf16 params + zeroing (34 B) and bf16 grad + bf16
   params (28 B), after a short sweep of launch configurations.
5. the floor = bytes moved / copy bandwidth, ratios, a table, and a last line of JSON.

Peak memory at the default numel 2**30 (1.07e9) is about 20 GB. Every section is guarded: a
failure is printed and recorded, and the JSON line is printed regardless. Without CUDA the
script runs on CPU (with TRITON_INTERPRET=1 the kernel runs in Triton's interpreter; use a small
--numel): this is a dry run of the logic, its timings mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from dtypeplan.optimizers._fused_adamw_triton import (  # noqa: E402
    DEFAULT_BLOCK,
    DEFAULT_NUM_WARPS,
    bytes_per_param,
    fused_mixed_adamw_,
    triton_available,
)

HP: dict[str, float] = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
GRAD_FACTOR = 0.37  # stands for clip_coef / (loss_scale * world_size)
GOAL_RATIO = 1.10
SWEEP = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16)]
BYTES_COMPOSED = 8 + 28 + 6 + 4  # scale acc, fused AdamW, master -> bf16 copy, zero acc
BYTES_COMPOSED_ACC = BYTES_COMPOSED + 10  # + acc.add_(bf16 grad): read 2 + read 4 + write 4


def log(msg: str) -> None:
    print(msg, flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.errors: list[dict[str, str]] = []
        self.res: dict[str, Any] = {}

    # -- helpers --------------------------------------------------------------------------------

    def section(self, name: str, fn: Callable[[], None]) -> None:
        log(f"\n== {name}")
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # keep going: every section is optional
            tb = traceback.format_exc()
            log(f"!! {name} failed: {exc!r}\n{tb}")
            self.errors.append({"section": name, "error": repr(exc)[:2000]})
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        log(f"   ({time.perf_counter() - t0:.1f} s)")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time_ms(self, fn: Callable[[], None], iters: int | None = None) -> dict[str, float]:
        """Median / min milliseconds per call after warmup (CUDA events on a GPU)."""
        iters = iters or self.args.iters
        for _ in range(self.args.warmup):
            fn()
        self.sync()
        times: list[float] = []
        if self.device.type == "cuda":
            pairs = []
            for _ in range(iters):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                pairs.append((start, end))
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) for s, e in pairs]
        else:
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return {"median_ms": statistics.median(times), "min_ms": min(times)}

    # -- sections -------------------------------------------------------------------------------

    def info(self) -> None:
        triton_version = None
        try:
            import triton

            triton_version = triton.__version__
        except Exception as exc:
            triton_version = f"unavailable: {exc!r}"
        self.res.update(
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            device=(
                torch.cuda.get_device_name() if self.device.type == "cuda" else platform.processor()
            ),
            device_type=self.device.type,
            torch=torch.__version__,
            triton=triton_version,
            cuda=torch.version.cuda,
            python=platform.python_version(),
            numel=self.args.numel,
            hyperparameters=dict(HP, grad_factor=GRAD_FACTOR),
            triton_interpret=os.environ.get("TRITON_INTERPRET", "0"),
        )
        for k in ("date", "device", "torch", "triton", "cuda", "numel"):
            log(f"   {k}: {self.res[k]}")

    def check(self) -> None:
        """Kernel on the device vs the CPU path (torch.optim.AdamW(fused=True)) on CPU copies."""
        n = min(self.args.check_numel, self.args.numel)
        cases = {
            "fp32acc_bf16": (torch.float32, True, True),  # grad dtype, zero_grad, tensor factor
            "bf16grad_bf16": (torch.bfloat16, False, False),
        }
        out: dict[str, Any] = {}
        self.res["check"] = out
        for name, (gdtype, zero_grad, tensor_factor) in cases.items():
            try:
                out[name] = self._check_case(n, gdtype, zero_grad, tensor_factor)
                log(f"   {name}: {out[name]}")
            except Exception as exc:
                log(f"!! check {name} failed: {exc!r}\n{traceback.format_exc()}")
                self.errors.append({"section": f"check/{name}", "error": repr(exc)[:2000]})
                out[name] = {"ok": False, "error": repr(exc)[:500]}

    def _check_case(
        self, n: int, gdtype: torch.dtype, zero_grad: bool, tensor_factor: bool
    ) -> dict[str, Any]:
        dev = self.device
        torch.manual_seed(0)
        master = torch.randn(n, device=dev)
        m = torch.zeros_like(master)
        v = torch.zeros_like(master)
        param = torch.empty(n, dtype=torch.bfloat16, device=dev)
        factor: float | torch.Tensor = (
            torch.tensor(GRAD_FACTOR, device=dev) if tensor_factor else GRAD_FACTOR
        )
        p_cpu = torch.nn.Parameter(master.cpu().clone())
        opt = torch.optim.AdamW(
            [p_cpu],
            lr=HP["lr"] * 100,  # a larger lr so that the master moves visibly in 3 steps
            betas=(HP["beta1"], HP["beta2"]),
            eps=HP["eps"],
            weight_decay=HP["weight_decay"],
            fused=True,
        )
        for step in range(1, 4):
            grad = torch.randn(n, device=dev).to(gdtype)
            p_cpu.grad = grad.cpu().float() * GRAD_FACTOR
            opt.step()
            fused_mixed_adamw_(
                master,
                m,
                v,
                grad,
                param,
                lr=HP["lr"] * 100,
                beta1=HP["beta1"],
                beta2=HP["beta2"],
                eps=HP["eps"],
                weight_decay=HP["weight_decay"],
                step=step,
                grad_factor=factor,
                zero_grad=zero_grad,
            )
            if zero_grad and bool(grad.any()):
                raise AssertionError("the kernel did not zero the gradient")
        self.sync()
        st = opt.state[p_cpu]
        want = {
            "master": p_cpu.detach(),
            "exp_avg": st["exp_avg"],
            "exp_avg_sq": st["exp_avg_sq"],
            "param": p_cpu.detach().to(torch.bfloat16),
        }
        got = {"master": master, "exp_avg": m, "exp_avg_sq": v, "param": param}
        res: dict[str, Any] = {"numel": n}
        for key, ref in want.items():
            a = got[key].cpu().double()
            b = ref.double()
            res[f"max_rel_err_{key}"] = ((a - b).abs().max() / b.abs().max()).item()
        res["ok"] = (
            max(res[f"max_rel_err_{k}"] for k in ("master", "exp_avg", "exp_avg_sq")) <= 1e-5
            and res["max_rel_err_param"] <= 1e-2
        )
        return res

    def copy_bandwidth(self) -> None:
        n = self.args.copy_numel or self.args.numel
        src = torch.randn(n, device=self.device)
        dst = torch.empty_like(src)
        t = self.time_ms(lambda: dst.copy_(src))
        nbytes = 2 * src.numel() * src.element_size()
        bw = nbytes / (t["median_ms"] * 1e-3)
        self.res["copy"] = {
            "numel": n,
            "bytes": nbytes,
            **t,
            "bandwidth_TBps": bw / 1e12,
            "bandwidth_TBps_best": nbytes / (t["min_ms"] * 1e-3) / 1e12,
        }
        log(f"   copy {nbytes / 1e9:.2f} GB: {t['median_ms']:.3f} ms, {bw / 1e12:.3f} TB/s")

    def allocate(self) -> None:
        n, dev = self.args.numel, self.device
        torch.manual_seed(1)
        self.master = torch.nn.Parameter(torch.randn(n, device=dev).mul_(0.02))
        self.acc = torch.randn(n, device=dev).mul_(1e-3)
        self.g16 = torch.randn(n, device=dev, dtype=torch.bfloat16).mul_(1e-3)
        self.param = torch.empty(n, device=dev, dtype=torch.bfloat16)
        self.factor = torch.tensor(GRAD_FACTOR, device=dev)
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def composed(self) -> None:
        master, acc, param, g16, factor = self.master, self.acc, self.param, self.g16, self.factor
        opt = torch.optim.AdamW(
            [master],
            lr=HP["lr"],
            betas=(HP["beta1"], HP["beta2"]),
            eps=HP["eps"],
            weight_decay=HP["weight_decay"],
            fused=True,
        )
        master.grad = acc

        @torch.no_grad()
        def step() -> None:
            acc.mul_(factor)
            opt.step()
            param.copy_(master)
            acc.zero_()

        @torch.no_grad()
        def step_acc() -> None:
            acc.add_(g16)
            step()

        try:
            t = self.time_ms(step)
            self.res["composed"] = {**t, "bytes_per_param": BYTES_COMPOSED}
            log(f"   composed (mul, fused AdamW, copy, zero): {t['median_ms']:.3f} ms")
            t = self.time_ms(step_acc)
            self.res["composed_with_accumulate"] = {**t, "bytes_per_param": BYTES_COMPOSED_ACC}
            log(f"   composed + accumulate bf16 grad: {t['median_ms']:.3f} ms")
        finally:
            st = opt.state.get(master, {})
            self.m, self.v = st.get("exp_avg"), st.get("exp_avg_sq")
            master.grad = None
            opt.state.clear()

    def kernel(self) -> None:
        if self.m is None or self.v is None:
            self.m = torch.zeros_like(self.master)
            self.v = torch.zeros_like(self.master)
        master, m, v = self.master.detach(), self.m, self.v
        common: dict[str, Any] = {
            "lr": HP["lr"],
            "beta1": HP["beta1"],
            "beta2": HP["beta2"],
            "eps": HP["eps"],
            "weight_decay": HP["weight_decay"],
            "step": 10,
        }

        def run_bf16(block: int, warps: int) -> None:
            fused_mixed_adamw_(
                master, m, v, self.g16, self.param, grad_factor=GRAD_FACTOR,
                block_size=block, num_warps=warps, **common,
            )  # fmt: skip

        def run_acc(block: int, warps: int) -> None:
            fused_mixed_adamw_(
                master, m, v, self.acc, self.param, grad_factor=self.factor, zero_grad=True,
                block_size=block, num_warps=warps, **common,
            )  # fmt: skip

        best = (DEFAULT_BLOCK, DEFAULT_NUM_WARPS)
        if not self.args.no_sweep:
            sweep: dict[str, float] = {}
            for block, warps in SWEEP:
                try:
                    t = self.time_ms(lambda b=block, w=warps: run_bf16(b, w), iters=5)
                    sweep[f"{block}x{warps}"] = t["median_ms"]
                    log(f"   sweep BLOCK={block} warps={warps}: {t['median_ms']:.3f} ms")
                except Exception as exc:
                    log(f"!! sweep {block}x{warps} failed: {exc!r}")
                    self.errors.append({"section": f"sweep/{block}x{warps}", "error": repr(exc)})
            self.res["sweep_bf16grad_bf16_ms"] = sweep
            if sweep:
                key = min(sweep, key=lambda k: sweep[k])
                best = (int(key.split("x")[0]), int(key.split("x")[1]))
        self.res["launch_config"] = {"block": best[0], "num_warps": best[1]}
        for name, fn, gdtype, zero in (
            ("kernel_bf16grad_bf16", run_bf16, torch.bfloat16, False),
            ("kernel_fp32acc_bf16_zero", run_acc, torch.float32, True),
        ):
            for cfg_name, cfg in (("", best), ("_default_config", None)):
                if cfg_name and best == (DEFAULT_BLOCK, DEFAULT_NUM_WARPS):
                    continue
                b, w = cfg if cfg is not None else (DEFAULT_BLOCK, DEFAULT_NUM_WARPS)
                t = self.time_ms(lambda fn=fn, b=b, w=w: fn(b, w))
                nbytes = bytes_per_param(gdtype, torch.bfloat16, zero)
                self.res[name + cfg_name] = {
                    **t,
                    "bytes_per_param": nbytes,
                    "block": b,
                    "num_warps": w,
                    "achieved_TBps": nbytes * self.args.numel / (t["median_ms"] * 1e-3) / 1e12,
                }
                log(f"   {name}{cfg_name} (BLOCK={b}, warps={w}): {t['median_ms']:.3f} ms")

    def summarize(self) -> None:
        res, n = self.res, self.args.numel
        bw = res.get("copy", {}).get("bandwidth_TBps")
        rows = []
        floors: dict[str, float] = {}
        for key in (
            "composed",
            "composed_with_accumulate",
            "kernel_bf16grad_bf16",
            "kernel_fp32acc_bf16_zero",
        ):
            if key not in res:
                continue
            nbytes = res[key]["bytes_per_param"]
            floor = nbytes * n / (bw * 1e12) * 1e3 if bw else None
            if floor is not None:
                floors[key] = floor
                res[key]["floor_ms"] = floor
                res[key]["ratio_to_floor"] = res[key]["median_ms"] / floor
            rows.append((key, nbytes, res[key]["median_ms"], floor))
        ratios: dict[str, float] = {}
        for kern in ("kernel_bf16grad_bf16", "kernel_fp32acc_bf16_zero"):
            if kern in res and "ratio_to_floor" in res[kern]:
                ratios[f"{kern}/floor"] = res[kern]["ratio_to_floor"]
        pairs = (
            ("composed", "kernel_fp32acc_bf16_zero"),
            ("composed_with_accumulate", "kernel_bf16grad_bf16"),
        )
        for comp, kern in pairs:
            if comp in res and kern in res:
                ratios[f"{comp}/{kern}"] = res[comp]["median_ms"] / res[kern]["median_ms"]
        res["ratios"] = ratios
        if "kernel_bf16grad_bf16/floor" in ratios:
            res["goal_ratio"] = GOAL_RATIO
            res["goal_met"] = ratios["kernel_bf16grad_bf16/floor"] <= GOAL_RATIO
        if bw:
            log(f"\ncopy bandwidth: {bw:.3f} TB/s   numel: {n:,}")
        log(f"{'path':<28}{'B/param':>8}{'median ms':>12}{'floor ms':>10}{'x floor':>9}")
        for key, nbytes, ms, floor in rows:
            fl = f"{floor:10.3f}{ms / floor:9.3f}" if floor else f"{'-':>10}{'-':>9}"
            log(f"{key:<28}{nbytes:>8}{ms:>12.3f}{fl}")
        for k, r in ratios.items():
            log(f"{k}: {r:.3f}")

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.section("info", self.info)
        if self.device.type != "cuda":
            log("   no CUDA: dry run on CPU, timings are meaningless")
        if not triton_available():
            self.errors.append({"section": "info", "error": "triton is not importable"})
        if not self.args.skip_check:
            self.section("check vs CPU fused AdamW", self.check)
        self.section("copy bandwidth", self.copy_bandwidth)
        self.section("allocate", self.allocate)
        if hasattr(self, "master"):
            self.section("composed torch path", self.composed)
            self.section("triton kernel", self.kernel)
        for name in ("master", "acc", "g16", "param", "m", "v"):
            if hasattr(self, name):
                delattr(self, name)
        self.section("summary", self.summarize)
        if self.device.type == "cuda":
            self.res["max_memory_allocated_GB"] = torch.cuda.max_memory_allocated() / 1e9
        self.res["errors"] = self.errors
        self.res["wall_s"] = time.perf_counter() - t0
        return self.res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 30, help="parameters (default 2**30)")
    ap.add_argument("--out", type=Path, default=None, help="write DIR/fused_step.json")
    ap.add_argument("--check-numel", type=int, default=(1 << 22) + 37)
    ap.add_argument("--copy-numel", type=int, default=None, help="fp32 elements (default numel)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep")
    ap.add_argument("--skip-check", action="store_true")
    args = ap.parse_args(argv)
    res: dict[str, Any] = {}
    try:
        res = Bench(args).run()
    except BaseException as exc:  # still print the JSON line
        log(f"!! fatal: {exc!r}\n{traceback.format_exc()}")
        res.setdefault("errors", []).append({"section": "fatal", "error": repr(exc)})
    line = json.dumps(res, default=str, sort_keys=True)
    if args.out is not None:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "fused_step.json").write_text(line + "\n")
        except Exception as exc:
            log(f"!! could not write {args.out}: {exc!r}")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
