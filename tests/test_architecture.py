"""The package's import graph: no module imports in a circle, and imports run one way.

Every module of ``dtypeplan`` is read with ``ast`` (nothing is imported), and every import
statement counts: at module level, inside functions, and under ``TYPE_CHECKING``, since each
one is a dependency a reader must follow. ``from pkg import name`` is an edge to ``pkg.name``
when that is a module, else to ``pkg``. The parent packages that Python initializes before a
submodule are not edges: every module would otherwise depend on the package root.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dtypeplan

PACKAGE = Path(dtypeplan.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _target(name: str) -> str | None:
    """The package module ``name`` denotes (itself, or the nearest package above it)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path) -> set[str]:
    is_package = path.name == "__init__.py"
    edges: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            names = [f"{source}.{alias.name}" for alias in node.names]
            names = [name if name in MODULES else source for name in names]
        else:
            continue
        edges |= {t for name in names if (t := _target(name)) is not None and t != module}
    return edges


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _cycle() -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(GRAPH):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_the_graph_sees_the_package() -> None:
    assert {"dtypeplan", "dtypeplan.resolver._plan", "dtypeplan.optimizers._build"} <= set(GRAPH)
    assert "dtypeplan.resolver" in GRAPH["dtypeplan.optimizers._build"]


def test_no_import_cycles() -> None:
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_resolver_imports_nothing_of_the_optimizers() -> None:
    offending = {
        module: sorted(t for t in targets if t.startswith("dtypeplan.optimizers"))
        for module, targets in GRAPH.items()
        if module.startswith("dtypeplan.resolver")
    }
    assert not any(offending.values()), offending


def test_the_demo_does_not_import_the_command_line() -> None:
    """``dtypeplan demo`` runs the demo; both print through ``dtypeplan.report``."""
    assert "dtypeplan.cli" not in GRAPH["dtypeplan.demo"]
    assert (
        "dtypeplan.report" in GRAPH["dtypeplan.demo"]
        and "dtypeplan.report" in GRAPH["dtypeplan.cli"]
    )
