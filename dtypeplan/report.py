"""Plain-text reports shared by ``dtypeplan check`` and ``dtypeplan demo``: bytes and memory."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from dtypeplan.resolver._memory import HOST_MEMORY_KEYS, MEMORY_KEYS

if TYPE_CHECKING:
    from dtypeplan.resolver import PrecisionPlan

__all__ = ["format_bytes", "memory_layout", "memory_report"]


def memory_layout(plan: PrecisionPlan, world_size: int) -> dict[str, str]:
    """How each ``plan.memory()`` component is held: ``"whole"`` on every rank, or sharded
    over the ranks of a shard group (``"1/8"``), for the report's ``held`` column."""
    width = plan.shard_group_size if plan.shard_group_size and world_size > 1 else world_size
    stage = plan.zero_stage if world_size > 1 or plan.zero_stage < 3 else 2
    sharded = f"1/{width}" if width > 1 else "whole"
    states = sharded if stage >= 1 else "whole"
    return {
        "params": sharded if stage >= 3 else "whole",
        "grads": "-",
        "accumulator": sharded if plan.accumulator_sharded else "whole",
        "master": states,
        "optimizer_states": states,
        "host_params": sharded if stage >= 3 else "whole",
        "host_accumulator": sharded if plan.accumulator_sharded else "whole",
        "host_master": states,
        "host_optimizer_states": states,
    }


def format_bytes(count: int | float) -> str:
    """``1536`` -> ``"1.50 KiB"``; binary units up to TiB."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def memory_report(
    predicted: dict[str, int],
    num_params: int,
    world_size: int,
    measured: Sequence[dict[str, int] | None] = (),
    layout: Mapping[str, str] | None = None,
) -> str:
    """The per-rank byte table; ``measured`` adds one column per rank next to the prediction,
    ``layout`` (:func:`memory_layout`) a column saying which components are sharded.

    The ``host_*`` rows are an offloaded optimizer's host memory, shown where any is
    predicted or measured; the other rows are device bytes.
    """
    header = ["component"] + (["held"] if layout is not None else [])
    header += ["predicted bytes", "human", "bytes/param"]
    header += [f"rank {r} measured" for r in range(len(measured))]
    rows = [header]
    host_used = any(predicted[k] for k in HOST_MEMORY_KEYS) or any(
        m.get(k) for m in measured if m is not None for k in HOST_MEMORY_KEYS
    )
    for key in (*MEMORY_KEYS, *(HOST_MEMORY_KEYS if host_used else ())):
        row = [key] + ([layout.get(key, "")] if layout is not None else [])
        row += [
            f"{predicted[key]:,}",
            format_bytes(predicted[key]),
            f"{predicted[key] / num_params:.2f}" if num_params else "-",
        ]
        row += [f"{m[key]:,}" if m is not None and key in m else "n/a" for m in measured]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        f"memory per rank at the accumulation boundary: {num_params:,} parameters, "
        f"{world_size} rank{'s' if world_size != 1 else ''}"
        + ("" if host_used else " (nothing in host memory)")
    ]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)
