"""What the built-in implementations serve, in the table's dimension language.

An implementation declares the boxes of combinations it serves (``@register(name,
serves=[...])``); the rules loader refuses an OK rule that sends a combination outside them, so
an edited table cannot claim what no code does. A box names dimensions as a grid rule does: a
core dimension left out takes any value, a feature left out is at its "not used" value.

Every box here is a cell with a parity test against fp32 ``torch.optim`` (tests/test_parity.py,
test_every_optimizer.py, test_optimizer_states.py, test_master_rounding.py, test_autocast.py,
test_offload*.py, test_hpz.py, test_fp8.py): widen a declaration only together with the test.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["FSDP2", "PRECISION_CELLS", "REPLICATED", "SHARDED", "SHARDED_ALONE", "with_fp8"]

Box = dict[str, Any]

_BF16_MASTERS = ["bf16", "bf16_sr", "bf16_kahan"]
_UNQUANTIZED_STATES = ["fp32", "bf16", "fp32/bf16", "bf16/fp32"]

PRECISION_CELLS: tuple[Box, ...] = (
    # fp32 masters: any state dtype for moments; step sizes and averaged weights unquantized.
    {"master": "fp32", "states": "*", "state_kind": "moments"},
    {"master": "fp32", "states": _UNQUANTIZED_STATES, "state_kind": "*"},
    # bf16 parameters as their own masters, each rounding.
    {"params": "bf16", "master": _BF16_MASTERS, "states": "*", "state_kind": "moments"},
    {"params": "bf16", "master": _BF16_MASTERS, "states": _UNQUANTIZED_STATES, "state_kind": "*"},
    # torch_autocast around the forward of fp32 parameters.
    {"params": "fp32", "autocast": ["bf16", "fp16"], "state_kind": "*"},
)
"""The master, state and autocast cells served at every stage."""

_NO_AUTOCAST = PRECISION_CELLS[:4]


def _each(cells: Iterable[Mapping[str, Any]], **where: Any) -> list[Box]:
    return [{**cell, **where} for cell in cells]


def with_fp8(boxes: Iterable[Mapping[str, Any]], **where: Any) -> list[Box]:
    """``boxes`` under fp8 compute (torchao's float8 training of the eligible layers, native or
    emulated): the optimizer's cell is the one without fp8, without a pipeline."""
    return [
        {
            **box,
            "params": [p for p in ("fp32", "bf16") if box.get("params", p) == p],
            "fp8": True,
            "fp8_recipe": "*",
            "fp8_execution": ["native", "emulated"],
            "pipeline": False,
            **where,
        }
        for box in boxes
        if box.get("params") in (None, "fp32", "bf16")
    ]


_STAGE0 = {"stage": 0, "sharded": False}
_STAGE1_2 = ({"stage": 1}, {"stage": 2, "sharded": True})
_ZERO3 = {
    "stage": 3,
    "sharded": True,
    "reduction": "collective",
    "shard_groups": ["flat", "hybrid"],
}
_FP8_WEIGHTS_IN_PARAM_DTYPE = {"fp8_all_gather": "param_dtype"}

REPLICATED: list[Box] = [
    *_each(PRECISION_CELLS, **_STAGE0),
    *with_fp8(_each(_NO_AUTOCAST, **_STAGE0), **_FP8_WEIGHTS_IN_PARAM_DTYPE),
]
"""ZeRO-0 (``flat/``): whole masters and states on every rank."""

_ZERO3_CELLS = [
    *_each(PRECISION_CELLS, **_ZERO3),
    # hpZ: FSDP2's reshard_after_forward=H, fp32 masters and states, no pipeline.
    {
        **_ZERO3,
        "shard_groups": "flat",
        "hierarchical_partitioning": True,
        "pipeline": False,
        "state_kind": "*",
    },
]
# offload_optimizer alone: fp32 masters and states on the host, the device shards fp32.
_ZERO3_OFFLOAD_OPTIMIZER = {
    **_ZERO3,
    "offload_optimizer": "cpu",
    "pipeline": False,
    "state_kind": "*",
}
_ZERO3_FLAT = {**_ZERO3, "shard_groups": "flat"}
_ZERO3_FP8 = [
    *with_fp8(_each(_NO_AUTOCAST, **_ZERO3_FLAT), **_FP8_WEIGHTS_IN_PARAM_DTYPE),
    # The fp8 weight all-gather: tensorwise scales only.
    *with_fp8(_each(_NO_AUTOCAST, **_ZERO3_FLAT), fp8_all_gather="fp8", fp8_recipe="tensorwise"),
]

SHARDED: list[Box] = [
    box
    for stage in _STAGE1_2
    for box in (
        *_each(PRECISION_CELLS, shard_groups="*", **stage),
        # Optimizer offload: fp32 masters and states in host memory, the CPU step.
        {
            **stage,
            "shard_groups": "*",
            "offload_optimizer": "cpu",
            "pipeline": False,
            "state_kind": "*",
        },
        *with_fp8(_each(_NO_AUTOCAST, **stage), **_FP8_WEIGHTS_IN_PARAM_DTYPE),
    )
]
"""ZeRO-1/2 (``flat/``)."""

SHARDED_ALONE: list[Box] = [*_ZERO3_CELLS, *_ZERO3_FP8, _ZERO3_OFFLOAD_OPTIMIZER]
"""ZeRO-3's plan without a process group (nothing to shard over): the flat sharded engine runs
it in one process."""

FSDP2: list[Box] = [
    *_ZERO3_CELLS,
    *_ZERO3_FP8,
    _ZERO3_OFFLOAD_OPTIMIZER,
    # offload_param too (FSDP2's CPUOffloadPolicy): the shards, gradients and states on the host.
    *_each(_NO_AUTOCAST, **_ZERO3, offload_optimizer="cpu", offload_param="cpu", pipeline=False),
]
"""ZeRO-3 on FSDP2 (``fsdp2/``)."""
