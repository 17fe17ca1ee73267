"""The one map between dtype names at the config boundary (``"bf16"``) and ``torch.dtype``."""

from __future__ import annotations

from types import MappingProxyType

import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "dtype_name"]

DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType(
    {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
)
"""Config spelling -> ``torch.dtype``, in the order the table shows them."""

DTYPE_NAMES: MappingProxyType[torch.dtype, str] = MappingProxyType(
    {dtype: name for name, dtype in DTYPES.items()}
)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``; another dtype as torch prints it."""
    return DTYPE_NAMES.get(dtype, str(dtype))
