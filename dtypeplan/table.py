"""The rules table as markdown: ``dtypeplan table`` and ``docs/reference/truth-table.md``.

Five kinds of table are rendered. The first two list the file as it reads: the gates in their
order (what each refuses, the exception it leaves, the setting that lifts it), then the grid's
rules (a feature a rule names at its "not used" value is not shown). With the registry's
declarations, a third lists what each implementation declares it serves. The next is the
status grid a reader looks for: the :data:`GRID_ROWS` dimensions (parameter dtype x
accumulation dtype) against the :data:`GRID_COLUMNS` ones (ZeRO stage x pipeline parallelism),
with the other dimensions left to the defaults of the rules file and every feature unused.
Then one grid per feature dimension that has an OK value (master weights, optimizer states,
autocast, offload, ...): parameter dtype x feature value against the same columns, that
feature the only one in use. The last lists each value of every feature dimension with the
rules that decide it when it is the only feature in use. Titles, values and the config keys
that select them come from the dimension records (``resolver/_dimensions.py``). Each cell is
computed by resolving a real config for it, so the grid shows what ``dtypeplan.resolve``
answers, defaults included, and cannot drift from the resolver.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from dtypeplan.resolver._dimensions import (
    ACCUM,
    DIMENSIONS,
    FEATURE_DIMENSIONS,
    PARAMS,
    PIPELINE,
    STAGE,
    Dimension,
    config_for,
    value_text,
)
from dtypeplan.resolver._load import load_config
from dtypeplan.resolver._resolve import resolve_config
from dtypeplan.resolver._rules import Rule, RuleTable

__all__ = [
    "condition_text",
    "GRID_COLUMNS",
    "GRID_ROWS",
    "grid_config",
    "render_declarations",
    "render_gates",
    "render_grid",
    "render_markdown",
    "feature_rows",
    "feature_statuses",
    "render_feature_grid",
    "render_features",
    "render_rules",
    "status_grid",
]

GRID_ROWS: tuple[Dimension, ...] = (PARAMS, ACCUM)
"""One grid row per combination of their advisable values."""
GRID_COLUMNS: tuple[Dimension, ...] = (STAGE, PIPELINE)
"""One grid column per combination of their values."""

Cell = tuple[Any, ...]


def _cells(dimensions: tuple[Dimension, ...], advisable: bool) -> list[Cell]:
    return list(
        itertools.product(*(dim.choices if advisable else dim.values for dim in dimensions))
    )


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _implementation_cell(rule: Rule) -> str:
    if rule.implementation is None:
        return "-"
    single = rule.single_process_implementation
    if single is None or single == rule.implementation:
        return _cell(rule.implementation)
    return _cell(f"{rule.implementation} ({single} without torch.distributed)")


def condition_text(rule: Rule) -> str:
    """The rule's condition as the file names it (a feature named at "not used" left out)."""
    parts = []
    for name, dim in DIMENSIONS.items():
        if name not in rule.named:
            continue
        values = rule.matched_values(name)
        if len(values) == len(dim.values):
            parts.append(f"{name}=*")
        elif not (name in FEATURE_DIMENSIONS and values == [dim.default_value]):
            parts.append(f"{name}={'|'.join(value_text(v) for v in values)}")
    return ", ".join(parts) or "any"


def _unless_text(rule: Rule) -> str:
    if rule.unless is None:
        return ""
    return ", ".join(
        f"{name}={'|'.join(value_text(v) for v in dim.values if v in rule.unless[name])}"
        for name, dim in DIMENSIONS.items()
        if name in rule.unless
    )


def render_gates(table: RuleTable) -> str:
    """One markdown row per gate, in order: the first that holds a combination decides it."""
    lines = [
        "| # | id | refuses | unless | status | fix | reason |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for number, gate in enumerate(table.gates, 1):
        status = (
            "as " + ", ".join(f"{k}={value_text(v)}" for k, v in gate.decide_as.items())
            if gate.decide_as
            else str(gate.status)
        )
        lines.append(
            f"| {number} | `{gate.id}` | {_cell(condition_text(gate))} | "
            f"{_cell(_unless_text(gate)) or '-'} | {status} | {_cell(gate.fix or '-')} | "
            f"{_cell(gate.reason)} |"
        )
    return "\n".join(lines)


def render_rules(table: RuleTable) -> str:
    """One markdown row per rule of the grid."""
    lines = [
        "| id | when (features not named: unused) | status | implementation | reason |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rule in table.grid:
        lines.append(
            f"| `{rule.id}` | {_cell(condition_text(rule))} | {rule.status} | "
            f"{_implementation_cell(rule)} | {_cell(rule.reason)} |"
        )
    return "\n".join(lines)


def _box_text(box: dict[str, Any]) -> str:
    def values(v: Any) -> str:
        return "|".join(value_text(x) for x in v) if isinstance(v, (list, tuple)) else value_text(v)

    return ", ".join(f"{k}={values(v)}" for k, v in box.items())


def render_declarations(declarations: dict[str, Any]) -> str:
    """What each implementation declares it serves, one row per box (features not named are
    at their "not used" value); boxes served only without a process group say so."""
    lines = ["| implementation | serves |", "| --- | --- |"]
    for name, declared in declarations.items():
        if declared is None:
            continue
        for box in declared.serves:
            lines.append(f"| `{name}` | {_cell(_box_text(box))} |")
        for box in declared.alone:
            lines.append(f"| `{name}` | {_cell(_box_text(box))} (one process only) |")
    return "\n".join(lines)


def grid_config(row: Cell, column: Cell) -> tuple[dict[str, Any], bool]:
    """The config a user writes for one grid cell, and its ``pipeline_parallel`` argument."""
    values = dict(zip((d.name for d in GRID_ROWS + GRID_COLUMNS), row + column, strict=True))
    return config_for(values), bool(values.get(PIPELINE.name, PIPELINE.default_value))


def status_grid(table: RuleTable) -> dict[Cell, dict[Cell, str]]:
    """``{row: {column: status}}`` from the resolver, defaults applied."""
    grid: dict[Cell, dict[Cell, str]] = {}
    for row in _cells(GRID_ROWS, advisable=True):
        grid[row] = {}
        for column in _cells(GRID_COLUMNS, advisable=False):
            config, pipeline = grid_config(row, column)
            plan = resolve_config(load_config(config), pipeline_parallel=pipeline, table=table)
            grid[row][column] = str(plan.status)
    return grid


def _heading(column: Cell) -> str:
    return " ".join(
        text for dim, v in zip(GRID_COLUMNS, column, strict=True) if (text := dim.show(v))
    )


def render_grid(table: RuleTable) -> str:
    """The status grid as a markdown table."""
    columns = _cells(GRID_COLUMNS, advisable=False)
    header = [dim.title for dim in GRID_ROWS] + [_heading(column) for column in columns]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for row, statuses in status_grid(table).items():
        cells = [value_text(v) for v in row]
        for column in columns:
            cells.append(_status_text(statuses[column]))
        lines.append("| " + " | ".join(cells) + " |")
    defaults = table.defaults
    sharded = ", ".join(
        f"{stage}: {'sharded' if defaults.accumulator_sharded[stage] else 'whole'}"
        for stage in STAGE.values
    )
    comm = defaults.communication_data_type
    comm_text = {"accum": "the accumulation dtype", "params": "the parameter dtype"}.get(comm, comm)
    keys = ", ".join(f"`{dim.config_key}` ({dim.title})" for dim in GRID_ROWS + GRID_COLUMNS)
    note = (
        f"Each cell is what `resolve` answers for a config that sets only {keys}, leaving the "
        f"rest to the defaults of `{os.path.basename(table.path)}`: accumulator by ZeRO stage "
        f"({sharded}), gradients on the wire in {comm_text}. "
        f"PP = `resolve(..., {PIPELINE.config_key}=True)`."
    )
    return "\n".join(lines) + "\n\n" + note


def _status_text(status: str) -> str:
    return f"**{status}**" if status == "OK" else status


def feature_statuses(table: RuleTable, feature: Dimension) -> dict[tuple[Any, Any], list[str]]:
    """``{(parameter dtype, value of feature): [status per grid column]}``, the feature the only
    one in use (other dimensions at the rules file's defaults), as ``resolve`` answers."""
    columns = _cells(GRID_COLUMNS, advisable=False)
    statuses: dict[tuple[Any, Any], list[str]] = {}
    for params in PARAMS.choices:
        for value in feature.values:
            # A value no config selects (a shaped optimizer comes from build's argument) has
            # no row: a config without it would show the "not used" value's status.
            if value == feature.default_value or not feature.config_for(value):
                continue
            row = statuses[(params, value)] = []
            for column in columns:
                # The parameter dtype last: a feature's config may enable a 16-bit mode itself.
                values = {feature.name: value, PARAMS.name: params}
                values.update(zip((d.name for d in GRID_COLUMNS), column, strict=True))
                pipeline = bool(values.pop(PIPELINE.name, PIPELINE.default_value))
                plan = resolve_config(
                    load_config(config_for(values)), pipeline_parallel=pipeline, table=table
                )
                row.append(str(plan.status))
    return statuses


def render_feature_grid(table: RuleTable, feature: Dimension) -> str | None:
    """:func:`feature_statuses` as a markdown table; None when no cell is OK.

    Rows with the same statuses are one row (their values listed together, then their
    parameter dtypes), and rows that are an Error in every column (a contradiction, such as
    bf16 masters for fp32 parameters, which the features table states once) are left out.
    """
    statuses = feature_statuses(table, feature)
    if not any("OK" in row for row in statuses.values()):
        return None
    values_by_params: dict[tuple[Any, tuple[str, ...]], list[Any]] = {}
    for (params, value), row in statuses.items():
        if set(row) != {"Error"}:
            values_by_params.setdefault((params, tuple(row)), []).append(value)
    params_by_values: dict[tuple[tuple[Any, ...], tuple[str, ...]], list[Any]] = {}
    for (params, pattern), values in values_by_params.items():
        params_by_values.setdefault((tuple(values), pattern), []).append(params)
    lines = []
    for (shared_values, pattern), params_list in params_by_values.items():
        cells = [", ".join(value_text(p) for p in params_list)]
        cells.append(", ".join(value_text(v) for v in shared_values))
        cells.extend(_status_text(status) for status in pattern)
        lines.append("| " + " | ".join(cells) + " |")
    columns = _cells(GRID_COLUMNS, advisable=False)
    header = [PARAMS.title, feature.title] + [_heading(column) for column in columns]
    return "\n".join(
        ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |", *lines]
    )


def render_feature_grids(table: RuleTable) -> str:
    """A heading and a grid for every feature dimension that has an OK cell and that a config
    selects."""
    sections = []
    for feature in FEATURE_DIMENSIONS.values():
        grid = render_feature_grid(table, feature)
        if grid is not None:
            sections.append(f"#### {feature.title} (`{feature.config_key}`)\n\n{grid}")
    return "\n\n".join(sections)


def feature_rows(table: RuleTable) -> list[tuple[Dimension, list[Any], Rule]]:
    """For each feature dimension, its values other than "not used" grouped by the rule that
    decides the grid's cells (any core point whose settings agree, a parameter dtype a user
    can choose) when that value is the only feature in use: ``(dimension, values, rule)`` in
    file order of rules. A core point that is an Error is that Error whatever the features
    (``RuleTable.lookup``), so it names no feature's rule."""
    rows = []
    for dim in FEATURE_DIMENSIONS.values():
        by_rule: dict[str, tuple[list[Any], Rule]] = {}
        for value in dim.values:
            if value == dim.default_value:
                continue
            for point in table.points():
                if point[PARAMS.name] in PARAMS.choices and table.core_error(point) is None:
                    rule = table.lookup({**point, dim.name: value})
                    values, _ = by_rule.setdefault(rule.id, ([], rule))
                    if value not in values:
                        values.append(value)
        for values, rule in sorted(by_rule.values(), key=lambda entry: entry[1].line):
            rows.append((dim, values, rule))
    return rows


def render_features(table: RuleTable) -> str:
    """The feature table: one row per feature and deciding rule."""
    lines = [
        "| feature (config key) | value | params | status | rule | reason |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for dim, values, rule in feature_rows(table):
        params = [
            v for v in PARAMS.choices if PARAMS.name not in rule.when or v in rule.when[PARAMS.name]
        ]
        lines.append(
            f"| {_cell(f'{dim.title} (`{dim.config_key}`)')} "
            f"| {_cell(', '.join(value_text(v) for v in values))} "
            f"| {'any' if params == list(PARAMS.choices) else ', '.join(params)} "
            f"| {rule.status} | `{rule.id}` | {_cell(rule.reason)} |"
        )
    return "\n".join(lines)


def render_markdown(table: RuleTable, declarations: dict[str, Any] | None = None) -> str:
    """The whole table: the gates, the grid, the implementations' declarations (when given),
    the status grid, then the features."""
    served = (
        "\n\n### What each implementation serves\n\n"
        + "Declared with `@register(name, serves=[...])`; the loader refuses an OK rule that "
        + "sends a combination outside its implementation's boxes.\n\n"
        + render_declarations(declarations)
        if declarations
        else ""
    )
    return (
        f"### Gates of `{os.path.basename(table.path)}`, in order\n\n"
        + "The first gate that holds a combination decides it; a dimension a gate does not "
        + "name may have any value.\n\n"
        + render_gates(table)
        + "\n\n### The grid\n\n"
        + "Every combination no gate takes is matched by exactly one of these rules.\n\n"
        + render_rules(table)
        + served
        + "\n\n### Status by parameter dtype, accumulation dtype, ZeRO stage and pipeline\n\n"
        + render_grid(table)
        + "\n\n### Status of each feature that has OK cells\n\n"
        + "One grid per feature: that feature's value is the only one set beside the parameter "
        + "dtype and the ZeRO stage; everything else takes the defaults above. Values (and then "
        + "parameter dtypes) with the same status everywhere share a row; rows that are an "
        + "Error in every column (a contradiction, such as bf16 master weights for fp32 "
        + "parameters) are left out, and the next table gives their reasons.\n\n"
        + render_feature_grids(table)
        + "\n\n### DeepSpeed features, each alone\n\n"
        + 'The grid above is every feature\'s "not used" value. Each other value, as the only '
        + "feature of a config, is decided by the rule shown; when a config uses several, the "
        + "first gate that holds the combination decides.\n\n"
        + render_features(table)
        + "\n"
    )
