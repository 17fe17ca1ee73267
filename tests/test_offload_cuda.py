"""Optimizer offload on CUDA (skipped without it; ``benchmarks/gpu/run_all.sh`` runs it).

What only a GPU shows: the masters and states are pinned host memory, the device holds no
master or state (its allocated bytes after build are the plain run's less those), the copies
are asynchronous and waited for as buffers/host_offload.py says (2 per bucket chunk for bf16
parameters), and the offloaded run
trains as the plain one does, within bf16 rounding (the host's fused Adam may round the fp32
update differently from the device's kernel).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dtypeplan
from tests._helpers import make_batch, make_model, mse

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BF16_ULP = 2.0**-8


def _config(offload: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 2, "reduce_bucket_size": 300}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
    }


def _train(offload: bool) -> dict[str, Any]:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    plan = dtypeplan.resolve(_config(offload))
    model = plan.prepare_model(make_model(0).cuda())
    opt = plan.build(model.parameters())
    losses = []
    for step in range(4):
        x, y = make_batch(step, 16)
        loss = mse(model, x.cuda(), y.cuda())
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    torch.cuda.synchronize()
    held = opt.held_tensors()
    return {
        "losses": losses,
        "params": [p.detach().float().cpu() for p in model.parameters()],
        "device_bytes": torch.cuda.memory_allocated() - before,
        "held": held,
        "opt": opt,
    }


def test_offloaded_step_on_cuda() -> None:
    plain, offloaded = _train(False), _train(True)
    held = offloaded["held"]
    for tensor in held.master + held.optimizer_states:
        assert tensor.device.type == "cpu" and tensor.is_pinned()
    figures = held.nbytes()
    # The device no longer holds the masters and states the plain run holds there.
    saved = plain["held"].nbytes()["master"] + plain["held"].nbytes()["optimizer_states"]
    assert offloaded["device_bytes"] <= plain["device_bytes"] - saved + 64 * 1024, (
        offloaded["device_bytes"],
        plain["device_bytes"],
        saved,
    )
    assert figures["host_total"] == saved
    opt = offloaded["opt"]
    chunks = sum(len(state.masters) for state in opt.groups)
    assert chunks > 2
    # Per step: C gradient copies, C - 2 parameter slots reused, the factor, the last upload.
    assert opt.offload.device_waits == 4 * (chunks + (chunks - 2) + 2)
    for mine, ref in zip(offloaded["losses"], plain["losses"], strict=True):
        assert abs(mine - ref) <= 1e-2 * abs(ref)
    for mine, ref in zip(offloaded["params"], plain["params"], strict=True):
        # 4 steps, each at most one bf16 rounding apart per weight.
        assert (mine - ref).abs().max() <= 4 * BF16_ULP * ref.abs().max()
