"""The launched recipes with an optimizer that needs each parameter whole
(tests/test_whole_launchers.py): DeepSpeed's ``"Muon"`` block they train with, and what a rank
holds at the end: which optimizer really ran, and the parameters as this rank holds them
against the masters.

A framework logs one rank's loss and saves one rank's weights: a rank that trained its own way
(DeepSpeed's Muon did at ZeRO-1/2, deepspeedai/DeepSpeed#8090) would not show there, and a
fallback to another optimizer would train too. So each rank reports:

* ``implementation``, ``stage`` and ``inner`` (the torch class that steps), and ``owned``: each
  parameter this rank updates, with the names of the states the class keeps for it (Muon's
  ``momentum_buffer``, AdamW's moments, Adafactor's ``row_var``/``col_var``);
* ``held``: a digest of each parameter as this rank holds it (ZeRO-3's shards gathered whole),
  and ``masters_as_held``: the digest of its fp32 master cast to the held dtype. Equal on both
  ranks, and equal to each other, the ranks hold the same model, the one the masters say;
  ``masters``: the digest of each fp32 master (what the framework should save).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor

MUON_LR, ADAM_LR = 0.02, 3e-3
MUON_BLOCK = {"type": "Muon", "params": {"lr": "auto", "adam_lr": ADAM_LR, "weight_decay": 0.01}}
"""DeepSpeed's Muon (Muon on the hidden matrices, AdamW on the rest) as its docs write the
block; the recipes fill its lr (``MUON_LR``) as they fill AdamW's."""


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().flatten().view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def what_ran(optimizer: Any, model: torch.nn.Module) -> dict[str, Any]:
    """This rank's facts (a collective at ZeRO 1-3: every rank calls it, in the same order).
    ``optimizer``: the framework's (a wrapper of) the dtypeplan optimizer; ``model``: the
    module whose ``named_parameters()`` it trains."""
    from dtypeplan.checkpoint import export_model_state
    from dtypeplan.integrations._common import find_optimizer

    own = find_optimizer(optimizer)
    assert own is not None, f"{type(optimizer).__name__} is not a dtypeplan optimizer"
    masters = export_model_state(own, model)
    names = {id(p): n for n, p in model.named_parameters()}
    held, from_masters, fp32 = {}, {}, {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        held[name] = digest(full)
        from_masters[name] = digest(masters[name].to(full.dtype))
        fp32[name] = digest(masters[name])
    whole = own.plan.implementation == "whole"  # else a fallback: the test names it
    inner = own.inner if whole else own
    return {
        "implementation": own.plan.implementation,
        "stage": own.plan.zero_stage,
        "inner": f"{type(inner).__module__}.{type(inner).__qualname__}",
        "owned": {
            names[id(own.params[index])]: sorted(inner.state[master])
            for index, master in (own.masters.items() if whole else ())
        },
        "held": held,
        "masters_as_held": from_masters,
        "masters": fp32,
    }
