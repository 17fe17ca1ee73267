"""The package's structure: no module imports in a circle, imports run one way, the flat
engine and the base class stay small, and every update kernel keeps one interface.

For the graph every module of ``dtypeplan`` is read with ``ast`` (nothing is imported), and
every import statement counts: at module level, inside functions, and under
``TYPE_CHECKING``, since each one is a dependency a reader must follow. ``from pkg import
name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``. The parent packages
that Python initializes before a submodule are not edges: every module would otherwise depend
on the package root.
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


MAX_LINES = 600
"""The flat engine and the base class stay the step's phases and the contract: the update
kernels, the state save/load, the param-group checks and the held tensors live apart."""


def test_the_engine_and_the_base_class_stay_under_600_lines() -> None:
    for module in ("dtypeplan.optimizers.flat.engine", "dtypeplan.optimizers.contract.base"):
        lines = len(MODULES[module].read_text().splitlines())
        assert lines < MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES - 1})"


def test_every_registered_update_kernel_keeps_the_interface() -> None:
    """Each kernel is a concrete :class:`UpdateKernel` in a module of its own under
    ``update/`` (those of one family may share one), named uniquely, and the last one
    serves every plan; the kernels never import the engine (it imports them)."""
    import inspect

    from dtypeplan.optimizers.update import KERNELS, UpdateKernel
    from dtypeplan.optimizers.update.generic import GenericKernel

    names = [kernel.name for kernel in KERNELS]
    assert len(set(names)) == len(names), names
    for kernel in KERNELS:
        assert issubclass(kernel, UpdateKernel) and not inspect.isabstract(kernel), kernel
        assert kernel.__module__.startswith("dtypeplan.optimizers.update."), kernel
        for method in ("applies", "update", "describe", "state_changed"):
            assert callable(getattr(kernel, method)), (kernel, method)
        own = inspect.signature(kernel.update).parameters
        base = inspect.signature(UpdateKernel.update).parameters
        assert list(own) == list(base), (kernel, list(own))
    assert KERNELS[-1] is GenericKernel
    kernel_modules = {m for m in GRAPH if m.startswith("dtypeplan.optimizers.update")}
    assert {k.__module__ for k in KERNELS} <= kernel_modules
    for module in kernel_modules:
        assert "dtypeplan.optimizers.flat.engine" not in GRAPH[module], module
        assert "dtypeplan.optimizers.flat.checkpoint_state" not in GRAPH[module], module
