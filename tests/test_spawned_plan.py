"""A plan pickled to ranks whose module never imports ``dtypeplan.resolve`` builds and steps.

``PrecisionPlan.build`` calls the optimizers' builder, which ``dtypeplan._api`` installs; a
spawned rank that only unpickles a plan has imported ``dtypeplan.resolver`` (through
``dtypeplan.launch``) but never ``dtypeplan._api``, so the plan must bring the builder in by
itself (issue 47, item 11: it raised ``AssertionError: dtypeplan/__init__.py installs the
optimizer builder``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dtypeplan
from dtypeplan.launch import spawn
from tests.workers import pickled_plan

ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def test_the_worker_imports_nothing_of_dtypeplan() -> None:
    tree = ast.parse(Path(pickled_plan.__file__).read_text())
    imported = [
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert not [name for name in imported if name.startswith("dtypeplan")], imported


@pytest.mark.slow
def test_a_pickled_plan_builds_and_steps_on_spawned_ranks() -> None:
    plan = dtypeplan.resolve({**ADAMW, "zero_optimization": {"stage": 2}})
    assert plan.status == "OK", plan.explain()
    differences = spawn(pickled_plan.build_and_step, 2, plan, timeout_s=300)
    # fp32 masters and states, the same batch on both ranks: torch's AdamW to rounding (the
    # mean of two equal gradients, two steps).
    assert max(differences) < 1e-6, differences
