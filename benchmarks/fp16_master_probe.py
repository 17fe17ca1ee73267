"""Can fp16 master weights be sound? Final loss after 200 AdamW steps against fp32 torch.

    python -m benchmarks.fp16_master_probe

The 3-layer MLP of the tests in fp16 (static loss scale 1024), updated by torch's fused AdamW
in fp32 and written back into fp16 masters as ``update/pieces.py`` would: rounded to
nearest (DeepSpeed's ``fp16_master_weights_and_grads``) or with an fp16 Kahan compensation
(``kernels/rounding.py``), next to fp32 masters. "lost" is the share of elementwise updates
after which the fp16 weight did not move (rounded away with nearest; held by the fp32 master or
the compensation otherwise). Then small weights: 1000 updates of ``delta`` on one weight kept as
an fp16 or a bf16 Kahan pair, and the share of the movement the pair lost. Evidence for the rule
``master-weights-fp16-with-fp16-params`` (not a test: the cell is NotSupported).
"""

from __future__ import annotations

import torch

from dtypeplan.optimizers.kernels.rounding import kahan_load, kahan_store
from tests._helpers import make_batch, make_model, mse

STEPS, LOSS_SCALE = 200, 1024.0
MODES = ("fp32 masters", "fp16 nearest", "fp16 kahan")


def final_loss(mode: str | None, lr: float) -> tuple[float, float]:
    """Final loss and share of lost updates; ``mode`` None trains plain fp32 torch."""
    model = make_model(0)
    if mode is None:
        reference = torch.optim.AdamW(model.parameters(), lr=lr)
        for step in range(STEPS):
            x, y = make_batch(step % 16, 64)
            reference.zero_grad()
            loss = mse(model, x, y)
            loss.backward()
            reference.step()
        return float(loss.detach()), 0.0
    fp32_values = [p.detach().clone() for p in model.parameters()]
    params = list(model.half().parameters())
    compensations = [torch.zeros_like(p) for p in params]
    work = [
        v if mode == "fp32 masters" else p.detach().float()
        for p, v in zip(params, fp32_values, strict=True)
    ]
    optimizer = torch.optim.AdamW(work, lr=lr, fused=True)
    lost = moved = 0
    for step in range(STEPS):
        x, y = make_batch(step % 16, 64)
        for param in params:
            param.grad = None
        loss = mse(model, x, y)
        (loss * LOSS_SCALE).backward()
        with torch.no_grad():
            for weights, param, compensation in zip(work, params, compensations, strict=True):
                if mode == "fp16 kahan":
                    kahan_load(param, compensation, weights)
                elif mode == "fp16 nearest":
                    weights.copy_(param)
                weights.grad = param.grad.float() / LOSS_SCALE
            before = [w.clone() for w in work]
            optimizer.step()
            for weights, param, compensation, old in zip(
                work, params, compensations, before, strict=True
            ):
                stored = param.clone()
                if mode == "fp16 kahan":
                    kahan_store(weights.clone(), param, compensation)
                else:
                    param.copy_(weights)
                changed = weights != old
                lost += int(((param == stored) & changed).sum())
                moved += int(changed.sum())
    return float(loss.detach()), lost / max(moved, 1)


def kahan_pair_error(weight: float, delta: float, dtype: torch.dtype) -> float:
    """Share of 1000 updates of ``delta`` that a Kahan pair in ``dtype`` loses."""
    master = torch.tensor([weight], dtype=dtype)
    compensation = torch.zeros(1, dtype=dtype)
    scratch = torch.empty(1)
    for _ in range(1000):
        kahan_load(master, compensation, scratch)
        scratch += delta
        kahan_store(scratch, master, compensation)
    held = float(master.float() + compensation.float())
    return abs(held - (weight + 1000 * delta)) / (1000 * delta)


def main() -> None:
    for lr in (1e-2, 1e-3, 1e-4, 1e-5):
        reference, _ = final_loss(None, lr)
        row = [f"lr {lr:g}: fp32 torch {reference:.4f}"]
        for mode in MODES:
            final, lost = final_loss(mode, lr)
            row.append(
                f"{mode}: deviation {abs(final - reference) / reference:.1e}, lost {lost:.0%}"
            )
        print(" | ".join(row))
    for weight, delta in ((1e-6, 1e-8), (1e-3, 1e-7)):
        fp16 = kahan_pair_error(weight, delta, torch.float16)
        bf16 = kahan_pair_error(weight, delta, torch.bfloat16)
        print(
            f"Kahan pair, weight {weight:g}, updates {delta:g}: "
            f"lost fp16 {fp16:.1%}, bf16 {bf16:.1%}"
        )


if __name__ == "__main__":
    main()
