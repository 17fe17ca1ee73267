"""fp8 compute's fidelity: a small Llama trained with each fp8 recipe against bf16 compute.

    python -m benchmarks.bench_fp8_fidelity [--quick] [--steps N]

A 2-layer Llama from ``transformers`` (hidden 64, MLP 128, 4 heads, 256-token vocabulary, 64
positions; random init) learns a seeded synthetic language: each sequence repeats a random
pattern of 3-8 tokens (as ``bench_master_tradeoff``). The same run (same init, same batches,
bf16 parameters, fp32 masters, AdamW) with ``fp8`` off (bf16 compute, the reference) and with
``"fp8": {"enabled": true, "recipe": R}`` for every recipe: the seven projections of each
layer compute in fp8, the output layer (``lm_head``) in bf16 (the block's default). On a CPU
every recipe runs emulated (fp8 rounding of every operand, the matmul in high precision), as
``explain()`` says: the rounding, hence the fidelity, is a GPU's; the speed is not measured.

Why Llama and not GPT-2: GPT-2's projections are ``transformers``' ``Conv1D``, not
``nn.Linear``, which neither torchao nor dtypeplan converts (a GPT-2 would compute in bf16
whatever the block says; ``prepare_model`` warns).

Reported per recipe: the loss curve's deviation from bf16 compute (max and mean over steps of
``|loss - bf16 loss| / bf16 loss``), the held-out loss after the last step and its deviation,
and ``plan.traffic()``'s weight all-gather bytes per step at ZeRO-3 on 8 ranks with
``fp8.all_gather`` ``fp8`` (tensorwise only) against bf16's (checked against the bytes FSDP2
sends by tests/test_fp8.py).
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
from dtypeplan.optimizers.contract import fp8_weight_numels

VOCAB = 256
SEQ_LEN = 64
BATCH = 8  # 512 tokens a step: a multiple of MXFP8's block of 32
EVAL_BATCH = 32
LR = 1e-3
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
VARIANTS = ("bf16 compute", *RECIPES)
GATHER_WORLD = 8


def _batch(generator: torch.Generator, size: int) -> torch.Tensor:
    return pattern_tokens(generator, size, VOCAB, SEQ_LEN)


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _config(variant: str, stage: int = 0, **fp8: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
    }
    if variant != "bf16 compute":
        config["fp8"] = {"enabled": True, "recipe": variant, **fp8}
    return config


def train(variant: str, steps: int) -> dict[str, Any]:
    """Training losses of every step, the held-out loss after the last, what explain() says."""
    plan = dtypeplan.resolve(_config(variant))
    model = plan.prepare_model(_model())
    optimizer = plan.build(model.parameters())
    data = torch.Generator().manual_seed(1)
    held_out = _batch(torch.Generator().manual_seed(2), EVAL_BATCH)
    losses = []
    for _ in range(steps):
        tokens = _batch(data, BATCH)
        loss = model(input_ids=tokens, labels=tokens).loss.float()
        losses.append(float(loss.detach()))
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        final = float(model(input_ids=held_out, labels=held_out).loss.float())
    converted = sum(type(m).__name__ in ("Float8Linear", "MXFP8Linear") for m in model.modules())
    return {
        "losses": losses,
        "held_out": final,
        "converted_layers": converted,
        "execution": plan.fp8_execution if plan.fp8 else "bf16",
    }


def all_gather_bytes() -> dict[str, int]:
    """Weight all-gather bytes each rank sends per step at ZeRO-3 on ``GATHER_WORLD`` ranks
    (``plan.traffic()``, forward and backward), bf16 against fp8 (tensorwise)."""
    model = _model()
    num_params = sum(p.numel() for p in model.parameters())
    fp8 = dtypeplan.resolve(_config("tensorwise", stage=3, all_gather="fp8"))
    bf16 = dtypeplan.resolve(_config("tensorwise", stage=3))
    weights = fp8_weight_numels(model, fp8)
    fp8_traffic = fp8.traffic(num_params, GATHER_WORLD, fp8_weights=weights).within
    return {
        "num_params": num_params,
        "fp8_weight_numel": sum(weights),
        "bf16 all_gather": bf16.traffic(num_params, GATHER_WORLD).within["all_gather"],
        "fp8 all_gather": fp8_traffic["all_gather"],
        "fp8 scales all_reduce": fp8_traffic.get("all_reduce", 0),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 200)")
    args = parser.parse_args(argv)
    steps = args.steps or (20 if args.quick else 200)
    env = environment()
    num_params = sum(p.numel() for p in _model().parameters())
    results = {variant: train(variant, steps) for variant in VARIANTS}
    reference = results["bf16 compute"]
    rows: list[dict[str, Any]] = []
    for variant in VARIANTS:
        result = results[variant]
        curve = [abs(a - b) / b for a, b in zip(result["losses"], reference["losses"], strict=True)]
        rows.append(
            {
                "compute": variant,
                "fp8 layers": result["converted_layers"],
                "execution": result["execution"],
                "max curve deviation": max(curve),
                "mean curve deviation": sum(curve) / len(curve),
                "held-out loss": result["held_out"],
                "held-out deviation": (result["held_out"] - reference["held_out"])
                / reference["held_out"],
            }
        )
    gather = all_gather_bytes()
    table = format_table(
        rows,
        list(rows[0]),
        formats={
            "max curve deviation": "{:.2%}",
            "mean curve deviation": "{:.2%}",
            "held-out loss": "{:.4f}",
            "held-out deviation": "{:+.2%}",
        },
    )
    gather_rows = [
        {"all-gather": "bf16 weights", "bytes per rank per step": gather["bf16 all_gather"]},
        {
            "all-gather": "fp8 weights (tensorwise)",
            "bytes per rank per step": gather["fp8 all_gather"] + gather["fp8 scales all_reduce"],
        },
    ]
    gather_table = format_table(gather_rows, list(gather_rows[0]))
    print(f"Llama (2 layers, hidden 64), {num_params} parameters, {steps} steps, AdamW lr {LR:g}")
    print(table)
    print(gather_table)
    summary = {
        "benchmark": "fp8_fidelity",
        "steps": steps,
        "num_params": num_params,
        "max_curve_deviation": {r["compute"]: round(r["max curve deviation"], 5) for r in rows},
        "held_out_deviation": {r["compute"]: round(r["held-out deviation"], 5) for r in rows},
        "fp8_over_bf16_all_gather": round(gather["fp8 all_gather"] / gather["bf16 all_gather"], 4),
    }
    if not args.no_write:
        plots = _plot(results, args.out, env["date"])
        write_result(
            "fp8_fidelity",
            out=args.out,
            env=env,
            config={
                "model": "LlamaForCausalLM(2 layers, hidden 64, intermediate 128, 4 heads, "
                "vocab 256, 64 positions, untied), seed 0",
                "num_params": num_params,
                "data": f"repeated random patterns of 3-8 tokens, batch {BATCH} x {SEQ_LEN}, "
                f"seed 1; held-out batch {EVAL_BATCH}, seed 2",
                "steps": steps,
                "optimizer": f"AdamW lr {LR:g}, weight_decay 0; bf16 parameters, fp32 masters",
                "quick": args.quick,
            },
            sections=[
                (f"Deviation from bf16 compute over {steps} steps", table),
                (
                    f"Weight all-gather at ZeRO-3 on {GATHER_WORLD} ranks (plan.traffic)",
                    gather_table,
                ),
                ("Plot", "\n\n".join(f"![{p.stem}]({p.name})" for p in plots)),
            ],
            data={"rows": rows, "summary": summary, "results": results, "all_gather": gather},
            notes=[
                "Curve deviation = |loss - bf16 compute's loss| / bf16 compute's loss at each "
                "step (same batches); held-out deviation = (held-out loss - bf16 compute's) / "
                "bf16 compute's, on one fixed batch after the last step.",
                "Every fp8 run is emulated on a CPU (fp8 rounding of each operand, the matmul "
                "in high precision): the numbers a GPU's fp8 kernels give up to their "
                "accumulation order; no speed is measured here (benchmarks/gpu/).",
                "fp8 all-gather bytes include the step's all-reduce of one fp32 maximum per "
                "gathered weight (the scales); the biases, norms, embeddings and lm_head are "
                "gathered in bf16 either way.",
            ],
        )
    finish(summary)
    return summary


def _plot(results: dict[str, dict[str, Any]], out: Path, date: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return []
    fig, (curves, deviation) = plt.subplots(1, 2, figsize=(12, 4.5))
    reference = results["bf16 compute"]["losses"]
    for variant, result in results.items():
        curves.plot(result["losses"], label=variant, linewidth=1)
        if variant != "bf16 compute":
            deviation.plot(
                [100 * (a - b) / b for a, b in zip(result["losses"], reference, strict=True)],
                label=variant,
                linewidth=1,
            )
    curves.set_xlabel("step")
    curves.set_ylabel("training loss")
    curves.set_title("2-layer Llama, loss per step", fontsize=9)
    curves.legend(fontsize=8)
    deviation.axhline(0.0, color="grey", linewidth=0.8, linestyle=":")
    deviation.set_xlabel("step")
    deviation.set_ylabel("loss deviation from bf16 compute (%)")
    deviation.set_title("fp8 recipes (emulated) against bf16 compute", fontsize=9)
    deviation.legend(fontsize=8)
    for ax in (curves, deviation):
        ax.grid(alpha=0.3)
    return [save_figure(fig, out, "fp8_fidelity", date)]


if __name__ == "__main__":
    main()
