"""The one-pass mixed-precision AdamW step (Triton) on one GPU, against torch and the floor.

    python3 -m benchmarks.gpu.bench_fused_step [--numel 1073741824] [--dry-run]

1. check: 3 steps of the kernel against the CPU path (torch.optim.AdamW(fused=True) on CPU
   copies) for an fp32 accumulator + bf16 params and a bf16 grad + bf16 params; max relative
   error (max |a - b| / max |b|) of master, exp_avg, exp_avg_sq and the bf16 params.
2. copy bandwidth: device-to-device copy of a large fp32 buffer, (bytes read + written) / time.
3. composed torch path at --numel: accumulator *= grad_factor, AdamW(fused=True).step() on the
   fp32 master with .grad = accumulator, copy master -> bf16 params, zero the accumulator (46 B
   per parameter); and the same preceded by accumulating a bf16 grad into the fp32 accumulator
   (56 B).
4. the kernel at --numel, after a short sweep of launch configurations: bf16 grad + bf16 params
   (28 B), fp32 accumulator + bf16 params (30 B, what the engine's step needs) and the same with
   zeroing the accumulator (34 B).
5. the floor = bytes moved / copy bandwidth, ratios, a table, and a last line of JSON.

Peak memory at the default numel 2**30 (1.07e9) is about 20 GB. Every section is guarded: a
failure is printed and recorded, and the rest still runs. ``--dry-run`` runs on CPU at a tiny
size with ``TRITON_INTERPRET=1`` (the kernel in Triton's interpreter, where Triton is installed):
the logic is exercised, the timings mean nothing, and the result is named
``gpu_fused_step_dryrun``. Writes ``results/gpu_fused_step-<date>.json/.md``.

The kernel is an internal of dtypeplan (``dtypeplan.optimizers.kernels.triton_adamw``); this is
the one benchmark that calls it directly, as its subject is the kernel itself.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from benchmarks._common import base_parser, environment, finish, format_table, write_result

HP: dict[str, float] = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
GRAD_FACTOR = 0.37  # stands for clip_coef / (loss_scale * world_size)
GOAL_RATIO = 1.10  # the kernel's goal against the copy floor (bf16 grad + bf16 params)
SWEEP = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16)]
BYTES_COMPOSED = 8 + 28 + 6 + 4  # scale acc, fused AdamW, master -> bf16 copy, zero acc
BYTES_COMPOSED_ACC = BYTES_COMPOSED + 10  # + acc.add_(bf16 grad): read 2 + read 4 + write 4


def log(msg: str) -> None:
    print(msg, flush=True)


def kernel_module() -> ModuleType:
    """The kernel's module, imported after ``TRITON_INTERPRET`` is settled (Triton reads it when
    the kernel is defined)."""
    from dtypeplan.optimizers.kernels import triton_adamw

    return triton_adamw


class Bench:
    def __init__(self, args: Any) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.errors: list[dict[str, str]] = []
        self.res: dict[str, Any] = {}
        self.k = kernel_module()

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
            self.k.fused_mixed_adamw_(
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
            self.k.fused_mixed_adamw_(
                master, m, v, self.g16, self.param, grad_factor=GRAD_FACTOR,
                block_size=block, num_warps=warps, **common,
            )  # fmt: skip

        def run_acc(block: int, warps: int, zero_grad: bool = False) -> None:
            self.k.fused_mixed_adamw_(
                master, m, v, self.acc, self.param, grad_factor=self.factor, zero_grad=zero_grad,
                block_size=block, num_warps=warps, **common,
            )  # fmt: skip

        def run_acc_zero(block: int, warps: int) -> None:
            run_acc(block, warps, zero_grad=True)

        best = (self.k.DEFAULT_BLOCK, self.k.DEFAULT_NUM_WARPS)
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
            ("kernel_fp32acc_bf16", run_acc, torch.float32, False),
            ("kernel_fp32acc_bf16_zero", run_acc_zero, torch.float32, True),
        ):
            for cfg_name, cfg in (("", best), ("_default_config", None)):
                if cfg_name and best == (self.k.DEFAULT_BLOCK, self.k.DEFAULT_NUM_WARPS):
                    continue
                default = (self.k.DEFAULT_BLOCK, self.k.DEFAULT_NUM_WARPS)
                b, w = cfg if cfg is not None else default
                t = self.time_ms(lambda fn=fn, b=b, w=w: fn(b, w))
                nbytes = self.k.bytes_per_param(gdtype, torch.bfloat16, zero)
                self.res[name + cfg_name] = {
                    **t,
                    "bytes_per_param": nbytes,
                    "block": b,
                    "num_warps": w,
                    "achieved_TBps": nbytes * self.args.numel / (t["median_ms"] * 1e-3) / 1e12,
                }
                log(f"   {name}{cfg_name} (BLOCK={b}, warps={w}): {t['median_ms']:.3f} ms")

    def summarize(self) -> list[dict[str, Any]]:
        res, n = self.res, self.args.numel
        bw = res.get("copy", {}).get("bandwidth_TBps")
        rows = []
        for key in (
            "composed",
            "composed_with_accumulate",
            "kernel_bf16grad_bf16",
            "kernel_fp32acc_bf16",
            "kernel_fp32acc_bf16_zero",
        ):
            if key not in res:
                continue
            nbytes = res[key]["bytes_per_param"]
            floor = nbytes * n / (bw * 1e12) * 1e3 if bw else None
            if floor is not None:
                res[key]["floor_ms"] = floor
                res[key]["ratio_to_floor"] = res[key]["median_ms"] / floor
            rows.append(
                {
                    "path": key,
                    "B/param": nbytes,
                    "median ms": res[key]["median_ms"],
                    "floor ms": floor,
                    "x floor": res[key].get("ratio_to_floor"),
                    "TB/s": nbytes * n / (res[key]["median_ms"] * 1e-3) / 1e12,
                }
            )
        ratios: dict[str, float] = {}
        for kern in ("kernel_bf16grad_bf16", "kernel_fp32acc_bf16", "kernel_fp32acc_bf16_zero"):
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
        return rows

    def run(self) -> list[dict[str, Any]]:
        if self.device.type != "cuda":
            log("   no CUDA: dry run on CPU, timings are meaningless")
        if not self.k.triton_available():
            self.errors.append({"section": "setup", "error": "triton is not importable"})
        if not self.args.skip_check:
            self.section("check vs CPU fused AdamW", self.check)
        self.section("copy bandwidth", self.copy_bandwidth)
        self.section("allocate", self.allocate)
        if hasattr(self, "master"):
            self.section("composed torch path", self.composed)
            if self.k.fused_kernel_available(self.device):
                self.section("triton kernel", self.kernel)
            else:
                self.errors.append(
                    {"section": "triton kernel", "error": f"no kernel on {self.device}"}
                )
        for name in ("master", "acc", "g16", "param", "m", "v"):
            if hasattr(self, name):
                delattr(self, name)
        rows = self.summarize()
        if self.device.type == "cuda":
            self.res["max_memory_allocated_GB"] = torch.cuda.max_memory_allocated() / 1e9
        self.res["errors"] = self.errors
        return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (logic only)")
    parser.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    parser.add_argument("--numel", type=int, default=1 << 30, help="parameters (default 2**30)")
    parser.add_argument("--check-numel", type=int, default=(1 << 22) + 37)
    parser.add_argument("--copy-numel", type=int, default=None, help="fp32 values (default numel)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep")
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args(argv)
    if args.dry_run or args.quick:
        args.numel, args.check_numel, args.iters, args.warmup = 4099, 1031, 2, 1
        args.no_sweep = True
    if args.dry_run:
        args.device = "cpu"
        # Triton reads this when the kernel is defined: before dtypeplan's kernel module loads.
        os.environ["TRITON_INTERPRET"] = "1"
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = "gpu_fused_step" + ("_dryrun" if args.dry_run else "")
    env = environment()
    started = time.perf_counter()
    bench = Bench(args)
    rows = bench.run()
    res = bench.res
    table = format_table(rows)
    log(f"\n{table}")
    summary = {
        "benchmark": name,
        "device": args.device,
        "numel": args.numel,
        "copy_TBps": res.get("copy", {}).get("bandwidth_TBps"),
        "ratios": res.get("ratios", {}),
        "goal_met": res.get("goal_met"),
        "check_ok": {k: v.get("ok") for k, v in res.get("check", {}).items()},
        "errors": [e["section"] for e in res["errors"]],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if not args.no_write:
        sections = [("Median time per step", table)]
        if "check" in res:
            checks = [{"case": k, **v} for k, v in res["check"].items()]
            sections.append(("Check against CPU fused AdamW", format_table(checks)))
        sweep = res.get("sweep_bf16grad_bf16_ms", {})
        if sweep:
            sweep_rows = [{"BLOCK x warps": k, "ms": v} for k, v in sweep.items()]
            sections.append(("Launch-config sweep (bf16 grad)", format_table(sweep_rows)))
        if res["errors"]:
            errors = [f"- {e['section']}: `{e['error'][:300]}`" for e in res["errors"]]
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
                "hyperparameters": dict(HP, grad_factor=GRAD_FACTOR),
                "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
                "dry_run": args.dry_run,
            },
            sections=sections,
            data={k: v for k, v in res.items() if k != "errors"}
            | {"errors": res["errors"], "summary": summary},
            notes=[
                "floor ms = numel x B/param / copy bandwidth (bytes read + written per second "
                f"of a device-to-device fp32 copy); the kernel's goal: <= {GOAL_RATIO}x the "
                "floor for a bf16 gradient and bf16 params.",
                "composed = accumulator *= factor, AdamW(fused=True).step(), master -> bf16 "
                "copy, zero the accumulator (46 B/param); with_accumulate adds acc += bf16 grad.",
            ]
            + (
                ["DRY RUN on CPU at a tiny size: its timings mean nothing."] if args.dry_run else []
            ),
        )
    finish(summary)
    return summary


if __name__ == "__main__":
    main()
