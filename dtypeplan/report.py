"""Plain-text reports shared by ``dtypeplan check`` and ``dtypeplan demo``: bytes and memory."""

from __future__ import annotations

from collections.abc import Sequence

from dtypeplan.resolver._memory import HOST_MEMORY_KEYS, MEMORY_KEYS

__all__ = ["format_bytes", "memory_report"]


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
) -> str:
    """The per-rank byte table; ``measured`` adds one column per rank next to the prediction.

    The ``host_*`` rows are an offloaded optimizer's host memory (0 without offload); the
    other rows are device bytes.
    """
    header = ["component", "predicted bytes", "human", "bytes/param"]
    header += [f"rank {r} measured" for r in range(len(measured))]
    rows = [header]
    for key in (*MEMORY_KEYS, *HOST_MEMORY_KEYS):
        row = [
            key,
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
    ]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)
