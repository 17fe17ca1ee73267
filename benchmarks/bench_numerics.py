"""Rounding error of gradient accumulation and of 16-bit reductions, against float64.

    python -m benchmarks.bench_numerics [--quick]

1. Accumulation over micro-batches (1..256). bf16 gradients ``g_k = mu + noise_k`` (the same
   mean every micro-batch, fresh noise, as micro-batch gradients are) are summed by
   ``dtypeplan.optimizers.grads.reduction.accumulate_`` into an fp32 and into a bf16
   accumulator, the first one copied as the engine does;
   error = ||acc - sum_k g_k (float64)|| / ||sum||.
   The same is then done by the real optimizer on 1 rank: a bf16 MLP built with
   ``gradient_accumulation_dtype`` fp32 or bf16 runs ``opt.backward`` micro-batch after
   micro-batch, its accumulator is read after each, and the reference is the float64 sum of
   the bf16 gradients that ``torch.autograd.grad`` gives for an identical bf16 model.
2. Reduction over ranks. Every rank holds an fp32 gradient ``mu + noise_r``; the sum over ranks
   goes on the wire in bf16 (and fp16). Measured on 2 and 4 gloo ranks through
   ``Communicator.reduce_scatter_sum`` with method ``"collective"`` (gloo's own 16-bit sum) and
   ``"fp32_sum"`` (16-bit all-to-all, fp32 sum by the receiver), and through
   ``Communicator.all_reduce_sum_`` (the stage-0 path), and simulated in one process
   for 2..256 ranks: a ring reduce-scatter adds one rank's 16-bit value per hop and rounds the
   partial sum to 16 bits after each (chunk c starts at rank c+1, as in a ring); ``fp32_sum``
   casts each value to 16 bits once and sums in fp32. Errors are against the float64 sum of the
   fp32 inputs (so the unavoidable rounding of each input to 16 bits is included) and, in the
   JSON, against the float64 sum of the 16-bit inputs (the reduction's own error).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

import dtypeplan
from benchmarks._common import (
    base_parser,
    environment,
    finish,
    format_table,
    save_figure,
    write_result,
)
from dtypeplan.comm import Communicator
from dtypeplan.launch import spawn
from dtypeplan.optimizers.grads.reduction import accumulate_

MICRO_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SIM_WORLDS = (2, 4, 8, 16, 32, 64, 128, 256)
REAL_WORLDS = (2, 4)
WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rel_err(value: torch.Tensor, ref: torch.Tensor) -> float:
    return float((value.double() - ref).norm() / ref.norm())


# --- 1. accumulation ---------------------------------------------------------------------------
def accumulation_synthetic(
    numel: int, max_micro: int, seed: int = 0
) -> dict[str, dict[int, float]]:
    generator = torch.Generator().manual_seed(seed)
    mu = torch.randn(numel, generator=generator)
    accs = {
        "fp32": torch.empty(numel, dtype=torch.float32),
        "bf16": torch.empty(numel, dtype=torch.bfloat16),
    }
    ref = torch.zeros(numel, dtype=torch.float64)
    errors: dict[str, dict[int, float]] = {name: {} for name in accs}
    for k in range(1, max_micro + 1):
        grad = (mu + torch.randn(numel, generator=generator)).to(torch.bfloat16)
        ref += grad.double()
        for acc in accs.values():
            if k == 1:
                acc.copy_(grad)
            else:
                accumulate_(acc, grad)
        if k in MICRO_COUNTS:
            for name, acc in accs.items():
                errors[name][k] = rel_err(acc, ref)
    return errors


def _mlp(width: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    )


def accumulation_optimizer(
    width: int, max_micro: int, rows: int = 16
) -> dict[str, dict[int, float]]:
    """The real optimizer's accumulator against the float64 sum of the same bf16 gradients."""
    errors: dict[str, dict[int, float]] = {}
    for accum in ("fp32", "bf16"):
        plan = dtypeplan.resolve(
            {
                "bf16": {"enabled": True},
                "gradient_accumulation_dtype": accum,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            }
        )
        assert plan.status == "OK", plan.explain()
        base = _mlp(width)
        reference = copy.deepcopy(base).to(torch.bfloat16)
        model = copy.deepcopy(base)
        opt = plan.build(model.parameters())
        state = opt.groups[0]
        ref_params = list(reference.parameters())
        ref_views = state.flat.param_views(torch.zeros(state.flat.numel, dtype=torch.float64))
        generator = torch.Generator().manual_seed(7)
        errors[accum] = {}
        target = torch.randn(rows, width, generator=generator)
        for k in range(1, max_micro + 1):
            x = (torch.randn(rows, width, generator=generator) + 0.5).to(torch.bfloat16)
            # Divide by the micro-batch count, as a training loop does (a power of two: exact).
            loss = torch.nn.functional.mse_loss(model(x).float(), target) / max_micro
            opt.backward(loss)
            ref_loss = torch.nn.functional.mse_loss(reference(x).float(), target) / max_micro
            grads = torch.autograd.grad(ref_loss, ref_params)
            for view, grad in zip(ref_views, grads, strict=True):
                view += grad.double()
            if k in MICRO_COUNTS:
                ref_flat = torch.cat([v.reshape(-1) for v in ref_views])
                got = torch.cat([v.reshape(-1) for v in state.acc_param_views])
                errors[accum][k] = rel_err(got, ref_flat)
    return errors


# --- 2. reduction over ranks -------------------------------------------------------------------
def rank_gradients(world: int, numel: int, seed: int = 0) -> torch.Tensor:
    """(world, numel) fp32: a shared mean plus per-rank noise; row r is rank r's gradient."""
    generator = torch.Generator().manual_seed(seed)
    mu = torch.randn(numel, generator=generator)
    rows = [
        mu + torch.randn(numel, generator=torch.Generator().manual_seed(seed + 1 + r))
        for r in range(world)
    ]
    return torch.stack(rows)


def simulate_ring(values: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """A ring reduce-scatter's result, rounded to ``wire`` at every hop; chunk c starts at c+1."""
    world, numel = values.shape
    wired = values.to(wire)
    chunk = -(-numel // world)
    start = (torch.arange(numel) // chunk + 1) % world
    cols = torch.arange(numel)
    acc = wired[start, cols]
    for hop in range(1, world):
        # c10's 16-bit add: both operands to fp32, add, round to 16 bits.
        acc = (acc.float() + wired[(start + hop) % world, cols].float()).to(wire)
    return acc


def simulate_fp32_sum(values: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """``fp32_sum``: each rank's value rounded to ``wire`` once, summed in fp32 in rank order."""
    wired = values.to(wire)
    acc = wired[0].float()
    for row in wired[1:]:
        acc += row.float()
    return acc


def reduction_simulated(numel: int, worlds: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for world in worlds:
        values = rank_gradients(world, numel)
        ref = values.double().sum(0)
        for wire_name, wire in WIRE.items():
            ref_wire = values.to(wire).double().sum(0)
            for method, fn in (("ring", simulate_ring), ("fp32_sum", simulate_fp32_sum)):
                out = fn(values, wire)
                rows.append(
                    {
                        "N": world,
                        "wire": wire_name,
                        "method": method,
                        "source": "simulated",
                        "rel err": rel_err(out, ref),
                        "reduction-only err": rel_err(out, ref_wire),
                    }
                )
    return rows


def _reduction_rank(rank: int, world: int, numel: int) -> list[dict[str, Any]]:
    comm = Communicator()
    values = rank_gradients(world, numel)
    ref = values.double().sum(0)
    chunk = numel // world
    mine = slice(rank * chunk, (rank + 1) * chunk)
    out = []
    for wire_name, wire in WIRE.items():
        ref_wire = values.to(wire).double().sum(0)
        for method in ("collective", "fp32_sum"):
            # Stages 1-2: reduce-scatter into the fp32 accumulator (this rank's slice).
            result = torch.empty(chunk, dtype=torch.float32)
            comm.reduce_scatter_sum(result, values[rank].to(wire), wire, method)
            # Stage 0: all-reduce of the whole fp32 accumulator; every rank holds the sum, so
            # rank r scores slice r.
            whole = values[rank].clone()
            comm.all_reduce_sum_(whole, wire, method)
            for op, got in (("reduce_scatter", result), ("all_reduce", whole[mine])):
                out.append(
                    {
                        "op": op,
                        "wire": wire_name,
                        "method": method,
                        "sq_err": float((got.double() - ref[mine]).square().sum()),
                        "sq_err_wire": float((got.double() - ref_wire[mine]).square().sum()),
                        "sq_ref": float(ref[mine].square().sum()),
                    }
                )
    return out


def reduction_real(numel: int) -> list[dict[str, Any]]:
    rows = []
    for world in REAL_WORLDS:
        per_rank = spawn(_reduction_rank, world, numel, timeout_s=600)
        for index, first in enumerate(per_rank[0]):
            parts = [r[index] for r in per_rank]
            err = (sum(p["sq_err"] for p in parts) / sum(p["sq_ref"] for p in parts)) ** 0.5
            err_w = (sum(p["sq_err_wire"] for p in parts) / sum(p["sq_ref"] for p in parts)) ** 0.5
            method = "ring" if first["method"] == "collective" else "fp32_sum"
            rows.append(
                {
                    "N": world,
                    "wire": first["wire"],
                    "method": method,
                    "source": f"gloo {first['op']}",
                    "rel err": err,
                    "reduction-only err": err_w,
                }
            )
    return rows


# --- report ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    numel = 1 << 16 if args.quick else 1 << 20
    sim_numel = 1 << 14 if args.quick else 1 << 16
    width = 32 if args.quick else 64
    max_micro = max(MICRO_COUNTS)
    env = environment()

    synthetic = accumulation_synthetic(numel, max_micro)
    real_opt = accumulation_optimizer(width, max_micro)
    acc_rows = [
        {
            "micro-batches": k,
            "accumulate_ fp32": synthetic["fp32"][k],
            "accumulate_ bf16": synthetic["bf16"][k],
            "optimizer fp32 accum": real_opt["fp32"][k],
            "optimizer bf16 accum": real_opt["bf16"][k],
            "bf16/fp32 (optimizer)": real_opt["bf16"][k] / real_opt["fp32"][k]
            if real_opt["fp32"][k] > 0
            else None,
        }
        for k in MICRO_COUNTS
    ]
    sim = reduction_simulated(sim_numel, SIM_WORLDS)
    real = reduction_real(numel)
    red_rows = sorted(sim + real, key=lambda r: (r["wire"], r["N"], r["source"], r["method"]))
    sig = "{:.3g}"
    acc_table = format_table(acc_rows, formats=dict.fromkeys(acc_rows[0], sig))
    red_table = format_table(
        red_rows,
        ["N", "wire", "method", "source", "rel err", "reduction-only err"],
        formats={"rel err": sig, "reduction-only err": sig},
    )
    print("1. accumulated gradient: relative L2 error against the float64 sum")
    print(acc_table)
    print("2. reduction over ranks: relative L2 error against the float64 sum of fp32 inputs")
    print(red_table)

    def err(n: int, wire: str, method: str, source: str = "simulated") -> float:
        return next(
            r["rel err"]
            for r in red_rows
            if r["N"] == n and r["wire"] == wire and r["method"] == method and r["source"] == source
        )

    summary = {
        "benchmark": "numerics",
        "accum_err_256_fp32": real_opt["fp32"][max_micro],
        "accum_err_256_bf16": real_opt["bf16"][max_micro],
        "accum_bf16_over_fp32_at_256": acc_rows[-1]["bf16/fp32 (optimizer)"],
        "synthetic_err_256": {k: v[max_micro] for k, v in synthetic.items()},
        "ring_bf16_err": {n: err(n, "bf16", "ring") for n in SIM_WORLDS},
        "fp32_sum_bf16_err": {n: err(n, "bf16", "fp32_sum") for n in SIM_WORLDS},
        "real_bf16_err_N4": {
            f"{op} {method}": err(4, "bf16", method, f"gloo {op}")
            for op in ("reduce_scatter", "all_reduce")
            for method in ("ring", "fp32_sum")
        },
    }
    if not args.no_write:
        plots = _plot(acc_rows, red_rows, args.out, env["date"])
        write_result(
            "numerics",
            out=args.out,
            env=env,
            config={
                "synthetic_numel": numel,
                "optimizer_model": f"MLP {width}-{4 * width}-{width}",
                "micro_counts": list(MICRO_COUNTS),
                "sim_numel": sim_numel,
                "sim_worlds": list(SIM_WORLDS),
                "real_worlds": list(REAL_WORLDS),
                "quick": args.quick,
            },
            sections=[
                ("Accumulation error against float64 (relative L2)", acc_table),
                ("Reduction error against float64 (relative L2)", red_table),
                ("Plots", "\n\n".join(f"![{p.stem}]({p.name})" for p in plots)),
            ],
            data={"accumulation": acc_rows, "reduction": red_rows, "summary": summary},
            notes=[
                "Accumulation: each gradient is bf16 (what autograd gives a bf16 model); "
                "an fp32 accumulator adds them exactly until the sum needs more than 24 bits, "
                "a bf16 one rounds to 8 bits at every add.",
                "Reduction 'rel err' includes rounding each fp32 input to the wire dtype; "
                "'reduction-only err' is against the float64 sum of the 16-bit inputs. "
                "fp32_sum results are left in fp32 (as the sharded optimizer's reduce-scatter "
                "writes them into the fp32 accumulator).",
                "gloo rows: Communicator.reduce_scatter_sum (stages 1-2) and "
                "Communicator.all_reduce_sum_ (stage 0) on real ranks; gloo's own 16-bit sum "
                "need not follow the simulated ring order. The stage-0 fp32_sum all-reduce "
                "all-gathers the fp32 sum in the wire dtype, so its result is rounded to 16 "
                "bits once more (and, in fp16, it is the undivided sum that must fit).",
            ],
        )
    finish(summary)
    return summary


def _plot(
    acc_rows: list[dict[str, Any]], red_rows: list[dict[str, Any]], out: Path, date: str
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ks = [r["micro-batches"] for r in acc_rows]
    for key, style in (
        ("accumulate_ fp32", "-o"),
        ("accumulate_ bf16", "-s"),
        ("optimizer fp32 accum", "--^"),
        ("optimizer bf16 accum", "--v"),
    ):
        ys = [max(r[key], 1e-12) for r in acc_rows]
        ax.plot(ks, ys, style, label=key)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("micro-batches accumulated")
    ax.set_ylabel("relative L2 error vs float64 (floor 1e-12)")
    ax.set_title("Gradient accumulation error")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, out, "numerics_accumulation", date))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for wire in WIRE:
        for method, style in (("ring", "-o"), ("fp32_sum", "-s")):
            pts = [
                r
                for r in red_rows
                if r["wire"] == wire and r["method"] == method and r["source"] == "simulated"
            ]
            ax.plot(
                [r["N"] for r in pts],
                [r["rel err"] for r in pts],
                style,
                label=f"{wire} {method} (simulated)",
            )
            first = wire == "bf16" and method == "ring"
            for op, marker in (("reduce_scatter", "x"), ("all_reduce", "+")):
                real = [
                    r
                    for r in red_rows
                    if r["wire"] == wire and r["method"] == method and r["source"] == f"gloo {op}"
                ]
                ax.scatter(
                    [r["N"] for r in real],
                    [r["rel err"] for r in real],
                    marker=marker,
                    s=70,
                    color="black",
                    zorder=3,
                    label=f"gloo ranks, {op}" if first else None,
                )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size N")
    ax.set_ylabel("relative L2 error of the sum vs float64")
    ax.set_title("16-bit gradient reduction error")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, out, "numerics_reduction", date))
    return paths


if __name__ == "__main__":
    main()
