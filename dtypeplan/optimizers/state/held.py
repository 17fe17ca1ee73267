"""The tensors one rank holds for the optimizer, by the components of ``plan.memory()``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

__all__ = ["HOST_COMPONENTS", "HeldTensors"]


HOST_COMPONENTS = ("params", "accumulator", "master", "optimizer_states")
"""The components an offload may keep in host memory: ``master`` and ``optimizer_states``
(optimizer offload), and at ZeRO-3 with ``offload_param`` the shards and accumulator too."""


@dataclass(frozen=True, kw_only=True)
class HeldTensors:
    """The tensors one rank holds for the optimizer, by the components of ``plan.memory()``.

    A read-only view for measuring memory: the tensors are the optimizer's own (not copies),
    so count them, never write them. Two components may share a storage (fp32 master weights
    are views of the parameters' flat buffer): count each storage once.
    """

    params: tuple[torch.Tensor, ...]
    """The storage of the parameters the optimizer updates (flat buffers, padding included)."""
    grads: tuple[torch.Tensor, ...]
    """The parameters' own ``.grad`` that exist right now."""
    accumulator: tuple[torch.Tensor, ...]
    """Where micro-batch gradients are summed, with the buffers of reductions under way."""
    master: tuple[torch.Tensor, ...]
    """The fp32 master weights this rank updates (empty where the parameters are the masters)."""
    optimizer_states: tuple[torch.Tensor, ...]
    """Every tensor of the inner ``torch.optim`` state (moments, step counters)."""
    on_host: frozenset[str] = frozenset()
    """The components held in host memory rather than on the device (optimizer offload:
    ``master`` and ``optimizer_states``; ZeRO-3's CPUOffloadPolicy: ``params`` and
    ``accumulator`` too); counted under ``host_<component>`` by :meth:`nbytes`."""

    def items(self) -> Iterator[tuple[str, tuple[torch.Tensor, ...]]]:
        """``(component, tensors)`` in the order of ``plan.memory()``'s keys."""
        for field in fields(self):
            if field.name != "on_host":
                yield field.name, getattr(self, field.name)

    def nbytes(self) -> dict[str, int]:
        """Bytes per component and ``total``, each storage counted once, whole.

        Whole storages include the flat buffers' bucket padding; a storage shared between
        components counts in the first one that holds it, in the order of :meth:`items`. As
        ``plan.memory()``, the device components are ``total``, and those in :attr:`on_host`
        count under ``host_<component>`` and ``host_total`` (the device figure of such a
        component is 0).
        """
        seen: set[int] = set()
        figures: dict[str, int] = {}
        host = dict.fromkeys(HOST_COMPONENTS, 0)
        for component, tensors in self.items():
            figures[component] = 0
            for tensor in tensors:
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                if component in self.on_host:
                    host[component] += storage.nbytes()
                else:
                    figures[component] += storage.nbytes()
        figures["total"] = sum(figures.values())
        for component, nbytes in host.items():
            figures[f"host_{component}"] = nbytes
        figures["host_total"] = sum(host.values())
        return figures
