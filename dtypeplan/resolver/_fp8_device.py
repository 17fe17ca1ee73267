"""Whether this process's device runs fp8 matmuls natively: the ``fp8_execution`` dimension's
reading of a config (``_dimensions.FP8_EXECUTION``) and ``explain()``'s note on the device."""

from __future__ import annotations

import torch

__all__ = ["fp8_device_text", "fp8_execution", "fp8_native"]


def fp8_execution(recipe: str, emulate: str) -> str:
    """The ``fp8_execution`` value: ``emulate`` true is emulated; else native where this
    process's accelerator has the recipe's kernels, else emulated (``auto``) or unavailable
    (``false``)."""
    if emulate == "true":
        return "emulated"
    if fp8_native(recipe):
        return "native"
    return "emulated" if emulate == "auto" else "unavailable"


def _capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability; None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def fp8_native(recipe: str) -> bool:
    """Whether this process's device runs ``recipe``'s matmuls natively: fp8 tensor cores from
    compute capability 8.9 (Ada, Hopper), MXFP8's block-scaled ones from 10.0 (Blackwell)."""
    capability = _capability()
    if capability is None:
        return False
    return capability >= ((10, 0) if recipe == "mxfp8" else (8, 9))


def fp8_device_text() -> str:
    capability = _capability()
    if capability is None:
        return "no CUDA device (fp8 emulated on the CPU)"
    return f"CUDA compute capability {capability[0]}.{capability[1]}"
