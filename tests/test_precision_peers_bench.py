"""The peers benchmark's "as in training" mode feeds each optimizer exactly the fixed gradients
(``benchmarks/bench_precision_peers.py``): the same steps as with ``.grad`` set by hand."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_precision_peers import (
    CELLS,
    Case,
    _stepper,
    check_linear_loss,
    dtypeplan_case,
    peer_case,
)

SHAPES = [torch.Size((64, 64)), torch.Size((32, 16))]


def _grads() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(shape, generator=generator) * 1e-3 for shape in SHAPES]


def _steps(case: Case, grads: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    given: list[torch.Tensor] = []
    prepare, step = _stepper(case, grads, given)
    for _ in range(n):
        prepare()
        step()
    return [p.detach().clone() for p in case.params]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_training_loss_has_exactly_the_fixed_gradient(dtype: torch.dtype) -> None:
    check_linear_loss(_grads(), dtype)


@pytest.mark.parametrize(
    "name", ["fp32 / fp32 / fp32", "bf16 / bf16 nearest / bf16", "torch fused bf16"]
)
def test_as_in_training_steps_like_hand_set_gradients(name: str) -> None:
    """Three steps through a backward give the parameters that three hand-set steps give,
    bit for bit (dtypeplan and a peer)."""
    grads = _grads()
    cells = {cell.name: cell for cell in CELLS}

    def build(training: bool) -> Case:
        if name in cells:
            return dtypeplan_case(cells[name], SHAPES, training=training)
        built = peer_case(name, SHAPES, training=training)
        assert built is not None
        return built

    hand_set, training = build(False), build(True)
    assert hand_set.backward is None and training.backward is not None
    for a, b in zip(_steps(hand_set, grads, 3), _steps(training, grads, 3), strict=True):
        assert torch.equal(a, b)
