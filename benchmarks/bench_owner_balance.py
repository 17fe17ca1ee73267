"""The owners' balance of the whole-tensor layout for real model shapes: a model, no run.

    python -m benchmarks.bench_owner_balance [--no-write]

Each parameter of a whole-tensor optimizer (Muon, Adafactor, DeepSpeed's Muon) is owned whole by
one rank, largest first to the least loaded rank (``optimizers/whole/owners.py``; the resolver's
copy, ``resolver/_owners.py``, is checked equal to it in tests/test_whole_cost.py). For GPT-2
124M / 355M and Llama-3 8B / 70B, their shapes counted from the configs (no download), and 2 to
1024 ranks: the balance (the largest rank's owned elements over the mean), the floor no
assignment can beat (the largest parameter over the mean, at least 1), and what the largest
rank holds by ``plan.memory()`` for DeepSpeed's Muon at ZeRO-1 (bf16 parameters, fp32 masters
and states) against AdamW at ZeRO-1 on the flat layout, in bytes per parameter of the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dtypeplan
from benchmarks._common import base_parser, environment, finish, format_table, write_result
from dtypeplan.planner import model_sizes
from dtypeplan.resolver._owners import owner_ranks

MODELS = Path(__file__).resolve().parents[1] / "tests" / "data" / "models"
GPT2_MEDIUM = {
    "model_type": "gpt2",
    "n_embd": 1024,
    "n_layer": 24,
    "n_head": 16,
    "vocab_size": 50257,
    "n_positions": 1024,
    "_name_or_path": "gpt2-medium",
}
RANKS = (2, 4, 8, 16, 64, 256, 1024)


def _plan(optimizer: str) -> dtypeplan.PrecisionPlan:
    return dtypeplan.resolve(
        {
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 1},
            "optimizer": {"type": optimizer, "params": {"lr": 1e-3}},
        }
    )


def rows() -> list[dict[str, Any]]:
    muon, adamw = _plan("Muon"), _plan("AdamW")
    table = []
    for source in (MODELS / "gpt2-124m", GPT2_MEDIUM, MODELS / "llama-3-8b", MODELS / "llama-70b"):
        sizes = model_sizes(source)
        n = sizes.num_params
        for ranks in RANKS:
            owners = owner_ranks(sizes.param_numels, ranks)
            owned = [0] * ranks
            for rank, numel in zip(owners, sizes.param_numels, strict=True):
                owned[rank] += numel
            mean = n / ranks
            muon_bytes = muon.memory(n, ranks, param_shapes=sizes.named_shapes)["total"]
            adamw_bytes = adamw.memory(n, ranks, param_numels=sizes.param_numels)["total"]
            table.append(
                {
                    "model": sizes.name,
                    "params": n,
                    "tensors": len(sizes.param_numels),
                    "ranks": ranks,
                    "balance": max(owned) / mean,
                    "floor": max(1.0, max(sizes.param_numels) / mean),
                    "Muon B/param": muon_bytes / n,
                    "AdamW B/param": adamw_bytes / n,
                }
            )
    return table


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    table = rows()
    body = format_table(
        table,
        formats={
            "balance": "{:.3f}",
            "floor": "{:.3f}",
            "Muon B/param": "{:.2f}",
            "AdamW B/param": "{:.2f}",
        },  # fmt: skip
    )
    worst = max((r for r in table if r["ranks"] == 64), key=lambda r: r["balance"])
    notes = [
        "Balance 1.0 is perfect; LPT stays within 4/3 of the best assignment, and no "
        "assignment goes below the floor (the largest tensor alone).",
        f"At 64 ranks the worst is {worst['model']}: {worst['balance']:.2f}x the mean, the "
        "embedding (and an untied lm_head) alone above a rank's share: the owners' layout "
        "keeps its masters and states whole on one rank.",
    ]
    if not args.no_write:
        write_result(
            "owner_balance",
            out=args.out,
            env=environment(),
            config={"ranks": RANKS},
            sections=[("Owners' balance and the largest rank's bytes", body)],
            data={"rows": table},
            notes=notes,
        )
    print(body)
    finish({"rows": len(table), "worst_at_64": worst["balance"]})


if __name__ == "__main__":
    main()
