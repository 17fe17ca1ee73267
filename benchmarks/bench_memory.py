"""Bytes per parameter per rank, measured, for every valid precision mode at 1, 2 and 4 ranks.

    python -m benchmarks.bench_memory [--quick]

For each mode (model dtype fp32/fp16/bf16 x accumulation dtype fp32/bf16 x ZeRO stage 0/1/2 x
whole/sharded accumulator, where the rules table says OK) an MLP is trained for one step, then
one more micro-batch is run and the optimizer's memory is measured at that accumulation
boundary (after backward, before ``step()``, with the AdamW states already created).

Measured: the tensors ``opt.held_tensors()`` lists per component (the flat parameter buffer,
the accumulator and reduction buffers, the master chunks, the inner ``torch.optim`` states, any
``param.grad``), then every other tensor reachable from the optimizer object (as "other"),
counted once per distinct storage (aliases such as fp32 master chunks that are views of the
parameter buffer count once), by its untyped storage's size. So
the figure includes bucket padding. It is set next to ``plan.memory()`` and next to DeepSpeed's
published byte counts for its nearest optimizer.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import dtypeplan
from benchmarks._common import (
    base_parser,
    environment,
    finish,
    format_table,
    save_figure,
    write_result,
)
from dtypeplan.launch import spawn

WORLD_SIZES = (1, 2, 4)
MICRO_BATCHES = 2
OWNERS = ("dtypeplan", "torch.optim")
"""Objects of these packages are searched for tensors through their ``__dict__``."""
CATEGORIES = ("params", "grads", "accumulator", "master", "optimizer_states", "other")


MASTERS = ("fp32", "bf16-nearest", "bf16-stochastic", "bf16-kahan")
STATES = ("fp32", "bf16")


def all_modes() -> list[dict[str, Any]]:
    """The 24 dtype modes (fp32 masters and states), then bf16 parameters with a bf16
    accumulator at ZeRO-1 (whole) and ZeRO-2 (sharded), DeepSpeed's layouts, for every other
    master x optimizer-state choice."""
    modes = []
    for model in ("fp32", "fp16", "bf16"):
        for accum in ("fp32", "bf16"):
            for stage, sharded in ((0, False), (1, False), (1, True), (2, True)):
                modes.append({"model": model, "accum": accum, "stage": stage, "sharded": sharded})
    for stage, sharded in ((1, False), (2, True)):
        for master in MASTERS:
            for states in STATES:
                if (master, states) == ("fp32", "fp32"):
                    continue  # bf16/bf16 z1 whole and z2 shard above
                modes.append(
                    {
                        "model": "bf16",
                        "accum": "bf16",
                        "stage": stage,
                        "sharded": sharded,
                        "master": master,
                        "states": states,
                    }
                )
    return modes


def mode_label(mode: dict[str, Any]) -> str:
    accumulator = "shard" if mode["sharded"] else "whole"
    label = f"{mode['model']}/{mode['accum']} z{mode['stage']} {accumulator}"
    master, states = mode.get("master", "fp32"), mode.get("states", "fp32")
    if (master, states) != ("fp32", "fp32"):
        label += f" m={master} s={states}"
    return label


def mode_config(mode: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bf16": {"enabled": mode["model"] == "bf16"},
        "fp16": {"enabled": mode["model"] == "fp16"},
        "gradient_accumulation_dtype": {"dtype": mode["accum"], "sharded": mode["sharded"]},
        "zero_optimization": {"stage": mode["stage"]},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    }
    if mode.get("states", "fp32") == "bf16":
        config["bf16"]["bf16_optimizer_states"] = True
    master = mode.get("master", "fp32")
    if master != "fp32":
        dtype, rounding = master.split("-")
        config["master_weights"] = {"dtype": dtype, "rounding": rounding}
    return config


def deepspeed_formula(mode: dict[str, Any], world: int) -> tuple[str, float] | None:
    """DeepSpeed's byte count per parameter for the bf16 optimizer it would use for ``mode``.

    ZeRO-1 (bf16 params and grads, 12 B of fp32 master + Adam states sharded): 4 + 12/N.
    BF16_Optimizer (bf16 params and grads plus a whole fp32 gradient accumulator): 8 + 12/N.
    ZeRO-2 (bf16 params; fp32 gradient partition, master and states sharded): 2 + 16/N.
    ZeRO paper's P_os+g (16-bit params; 16-bit grads, master and states sharded): 2 + 14/N.

    bf16 masters (``bf16.bf16_master_weights_and_grads``, read from DeepSpeed 0.19.8's
    ``runtime/zero/stage_1_and_2.py`` and ``runtime/base_optimizer.py``): the master partition
    is a bf16 *clone* of this rank's share of the bf16 parameters (``.clone().to(
    master_weights_and_grads_dtype)``, 2/N, next to the 2 B parameters), its gradient
    partition is bf16 too, and the inner ``torch.optim`` Adam creates its moments like the
    master, in bf16 (4/N). Without ``bf16_optimizer_states`` DeepSpeed asserts
    ``offload_optimizer: cpu`` with DeepSpeedCPUAdam (moments fp32, 8/N, master 2/N and bf16
    gradient partition 2/N in host memory), counted here device + host. Same gradient
    conventions as above (ZeRO-1: the whole bf16 gradient, 2 B; ZeRO-2: the partition):
    ZeRO-1 bf16 master + states 4 + 6/N, ZeRO-2 2 + 8/N; with CPU offload and fp32 states
    ZeRO-1 4 + 12/N, ZeRO-2 2 + 12/N. DeepSpeed rounds to nearest only; its formula is set
    next to the stochastic and Kahan rows as the nearest DeepSpeed option. fp32 masters with
    bf16 states do not exist in DeepSpeed (``bf16_optimizer_states requires
    bf16_master_weights_and_grads``).
    """
    if mode["model"] != "bf16":
        return None
    master, states = mode.get("master", "fp32"), mode.get("states", "fp32")
    if master != "fp32":
        if mode["accum"] != "bf16":
            return None
        note = "" if master == "bf16-nearest" else " (nearest)"
        if states == "bf16":
            if mode["stage"] == 1 and not mode["sharded"]:
                return f"ZeRO-1 bf16 master+states 4+6/N{note}", 4 + 6 / world
            if mode["stage"] == 2:
                return f"ZeRO-2 bf16 master+states 2+8/N{note}", 2 + 8 / world
            return None
        if mode["stage"] == 1 and not mode["sharded"]:
            return f"ZeRO-1 bf16 master, CPU offload 4+12/N{note}", 4 + 12 / world
        if mode["stage"] == 2:
            return f"ZeRO-2 bf16 master, CPU offload 2+12/N{note}", 2 + 12 / world
        return None
    if states != "fp32":
        return None
    key = (mode["accum"], mode["stage"], mode["sharded"])
    if key == ("bf16", 1, False):
        return "ZeRO-1 4+12/N", 4 + 12 / world
    if key == ("fp32", 1, False):
        return "BF16_Optimizer 8+12/N", 8 + 12 / world
    if key == ("fp32", 2, True):
        return "ZeRO-2 2+16/N", 2 + 16 / world
    if key == ("bf16", 2, True):
        return "ZeRO paper 2+14/N", 2 + 14 / world
    return None


def make_model(widths: list[int], seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


def _reachable_tensors(root: object) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor reachable from ``root`` through containers and the
    ``__dict__`` of dtypeplan and torch.optim objects."""
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [("opt", root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if is_traceable_wrapper_subclass(obj):
            # A quantized optimizer state (torchao): its bytes are the tensors inside it.
            names, _ = obj.__tensor_flatten__()
            stack += [(f"{path}.{name}", getattr(obj, name)) for name in names]
            continue
        if isinstance(obj, torch.Tensor):
            yield path, obj
            if obj.grad is not None:
                stack.append((path + ".grad", obj.grad))
            continue
        if isinstance(obj, dict):
            stack += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
            stack += [(f"{path}.key", k) for k in obj if isinstance(k, torch.Tensor)]
        elif isinstance(obj, (list, tuple)):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(OWNERS):
            stack += [(f"{path}.{k}", v) for k, v in vars(obj).items()]


def measure(opt: Any, model: torch.nn.Module) -> dict[str, int]:
    """Bytes per category of every distinct storage the optimizer (and the model) holds."""
    by_storage: dict[int, tuple[str, int]] = {}

    def claim(tensor: torch.Tensor, category: str) -> None:
        storage = tensor.untyped_storage()
        by_storage.setdefault(storage.data_ptr(), (category, storage.nbytes()))

    # The optimizer's own account first, in plan.memory()'s order, so an alias counts where it
    # lives (fp32 masters are views of the parameters' buffer); the model's parameters are
    # views of those buffers. Whatever else is reachable is "other".
    for component, tensors in opt.held_tensors().items():
        for tensor in tensors:
            claim(tensor, component)
    for param in model.parameters():
        claim(param.detach(), "params")
    for _path, tensor in _reachable_tensors(opt):
        claim(tensor, "other")
    totals = dict.fromkeys(CATEGORIES, 0)
    for category, nbytes in by_storage.values():
        totals[category] += nbytes
    totals["total"] = sum(totals[c] for c in CATEGORIES)
    return totals


def run_mode(mode: dict[str, Any], widths: list[int], world: int, rank: int) -> dict[str, Any]:
    plan = dtypeplan.resolve(mode_config(mode))
    if plan.status != "OK":
        return {"status": str(plan.status), "reason": plan.reason}
    base = make_model(widths)
    model = copy.deepcopy(base)
    num_params = sum(p.numel() for p in model.parameters())
    opt = plan.build(model.parameters())
    dtype = plan.param_dtype
    generator = torch.Generator().manual_seed(rank)

    def micro_step() -> None:
        x = torch.randn(8, widths[0], generator=generator).to(dtype)
        loss = model(x).float().pow(2).mean() / MICRO_BATCHES
        opt.backward(loss)

    for _ in range(MICRO_BATCHES):
        micro_step()
    opt.step()
    opt.zero_grad()
    for _ in range(MICRO_BATCHES):
        micro_step()
    measured = measure(opt, model)
    predicted = plan.memory(num_params, world)
    padded = sum(buffer.numel() for buffer in opt.held_tensors().params)
    return {
        "status": "OK",
        "num_params": num_params,
        "padded_numel": padded,
        "measured": measured,
        "predicted": predicted,
        "implementation": plan.implementation,
    }


def _rank_worker(
    rank: int, world: int, modes: list[dict[str, Any]], widths: list[int]
) -> list[Any]:
    return [run_mode(mode, widths, world, rank) for mode in modes]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--worlds",
        default=",".join(map(str, WORLD_SIZES)),
        help="comma-separated world sizes (default %(default)s; 8 ranks take ~2 min on 2 cores)",
    )
    args = parser.parse_args(argv)
    worlds = tuple(int(w) for w in args.worlds.split(","))
    widths = [128, 256, 256, 128] if args.quick else [512, 1024, 1024, 512]
    modes = all_modes()
    env = environment()
    per_world: dict[int, list[Any]] = {}
    for world in worlds:
        if world == 1:
            per_world[world] = _rank_worker(0, 1, modes, widths)
        else:
            results = spawn(_rank_worker, world, modes, widths, timeout_s=900)
            # Ranks differ only by the padding they do not hold; report the largest rank.
            per_world[world] = [
                max(by_rank, key=lambda r: r.get("measured", {}).get("total", 0))
                for by_rank in zip(*results, strict=True)
            ]

    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    num_params = 0
    for index, mode in enumerate(modes):
        for world in worlds:
            result = per_world[world][index]
            if result["status"] != "OK":
                if world == worlds[0]:
                    reason = result["reason"].strip()
                    skipped.append(f"{mode_label(mode)}: {result['status']} ({reason})")
                continue
            num_params = result["num_params"]
            n = num_params
            measured, predicted = result["measured"], result["predicted"]
            ds = deepspeed_formula(mode, world)
            rows.append(
                {
                    "mode": mode_label(mode),
                    "N": world,
                    "measured B/param": measured["total"] / n,
                    "plan.memory B/param": predicted["total"] / n,
                    "measured/plan": measured["total"] / predicted["total"],
                    "params": measured["params"] / n,
                    "grads": measured["grads"] / n,
                    "accum": measured["accumulator"] / n,
                    "master": measured["master"] / n,
                    "states": measured["optimizer_states"] / n,
                    "other": measured["other"] / n,
                    "DeepSpeed": ds[0] if ds else None,
                    "DeepSpeed B/param": ds[1] if ds else None,
                    "_mode": mode,
                    "_measured": measured,
                    "_predicted": predicted,
                    "_padded_numel": result["padded_numel"],
                }
            )
    columns = [c for c in rows[0] if not c.startswith("_")]
    table = format_table(rows, columns)
    print(f"model: MLP {widths}, {num_params} parameters, AdamW; bytes per parameter per rank")
    print(table)

    worst = max(abs(r["measured/plan"] - 1.0) for r in rows)
    ds_rows = [r for r in rows if r["DeepSpeed B/param"] is not None]
    savings = {
        f"{r['mode']} N={r['N']}": round(r["DeepSpeed B/param"] - r["measured B/param"], 3)
        for r in ds_rows
    }
    summary = {
        "benchmark": "memory",
        "num_params": num_params,
        "modes": len(modes) - len(skipped),
        "max_abs_measured_over_plan_minus_1": round(worst, 5),
        "bf16_fp32accum_z1_whole_N4_B_per_param": next(
            (
                r["measured B/param"]
                for r in rows
                if r["mode"] == "bf16/fp32 z1 whole" and r["N"] == 4
            ),
            None,
        ),
        "deepspeed_minus_measured_B_per_param": savings,
    }
    if not args.no_write:
        stem_path = args.out
        plot = _plot(rows, worlds, stem_path, env["date"])
        notes = [
            "Measured = distinct storages reachable from the optimizer at the accumulation "
            "boundary of the 2nd step (Adam states exist), so bucket padding is included; "
            "plan.memory() leaves padding out.",
            "Rows report the rank with the most bytes (ranks differ only by padding).",
            "DeepSpeed figures are its published formulas, not measurements: ZeRO-1 4+12/N "
            "(bf16 params and grads), BF16_Optimizer 8+12/N (bf16 params and grads + whole "
            "fp32 accumulator), ZeRO-2 2+16/N (fp32 gradient partition); the ZeRO paper's "
            "P_os+g 2+14/N is set next to bf16 accumulation at stage 2.",
            "bf16 masters (m=...) and bf16 optimizer states (s=bf16) against DeepSpeed 0.19.8's "
            "bf16_master_weights_and_grads (+ bf16_optimizer_states), derived from "
            "deepspeed/runtime/zero/stage_1_and_2.py (the master partition is a bf16 clone of "
            "the parameters' partition, 2/N; its gradient partition bf16; torch Adam moments "
            "in the master's dtype, 4/N) and runtime/base_optimizer.py (bf16 masters with fp32 "
            "states assert offload_optimizer cpu + DeepSpeedCPUAdam: fp32 moments 8/N in host "
            "memory, counted device + host): ZeRO-1 4+6/N, ZeRO-2 2+8/N; with offload ZeRO-1 "
            "4+12/N, ZeRO-2 2+12/N. DeepSpeed only rounds to nearest: '(nearest)' marks its "
            "formula set next to stochastic and Kahan rows. DeepSpeed has no fp32 masters with "
            "bf16 states.",
            *[f"not measured: {s}" for s in skipped],
        ]
        write_result(
            "memory",
            out=args.out,
            env=env,
            config={
                "model": f"MLP {widths}",
                "num_params": num_params,
                "optimizer": "AdamW",
                "micro_batches": MICRO_BATCHES,
                "world_sizes": list(worlds),
                "quick": args.quick,
            },
            sections=[
                ("Bytes per parameter per rank", table),
                ("Plot", f"![bytes per param]({plot.name})"),
            ],
            data={"rows": [_jsonable_row(r) for r in rows], "skipped": skipped, "summary": summary},
            notes=notes,
        )
    finish(summary)
    return summary


def _jsonable_row(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if not k.startswith("_")}
    out.update(
        mode=row["_mode"],
        measured_bytes=row["_measured"],
        predicted_bytes=row["_predicted"],
        padded_numel=row["_padded_numel"],
        label=row["mode"],
    )
    return out


def _plot(rows: list[dict[str, Any]], worlds: tuple[int, ...], out: Path, date: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(10, 0.6 * len(labels)), 5.5))
    width = 0.8 / len(worlds)
    for k, world in enumerate(worlds):
        xs, measured, predicted, ds_x, ds_y = [], [], [], [], []
        for i, label in enumerate(labels):
            row = next((r for r in rows if r["mode"] == label and r["N"] == world), None)
            if row is None:
                continue
            x = i + (k - (len(worlds) - 1) / 2) * width
            xs.append(x)
            measured.append(row["measured B/param"])
            predicted.append(row["plan.memory B/param"])
            if row["DeepSpeed B/param"] is not None:
                ds_x.append(x)
                ds_y.append(row["DeepSpeed B/param"])
        ax.bar(xs, measured, width, label=f"measured N={world}")
        ax.scatter(
            xs,
            predicted,
            marker="_",
            s=120,
            color="black",
            label="plan.memory()" if k == 0 else None,
            zorder=3,
        )
        ax.scatter(
            ds_x,
            ds_y,
            marker="x",
            color="red",
            label="DeepSpeed formula" if k == 0 else None,
            zorder=3,
        )
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("bytes per parameter per rank")
    ax.set_title(
        "Optimizer memory at the accumulation boundary (model/accum dtype, ZeRO stage, accumulator)"
    )
    ax.set_ylim(
        0,
        1.2
        * max(
            max(r["measured B/param"] for r in rows), max(r["DeepSpeed B/param"] or 0 for r in rows)
        ),
    )
    ax.legend(fontsize=8, ncol=5, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, out, "memory", date)


if __name__ == "__main__":
    main()
