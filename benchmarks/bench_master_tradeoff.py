"""The trade-off: final loss of a small GPT-2 against bytes per parameter, per master/state dtype.

    python -m benchmarks.bench_master_tradeoff [--quick] [--steps N]

A 2-layer GPT-2 from ``transformers`` (n_embd 64, 2 heads, 256-token vocabulary, 64
positions; random init, dropout off) learns a seeded synthetic language: each sequence repeats
a random pattern of 3-8 tokens, so after one period the next token is predictable and the loss
can fall well below ln(256). The same run (same init, same batches) with:

* ``fp32 torch``: plain ``torch.optim.AdamW`` on fp32 parameters (the reference);
* ``fp32 masters``: bf16 parameters, fp32 master weights (dtypeplan's default);
* ``bf16 nearest`` / ``bf16 stochastic`` / ``bf16 kahan``: ``master_weights: {dtype: bf16,
  rounding: ...}``, the bf16 parameters being the masters;
* each also with ``bf16`` optimizer states (Adam's moments stored in bf16), and fp32 masters
  and stochastically rounded bf16 masters also with ``int8`` and ``fp8`` states (torchao's
  blockwise codes, both moments) and ``fp8/bf16`` (exp_avg fp8, exp_avg_sq bf16), where the
  rules table says OK.

For two learning rates (3e-4, and 3e-5 where a bf16 ulp swallows round-to-nearest updates) it
reports the loss on a fixed held-out batch after the last step, its relative deviation from the
fp32 run, and bytes per parameter from ``plan.memory()`` (one rank, ZeRO-0; and 8 ranks at
ZeRO-2 with a sharded accumulator).
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
    pattern_tokens,
    save_figure,
    write_result,
)

VOCAB = 256
SEQ_LEN = 64
BATCH = 8
EVAL_BATCH = 32
LEARNING_RATES = (3e-4, 3e-5)
MASTERS = ("fp32 masters", "bf16 nearest", "bf16 stochastic", "bf16 kahan")
QUANTIZED_STATES = ("int8", "fp8", "fp8/bf16")  # optimizer_states values, beyond fp32 / bf16
VARIANTS = (
    "fp32 torch",
    *MASTERS,
    *(f"{m} + bf16 states" for m in MASTERS),
    *(f"{m} + {s} states" for m in ("fp32 masters", "bf16 stochastic") for s in QUANTIZED_STATES),
)
SHARDED_WORLD = 8


def _batch(generator: torch.Generator, size: int) -> torch.Tensor:
    return pattern_tokens(generator, size, VOCAB, SEQ_LEN)


def _model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ_LEN,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _config(variant: str, lr: float, stage: int = 0, sharded: bool = False) -> dict[str, Any]:
    master, _, states = variant.partition(" + ")
    exp_avg, _, exp_avg_sq = (states.removesuffix(" states") or "fp32").partition("/")
    config: dict[str, Any] = {
        "bf16": {"enabled": True},
        "optimizer_states": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq or exp_avg},
        "zero_optimization": {"stage": stage},
        "gradient_accumulation_dtype": {"dtype": "fp32", "sharded": sharded},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
    }
    if master != "fp32 masters":
        config["master_weights"] = {"dtype": "bf16", "rounding": master.split()[1]}
    return config


def bytes_per_param(variant: str, num_params: int) -> tuple[float, float]:
    """``plan.memory()`` per parameter: one rank at ZeRO-0, and ``SHARDED_WORLD`` ranks at
    ZeRO-2 with a sharded accumulator."""
    if variant == "fp32 torch":
        # fp32 parameters, an fp32 gradient and two fp32 moments.
        return 16.0, 16.0
    one = dtypeplan.resolve(_config(variant, 1e-3)).memory(num_params, 1)["total"]
    sharded_plan = dtypeplan.resolve(_config(variant, 1e-3, stage=2, sharded=True))
    sharded = sharded_plan.memory(num_params, SHARDED_WORLD)["total"]
    return one / num_params, sharded / num_params


def train(variant: str, lr: float, steps: int) -> tuple[list[float], float]:
    """Training losses of every step and the held-out loss after the last one."""
    model = _model()
    if variant == "fp32 torch":
        optimizer: Any = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    else:
        plan = dtypeplan.resolve(_config(variant, lr))
        model = plan.prepare_model(model)
        optimizer = plan.build(model.parameters())
    data = torch.Generator().manual_seed(1)
    held_out = _batch(torch.Generator().manual_seed(2), EVAL_BATCH)
    losses = []
    for _ in range(steps):
        tokens = _batch(data, BATCH)
        optimizer.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss.float()
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        final = float(model(input_ids=held_out, labels=held_out).loss.float())
    return losses, final


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 150)")
    args = parser.parse_args(argv)
    steps = args.steps or (30 if args.quick else 150)
    env = environment()
    num_params = sum(p.numel() for p in _model().parameters())
    available, skipped = [], []
    for variant in VARIANTS:
        plan = None if variant == "fp32 torch" else dtypeplan.resolve(_config(variant, 1e-3))
        if plan is None or plan.status == "OK":
            available.append(variant)
        else:
            skipped.append(f"{variant}: {plan.status} ({plan.reason.strip()})")
    rows: list[dict[str, Any]] = []
    curves: dict[str, dict[str, list[float]]] = {}
    for lr in LEARNING_RATES:
        results = {variant: train(variant, lr, steps) for variant in available}
        curves[str(lr)] = {v: r[0] for v, r in results.items()}
        reference = results["fp32 torch"][1]
        for variant in available:
            one, sharded = bytes_per_param(variant, num_params)
            final = results[variant][1]
            rows.append(
                {
                    "lr": lr,
                    "variant": variant,
                    "B/param (1 rank, ZeRO-0)": one,
                    f"B/param ({SHARDED_WORLD} ranks, ZeRO-2)": sharded,
                    "first loss": results[variant][0][0],
                    "final loss": final,
                    "deviation from fp32": (final - reference) / reference,
                }
            )
    columns = list(rows[0])
    table = format_table(
        rows,
        columns,
        formats={
            "lr": "{:g}",
            "first loss": "{:.4f}",
            "final loss": "{:.4f}",
            "deviation from fp32": "{:+.2%}",
        },
    )
    print(f"GPT-2 (2 layers, n_embd 64), {num_params} parameters, {steps} steps, AdamW")
    print(table)
    summary = {
        "benchmark": "master_tradeoff",
        "steps": steps,
        "num_params": num_params,
        "deviation": {
            f"{r['variant']} @ {r['lr']:g}": round(r["deviation from fp32"], 5) for r in rows
        },
    }
    if not args.no_write:
        plots = _plot(rows, args.out, env["date"])
        write_result(
            "master_tradeoff",
            out=args.out,
            env=env,
            config={
                "model": "GPT2LMHeadModel(n_layer=2, n_embd=64, n_head=2, vocab_size=256, "
                "n_positions=64, dropout 0), seed 0",
                "num_params": num_params,
                "data": f"repeated random patterns of 3-8 tokens, batch {BATCH} x {SEQ_LEN}, "
                f"seed 1; held-out batch {EVAL_BATCH}, seed 2",
                "steps": steps,
                "learning_rates": list(LEARNING_RATES),
                "optimizer": "AdamW, weight_decay 0",
                "quick": args.quick,
            },
            sections=[
                (f"Held-out loss after {steps} steps, and bytes per parameter", table),
                ("Plot", "\n\n".join(f"![{p.stem}]({p.name})" for p in plots)),
            ],
            data={"rows": rows, "summary": summary, "curves": curves, "skipped": skipped},
            notes=[
                "Deviation = (final loss - fp32 torch's final loss) / fp32 torch's final loss, "
                "on the same held-out batch; negative is better than fp32.",
                "Bytes per parameter from plan.memory(): params + accumulator + master + "
                "optimizer states (fp32 accumulator here). fp32 torch: 4 + 4 + 8 = 16. int8 "
                "and fp8 moments take 1 + 4/256 bytes a value (a code and a share of the "
                "block's fp32 scale), bf16 moments 2.",
                "Stochastic rounding is seeded, so every run repeats exactly.",
                *[f"not run: {s}" for s in skipped],
            ],
        )
    finish(summary)
    return summary


def _plot(rows: list[dict[str, Any]], out: Path, date: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return []
    fig, axes = plt.subplots(1, len(LEARNING_RATES), figsize=(6 * len(LEARNING_RATES), 4.8))
    for ax, lr in zip(axes, LEARNING_RATES, strict=True):
        for row in (r for r in rows if r["lr"] == lr):
            x = row["B/param (1 rank, ZeRO-0)"]
            y = 100 * row["deviation from fp32"]
            states = row["variant"].partition(" + ")[2].removesuffix(" states") or "fp32"
            marker = {"fp32": "o", "bf16": "s", "int8": "^", "fp8": "v"}.get(states, "D")
            ax.scatter(x, y, marker=marker, s=40)
            ax.annotate(
                row["variant"], (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points"
            )
        ax.axhline(0.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("bytes per parameter (plan.memory(), 1 rank, ZeRO-0)")
        ax.set_ylabel("final-loss deviation from fp32 (%)")
        ax.set_title(f"lr {lr:g} (states: o fp32, s bf16, ^ int8, v fp8, D fp8/bf16)", fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return [save_figure(fig, out, "master_tradeoff", date)]


if __name__ == "__main__":
    main()
