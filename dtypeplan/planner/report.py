"""What ``dtypeplan plan`` shows: the ranked table, the closest misses, the config, the front."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from dtypeplan.planner import Planning
from dtypeplan.planner.costs import Candidate

__all__ = ["describe", "plot_front", "table", "write_config"]

_SHOWN = (
    ("stage", "ZeRO"),
    ("params", "params"),
    ("accum", "accum"),
    ("comm", "wire"),
    ("master", "masters"),
    ("states", "states"),
)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f}" if nbytes < 1e10 else f"{nbytes / 1e9:.1f}"


def setting(candidate: Candidate) -> str:
    """The combination in a few words: what differs from plain fp32 data parallelism."""
    v = candidate.values
    parts = []
    layout = v["shard_groups"]
    if layout != "flat":
        wire = layout.partition("_")[2]
        parts.append(f"hybrid {candidate.shard_group_size}" + (f" ({wire} across)" if wire else ""))
    if v["offload_optimizer"] != "none":
        parts.append("offload opt" + ("+params" if v["offload_param"] != "none" else ""))
    if v["autocast"] != "none":
        parts.append(f"autocast {v['autocast']}")
    if v["fp8"]:
        gather = ", fp8 gather" if v["fp8_all_gather"] == "fp8" else ""
        parts.append(f"fp8 {v['fp8_recipe']}{gather}")
    if v["hierarchical_partitioning"]:
        parts.append("hpZ")
    if not v["sharded"] and v["stage"] == 1:
        parts.append("whole accum")
    return ", ".join(parts) or "-"


def table(rows: Sequence[Candidate], start: int = 1) -> str:
    """A markdown table of ``rows``: the combination and its figures."""
    heads = [
        "#",
        *(title for _, title in _SHOWN),
        "also",
        "device GB",
        "host GB",
        "recompute",
        "intra GB",
        "inter GB",
        "step s",
        "comm s",
        "drift",
        "front",
    ]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for i, c in enumerate(rows, start):
        cells = [
            str(i),
            *(str(c.values[name]) for name, _ in _SHOWN),
            setting(c),
            _gb(c.device_bytes),
            _gb(c.host_bytes),
            c.recompute,
            _gb(c.intra_node_bytes),
            _gb(c.inter_node_bytes),
            f"{c.seconds:.2f}",
            f"{c.comm_seconds + c.host_link_seconds:.2f}",
            c.numerics.text(),
            "*" if c.pareto else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def describe(planning: Planning, top: int) -> str:
    """The whole answer: what was planned, the top rows (and the front), or the closest miss."""
    sizes, fleet, w = planning.sizes, planning.fleet, planning.workload
    lines = [
        f"model: {sizes.name}, {sizes.num_params:,} parameters ({sizes.source})",
        f"fleet: {fleet.describe()}",
        f"step: {w.micro_batch} x {w.seq} tokens per micro-batch, {w.micro_batches} "
        f"micro-batch(es), {planning.optimizer}, recompute {w.recompute}",
        f"table: {planning.ok_points:,} OK combinations, {planning.distinct:,} of distinct cost; "
        f"{len(planning.fitting):,} fit, {len(planning.rejected):,} do not",
        "",
    ]
    if not planning.fitting:
        lines.append("no combination fits. The closest:")
        lines.append(table(planning.rejected[:top]))
        for c in planning.rejected[:3]:
            lines.append(f"  - {setting(c)} (rule {c.rule_id}): {c.rejected}")
        lines.append(
            "more GPUs, more memory per GPU, a smaller micro-batch or sequence, or "
            "--recompute full would bring the figures down"
        )
        return "\n".join(lines)
    lines.append(
        f"ranked by {planning.objective} (front: on the Pareto front of memory, "
        "step time and drift):"
    )
    lines.append(table(planning.fitting[:top]))
    best = planning.fitting[0]
    lines += [
        "",
        f"chosen: #1, rule {best.rule_id} ({best.implementation}); model states "
        f"{_gb(best.memory['total'])} GB, activations {_gb(best.activations)} GB"
        + (f", gathered units {_gb(best.gathered)} GB" if best.gathered else "")
        + f" per GPU; drift {best.numerics.text()}"
        + (
            f" ({', '.join(f'{n} {f:.1e}' for n, f in best.numerics.parts)})"
            if best.numerics.parts
            else ""
        ),
    ]
    if best.numerics.unmeasured:
        lines.append(
            f"  * not measured by the drift benchmarks: {', '.join(best.numerics.unmeasured)} "
            "(a stand-in figure counted)"
        )
    return "\n".join(lines)


def write_config(planning: Planning, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Write the chosen combination's ds_config as JSON; returns it."""
    config = planning.config()
    with open(path, "w", encoding="utf-8") as file:
        json.dump(config, file, indent=2, sort_keys=True)
        file.write("\n")
    return config


def plot_front(planning: Planning, path: str | os.PathLike[str]) -> None:
    """Draw every fitting combination (device bytes against step time, coloured by drift)
    with the Pareto front marked, as a PNG. matplotlib comes with the ``bench`` extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib: pip install 'dtypeplan[bench]' (or pip install matplotlib)"
        ) from None
    rows = planning.fitting
    fig, ax = plt.subplots(figsize=(8, 5.5))
    drift = [max(c.numerics.total, 1e-7) for c in rows]
    import math

    colours = [math.log10(d) for d in drift]
    points = ax.scatter(
        [c.seconds for c in rows],
        [c.device_bytes / 1e9 for c in rows],
        c=colours,
        s=8,
        cmap="viridis",
        alpha=0.5,
        label="fits",
    )
    front = sorted(planning.front, key=lambda c: c.seconds)
    ax.scatter(
        [c.seconds for c in front],
        [c.device_bytes / 1e9 for c in front],
        facecolors="none",
        edgecolors="red",
        s=60,
        label="Pareto front (memory, time, drift)",
    )
    if rows:
        best = rows[0]
        ax.scatter(
            [best.seconds],
            [best.device_bytes / 1e9],
            marker="*",
            s=200,
            c="black",
            label=f"chosen ({planning.objective})",
        )
    fig.colorbar(points, ax=ax, label="log10 expected drift (relative loss deviation)")
    ax.set_xlabel("modelled step time (s): compute + communication")
    ax.set_ylabel("device GB per GPU")
    ax.set_title(
        f"{planning.sizes.name} on {planning.fleet.gpus} GPUs: {len(rows):,} combinations that fit"
    )
    ax.axhline(
        planning.fleet.usable_gpu_memory / 1e9,
        color="grey",
        linestyle="--",
        linewidth=0.8,
        label="usable GPU memory",
    )
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def as_json(planning: Planning, top: int) -> Mapping[str, Any]:
    """The top rows as data (``--json``)."""
    return {
        "fits": bool(planning.fitting),
        "rows": [
            {
                "values": dict(c.values),
                "shard_group_size": c.shard_group_size,
                "rule": c.rule_id,
                "device_bytes": c.device_bytes,
                "host_bytes": c.host_bytes,
                "memory": dict(c.memory),
                "activations": c.activations,
                "recompute": c.recompute,
                "intra_node_bytes": c.intra_node_bytes,
                "inter_node_bytes": c.inter_node_bytes,
                "step_seconds": c.seconds,
                "drift": c.numerics.total,
                "unmeasured": list(c.numerics.unmeasured),
                "pareto": c.pareto,
                "rejected": c.rejected,
            }
            for c in (planning.fitting or planning.rejected)[:top]
        ],
    }
