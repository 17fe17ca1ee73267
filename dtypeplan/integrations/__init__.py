"""Training frameworks driving a dtypeplan optimizer: HF Trainer, Accelerate, Lightning.

Each integration uses its framework's own extension point and imports the framework only when
one of its names is first used, so none of them is a dependency of dtypeplan::

    from dtypeplan.integrations import DtypeplanTrainer       # transformers.Trainer subclass
    from dtypeplan.integrations import DtypeplanAccelerator   # accelerate.Accelerator subclass
    from dtypeplan.integrations import DtypeplanStrategy      # lightning Strategy

What each one changes against the framework's defaults, and why, is the same:

* the model is not wrapped in DistributedDataParallel: the optimizer reduces the gradients
  itself (in the plan's wire dtype), so a DDP all-reduce would be redundant;
* the framework's mixed precision (autocast, GradScaler) is off: the plan decides every dtype;
* gradient clipping and the gradient norm the framework logs go through the optimizer's
  ``clip_grad_norm_`` (the gradients live in the optimizer, not in ``.grad``);
* the optimizer state is saved and loaded with :mod:`dtypeplan.checkpoint` on every rank (each
  rank holds its own shard; the frameworks' ``optimizer.state_dict()`` from rank 0 would give
  rank 1 the wrong shard), and model weights are written as the fp32 master weights by name
  (:func:`dtypeplan.checkpoint.export_model_state`), at every ZeRO stage.

Modules: ``hf_trainer``, ``hf_accelerate``, ``lightning_strategy`` (one framework each) and
``_common`` (finding the dtypeplan optimizer inside a framework's wrapper).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DtypeplanAccelerator", "DtypeplanStrategy", "DtypeplanTrainer"]

_MODULE_OF = {
    "DtypeplanTrainer": "dtypeplan.integrations.hf_trainer",
    "DtypeplanAccelerator": "dtypeplan.integrations.hf_accelerate",
    "DtypeplanStrategy": "dtypeplan.integrations.lightning_strategy",
}


def __getattr__(name: str) -> Any:
    # Importing a framework costs seconds (and may not be installed): only on first use.
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name]), name)
    raise AttributeError(f"module 'dtypeplan.integrations' has no attribute {name!r}")
