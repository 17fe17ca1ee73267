"""What ZeRO-3 keeps of the weights besides the shards, and how it follows the shards.

The sharded parameters are the master weights; three things hold values made from them:

* **gathered units**: FSDP2 keeps the root unit gathered from its forward to its backward (it
  never reshards the root after forward), and a unit whose forward no backward follows (a
  forward under ``torch.no_grad()``, an evaluation between backward and ``step()``) stays
  gathered until something reshards it. Its next forward gathers nothing: it computes with
  the values of the last gather.
* **hpZ's secondary partition** (``zero_hpz_partition_size``): after its forward each unit
  keeps its gathered parameters sharded within H ranks for its backward; the next forward
  of a unit left so gathers from it, not from the shards.
* **fp8 scales** (``fp8.all_gather: fp8``): the tensorwise scale each weight's next gather
  casts with, precomputed from the shards' maxima (``contract/fp8_compute.py``).

The shards change outside a forward and backward: ``step()``, ``optimizer.load_state_dict``,
``dtypeplan.checkpoint.load``, ``model.load_state_dict``, an EMA swap or any write under
``torch.no_grad()``. Each copy above must follow, or the next forward and backward compute
with the old weights (fp8: values above the old maximum saturate at 448 / scale). So
(:class:`WeightCopies`, installed on the model by ``sharding.shard_model``):

* after a forward under ``torch.no_grad()`` (no backward follows it) every unit of the model
  is resharded, its gathered parameters and secondary partitions dropped. Between such a
  forward and the next the module holds the shards, so a write lands in them, as after a
  training step. (FSDP2 reshards before ``state_dict`` and ``load_state_dict`` itself.) Cost:
  a forward under ``no_grad`` gathers the root unit each time, as it gathers every other.
* ``step()`` and the optimizer's loads reshard every unit of their parameters' models: a
  forward whose backward never came (a micro-batch dropped for a NaN loss) leaves the root
  gathered.
* the fp8 scales are computed anew at the start of every forward of the model, from the
  shards as they are then (one all-reduce for every weight), so that whatever changed the
  shards, the gathers cast with their scale; ``step()`` and the loads compute them too, for
  an entry point that is not the model's ``forward``.

Not caught: a write into the root's gathered parameters between a forward with gradients and
its backward (the module holds the gathered copy then; FSDP2 drops it at the reshard).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from dtypeplan.optimizers.contract.fp8_compute import fp8_all_gather_weights, precompute_scales
from dtypeplan.optimizers.grads.ownership import ParamWeakMap

__all__ = ["COPIES_OF", "WeightCopies", "copies_of", "follow_the_shards"]

COPIES_OF = ParamWeakMap()
"""Sharded parameter -> the :class:`WeightCopies` of its model (:func:`follow_the_shards`)."""


class WeightCopies:
    """The gathered units, secondary partitions and fp8 scales of one sharded model.

    Holds the units and the fp8 layers weakly (the model owns them, and its hooks own this;
    :data:`COPIES_OF` keeps it as long as a parameter lives). The fp8 layers are in the order
    of the model's parameters, the same on every rank (their scales are reduced in one
    all-reduce, in that order).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._units = [weakref.ref(m) for m in model.modules() if isinstance(m, FSDPModule)]
        self._fp8_layers = [weakref.ref(m) for m in fp8_all_gather_weights(model.parameters())]

    def reshard(self) -> None:
        """Drop every gathered parameter and secondary partition of the model's units: the
        next forward and backward gather from the shards."""
        for ref in self._units:
            unit = ref()
            if unit is None:
                continue
            unit.reshard()
            _drop_secondary(unit)

    def rescale(self) -> None:
        """The fp8 scales from the shards as they are now (collective: one all-reduce)."""
        if self._fp8_layers:
            precompute_scales([layer for ref in self._fp8_layers if (layer := ref()) is not None])


def _drop_secondary(unit: Any) -> None:
    """Free hpZ's secondary partition of ``unit``'s parameters, which ``reshard`` leaves
    allocated (FSDP2 frees it when it next gathers from it, which then never comes)."""
    state = unit._get_fsdp_state()
    for group in getattr(state, "_fsdp_param_groups", ()):
        for fsdp_param in getattr(group, "fsdp_params", ()):
            if getattr(fsdp_param, "_sharded_post_forward_param_data", None) is not None:
                fsdp_param._sharded_post_forward_param = None
                fsdp_param._sharded_post_forward_param_data = None


def follow_the_shards(model: torch.nn.Module) -> WeightCopies:
    """Install :class:`WeightCopies` on ``model`` (sharded already): the fp8 scales computed
    before each forward (before FSDP2's own hook gathers the root), every unit resharded
    after a forward under ``no_grad``; each sharded parameter mapped to it (:data:`COPIES_OF`)."""
    copies = WeightCopies(model)

    def before_forward(*_: Any) -> None:
        copies.rescale()

    def after_forward(*_: Any) -> None:
        if not torch.is_grad_enabled():
            copies.reshard()

    model.register_forward_pre_hook(before_forward, prepend=True)
    model.register_forward_hook(after_forward)
    for param in model.parameters():
        COPIES_OF[param] = copies
    return copies


def copies_of(params: Iterable[torch.Tensor]) -> list[WeightCopies]:
    """The distinct :class:`WeightCopies` of the models holding ``params``, in first-seen order."""
    found: dict[int, WeightCopies] = {}
    for param in params:
        copies = COPIES_OF.get(param)
        if copies is not None:
            found.setdefault(id(copies), copies)
    return list(found.values())
