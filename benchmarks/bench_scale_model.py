"""A model of the communication time per step at scale, from ``plan.traffic`` and link speeds.

    python -m benchmarks.bench_scale_model [--micro-batches K] [--no-write]

No GPU and no run: for a 7B and a 70B model (bf16 parameters and gradients on the wire, AdamW)
on 8 to 1024 GPUs, 8 per node, ``plan.traffic(num_params, world_size)`` gives the bytes each
rank sends per step within its shard group and across the groups, for ZeRO-1/2/3 in three
layouts: flat (every collective spans the group), hybrid (``shard_group_size`` 8: one shard
group per node, bf16 across) and hybrid with int8 blocks across the nodes (ZeRO-1/2; the table
says NotSupported at ZeRO-3). The time is bytes over bandwidth:

* within a node: NVLink, 900 GB/s per H200;
* across nodes: InfiniBand NDR, one 400 Gb/s NIC per GPU = 50 GB/s per GPU; and, as a slower
  cluster, 100 Gb/s Ethernet per GPU = 12.5 GB/s.

A flat collective over more than one node is counted at the cross-node bandwidth for all its
bytes: a ring runs at its slowest hop, and the ring crosses the nodes. This is the count of the
ZeRO++ paper (communication volume per rank, all of it cross-node for ZeRO-3 on low-bandwidth
clusters). NCCL's multi-ring and tree algorithms spread the cross-node part over a node's NICs,
so on nodes with one NIC per GPU the flat figures here are an upper bound (by up to the GPUs per
node); the hybrid figures need no such credit: their cross-node bytes are the all-reduce of
one shard per rank. Compute, latency (alpha), overlap with compute and congestion are left
out: the figures compare layouts, they do not predict a step time.

The ZeRO++ paper (Wang et al., arXiv 2306.10209) cuts ZeRO-3's cross-node volume from 3M to
0.75M per step (M the model's bytes: qwZ's int8 forward gather 0.5M, hpZ's node-local backward
gather 0, qgZ's int4 gradients 0.25M), "4x less communication", with up to 2.16x end-to-end
throughput at 384 GPUs. The model places it as ZeRO-3's flat time with a quarter of the
cross-node bytes (``zero++ (paper)``); the throughput figure includes compute, so it is set
beside the communication-time ratio at 384 GPUs, not on the time axis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dtypeplan
from benchmarks._common import (
    base_parser,
    environment,
    finish,
    format_table,
    save_figure,
    write_result,
)

GPUS_PER_NODE = 8
NVLINK = 900e9
"""Bytes per second per GPU within an H200 node (NVLink 4, both directions summed as NVIDIA
quotes it; the model uses it as the send rate)."""
LINKS = {"InfiniBand 400 Gb/s": 50e9, "Ethernet 100 Gb/s": 12.5e9}
"""Bytes per second per GPU across nodes (one NIC per GPU)."""
MODELS = {"7B": 7_000_000_000, "70B": 70_000_000_000}
WORLDS = (8, 16, 32, 64, 128, 256, 384, 512, 1024)
LAYOUTS = {"flat": (None, None), "hybrid": (GPUS_PER_NODE, None), "hybrid int8": (8, "int8")}
ZEROPP_CROSS_FRACTION = 0.75 / 3
"""ZeRO++'s cross-node volume over ZeRO-3's (0.75M of 3M)."""
ZEROPP_WORLD, ZEROPP_THROUGHPUT = 384, 2.16


def plan_for(stage: int, layout: str) -> dtypeplan.PrecisionPlan:
    size, wire = LAYOUTS[layout]
    config: dict[str, Any] = {
        "bf16": {"enabled": True},
        "communication_data_type": "bf16",
        "zero_optimization": {"stage": stage, "shard_group_size": size},
    }
    if wire is not None:
        config["communication_data_type_across_groups"] = wire
    return dtypeplan.resolve(config)


def step_time(
    plan: dtypeplan.PrecisionPlan, num_params: int, world: int, cross: float, micro_batches: int
) -> dict[str, float]:
    """Seconds of communication per step, within the node and across nodes."""
    size = plan.shard_group_size
    traffic = plan.traffic(num_params, world, micro_batches=micro_batches)
    if size is not None and world % size:
        raise AssertionError("a shard group per node divides every world here")
    one_node = world <= GPUS_PER_NODE
    if traffic.hybrid or one_node:
        within = traffic.within_bytes / NVLINK
        across = traffic.across_bytes / cross
    else:
        within, across = 0.0, traffic.total_bytes / cross
    return {
        "within_s": within,
        "across_s": across,
        "total_s": within + across,
        "within_bytes": traffic.within_bytes if (traffic.hybrid or one_node) else 0,
        "across_bytes": traffic.across_bytes
        if (traffic.hybrid or one_node)
        else traffic.total_bytes,
    }


def rows_for(micro_batches: int) -> tuple[list[dict[str, Any]], list[str]]:
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for (model, n), (link, cross), stage, layout in (
        (m, lk, s, la)
        for m in MODELS.items()
        for lk in LINKS.items()
        for s in (1, 2, 3)
        for la in LAYOUTS
    ):
        plan = plan_for(stage, layout)
        if plan.status != "OK":
            if link == next(iter(LINKS)) and model == next(iter(MODELS)):
                skipped.append(f"ZeRO-{stage} {layout}: {plan.status} ({plan.rule_id})")
            continue
        for world in WORLDS:
            times = step_time(plan, n, world, cross, micro_batches)
            memory = plan.memory(n, world)["total"]
            rows.append(
                {
                    "model": model,
                    "link": link,
                    "stage": stage,
                    "layout": layout,
                    "gpus": world,
                    **times,
                    "memory_gib": memory / 2**30,
                }
            )
        if stage == 3 and layout == "flat":
            for world in WORLDS:
                flat = next(
                    r
                    for r in rows
                    if (r["model"], r["link"], r["stage"], r["layout"], r["gpus"])
                    == (model, link, 3, "flat", world)
                )
                across = flat["across_s"] * (ZEROPP_CROSS_FRACTION if world > 8 else 1.0)
                rows.append(
                    {
                        "model": model,
                        "link": link,
                        "stage": 3,
                        "layout": "zero++ (paper)",
                        "gpus": world,
                        "within_s": flat["within_s"],
                        "across_s": across,
                        "total_s": flat["within_s"] + across,
                        "within_bytes": None,
                        "across_bytes": None,
                        "memory_gib": None,
                    }
                )
    return rows, skipped


def _plot(rows: list[dict[str, Any]], out: Path, date: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(len(LINKS), len(MODELS), figsize=(12, 9), sharex=True)
    styles = {
        (2, "flat"): ("tab:blue", "-", "o"),
        (2, "hybrid"): ("tab:blue", "--", "s"),
        (2, "hybrid int8"): ("tab:blue", ":", "^"),
        (3, "flat"): ("tab:red", "-", "o"),
        (3, "hybrid"): ("tab:red", "--", "s"),
        (3, "zero++ (paper)"): ("tab:green", "-.", "d"),
    }
    for i, link in enumerate(LINKS):
        for j, model in enumerate(MODELS):
            ax = axes[i][j]
            for (stage, layout), (color, line, marker) in styles.items():
                points = [
                    r
                    for r in rows
                    if (r["link"], r["model"], r["stage"], r["layout"])
                    == (link, model, stage, layout)
                ]
                ax.plot(
                    [r["gpus"] for r in points],
                    [r["total_s"] for r in points],
                    color=color,
                    linestyle=line,
                    marker=marker,
                    markersize=4,
                    label=f"ZeRO-{stage} {layout}",
                )
            ax.axvline(ZEROPP_WORLD, color="grey", linewidth=0.8)
            ax.text(
                ZEROPP_WORLD * 1.05,
                0.03,
                f"ZeRO++ paper: {ZEROPP_THROUGHPUT}x throughput at {ZEROPP_WORLD} GPUs",
                transform=ax.get_xaxis_transform(),
                fontsize=7,
                rotation=90,
                color="grey",
            )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{model}, {link} across nodes, NVLink 900 GB/s within", fontsize=9)
            ax.set_xlabel("GPUs (8 per node)")
            ax.set_ylabel("communication per step (s), 1 micro-batch")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    return save_figure(fig, out, "scale_model", date)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=1, help="per step (default 1)")
    args = parser.parse_args(argv)
    env = environment()
    rows, skipped = rows_for(args.micro_batches)
    shown = [r for r in rows if r["gpus"] in (8, 64, 384, 1024) and r["link"] == next(iter(LINKS))]
    table = format_table(
        shown,
        ["model", "stage", "layout", "gpus", "within_s", "across_s", "total_s", "memory_gib"],
        formats={
            "within_s": "{:.3f}",
            "across_s": "{:.3f}",
            "total_s": "{:.3f}",
            "memory_gib": "{:.1f}",
        },
    )
    print(
        f"InfiniBand 400 Gb/s per GPU across nodes, NVLink 900 GB/s within; "
        f"{args.micro_batches} micro-batch(es) per step"
    )
    print(table)

    def at(model: str, stage: int, layout: str, world: int, link: str) -> float:
        return next(
            r["total_s"]
            for r in rows
            if (r["model"], r["stage"], r["layout"], r["gpus"], r["link"])
            == (model, stage, layout, world, link)
        )

    ib = next(iter(LINKS))
    summary = {
        "benchmark": "scale_model",
        "micro_batches": args.micro_batches,
        "zero3_flat_over_hybrid_at_384": {
            m: round(at(m, 3, "flat", 384, ib) / at(m, 3, "hybrid", 384, ib), 2) for m in MODELS
        },
        "zero3_flat_over_zeropp_model_at_384": {
            m: round(at(m, 3, "flat", 384, ib) / at(m, 3, "zero++ (paper)", 384, ib), 2)
            for m in MODELS
        },
        "zero2_flat_over_hybrid_int8_at_384": {
            m: round(at(m, 2, "flat", 384, ib) / at(m, 2, "hybrid int8", 384, ib), 2)
            for m in MODELS
        },
    }
    if not args.no_write:
        plot = _plot(rows, args.out, env["date"])
        write_result(
            "scale_model",
            out=args.out,
            env=env,
            config={
                "models": MODELS,
                "gpus": list(WORLDS),
                "gpus_per_node": GPUS_PER_NODE,
                "nvlink_bytes_per_s": NVLINK,
                "cross_node_bytes_per_s": LINKS,
                "layouts": {
                    k: {"shard_group_size": v[0], "wire_across": v[1]} for k, v in LAYOUTS.items()
                },
                "config": "bf16 parameters, communication_data_type bf16, AdamW",
                "micro_batches": args.micro_batches,
            },
            sections=[
                ("Communication per step, InfiniBand across nodes (s)", table),
                *([("Plot", f"![scale_model]({plot.name})")] if plot else []),
            ],
            data={"rows": rows, "summary": summary, "skipped": skipped},
            notes=[
                "A model, not a measurement: bytes from plan.traffic() over the stated link "
                "bandwidths; no compute, latency, overlap or congestion.",
                "Flat collectives over several nodes are counted at the cross-node bandwidth for "
                "all their bytes (a ring's slowest hop), as the ZeRO++ paper counts volume; "
                "NCCL's multi-NIC rings and trees can do better by up to the GPUs per node.",
                "zero++ (paper): ZeRO-3 flat with 0.75/3 of its cross-node time (Wang et al., "
                "arXiv 2306.10209: 3M -> 0.75M cross-node, up to 2.16x throughput at 384 "
                "GPUs, end to end, so not on this time axis).",
                "memory_gib: plan.memory() per rank; the hybrid layouts replicate the states on "
                "every node (sharded over 8 ranks, not all).",
                *[f"not modelled: {s}" for s in skipped],
            ],
        )
    finish(summary)
    return summary


if __name__ == "__main__":
    main()
