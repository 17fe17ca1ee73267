"""The step's update in the flat engine: one interface, an ordered registry, one module per family.

Every kernel keeps one interface (``interface.py``: :class:`UpdateKernel`): ``applies(engine)``
says whether it serves the optimizer's plan, device and optimizer class, and
``update(grads, factor, gather)`` updates every master chunk of the step, writing the
parameters and starting their all-gathers through the engine's ``gather`` where asked. The
engine builds the first that applies (``registry.py``) and stays the step's phases.

    host_offload.py   Adam/AdamW on offloaded fp32 masters, on the host between copies
    triton.py         the one-pass Triton AdamW (CUDA; fp32 masters and states)
    torch_fused.py    torch's fused Adam/AdamW per bucket chunk: fp32 masters and states, and
                      the hand-off of 16-bit masters, moments and accumulator of one dtype
    triton_low_precision.py
                      bf16 masters or bf16 moments on CUDA: the one-pass update in Triton
    low_precision.py  16-bit masters or bf16 moments: one pass on the host, else fp32 pieces;
                      int8 / fp8 moments: dequantize, update in fp32, quantize back
    generic.py        any other elementwise optimizer: its own ``inner.step()``

The numerical work stays in the modules the kernels call (``kernels/torch_adam.py``,
``update/pieces.py``, ``kernels/one_pass.py``, ``buffers/host_offload.py``,
``kernels/triton_adamw.py``, ``kernels/triton_one_pass.py``).
"""

from __future__ import annotations

from dtypeplan.optimizers.update.interface import (
    FlatEngine,
    Gather,
    GradsByGroup,
    UpdateKernel,
    write_params,
)
from dtypeplan.optimizers.update.registry import KERNELS, choice_key, choose

__all__ = [
    "KERNELS",
    "FlatEngine",
    "Gather",
    "GradsByGroup",
    "UpdateKernel",
    "choice_key",
    "choose",
    "write_params",
]
