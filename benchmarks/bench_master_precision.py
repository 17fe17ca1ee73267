"""The stagnation probe: bf16 master weights rounded to nearest stall at small learning rates.

A tiny linear regression (``FEATURES`` inputs, one output) starts with weights near 1, where a
bf16 ulp is 2**-7, and must move each weight by ~0.05 to fit its target. AdamW's update is
about ``lr`` per step, so below ``lr`` ~ 2**-8 (half an ulp) every update rounded to nearest
is lost. The same run through dtypeplan's public API (``dtypeplan.resolve`` / ``plan.build``)
with each master-weight choice:

* ``fp32 torch``: plain ``torch.optim.AdamW`` on fp32 parameters (the reference);
* ``fp32 masters``: bf16 parameters, fp32 master weights (dtypeplan's default);
* ``bf16 nearest`` / ``bf16 stochastic`` / ``bf16 kahan``: ``master_weights: {dtype: bf16,
  rounding: ...}``, the bf16 parameters being the masters.

For every learning rate it reports the final loss and the *progress*, the share of the fp32
run's loss reduction that the variant achieved (1 = tracks fp32, 0 = never moved); a variant
*stalls* at an lr where its progress is below one half.
"""

from __future__ import annotations

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

FEATURES = 64
SAMPLES = 256
LEARNING_RATES = (1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5)
VARIANTS = ("fp32 torch", "fp32 masters", "bf16 nearest", "bf16 stochastic", "bf16 kahan")
STALLED = 0.5


def _problem(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets and the starting weights (bf16-representable, so every run starts
    from the same values)."""
    generator = torch.Generator().manual_seed(seed)
    start = (1.0 + 0.25 * torch.rand(1, FEATURES, generator=generator)).bfloat16().float()
    target = start + 0.05 * torch.randn(1, FEATURES, generator=generator)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return x, x @ target.T, start, target


def _config(variant: str, lr: float) -> dict[str, Any]:
    optimizer = {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}}
    if variant == "fp32 masters":
        return {"bf16": {"enabled": True}, "optimizer": optimizer}
    rounding = variant.split()[1]
    return {
        "bf16": {"enabled": True},
        "master_weights": {"dtype": "bf16", "rounding": rounding},
        "optimizer": optimizer,
    }


def train(variant: str, lr: float, steps: int, seed: int = 0) -> list[float]:
    """The loss before each step (and after the last), of one variant at one lr."""
    x, y, start, _target = _problem(seed)
    model = torch.nn.Linear(FEATURES, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(start)
    if variant == "fp32 torch":
        optimizer: Any = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        dtype = torch.float32
    else:
        plan = dtypeplan.resolve(_config(variant, lr))
        assert plan.status == "OK", plan.explain()
        model = plan.prepare_model(model)
        optimizer = plan.build(model.parameters())
        dtype = plan.param_dtype
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        losses.append(float(torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)))
    return losses


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 400)")
    args = parser.parse_args(argv)
    steps = args.steps or (100 if args.quick else 400)
    env = environment()
    curves: dict[float, dict[str, list[float]]] = {}
    rows = []
    for lr in LEARNING_RATES:
        curves[lr] = {variant: train(variant, lr, steps) for variant in VARIANTS}
        reference = curves[lr]["fp32 torch"]
        gained = reference[0] - reference[-1]
        row: dict[str, Any] = {"lr": lr}
        for variant in VARIANTS:
            final = curves[lr][variant][-1]
            row[f"{variant} loss"] = final
            row[f"{variant} progress"] = (reference[0] - final) / gained if gained > 0 else None
        rows.append(row)
    stall_lr = {
        variant: max(
            (r["lr"] for r in rows if (r[f"{variant} progress"] or 0.0) < STALLED), default=None
        )
        for variant in VARIANTS[1:]
    }
    columns = ["lr", *(f"{v} progress" for v in VARIANTS[1:])]
    progress_table = format_table(rows, columns, formats=dict.fromkeys(columns, "{:.3g}"))
    loss_columns = ["lr", *(f"{v} loss" for v in VARIANTS)]
    loss_table = format_table(rows, loss_columns, formats=dict.fromkeys(loss_columns, "{:.4g}"))
    print(f"progress after {steps} steps (share of the fp32 run's loss reduction)")
    print(progress_table)
    print("final loss")
    print(loss_table)
    summary = {
        "benchmark": "master_precision",
        "steps": steps,
        "stall_lr": stall_lr,
        "progress_at_smallest_lr": {v: rows[-1][f"{v} progress"] for v in VARIANTS[1:]},
    }
    if not args.no_write:
        plots = _plot(curves, rows, steps, args.out, env["date"])
        write_result(
            "master_precision",
            out=args.out,
            env=env,
            config={
                "features": FEATURES,
                "samples": SAMPLES,
                "steps": steps,
                "learning_rates": list(LEARNING_RATES),
                "optimizer": "AdamW, weight_decay 0",
                "quick": args.quick,
            },
            sections=[
                (f"Progress after {steps} steps (1 = as fp32, 0 = never moved)", progress_table),
                ("Final loss", loss_table),
                (
                    "Stalls (largest lr with progress below one half)",
                    "\n".join(
                        f"- {v}: {lr if lr is not None else 'never'}" for v, lr in stall_lr.items()
                    ),
                ),
                ("Plots", "\n\n".join(f"![{p.stem}]({p.name})" for p in plots)),
            ],
            data={
                "rows": rows,
                "summary": summary,
                "curves": {str(lr): c for lr, c in curves.items()},
            },
            notes=[
                "Weights start in [1, 1.25), where a bf16 ulp is 2**-7 and half an ulp "
                "3.9e-3; AdamW moves each weight by about lr per step, so round-to-nearest "
                "loses updates once lr falls below ~4e-3 and loses all of them well below it.",
                "Stochastic rounding is seeded (dtypeplan's generator, seed 0x5EED), so the "
                "run repeats exactly; Kahan holds a bf16 compensation buffer (2 B/param).",
                "Bytes per parameter with AdamW at ZeRO-0 (params + master + moments, the "
                "accumulator aside): fp32 masters 2 + 4 + 8 = 14, bf16 nearest and stochastic "
                "2 + 0 + 8 = 10, bf16 kahan 2 + 2 + 8 = 12; bf16_optimizer_states takes 4 off "
                "each.",
            ],
        )
    finish(summary)
    return summary


def _plot(
    curves: dict[float, dict[str, list[float]]],
    rows: list[dict[str, Any]],
    steps: int,
    out: Path,
    date: str,
) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return []
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    small = LEARNING_RATES[-2]
    for variant in VARIANTS:
        left.plot(
            curves[small][variant],
            label=variant,
            linestyle="--" if variant == "fp32 torch" else "-",
        )
    left.set_yscale("log")
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.set_title(f"loss at lr {small:g}")
    left.legend()
    for variant in VARIANTS[1:]:
        right.plot(
            [r["lr"] for r in rows],
            [r[f"{variant} progress"] for r in rows],
            marker="o",
            label=variant,
        )
    right.axhline(STALLED, color="grey", linewidth=0.8, linestyle=":")
    right.set_xscale("log")
    right.set_xlabel("learning rate")
    right.set_ylabel("progress (share of fp32's loss reduction)")
    right.set_title(f"progress after {steps} steps")
    right.legend()
    return [save_figure(fig, out, "master_precision", date)]


if __name__ == "__main__":
    main()
