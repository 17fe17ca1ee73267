"""The multi-chunk Triton kernels on a 7B Llama's chunks, against the floor and torch.

    python3 -m benchmarks.gpu.bench_multi_chunk_step [--ranks 8,64] [--dry-run]

The chunks are those the flat engine updates on one rank: a 7B Llama's parameters (embedding
and head 32000 x 4096; per layer q/k/v/o 4096 x 4096, gate/up 11008 x 4096, down 4096 x 11008,
two norms of 4096; a final norm) packed into buckets of ``DEFAULT_BUCKET_NUMEL`` as
``buffers/layout.FlatGroup`` packs them for N ranks, rank 0's chunk of each bucket.

1. table build (host): ``launch_tables.tile_rows`` at each ``--ranks`` and at one rank, for
   both kernels' blocks (the first step's cost before the kernel runs; measured on the host in
   every mode, a dry run included);
2. check (bits): 3 steps of each multi-chunk launch against the single-chunk kernel chunk by
   chunk, which claims the same bits (the fp32 kernel; the one-pass kernel with each chunk's
   noise key), on the first chunks of the layout up to ``--check-numel``: values differing;
3. copy bandwidth: a device-to-device fp32 copy, (bytes read + written) / time;
4. per ``--ranks``: the fp32 kernel in one launch (fp32 accumulator, bf16 parameters written,
   30 B/param) and one launch per chunk; ``torch.optim.AdamW(fused=True)`` on the same fp32
   masters and accumulator chunks (28 B/param); the one-pass kernel's cells in one launch.
   For each launch its first step after the tables were dropped (the kernel compiled already:
   the table build and upload) against the median of the later steps.

Peak memory at 8 ranks (8.4e8 elements a rank) is about 16 GB. ``--dry-run`` runs on CPU at a
tiny Llama's shapes with ``TRITON_INTERPRET=1`` (timings of the kernels mean nothing; the
host's table build at the 7B layout is measured as on a GPU machine). Writes
``results/gpu_multi_chunk_step-<date>.json/.md``.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._common import base_parser, environment, finish, format_table, write_result

BF16, FP32 = torch.bfloat16, torch.float32
HP: dict[str, Any] = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
LLAMA_7B = {"vocab": 32000, "hidden": 4096, "intermediate": 11008, "layers": 32}
TINY = {"vocab": 96, "hidden": 32, "intermediate": 88, "layers": 2}
ONE_PASS_CELLS: dict[str, tuple[torch.dtype, str, torch.dtype, torch.dtype | None]] = {
    # name: master, rounding, moments, parameter written (None: the master is it)
    "one-pass bf16 stochastic / fp32 states": (BF16, "stochastic", FP32, None),
    "one-pass fp32 / bf16 states, bf16 params": (FP32, "nearest", BF16, BF16),
}
SEED = 0x5EED


def log(msg: str) -> None:
    print(msg, flush=True)


def llama_shapes(config: dict[str, int]) -> list[tuple[int, ...]]:
    """A Llama's parameter shapes in ``model.parameters()`` order."""
    h, f = config["hidden"], config["intermediate"]
    shapes: list[tuple[int, ...]] = [(config["vocab"], h)]
    for _ in range(config["layers"]):
        shapes += [(h, h)] * 4 + [(f, h), (f, h), (h, f), (h,), (h,)]
    return shapes + [(h,), (config["vocab"], h)]


def chunk_sizes(shapes: list[tuple[int, ...]], ranks: int, bucket_numel: int) -> tuple[int, ...]:
    """Rank 0's chunk of every bucket, as the flat engine lays the parameters out (on the meta
    device: nothing is allocated)."""
    from dtypeplan.optimizers.buffers.layout import FlatGroup

    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
    flat = FlatGroup(params, BF16, ranks, bucket_numel, ranks)
    return tuple(bucket.chunk_numel(ranks) for bucket in flat.buckets)


class Bench:
    def __init__(self, args: Any) -> None:
        from dtypeplan.optimizers.kernels import (
            launch_tables,
            rounding,
            triton_adamw,
            triton_one_pass,
        )
        from dtypeplan.resolver._traffic import DEFAULT_BUCKET_NUMEL

        self.tables, self.rounding = launch_tables, rounding
        self.fp32, self.one_pass = triton_adamw, triton_one_pass
        self.args = args
        self.default_bucket_numel = DEFAULT_BUCKET_NUMEL
        self.bucket_numel = args.bucket_numel or DEFAULT_BUCKET_NUMEL
        self.device = torch.device(args.device)
        self.errors: list[dict[str, str]] = []
        self.res: dict[str, Any] = {"table_build": [], "check": {}, "layouts": {}}

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

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time_ms(self, fn: Callable[[], None]) -> dict[str, float]:
        for _ in range(self.args.warmup):
            fn()
        self.sync()
        times: list[float] = []
        for _ in range(self.args.iters):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return {"median_ms": statistics.median(times), "min_ms": min(times)}

    def first_then_later(self, fn: Callable[[], None]) -> dict[str, float]:
        """The first step after the tables were dropped (the build and upload in it), then the
        median of the later ones; wall clock, synchronized (a step is ms on a GPU)."""
        self.tables._TILE_TABLES.clear()
        self.tables._POINTER_TABLES.clear()
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        first = (time.perf_counter() - t0) * 1e3
        later = self.time_ms(fn)
        return {
            "first_step_ms": first,
            **later,
            "first_minus_median_ms": first - later["median_ms"],
        }

    # -- sections -------------------------------------------------------------------------------

    def table_build(self) -> None:
        shapes = llama_shapes(LLAMA_7B)
        for ranks in sorted({1, *self.args.ranks}):
            sizes = chunk_sizes(shapes, ranks, self.default_bucket_numel)
            for block in (self.fp32.DEFAULT_BLOCK, self.one_pass.BLOCK):
                t0 = time.perf_counter()
                table = self.tables.tile_rows(sizes, block)
                ms = (time.perf_counter() - t0) * 1e3
                row = {"ranks": ranks, "block": block, "chunks": len(sizes), "numel": sum(sizes),
                       "tiles": table.shape[0], "table_MB": table.numel() * 8 / 1e6,
                       "build_ms": ms}  # fmt: skip
                self.res["table_build"].append(row)
                log(f"   {row}")

    def _fp32_tensors(self, sizes: tuple[int, ...]) -> dict[str, list[torch.Tensor]]:
        dev, gen = self.device, torch.Generator(device=self.device).manual_seed(0)
        return {
            "masters": [torch.randn(n, device=dev, generator=gen).mul_(0.02) for n in sizes],
            "m": [torch.zeros(n, device=dev) for n in sizes],
            "v": [torch.zeros(n, device=dev) for n in sizes],
            "grads": [torch.randn(n, device=dev, generator=gen).mul_(1e-3) for n in sizes],
            "params": [torch.empty(n, device=dev, dtype=BF16) for n in sizes],
        }

    def _fp32_multi(self, t: dict[str, list[torch.Tensor]], step: int, factor: Any) -> None:
        self.fp32.fused_mixed_adamw_multi_(
            t["masters"], t["m"], t["v"], t["grads"], t["params"], step=step, grad_factor=factor,
            **HP,
        )  # fmt: skip

    def _fp32_each(self, t: dict[str, list[torch.Tensor]], step: int, factor: Any) -> None:
        rows = zip(*(t[k] for k in ("masters", "m", "v", "grads", "params")), strict=True)
        for mst, m, v, g, p in rows:
            self.fp32.fused_mixed_adamw_(mst, m, v, g, p, step=step, grad_factor=factor, **HP)

    def _one_pass_tensors(self, cell: str, sizes: tuple[int, ...]) -> dict[str, Any]:
        master, _, moments, param = ONE_PASS_CELLS[cell]
        dev, gen = self.device, torch.Generator(device=self.device).manual_seed(0)
        return {
            "masters": [
                torch.randn(n, device=dev, generator=gen).mul_(0.02).to(master) for n in sizes
            ],
            "grads": [torch.randn(n, device=dev, generator=gen).mul_(1e-3) for n in sizes],
            "m": [torch.zeros(n, device=dev, dtype=moments) for n in sizes],
            "v": [torch.zeros(n, device=dev, dtype=moments) for n in sizes],
            "params": [
                None if param is None else torch.empty(n, device=dev, dtype=param) for n in sizes
            ],
            "hyper": self._hyper(step=1),
            "scale": torch.tensor(0.5, device=dev),
        }

    def _hyper(self, step: int) -> torch.Tensor:
        from dtypeplan.optimizers.kernels import one_pass

        group = {"lr": HP["lr"], "betas": (HP["beta1"], HP["beta2"]), "eps": HP["eps"],
                 "weight_decay": HP["weight_decay"]}  # fmt: skip
        return one_pass.hyperparameters(group, step, True, torch.device("cpu")).to(self.device)

    def _one_pass_multi(self, cell: str, t: dict[str, Any], step: int) -> None:
        count = len(t["masters"])
        self.one_pass.adam_one_pass_triton_multi_(
            t["masters"], t["grads"], t["m"], t["v"], [None] * count, t["params"], t["hyper"],
            t["scale"], [self.one_pass.noise_key_base(SEED, i) for i in range(count)], step,
            decoupled=True, weight_decay=True, rounding=ONE_PASS_CELLS[cell][1],
        )  # fmt: skip

    def _one_pass_each(self, cell: str, t: dict[str, Any], step: int) -> None:
        for i, row in enumerate(zip(*(t[k] for k in ("masters", "grads", "m", "v")),
                                    t["params"], strict=True)):  # fmt: skip
            master, grad, m, v, param = row
            self.one_pass.adam_one_pass_triton_(
                master, grad, m, v, None, param, t["hyper"], t["scale"],
                self.rounding.noise_key(SEED, i, step), 0,
                decoupled=True, weight_decay=True, rounding=ONE_PASS_CELLS[cell][1],
            )  # fmt: skip

    def check(self) -> None:
        sizes: list[int] = []
        for n in chunk_sizes(llama_shapes(self.args.model), max(self.args.ranks), 1 << 12):
            if sizes and sum(sizes) + n > self.args.check_numel:
                break
            sizes.append(n)
        layout = tuple(sizes)
        cases: list[tuple[str, Callable[[Any, int], None], Callable[[Any, int], None], Any]] = [
            ("fp32 kernel", lambda t, s: self._fp32_multi(t, s, 0.37),
             lambda t, s: self._fp32_each(t, s, 0.37), lambda: self._fp32_tensors(layout)),
        ]  # fmt: skip
        for cell in ONE_PASS_CELLS:
            cases.append((cell, lambda t, s, c=cell: self._one_pass_multi(c, t, s),
                          lambda t, s, c=cell: self._one_pass_each(c, t, s),
                          lambda c=cell: self._one_pass_tensors(c, layout)))  # fmt: skip
        for name, multi, each, make in cases:
            mine, ref = make(), make()
            for step in range(1, 4):
                mine["hyper"] = ref["hyper"] = self._hyper(step)
                multi(mine, step)
                each(ref, step)
            differ = 0
            for key in ("masters", "m", "v", "params"):
                for a, b in zip(mine[key], ref[key], strict=True):
                    if a is not None and b is not None:
                        same = (a == b) | (a.float().isnan() & b.float().isnan())
                        differ += int((~same).sum())
            self.res["check"][name] = {"chunks": len(layout), "numel": sum(layout),
                                       "values_differing": differ, "ok": differ == 0}  # fmt: skip
            log(f"   {name}: {len(layout)} chunks, {differ} values differ")

    def copy_bandwidth(self) -> None:
        src = torch.randn(self.args.copy_numel, device=self.device)
        dst = torch.empty_like(src)
        t = self.time_ms(lambda: dst.copy_(src))
        self.res["copy"] = {
            **t,
            "bandwidth_TBps": 2 * src.numel() * 4 / (t["median_ms"] * 1e-3) / 1e12,
        }
        log(f"   copy: {t['median_ms']:.3f} ms, {self.res['copy']['bandwidth_TBps']:.3f} TB/s")

    def layout(self, ranks: int) -> None:
        sizes = chunk_sizes(llama_shapes(self.args.model), ranks, self.bucket_numel)
        numel = sum(sizes)
        out: dict[str, Any] = {"chunks": len(sizes), "numel": numel, "cases": {}}
        self.res["layouts"][str(ranks)] = out
        warm = (16 * 64, 64)  # compiles each variant (aligned, as the layout's chunks are)
        t = self._fp32_tensors(warm)
        factor = torch.tensor(0.37, device=self.device)
        self._fp32_multi(t, 10, factor)
        self._fp32_each(t, 10, factor)
        t = self._fp32_tensors(sizes)
        bytes_fp32 = self.fp32.bytes_per_param(FP32, BF16, False)
        launches = {
            "fp32 kernel, one launch": self._fp32_multi,
            "fp32 kernel, a launch per chunk": self._fp32_each,
        }
        for name, launch in launches.items():
            fn = functools.partial(launch, t, 10, factor)
            out["cases"][name] = {**self.first_then_later(fn), "bytes_per_param": bytes_fp32}
            log(f"   {name}: {out['cases'][name]}")
        del t["m"], t["v"], t["params"]
        params = [torch.nn.Parameter(master) for master in t["masters"]]
        for param, grad in zip(params, t["grads"], strict=True):
            param.grad = grad
        opt = torch.optim.AdamW(
            params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
            weight_decay=HP["weight_decay"], fused=True,
        )  # fmt: skip
        out["cases"]["torch AdamW fused fp32"] = {**self.time_ms(opt.step), "bytes_per_param": 28}
        log(f"   torch AdamW fused fp32: {out['cases']['torch AdamW fused fp32']}")
        del opt, params, t, fn
        for cell, (master, rounding, moments, param) in ONE_PASS_CELLS.items():
            small = self._one_pass_tensors(cell, warm)
            self._one_pass_multi(cell, small, 10)
            del small
            cell_tensors = self._one_pass_tensors(cell, sizes)
            timed = self.first_then_later(
                lambda c=cell, ct=cell_tensors: self._one_pass_multi(c, ct, 10)
            )
            nbytes = self.one_pass.bytes_per_param(master, moments, moments, FP32, param,
                                                   rounding == "kahan")  # fmt: skip
            out["cases"][cell + ", one launch"] = {**timed, "bytes_per_param": nbytes}
            log(f"   {cell}: {timed}")
            del cell_tensors

    def summarize(self) -> list[dict[str, Any]]:
        bw = self.res.get("copy", {}).get("bandwidth_TBps")
        rows = []
        for ranks, layout in self.res["layouts"].items():
            torch_ms = layout["cases"].get("torch AdamW fused fp32", {}).get("median_ms")
            for case, r in layout["cases"].items():
                floor = r["bytes_per_param"] * layout["numel"] / (bw * 1e12) * 1e3 if bw else None
                r["floor_ms"] = floor
                r["ratio_to_floor"] = r["median_ms"] / floor if floor else None
                r["x_torch_fused"] = r["median_ms"] / torch_ms if torch_ms else None
                rows.append({"ranks": int(ranks), "chunks": layout["chunks"], "case": case,
                             "B/param": r["bytes_per_param"], "median ms": r["median_ms"],
                             "floor ms": floor, "x floor": r["ratio_to_floor"],
                             "x torch fused": r["x_torch_fused"],
                             "first step ms": r.get("first_step_ms")})  # fmt: skip
        return rows

    def run(self) -> list[dict[str, Any]]:
        if self.device.type != "cuda":
            log("   no CUDA: dry run on CPU, the kernels' timings are meaningless")
        self.section("table build (host, the 7B layout)", self.table_build)
        if self.fp32.triton is None:
            self.errors.append({"section": "setup", "error": "triton is not importable"})
            return []
        if not self.args.skip_check:
            self.section("check: one launch against a launch per chunk (bits)", self.check)
        self.section("copy bandwidth", self.copy_bandwidth)
        for ranks in self.args.ranks:
            self.section(f"layout of {ranks} ranks", lambda r=ranks: self.layout(r))
        return self.summarize()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (logic only)")
    parser.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    parser.add_argument("--ranks", default="8,64", help="layouts of these rank counts (8,64)")
    parser.add_argument("--bucket-numel", type=int, default=None, help="the engine's default")
    parser.add_argument("--check-numel", type=int, default=1 << 24)
    parser.add_argument("--copy-numel", type=int, default=1 << 28)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args(argv)
    args.ranks = [int(r) for r in str(args.ranks).split(",")]
    args.model = LLAMA_7B
    if args.dry_run or args.quick:
        args.model, args.bucket_numel = TINY, args.bucket_numel or 1 << 12
        args.check_numel, args.copy_numel, args.iters, args.warmup = 4096, 4096, 2, 1
        args.ranks = [2]
    if args.dry_run:
        args.device = "cpu"
        # Triton reads this when the kernel is defined: before dtypeplan's kernel module loads.
        os.environ["TRITON_INTERPRET"] = "1"
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = "gpu_multi_chunk_step" + ("_dryrun" if args.dry_run else "")
    env = environment()
    started = time.perf_counter()
    bench = Bench(args)
    rows = bench.run()
    res = bench.res
    table = format_table(rows)
    log(f"\n{table}")
    builds = format_table(res["table_build"])
    summary = {
        "benchmark": name,
        "device": args.device,
        "ranks": args.ranks,
        "copy_TBps": res.get("copy", {}).get("bandwidth_TBps"),
        "ratio_to_floor": {f"{row['ranks']} ranks, {row['case']}": row["x floor"] for row in rows},
        "first_step_ms": {
            f"{row['ranks']} ranks, {row['case']}": row["first step ms"]
            for row in rows
            if row["first step ms"] is not None
        },
        "table_build_ms": {
            f"{row['ranks']} ranks, block {row['block']}": row["build_ms"]
            for row in res["table_build"]
        },
        "check_ok": {k: v["ok"] for k, v in res["check"].items()},
        "errors": [e["section"] for e in bench.errors],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if not args.no_write:
        sections = [("Median time per step", table), ("Tile table build on the host", builds)]
        if res["check"]:
            checks = [{"case": k, **v} for k, v in res["check"].items()]
            sections.append(("One launch against a launch per chunk", format_table(checks)))
        if bench.errors:
            errors = [f"- {e['section']}: `{e['error'][:300]}`" for e in bench.errors]
            sections.append(("Errors", "\n".join(errors)))
        write_result(
            name,
            out=args.out,
            env=env,
            config={
                "device": args.device,
                "model": args.model,
                "ranks": args.ranks,
                "bucket_numel": bench.bucket_numel,
                "check_numel": args.check_numel,
                "iters": args.iters,
                "warmup": args.warmup,
                "hyperparameters": HP,
                "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
                "dry_run": args.dry_run,
            },
            sections=sections,
            data=dict(res) | {"errors": bench.errors, "summary": summary},
            notes=[
                "floor ms = numel x B/param / copy bandwidth (bytes read + written per second "
                "of a device-to-device fp32 copy); x torch fused: against "
                "torch.optim.AdamW(fused=True) on the same fp32 masters and accumulator chunks.",
                "first step ms: the first step after the launch tables were dropped (the kernel "
                "compiled already): the tile and pointer tables' build and upload, and the step.",
            ]
            + (
                ["DRY RUN on CPU at a tiny size: the kernels' timings mean nothing."]
                if args.dry_run
                else []
            ),
        )
    finish(summary)
    return summary


if __name__ == "__main__":
    main()
