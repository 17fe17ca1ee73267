"""One record per setting: the dimension records of ``resolver/_dimensions.py`` are the source
of the plan's per-dimension attributes, ``to_dict``, ``explain()``'s rows, the schemas' enums
and the docs' figures.

The last test adds a dimension to a copy of the package by one record and shows that the rest
follows with no other edit (``python -m dtypeplan docs --write`` regenerates the schemas' enums
and the pages); only the rules that decide its values would remain to write.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import dtypeplan
from dtypeplan import docs_pages
from dtypeplan.resolver import _plan
from dtypeplan.resolver._dimensions import (
    COMBINATIONS,
    CORE_DIMENSIONS,
    DIMENSIONS,
    FEATURE_DIMENSIONS,
)

ROOT = Path(__file__).resolve().parent.parent


def test_every_feature_says_how_a_config_sets_it() -> None:
    assert all(dim.read is not None for dim in FEATURE_DIMENSIONS.values())
    # The core dimensions take the rules file's defaults: _effective.py works them out.
    assert all(dim.read is None for dim in CORE_DIMENSIONS.values())


def test_the_plan_derives_each_attribute_from_its_point() -> None:
    plan = dtypeplan.resolve(
        {
            "bf16": {"enabled": True},
            "master_weights": {"dtype": "bf16", "rounding": "kahan"},
            "optimizer_states": {"exp_avg": "bf16", "exp_avg_sq": "fp32"},
            "zero_optimization": {"stage": 2},
        }
    )
    assert set(plan.point) == set(DIMENSIONS)
    assert (plan.param_dtype, plan.master_dtype, plan.master_rounding) == (
        torch.bfloat16,
        torch.bfloat16,
        "kahan",
    )
    assert (plan.optimizer_states, plan.exp_avg_dtype, plan.exp_avg_sq_dtype) == (
        "bf16/fp32",
        "bf16",
        "fp32",
    )
    assert plan.zero_stage == 2 and plan.offload_optimizer == "none"
    data = plan.to_dict()
    for name, value in plan.attributes().items():
        expected = value if not isinstance(value, torch.dtype) else str(value).split(".")[-1]
        key = "optimizer_states_dtype" if name == "optimizer_states" else name
        assert key in data, name
        if not isinstance(value, torch.dtype):
            assert data[key] == expected, name
    assert data["master_dtype"] == "bf16" and data["param_dtype"] == "bf16"
    assert plan.origins["master_dtype"].startswith("config: master_weights")


def test_no_derived_attribute_shadows_the_plan() -> None:
    """A record's attribute named as a field or method of the plan would hide it (the
    ``optimizer`` dimension's value is ``optimizer_kind``: ``optimizer`` is the config's)."""
    own = {f.name for f in dataclasses.fields(_plan.PrecisionPlan)} | set(vars(_plan.PrecisionPlan))
    assert not set(_plan.ATTRIBUTES) & own
    assert len(_plan.ATTRIBUTES) == sum(len(d.attributes) for d in DIMENSIONS.values())


def _declared() -> dict[str, str]:
    """The attributes ``_PointAttributes`` declares for type checkers, with their types."""
    tree = ast.parse(Path(_plan.__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_PointAttributes")
    block = next(n for n in cls.body if isinstance(n, ast.If))
    return {
        n.target.id: ast.unparse(n.annotation)
        for n in block.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def test_the_type_declarations_name_generated_attributes_of_their_type() -> None:
    declared = _declared()
    assert declared and set(declared) <= set(_plan.ATTRIBUTES)
    plans = [
        dtypeplan.resolve({}),
        dtypeplan.resolve({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}),
    ]
    for plan in plans:
        for name, annotation in declared.items():
            kind = eval(annotation, {"torch": torch})  # noqa: S307 - our own source
            assert isinstance(getattr(plan, name), kind), (name, annotation)


def test_explain_writes_a_row_per_dimension_in_use() -> None:
    plain = dtypeplan.resolve({}).explain()
    used = dtypeplan.resolve(
        {
            "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"type": "Rprop"},
        }
    ).explain()
    for dim in CORE_DIMENSIONS.values():
        assert re.search(rf"^  {dim.label} ", plain, re.MULTILINE), dim.name
    assert "offload optimizer" not in plain and "state kind" not in plain
    assert re.search(r"^  offload optimizer +cpu +<- config: zero_optimization", used, re.M)
    assert re.search(r"^  state kind +step_sizes +<- config: optimizer.type", used, re.M)


# --- the schemas and the docs ------------------------------------------------------------------
def _enums(node: Any, marked: bool = False) -> list[tuple[list[Any], bool]]:
    """Every enum of a schema and whether a marker generates it."""
    found: list[tuple[list[Any], bool]] = []
    if isinstance(node, dict):
        if "enum" in node:
            found.append((node["enum"], "x-dtypeplan-values" in node))
        for value in node.values():
            found += _enums(value)
    elif isinstance(node, list):
        for value in node:
            found += _enums(value)
    return found


@pytest.mark.parametrize("path", ["dtypeplan/schemas/config.schema.json"])
def test_no_schema_enum_copies_a_source_by_hand(path: str) -> None:
    """An enum that lists a dimension's values (or another source's) is generated from it.
    (rules.schema.json's is the dimension names, checked below; its other enums are the rules
    file's own, rewritten with it.)"""
    sources = [list(values) for values in docs_pages.enum_sources().values()]
    schema = json.loads((ROOT / path).read_text())
    copied = [values for values, marked in _enums(schema) if values in sources and not marked]
    assert not copied, f"{path}: mark these enums with x-dtypeplan-values: {copied}"
    assert any(marked for _, marked in _enums(schema))


def test_the_rules_schema_names_exactly_the_dimensions() -> None:
    text = (ROOT / "dtypeplan/schemas/rules.schema.json").read_text()
    match = re.search(r'"x-dtypeplan-values": "dimension names", "enum": (\[[^\]]*\])', text)
    assert match is not None and json.loads(match[1]) == list(DIMENSIONS)


def test_figures_fill_their_markers(tmp_path: Path) -> None:
    page = "The table has <!-- dimensions -->18<!-- /dimensions --> dimensions."
    assert docs_pages.fill_figures(page, "page.md") == (
        f"The table has <!-- dimensions -->{len(DIMENSIONS)}<!-- /dimensions --> dimensions."
    )
    with pytest.raises(ValueError, match="names no figure"):
        docs_pages.fill_figures("<!-- planets -->9<!-- /planets -->", "page.md")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(page)
    assert "docs/page.md" in docs_pages.stale(tmp_path)
    docs_pages.write(tmp_path)
    assert f"-->{len(DIMENSIONS)}<!--" in (tmp_path / "docs" / "page.md").read_text()


_STATED = re.compile(
    r"(?<![\w>-])(\d[\d,.]*)(?: (billion|million))? (?:(core|feature) )?"
    r"(dimensions|combinations|points)\b"
)


def _stated_figures(text: str) -> list[str]:
    """Each figure ``text`` states about the space, outside a figure marker, that the code
    does not give."""
    size = docs_pages.figures()
    expected = {
        ("", "dimensions"): size["dimensions"],
        ("core", "dimensions"): size["core dimensions"],
        ("feature", "dimensions"): size["feature dimensions"],
        ("", "combinations"): size["combinations"],
        ("core", "combinations"): size["core combinations"],
    }
    wrong = []
    for match in _STATED.finditer(text):
        figure, billion, which, what = match.groups()
        if what == "points" and not billion:
            continue  # "3 points" is no claim about the space; "41 billion points" is
        what = "combinations" if what == "points" else what
        if billion or expected.get((which or "", what)) != figure:
            wrong.append(match[0])
    return wrong


def _prose() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return found + sorted((ROOT / "dtypeplan").rglob("*.py"))


_BEING_REWRITTEN: dict[str, str] = {}
"""Files whose stale figures the rules rewrite (issue 43, items 1 and 6) replaces."""


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(
            p.relative_to(ROOT).as_posix(),
            marks=pytest.mark.xfail(
                reason=f"stale: {_BEING_REWRITTEN[p.relative_to(ROOT).as_posix()]}", strict=True
            ),
        )
        if p.relative_to(ROOT).as_posix() in _BEING_REWRITTEN
        else p.relative_to(ROOT).as_posix()
        for p in _prose()
    ],
)
def test_the_prose_states_the_figures_of_the_code(path: str) -> None:
    """A page or docstring that says how many dimensions or combinations there are says what
    the records give (best through a figure marker, which ``docs --write`` keeps current)."""
    text = docs_pages._FIGURE.sub("", (ROOT / path).read_text(encoding="utf-8"))
    assert not _stated_figures(text), f"{path}: {_stated_figures(text)}"


# --- adding a dimension ------------------------------------------------------------------------
_RECORD = """
CLIPPED = Dimension(
    name="clipped",
    values=(False, True),
    doc="whether the gradients are clipped to a global norm (a test's dimension)",
    config_key="gradient_clipping",
    default="false (no gradient_clipping)",
    default_value=False,
    choices=(False,),
    title="clipped",
    read=lambda config: config.gradient_clipping > 0,
)

"""

_GATE = """\
  - id: clipped-not-served
    when: {clipped: true}
    status: NotSupported
    fix: remove gradient_clipping
    reason: A test's dimension that no implementation serves.

  # --- The optimizer."""

_CHECK = """
import dataclasses, json, re, sys
from pathlib import Path

import dtypeplan
from dtypeplan import docs_pages
from dtypeplan.resolver._frozen import FrozenDict

root = Path(sys.argv[1])
assert dtypeplan.__file__.startswith(str(root)), dtypeplan.__file__
written = docs_pages.write(root)  # python -m dtypeplan docs --write
assert "dtypeplan/schemas/rules.schema.json" in written, written
assert not docs_pages.stale(root)
schema = (root / "dtypeplan/schemas/rules.schema.json").read_text()
names = json.loads(re.search(r'"dimension names", "enum": (\\[[^\\]]*\\])', schema)[1])
assert names[-1] == "clipped", names
assert docs_pages.figures()["dimensions"] == str(int(sys.argv[2]) + 1)
assert docs_pages.figures()["combinations"] == f"{int(sys.argv[3]) * 2:,}"
assert "`clipped` (false (no gradient_clipping))" in (root / "docs/reference/config.md").read_text()

plan = dtypeplan.resolve({})
assert plan.point["clipped"] is False and plan.clipped is False
assert plan.to_dict()["clipped"] is False
assert plan.origins["clipped"] == "default: false (no gradient_clipping)"
assert "clipped" not in plan.explain()  # a feature not in use has no row

clipped = dtypeplan.resolve({"gradient_clipping": 1.0})
assert clipped.status == "NotSupported" and clipped.rule_id == "clipped-not-served", clipped
assert clipped.clipped is True and clipped.to_dict()["clipped"] is True
assert clipped.origins["clipped"] == "config: gradient_clipping"
row = re.search(r"^  clipped +true +<- config: gradient_clipping$", clipped.explain(), re.M)
assert row is not None, clipped.explain()
# The same without the table: a plan whose point has the value.
on = dataclasses.replace(plan, point=FrozenDict({**plan.point, "clipped": True}))
assert on.clipped is True and re.search(r"^  clipped +true ", on.explain(), re.M)
print("picked up")
"""


@pytest.mark.slow
def test_a_new_dimension_is_one_record(tmp_path: Path) -> None:
    """One record in a copy of ``_dimensions.py``; the schemas' enums (after ``docs --write``),
    the plan's attribute, ``to_dict``, the origins, ``explain()``'s row, the config reference
    and the figures all pick it up."""
    ignore = shutil.ignore_patterns("__pycache__", "_build")
    shutil.copytree(ROOT / "dtypeplan", tmp_path / "dtypeplan", ignore=ignore)
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=ignore)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    records = tmp_path / "dtypeplan/resolver/_dimensions.py"
    text = records.read_text()
    declaration = "FEATURE_DIMENSIONS: FrozenDict[str, Dimension] = FrozenDict("
    listed = re.compile(
        re.escape(declaration) + r"\n    \{\n        dim\.name: dim\n" + r"        for dim in \(\n"
    )
    assert text.count(declaration) == 1 and listed.search(text), "the records' layout changed"
    text = text.replace(declaration, _RECORD.lstrip() + "\n" + declaration)
    # Last in the display order: after the tuple's last entry.
    text = re.sub(
        r"(for dim in \(\n(?:            \w+,\n)+)", r"\1            CLIPPED,\n", text, count=1
    )
    records.write_text(text)
    # The rules that name it: one gate (the implementations declare nothing of it, so no OK
    # rule may send clipped=true anywhere).
    rules = tmp_path / "dtypeplan/precision_rules.yaml"
    rules.write_text(rules.read_text().replace("  # --- The optimizer.", _GATE, 1))
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_CHECK),
            str(tmp_path),
            str(len(DIMENSIONS)),
            str(COMBINATIONS),
        ],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "picked up" in done.stdout
