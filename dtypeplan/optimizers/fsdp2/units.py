"""Which modules ZeRO-3 shards as FSDP2 units: one per block, tied parameters kept together.

An FSDP2 unit (one ``fully_shard`` call) is what is all-gathered before its forward and freed
after, so the units bound the memory of the gathered parameters. Like torchtitan, which calls
``fully_shard`` on every transformer block and then on the root, the default units are:

* every module held by a ``ModuleList``, ``ModuleDict`` or ``Sequential``, at any depth
  (``model.layers[i]``, ``model.transformer.h[i]``, ``model.model.layers[i]``): the
  repeated blocks;
* every top-level child that is not such a container (embeddings, final norm, head).

Containers are never units by default, ``Sequential`` included although it has a forward:
models often iterate a container and call its blocks (``for layer in self.layers``), so the
container's own forward, which FSDP2 hooks to gather a unit, may never run. The blocks then
hold every parameter, and a unit would add nothing.
* then the root (by the caller), which takes every parameter no unit took.

``wrap`` replaces the first two: a set of module classes (``{LlamaDecoderLayer}``) or a
callable ``module -> bool``. The root is always a unit (except under a pipeline, see
``fsdp2/optimizer.py``).

Never a unit: a container without ``forward`` (``ModuleList``, ``ModuleDict``), which FSDP2
cannot hook; a module without parameters; and a module holding a parameter that is also held
outside it. Tied parameters (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) must
live in one unit, and FSDP2 refuses a unit whose parameter another unit shares. Such a module
is left to the nearest enclosing unit that holds every module sharing the parameter (at worst
the root), so the tie is never broken. The default policy does that silently (the embedding
and the head then share the root unit, as in torchtitan's tied configurations); a ``wrap``
that asked for such a module gets a warning naming the parameter.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn

from dtypeplan.errors import PrecisionConfigError
from dtypeplan.optimizers.contract.base import WrapPolicy

__all__ = ["choose_units", "is_container", "uncovered_parameters"]


def is_container(module: nn.Module) -> bool:
    """Whether ``module`` has no ``forward`` of its own (FSDP2 cannot shard it as a unit)."""
    return type(module).forward is nn.Module.forward


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _default_policy(model: nn.Module) -> Callable[[nn.Module], bool]:
    blocks = {
        id(child)
        for module in model.modules()
        if isinstance(module, _CONTAINERS)
        for child in module.children()
    }
    top = {id(child) for child in model.children() if not isinstance(child, _CONTAINERS)}
    return lambda module: id(module) in blocks or id(module) in top


def _policy(model: nn.Module, wrap: WrapPolicy | None) -> Callable[[nn.Module], bool]:
    if wrap is None:
        return _default_policy(model)
    if callable(wrap) and not isinstance(wrap, type):
        return wrap
    classes = (wrap,) if isinstance(wrap, type) else tuple(wrap)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise PrecisionConfigError(
            f"prepare_model(wrap=...) takes a callable module -> bool or a set of nn.Module "
            f"classes, not {wrap!r}"
        )
    return lambda module: isinstance(module, classes)


def _owner(name: str) -> str:
    """The path of the module that holds parameter ``name`` directly ('' for the root)."""
    return name.rsplit(".", 1)[0] if "." in name else ""


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root + ".") for root in roots)


def choose_units(model: nn.Module, wrap: WrapPolicy | None = None) -> list[nn.Module]:
    """The modules to ``fully_shard`` before the root, every one after the units inside it.

    Raises :class:`PrecisionConfigError` if ``wrap`` selects a container without ``forward``.
    """
    selected = _policy(model, wrap)
    paths: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
    holders: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(_owner(name))
        names.setdefault(id(param), name)
    units: list[nn.Module] = []
    covered: set[int] = set()  # parameters of the units chosen so far
    # Reversed pre-order: every module comes after all the modules inside it.
    for path, module in reversed(list(model.named_modules())):
        if module is model or not selected(module):
            continue
        if is_container(module):
            if wrap is None:
                continue
            raise PrecisionConfigError(
                f"prepare_model(wrap=...) chose {path} ({type(module).__name__}), which has no "
                "forward: FSDP2 can only shard modules that run. Choose the modules it holds"
            )
        params = [p for p in module.parameters() if id(p) not in covered]
        if not params:
            continue  # nothing of its own: the units inside it hold every parameter
        mine = paths[id(module)]
        shared = [p for p in params if not all(_inside(h, mine) for h in holders[id(p)])]
        if shared:
            if wrap is not None:
                tied = names[id(shared[0])]
                others = [h for h in holders[id(shared[0])] if not _inside(h, mine)]
                warnings.warn(
                    f"ZeRO-3: {path} is not sharded as a unit of its own: its parameter {tied} "
                    f"is tied to {', '.join(o or '<root>' for o in others)}; it is sharded "
                    "with the enclosing unit that holds both",
                    stacklevel=4,
                )
            continue
        units.append(module)
        covered.update(id(p) for p in params)
    return units


def uncovered_parameters(model: nn.Module, units: list[nn.Module]) -> list[str]:
    """Names of ``model``'s trainable parameters that no module of ``units`` holds."""
    covered = {id(p) for unit in units for p in unit.parameters()}
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
