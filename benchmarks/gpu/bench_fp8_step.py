"""fp8 compute on one GPU: a compiled linear stack's step in fp8 against bf16, and the bytes of
the fp8 weight all-gather.

    python3 -m benchmarks.gpu.bench_fp8_step [--width 8192] [--tokens 8192] [--dry-run]

1. check: the stack's output and input gradient with each recipe against bf16 compute on the
   same weights and batch: relative error (Frobenius) under 0.1 (e4m3 rounds each operand to
   2**-4 relative; measured about 3e-2 per matmul on CPU);
2. step: forward and backward of ``--layers`` ``nn.Linear(width, width)`` on ``--tokens``
   tokens, under ``torch.compile``, prepared by ``plan.prepare_model`` (bf16 parameters; fp8:
   torchao's conversion), median time per step and the speed-up over bf16 compute, for each
   recipe the device runs natively (``plan.fp8_execution``: tensorwise and rowwise from SM89,
   mxfp8 from SM100; others are listed as skipped, with the plan's reason);
3. all_gather: the stack at ZeRO-3 on a one-rank process group (FSDP2 still gathers every
   unit), ``fp8.all_gather`` ``fp8`` against ``param_dtype``: the bytes FSDP2's all-gathers
   produce in one forward and backward, against ``plan.traffic()``'s count of what is
   gathered (``P * (N - F) + F`` bytes per gather, twice a step), which must be equal.

``--dry-run`` runs on CPU at tiny sizes, emulated and not compiled: the logic is exercised,
the timings mean nothing. Writes ``results/gpu_fp8_step-<date>.json/.md``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

import dtypeplan
from benchmarks._common import base_parser, environment, finish, format_table, write_result

RECIPES = ("tensorwise", "rowwise", "mxfp8")
CHECK_RTOL = 0.1


def log(msg: str) -> None:
    print(msg, flush=True)


class Stack(torch.nn.Module):
    """``layers`` linear layers of ``width`` with a GELU between them (each its own unit at
    ZeRO-3: a ``ModuleList``'s blocks). With biases: a unit of one fp8 weight alone is
    gathered as float8_e4m3fn, which gloo refuses ("Invalid scalar type"; the CPU count
    below runs on gloo); with its bf16 bias FSDP2 gathers the unit as bytes."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _config(recipe: str | None, *, emulate: bool, stage: int = 0, **fp8: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    if recipe is not None:
        config["fp8"] = {"enabled": True, "recipe": recipe, "emulate": emulate, **fp8}
    return config


class Bench:
    def __init__(self, args: Any) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.emulate = args.device != "cuda"
        self.errors: list[dict[str, str]] = []
        self.res: dict[str, Any] = {"check": {}, "step": {}, "skipped": {}, "all_gather": {}}

    def section(self, name: str, fn: Callable[[], None]) -> None:
        log(f"== {name}")
        try:
            fn()
        except Exception as exc:  # a failing section is recorded, the next one runs
            traceback.print_exc()
            self.errors.append({"section": name, "error": f"{type(exc).__name__}: {exc}"})

    def _model(self, recipe: str | None) -> tuple[torch.nn.Module, dtypeplan.PrecisionPlan]:
        plan = dtypeplan.resolve(_config(recipe, emulate=self.emulate))
        model = Stack(self.args.width, self.args.layers).to(self.device)
        return plan.prepare_model(model), plan

    def _recipes(self) -> list[str]:
        runnable = []
        for recipe in RECIPES:
            plan = dtypeplan.resolve(_config(recipe, emulate=self.emulate))
            if plan.status != "OK":
                self.res["skipped"][recipe] = f"{plan.status}: {plan.reason.strip()}"
            elif not self.emulate and plan.fp8_execution != "native":
                self.res["skipped"][recipe] = f"not native on this device ({plan.fp8_execution})"
            else:
                runnable.append(recipe)
        return runnable

    def _input(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(self.args.tokens, self.args.width, generator=generator)
        return x.to(self.device, torch.bfloat16).requires_grad_()

    def check(self) -> None:
        x = self._input()

        def run(recipe: str | None) -> tuple[torch.Tensor, torch.Tensor]:
            model, _ = self._model(recipe)
            x.grad = None
            out = model(x)
            out.float().square().mean().backward()
            assert x.grad is not None
            return out.detach().float(), x.grad.detach().float()

        ref_out, ref_grad = run(None)
        for recipe in self._recipes():
            out, grad = run(recipe)
            errors = {
                "output_rel_error": float((out - ref_out).norm() / ref_out.norm()),
                "input_grad_rel_error": float((grad - ref_grad).norm() / ref_grad.norm()),
            }
            ok = all(e < CHECK_RTOL for e in errors.values())
            self.res["check"][recipe] = {**errors, "ok": ok}
            log(f"  {recipe}: {errors} ok={ok}")

    def time_ms(self, fn: Callable[[], None]) -> dict[str, float]:
        for _ in range(self.args.warmup):
            fn()
        times = []
        for _ in range(self.args.iters):
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(1000 * (time.perf_counter() - start))
        return {"median_ms": statistics.median(times), "min_ms": min(times)}

    def step(self) -> None:
        x = self._input()
        for recipe in (None, *self._recipes()):
            model, _ = self._model(recipe)
            compiled = model if self.args.dry_run else torch.compile(model)

            def one(compiled: Any = compiled, model: torch.nn.Module = model) -> None:
                compiled(x).float().square().mean().backward()
                model.zero_grad(set_to_none=True)
                x.grad = None

            name = recipe or "bf16"
            self.res["step"][name] = self.time_ms(one)
            log(f"  {name}: {self.res['step'][name]}")
        base = self.res["step"]["bf16"]["median_ms"]
        for timing in self.res["step"].values():
            timing["speedup_over_bf16"] = base / timing["median_ms"]

    def all_gather(self) -> None:
        from dtypeplan.launch import spawn

        # FSDP2 on one rank gathers nothing, and two NCCL ranks cannot share one GPU: the
        # bytes are counted on 2 gloo ranks on the CPU (they are the device's bytes too).
        width = min(self.args.width, self.args.gather_width)
        per_rank = spawn(_gather_case, 2, width, self.args.layers, timeout_s=300)
        self.res["all_gather"] = {**per_rank[0], "width": width}
        log(f"  {self.res['all_gather']}")

    def run(self) -> None:
        self.section("check", self.check)
        self.section("step", self.step)
        self.section("all_gather", self.all_gather)


def _gather_case(rank: int, world: int, width: int, layers: int) -> dict[str, Any]:
    """One forward and backward of the stack at ZeRO-3 (emulated fp8, tensorwise), with the
    bf16 and the fp8 weight all-gather: the bytes this rank's all-gathers sent (a ring's
    ``(g - 1) / g`` of their output), against ``plan.traffic()``'s."""
    from dtypeplan.optimizers.contract import fp8_weight_numels

    out: dict[str, Any] = {}
    for gather in ("param_dtype", "fp8"):
        plan = dtypeplan.resolve(_config("tensorwise", emulate=True, stage=3, all_gather=gather))
        model = Stack(width, layers)
        num_params = sum(p.numel() for p in model.parameters())
        weights = fp8_weight_numels(model, plan)
        model = plan.prepare_model(model)
        x = torch.randn(64, width, generator=torch.Generator().manual_seed(1)).bfloat16()
        with _gathered_bytes() as gathered:
            model(x).float().square().mean().backward()
        sent = gathered["bytes"] * (world - 1) // world
        predicted = plan.traffic(num_params, world, fp8_weights=weights).within["all_gather"]
        out[gather] = {"sent_bytes": sent, "plan_traffic_bytes": predicted, "ok": sent == predicted}
    out["fp8_over_bf16"] = out["fp8"]["sent_bytes"] / out["param_dtype"]["sent_bytes"]
    return out


@contextlib.contextmanager
def _gathered_bytes() -> Iterator[dict[str, int]]:
    """The output bytes of every c10d all-gather run while open (FSDP2's, as the dispatcher
    sees them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counted = {"bytes": 0}

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            if str(func).startswith("c10d._allgather_base_"):
                counted["bytes"] += args[0].numel() * args[0].element_size()
            return func(*args, **(kwargs or {}))

    with Mode():
        yield counted


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (logic only)")
    parser.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument(
        "--gather-width", type=int, default=1024, help="width of the all-gather count (CPU)"
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    if args.dry_run or args.quick:
        args.width, args.layers, args.tokens, args.iters, args.warmup = 64, 2, 64, 2, 1
    if args.dry_run:
        args.device = "cpu"
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = "gpu_fp8_step" + ("_dryrun" if args.dry_run else "")
    env = environment()
    started = time.perf_counter()
    bench = Bench(args)
    bench.run()
    res = bench.res
    steps = [{"compute": k, **v} for k, v in res["step"].items()]
    gathers = [{"all_gather": k, **v} for k, v in res["all_gather"].items() if isinstance(v, dict)]
    summary = {
        "benchmark": name,
        "device": args.device,
        "width": args.width,
        "layers": args.layers,
        "tokens": args.tokens,
        "speedup_over_bf16": {k: v.get("speedup_over_bf16") for k, v in res["step"].items()},
        "fp8_over_bf16_all_gather": res["all_gather"].get("fp8_over_bf16"),
        "check_ok": {k: v["ok"] for k, v in res["check"].items()},
        "all_gather_ok": {k: v["ok"] for k, v in res["all_gather"].items() if isinstance(v, dict)},
        "skipped": res["skipped"],
        "errors": [e["section"] for e in bench.errors],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if not args.no_write:
        sections = []
        if steps:
            sections.append(("Compiled forward and backward per step", format_table(steps)))
        if res["check"]:
            checks = [{"recipe": k, **v} for k, v in res["check"].items()]
            sections.append(("Check against bf16 compute", format_table(checks)))
        if gathers:
            sections.append(
                ("FSDP2 weight all-gather, one forward and backward", format_table(gathers))
            )
        if bench.errors:
            errors = [f"- {e['section']}: `{e['error'][:300]}`" for e in bench.errors]
            sections.append(("Errors", "\n".join(errors)))
        write_result(
            name,
            out=args.out,
            env=env,
            config=vars(args) | {"out": str(args.out)},
            sections=sections,
            data={"results": res, "summary": summary, "errors": bench.errors},
            notes=[f"skipped {k}: {v}" for k, v in res["skipped"].items()],
        )
    finish(summary)
    return summary


if __name__ == "__main__":
    main()
