"""The rules table as markdown: ``dtypeplan table`` and the generated section of README.md.

Two tables are rendered. The first lists every rule of the file in file order. The second is
the status grid a reader looks for: parameter dtype x accumulation dtype (rows) against ZeRO
stage x pipeline parallelism (columns), with ``sharded`` and ``comm`` left to the defaults of
the rules file. Each cell is computed by resolving a real config for it, so the grid shows
what ``dtypeplan.resolve`` answers, defaults included, and cannot drift from the resolver.
"""

from __future__ import annotations

import os
from typing import Any

from dtypeplan.resolver._config import load_config
from dtypeplan.resolver._resolve import resolve_config
from dtypeplan.resolver._rules import DIMENSIONS, RuleTable

__all__ = [
    "GRID_ACCUM",
    "GRID_MODELS",
    "GRID_PIPELINE",
    "GRID_STAGES",
    "README_BEGIN",
    "README_END",
    "grid_config",
    "readme_block",
    "render_grid",
    "render_markdown",
    "render_readme_block",
    "render_rules",
    "status_grid",
]

README_BEGIN = "<!-- table:begin -->"
README_END = "<!-- table:end -->"

GRID_MODELS = ("fp32", "fp16", "bf16")
GRID_ACCUM = ("fp32", "fp16", "bf16")
GRID_STAGES = (0, 1, 2, 3)
GRID_PIPELINE = (False, True)


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def render_rules(table: RuleTable) -> str:
    """One markdown row per rule, in file order."""
    lines = [
        "| id | when | status | implementation | reason |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rule in table.rules:
        lines.append(
            f"| `{rule.id}` | {_cell(rule.when_text())} | {rule.status} | "
            f"{_cell(rule.implementation) if rule.implementation else '-'} | {_cell(rule.reason)} |"
        )
    return "\n".join(lines)


def grid_config(model: str, accum: str, stage: int) -> dict[str, Any]:
    """The config a user writes for one cell of the grid; everything else stays default."""
    config: dict[str, Any] = {
        "gradient_accumulation_dtype": accum,
        "zero_optimization": {"stage": stage},
    }
    if model == "bf16":
        config["bf16"] = {"enabled": True}
    elif model == "fp16":
        config["fp16"] = {"enabled": True}
    return config


def status_grid(table: RuleTable) -> dict[tuple[str, str], dict[tuple[int, bool], str]]:
    """``{(model, accum): {(stage, pipeline): status}}`` from the resolver, defaults applied."""
    grid: dict[tuple[str, str], dict[tuple[int, bool], str]] = {}
    for model in GRID_MODELS:
        for accum in GRID_ACCUM:
            row: dict[tuple[int, bool], str] = {}
            for stage in GRID_STAGES:
                config = load_config(grid_config(model, accum, stage))
                for pipeline in GRID_PIPELINE:
                    plan = resolve_config(config, pipeline_parallel=pipeline, table=table)
                    row[(stage, pipeline)] = str(plan.status)
            grid[(model, accum)] = row
    return grid


def render_grid(table: RuleTable) -> str:
    """The 9 x 8 status grid as a markdown table."""
    header = ["params", "accum"]
    for stage in GRID_STAGES:
        for pipeline in GRID_PIPELINE:
            header.append(f"ZeRO {stage}{' + PP' if pipeline else ''}")
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for (model, accum), row in status_grid(table).items():
        cells = [model, accum]
        for stage in GRID_STAGES:
            for pipeline in GRID_PIPELINE:
                status = row[(stage, pipeline)]
                cells.append(f"**{status}**" if status == "OK" else status)
        lines.append("| " + " | ".join(cells) + " |")
    defaults = table.defaults
    sharded = ", ".join(
        f"{stage}: {'sharded' if defaults.accumulator_sharded[stage] else 'whole'}"
        for stage in DIMENSIONS["stage"]
    )
    comm = defaults.communication_data_type
    comm_text = {"accum": "the accumulation dtype", "model": "the parameter dtype"}.get(comm, comm)
    note = (
        "Each cell is what `resolve` answers for a config that sets only `bf16.enabled` or "
        "`fp16.enabled` (params), `gradient_accumulation_dtype` and `zero_optimization.stage`, "
        f"leaving the rest to the defaults of "
        f"`{os.path.basename(table.path)}`: accumulator by ZeRO stage ({sharded}), gradients on "
        f"the wire in {comm_text}. PP = `resolve(..., pipeline_parallel=True)`."
    )
    return "\n".join(lines) + "\n\n" + note


def render_markdown(table: RuleTable) -> str:
    """The whole table: every rule, then the status grid."""
    return (
        f"### Rules of `{os.path.basename(table.path)}`\n\n"
        + render_rules(table)
        + "\n\n### Status by parameter dtype, accumulation dtype, ZeRO stage and pipeline\n\n"
        + render_grid(table)
        + "\n"
    )


def render_readme_block(table: RuleTable) -> str:
    """What goes between :data:`README_BEGIN` and :data:`README_END` in README.md."""
    return (
        "<!-- generated by `dtypeplan table --readme` from dtypeplan/precision_rules.yaml; "
        "do not edit by hand -->\n\n" + render_markdown(table)
    )


def readme_block(text: str) -> str | None:
    """The text between the README markers (without them), or None when they are absent."""
    begin = text.find(README_BEGIN)
    end = text.find(README_END, begin + len(README_BEGIN)) if begin >= 0 else -1
    if begin < 0 or end < 0:
        return None
    return text[begin + len(README_BEGIN) : end]
