"""The package's structure: no module imports in a circle, imports run one way (the resolver
imports nothing of the optimizers; the optimizers' rooms import only rooms below them), the flat
engine and the base class stay small, and every update kernel keeps one interface.

For the graph every module of ``dtypeplan`` is read with ``ast`` (nothing is imported), and
every import statement counts for the layering: at module level, inside functions, and under
``TYPE_CHECKING``, since each one is a dependency a reader must follow. The cycle check leaves
out the imports under ``TYPE_CHECKING``: a module may name the type of one that imports it (the
report names ``PrecisionPlan``, whose ``explain()`` runs the report) without a run-time
cycle. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg``. The parent packages that Python initializes before a submodule are not edges: every
module would otherwise depend on the package root.
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


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The import statements under ``if TYPE_CHECKING:``."""
    found: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            for statement in node.body:
                found |= {
                    n for n in ast.walk(statement) if isinstance(n, ast.Import | ast.ImportFrom)
                }
    return found


def _imports(module: str, path: Path, *, type_only: bool = True) -> set[str]:
    """The package modules ``module`` imports (``type_only`` false: not those imported under
    ``TYPE_CHECKING`` only)."""
    is_package = path.name == "__init__.py"
    edges: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = set() if type_only else _type_checking_only(tree)
    for node in ast.walk(tree):
        if node in skipped:
            continue
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
RUN_TIME_GRAPH = {
    module: _imports(module, path, type_only=False) for module, path in MODULES.items()
}


def _cycle() -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(RUN_TIME_GRAPH[module]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(RUN_TIME_GRAPH):
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


LOW_MODULES = {
    "dtypeplan._dtypes",
    "dtypeplan._formats",
    "dtypeplan._int8_codes",
    "dtypeplan._quiet_imports",
}
"""The shared facts below everything: dtype names, the optimizer-state formats (records, their
codes, torchao's import). The resolver, the communicator, the optimizers and the checkpointer
all import them, so they import nothing of the package but one another."""


def test_the_low_shared_modules_import_only_one_another() -> None:
    for module in LOW_MODULES:
        assert module in GRAPH, module
        assert GRAPH[module] <= LOW_MODULES, (module, sorted(GRAPH[module] - LOW_MODULES))
    assert "dtypeplan._formats" in GRAPH["dtypeplan.resolver._memory"]
    assert "dtypeplan._formats" in GRAPH["dtypeplan.optimizers.state.storage"]


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
    ``update/`` (those of one family may share one: they share a base below
    :class:`UpdateKernel`), named uniquely, and the last one serves every plan; every module of
    ``update/`` but its interface, registry and the piecewise update holds a kernel; the
    kernels never import the engines (they import them)."""
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
    kernel_modules = {m for m in GRAPH if m.startswith("dtypeplan.optimizers.update.")}
    holding = {k.__module__ for k in KERNELS}
    infrastructure = {
        f"dtypeplan.optimizers.update.{m}" for m in ("interface", "registry", "pieces")
    }
    assert holding <= kernel_modules
    assert kernel_modules - infrastructure == holding, kernel_modules - infrastructure - holding
    for module in holding:
        family = [k for k in KERNELS if k.__module__ == module]
        if len(family) > 1:
            shared = set.intersection(*(set(k.__mro__[1:]) for k in family))
            assert any(b is not UpdateKernel and issubclass(b, UpdateKernel) for b in shared), (
                module,
                family,
            )
    for module in kernel_modules | {"dtypeplan.optimizers.update"}:
        engines = {t for t in GRAPH[module] if _room(t) in ("flat", "fsdp2")}
        assert not engines, (module, sorted(engines))


MAX_FUNCTION_LINES = 60
"""A resolver function reads in one screen: its body, after the signature and the docstring."""


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    first = body[0]
    if (
        len(body) > 1
        and isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        first = body[1]
    assert node.end_lineno is not None
    return node.end_lineno - first.lineno + 1


def test_no_resolver_function_is_over_60_lines() -> None:
    """``load_config`` and ``resolve`` are pipelines of stages; every stage and block reader
    stays short enough to read whole (nested functions and methods count on their own)."""
    long = {}
    for module, path in MODULES.items():
        if not module.startswith("dtypeplan.resolver"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (lines := _body_lines(node)) > MAX_FUNCTION_LINES:
                    long[f"{module}.{node.name}:{node.lineno}"] = lines
    assert not long, f"over {MAX_FUNCTION_LINES} lines: {long}"
    assert any(m.startswith("dtypeplan.resolver.") for m in MODULES)


OPTIMIZERS = "dtypeplan.optimizers"

ROOMS = {
    "kernels": 0,
    "state": 1,
    "buffers": 2,
    "grads": 3,
    "contract": 4,
    "update": 5,
    "flat": 6,
    "fsdp2": 6,
    "whole": 7,
}
"""The rooms of ``dtypeplan/optimizers/``, by level: a module imports modules of its own room or
of a room of a lower level, never of one of its own level or above (``flat/`` and ``fsdp2/``,
both 6, never import each other).

* 0 ``kernels/``: the update math, tensors in, tensors out (no optimizer object, no plan);
* 1 ``state/``: what the optimizer state holds, how it is named, stored and counted;
* 2 ``buffers/``: the flat engine's buffers, buckets, master chunks and host slots (a group's
  ``shard_pieces`` are ``state/``'s ``ShardPiece``);
* 3 ``grads/``: a gradient from autograd to ``step()`` (ownership, DDP, the reduction
  scheduler, the factor, the loss scaler);
* 4 ``contract/``: the ``torch.optim``-like contract (base class, ``state_dict``, param groups,
  hyperparameters, ``prepare_model``, the registry);
* 5 ``update/``: the step's update (the kernels and their registry, the piecewise update);
* 6 ``flat/`` (ZeRO 0-2) and ``fsdp2/`` (ZeRO-3): the implementations;
* 7 ``whole/``: optimizers that need each parameter whole (ZeRO-3 through ``fsdp2/``'s sharding).

Above them, at level ``TOP``, ``optimizers/__init__.py`` and ``_build.py`` import the rooms'
public names only (each room's ``__init__``); nothing outside ``optimizers/`` imports a module
inside a room."""

TOP = max(ROOMS.values()) + 1
TOP_MODULES = {OPTIMIZERS, f"{OPTIMIZERS}._build"}


def _room(module: str) -> str | None:
    """The room ``module`` belongs to (a room's own ``__init__`` included), else None."""
    if not module.startswith(OPTIMIZERS + "."):
        return None
    room = module[len(OPTIMIZERS) + 1 :].split(".")[0]
    return room if room in ROOMS else None


def _room_edges() -> list[tuple[str, str]]:
    """Every import edge from a module of one room to a module of another."""
    return [
        (module, target)
        for module, targets in GRAPH.items()
        for target in targets
        if _room(module) and _room(target) and _room(module) != _room(target)
    ]


def test_optimizers_hold_no_module_outside_a_room() -> None:
    """Only the public ``__init__`` and ``_build`` stay at the top of ``optimizers/``; every
    room is a package, and inside a room modules drop the underscore."""
    optimizers = {m for m in MODULES if m == OPTIMIZERS or m.startswith(OPTIMIZERS + ".")}
    outside = sorted(m for m in optimizers - TOP_MODULES if _room(m) is None)
    assert not outside, outside
    for room in ROOMS:
        assert MODULES[f"{OPTIMIZERS}.{room}"].name == "__init__.py", room
    private = sorted(m for m in optimizers if _room(m) and m.rpartition(".")[2].startswith("_"))
    assert not private, private


def test_every_import_between_rooms_points_to_a_lower_room() -> None:
    upward = sorted(
        f"{module} -> {target}"
        for module, target in _room_edges()
        if ROOMS[_room(target) or ""] >= ROOMS[_room(module) or ""]
    )
    assert not upward, upward
    assert len(_room_edges()) > 0  # the graph sees the rooms


def test_the_top_of_the_optimizers_imports_the_rooms_public_names_only() -> None:
    """``optimizers/__init__.py`` and ``_build.py`` import rooms' ``__init__`` (and each other),
    and no room imports them."""
    for module in TOP_MODULES:
        inside = sorted(t for t in GRAPH[module] if _room(t) and t.count(".") > 2)
        assert not inside, (module, inside)
    for module, targets in GRAPH.items():
        if _room(module):
            assert not targets & TOP_MODULES, (module, sorted(targets & TOP_MODULES))


def test_the_checkpointer_and_the_integrations_import_no_module_inside_a_room() -> None:
    """Outside ``optimizers/`` (the checkpointer, the integrations, the demo, the command line)
    only ``dtypeplan.optimizers`` and the rooms' public names (their ``__init__``) are
    imported; each room's ``__init__`` lists them in ``__all__``."""
    outside = [m for m in GRAPH if not m.startswith(OPTIMIZERS)]
    assert any(m.startswith("dtypeplan.checkpoint.") for m in outside)
    assert any(m.startswith("dtypeplan.integrations.") for m in outside)
    for module in outside:
        inside = sorted(t for t in GRAPH[module] if _room(t) and t.count(".") > 2)
        assert not inside, (module, inside)
        assert f"{OPTIMIZERS}._build" not in GRAPH[module], module
    import importlib

    for room in ROOMS:
        package = importlib.import_module(f"{OPTIMIZERS}.{room}")
        names = package.__all__
        assert len(set(names)) == len(names), room
        assert all(hasattr(package, name) for name in names), room
