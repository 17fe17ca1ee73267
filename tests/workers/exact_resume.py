"""Worker functions for ``tests/test_exact_resume.py``: same-layout round trips that must restore
every state bit, the torch load order with Kahan masters, and hyperparameters changed on one
rank after build. Run in this process (one rank) and on a spawned 2-rank group.

Every case trains ``tests/workers/checkpoint.py``'s model and data (a fixed global batch split
over the ranks), so a resumed run can be compared bitwise with the uninterrupted one.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

import dtypeplan
from dtypeplan import checkpoint
from dtypeplan.optimizers.state import storage
from tests._helpers import make_batch, make_model
from tests.workers.checkpoint import capture, train

MASTERS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16-nearest": {"master_weights": {"dtype": "bf16", "rounding": "nearest"}},
    "bf16-stochastic": {"master_weights": {"dtype": "bf16", "rounding": "stochastic"}},
    "bf16-kahan": {"master_weights": {"dtype": "bf16", "rounding": "kahan"}},
}
STATES = ("fp32", "bf16", "int8", "fp8")
STEPS_BEFORE, STEPS_AFTER = 3, 3
BUCKET = 300
"""Several buckets: a master chunk holds several parameter pieces (segments)."""


SGD_MOMENTA = (0.0, 0.9)
"""SGD keeps no step count (and, without momentum, no state at all): its stochastic rounding
counts its own steps (``keys.ROUNDING_STEP``)."""


def config(
    master: str, states: str, stage: int, lr: float = 1e-2, sgd_momentum: float | None = None
) -> dict[str, Any]:
    optimizer: dict[str, Any] = {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}}
    if sgd_momentum is not None:
        optimizer = {"type": "SGD", "params": {"lr": lr, "momentum": sgd_momentum}}
    return {
        "bf16": {"enabled": True},
        **MASTERS[master],
        "optimizer_states": states,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET},
        "optimizer": optimizer,
    }


def build(
    cfg: dict[str, Any], seed: int = 0
) -> tuple[torch.nn.Module, dtypeplan.MixedPrecisionOptimizer]:
    plan = dtypeplan.resolve(cfg)
    assert plan.status == "OK", plan.explain()
    model = plan.prepare_model(make_model(seed))
    return model, plan.build(model.parameters())


def state_bits(opt: dtypeplan.MixedPrecisionOptimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the optimizer's inner states hold (quantized moments as their codes and
    scales, the Kahan compensation), as raw bytes, in a fixed order."""
    out = []
    for position, slot in enumerate(opt.inner.state.values()):
        for name in sorted(slot):
            value = slot[name]
            if not torch.is_tensor(value):
                out.append((f"{position}.{name}", torch.tensor([float(value)])))
                continue
            for part, tensor in enumerate(storage.state_tensors(value)):
                raw = tensor.detach().reshape(-1).clone().cpu()
                raw = raw.view(torch.uint8) if raw.numel() else raw
                out.append((f"{position}.{name}.{part}.{tensor.dtype}", raw))
    return out


def _local(param: torch.Tensor) -> torch.Tensor:
    """A parameter's local values (a ZeRO-3 rank's shard), detached."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.detach()


def param_bits(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters' local values (a ZeRO-3 rank's shards) as raw bytes."""
    return [_local(p).reshape(-1).clone().cpu().view(torch.uint8) for p in model.parameters()]


def differing(a: list[Any], b: list[Any]) -> list[str]:
    """What differs between two :func:`state_bits` (or :func:`param_bits`) lists."""
    if len(a) != len(b):
        return [f"{len(a)} tensors against {len(b)}"]
    out = []
    for index, (x, y) in enumerate(zip(a, b, strict=True)):
        name_x, x = x if isinstance(x, tuple) else (str(index), x)
        name_y, y = y if isinstance(y, tuple) else (str(index), y)
        if name_x != name_y or x.shape != y.shape or not torch.equal(x, y):
            count = int((x != y).sum()) if x.shape == y.shape else -1
            out.append(f"{name_x}/{name_y}: {count} bytes differ")
    return out


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def round_trip(cfg: dict[str, Any], how: str, directory: str) -> dict[str, Any]:
    """Train, save (``state_dict`` or ``checkpoint``), load into a fresh optimizer of the same
    layout (another init): what differs in its states and parameters, and whether it trains on
    bitwise as the uninterrupted one."""
    model, opt = build(cfg)
    train(model, opt, range(STEPS_BEFORE))
    saved = opt.state_dict() if how == "state_dict" else None
    if how == "checkpoint":
        checkpoint.save(opt, directory)
    want_states, want_params = state_bits(opt), param_bits(model)
    losses = train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    model2, opt2 = build(cfg, seed=9)
    if saved is not None:
        opt2.load_state_dict(saved)
    else:
        checkpoint.load(opt2, directory)
    got_states, got_params = state_bits(opt2), param_bits(model2)
    losses2 = train(model2, opt2, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return {
        "states": differing(got_states, want_states),
        "params": differing(got_params, want_params),
        "same_run": losses2 == losses and not differing(param_bits(model2), param_bits(model)),
    }


def torch_order_resume(cfg: dict[str, Any], how: str, order: str, directory: str) -> dict[str, Any]:
    """Train, save the model's and the optimizer's state; resume in a fresh model and optimizer
    loading them in ``order`` (``model_first``: torch's usual order); report whether the
    resumed run's losses and weights are bitwise the uninterrupted run's."""
    model, opt = build(cfg)
    train(model, opt, range(STEPS_BEFORE))
    weights = model_state(model)
    saved = opt.state_dict() if how == "state_dict" else None
    if how == "checkpoint":
        checkpoint.save(opt, directory)
    losses = train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    model2, opt2 = build(cfg, seed=9)

    def load_optimizer() -> None:
        if saved is not None:
            opt2.load_state_dict(saved)
        else:
            checkpoint.load(opt2, directory)

    if order == "model_first":
        model2.load_state_dict(weights)
        load_optimizer()
    else:
        load_optimizer()
        model2.load_state_dict(weights)
    losses2 = train(model2, opt2, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return {
        "losses": losses2 == losses,
        "params": differing(param_bits(model2), param_bits(model)),
    }


def lr_changed_on_one_rank(cfg: dict[str, Any], changed_rank: int) -> dict[str, Any]:
    """Build on every rank, then change ``lr`` of param group 1 on ``changed_rank`` only (a
    scheduler one rank steps) and train: the step must fail on every rank, naming the group,
    the hyperparameter and the ranks, before any weight moves apart."""
    plan = dtypeplan.resolve(cfg)
    model = plan.prepare_model(make_model(0))
    params = list(model.parameters())
    opt = plan.build([{"params": params[:2]}, {"params": params[2:]}])
    train(model, opt, range(1))
    before = param_bits(model)
    if dist.get_rank() == changed_rank:
        opt.param_groups[1]["lr"] *= 0.5
    result = capture(lambda: train(model, opt, range(1, 3)))
    result.pop("trace", None)
    result["params_unchanged"] = not differing(param_bits(model), before)
    return result


def all_reduces_per_step(cfg: dict[str, Any]) -> dict[str, Any]:
    """The sizes of the all-reduces of one step with the hyperparameter check on and off (the
    check must add values to an existing all-reduce, not a collective), and whether a run
    without the check ends bitwise where the one with it does (it changes no number)."""
    model, opt = build(cfg)
    train(model, opt, range(1))
    sizes: list[list[int]] = []
    original = dist.all_reduce
    slots = opt.hyperparameter_check.numel
    for enabled in (True, False):
        opt.hyperparameter_check.enabled = enabled
        calls: list[int] = []

        def counted(
            tensor: torch.Tensor, *args: Any, calls: list[int] = calls, **kwargs: Any
        ) -> Any:
            calls.append(tensor.numel())
            return original(tensor, *args, **kwargs)

        with mock.patch.object(dist, "all_reduce", counted):
            train(model, opt, range(1, 2))
        sizes.append(calls)
    unchecked_model, unchecked = build(cfg)
    unchecked.hyperparameter_check.enabled = False
    for steps in (range(1), range(1, 2), range(1, 2)):  # the same batches as above
        train(unchecked_model, unchecked, steps)
    same = not differing(param_bits(unchecked_model), param_bits(model))
    return {"sizes": sizes, "slots": slots, "same_numbers": same}


def group_cases(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Everything multi-rank, on one spawned group."""
    out: dict[str, Any] = {}
    for stage in (1, 3):
        # int8 first moment, fp8 second: both quantized formats in one run.
        cfg = config("bf16-kahan", "fp32", stage)
        cfg["optimizer_states"] = {"exp_avg": "int8", "exp_avg_sq": "fp8"}
        for how in ("state_dict", "checkpoint"):
            directory = os.path.join(root, f"rt-{stage}-{how}")
            out[f"round_trip/{stage}/{how}"] = round_trip(cfg, how, directory)
        for how in ("state_dict", "checkpoint"):
            for order in ("model_first", "optimizer_first"):
                directory = os.path.join(root, f"order-{stage}-{how}-{order}")
                out[f"order/{stage}/{how}/{order}"] = torch_order_resume(
                    config("bf16-kahan", "fp32", stage), how, order, directory
                )
    for stage, master, momentum in SKIPPED_STEP_CASES:
        key = skipped_step_key(stage, master, momentum)
        directory = os.path.join(root, key.replace("/", "-"))
        out[key] = skipped_step_resume(
            skipping_config(master, stage, momentum), "checkpoint", directory
        )
    for stage in (0, 2, 3):
        out[f"lr/{stage}"] = lr_changed_on_one_rank(config("fp32", "fp32", stage), 1)
        out[f"all_reduces/{stage}"] = all_reduces_per_step(config("fp32", "fp32", stage))
    return out


SKIPPED_STEP_CASES: list[tuple[int, str, float | None]] = [
    (1, "bf16-stochastic", None),
    (2, "bf16-kahan", None),
    (3, "bf16-nearest", None),
    (3, "bf16-stochastic", None),
    (3, "bf16-kahan", None),
    (3, "bf16-stochastic", 0.9),
]
"""The 2-rank resumes after skipped steps through ``dtypeplan.checkpoint``: ``(stage, masters,
SGD momentum or None for AdamW)``; the hybrid 2 x 2 ZeRO-2 ones run in the 4-rank group of
``tests/workers/checkpoint.py`` (:data:`HYBRID_SKIPPED_STEP_CASES`)."""
HYBRID_SKIPPED_STEP_CASES: list[tuple[int, str, float | None]] = [
    (2, "bf16-nearest", None),
    (2, "bf16-stochastic", None),
    (2, "bf16-kahan", None),
    (2, "bf16-stochastic", 0.0),
]


def skipped_step_key(stage: int, master: str, momentum: float | None) -> str:
    optimizer = "AdamW" if momentum is None else f"SGD-{momentum}"
    return f"skipped/{stage}/{master}/{optimizer}"


def skipping_config(
    master: str, stage: int, momentum: float | None, shard_group_size: int | None = None
) -> dict[str, Any]:
    """:func:`config` with the non-finite check on (the NaN steps of :func:`_train_skipping`
    are skipped whole), on a hybrid layout where ``shard_group_size`` is given."""
    cfg = config(master, "fp32", stage, sgd_momentum=momentum)
    cfg["check_nonfinite"] = True
    if shard_group_size is not None:
        cfg["zero_optimization"]["shard_group_size"] = shard_group_size
    return cfg


def spawned_group(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        # Every rank must see the same checkpoint directory: rank 0's, broadcast.
        names = [scratch]
        dist.broadcast_object_list(names, src=0)
        result = group_cases(rank, world_size, names[0])
        dist.barrier()
    return result


class _SometimesHead(torch.nn.Module):
    """``make_model``'s MLP plus a head used only on even steps: on odd steps no rank gives
    the head a gradient, so torch (and the engine) skips it and it keeps its own step count."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.body = make_model(seed)
        generator = torch.Generator().manual_seed(seed + 1)
        self.head = torch.nn.Linear(6, 6)
        with torch.no_grad():
            for param in self.head.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        self.use_head = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return y + self.head(y) if self.use_head else y


NONFINITE_STEPS = (1, 4)
"""Steps whose loss is made NaN (with ``check_nonfinite`` on): every parameter skips them, one
before the save and one after."""


def _train_skipping(model: _SometimesHead, opt: Any, steps: range) -> list[float]:
    nonfinite = bool(opt.plan.check_nonfinite)
    losses = []
    for step in steps:
        model.use_head = step % 2 == 0
        x, y = make_batch(100 + step, 8)
        opt.zero_grad()
        loss = (model(x.to(torch.bfloat16)).float() - y).square().mean()
        losses.append(float(loss.detach()))
        if nonfinite and step in NONFINITE_STEPS:
            loss = loss * float("nan")
        opt.backward(loss)
        opt.step()
    return losses


def skipped_step_resume(cfg: dict[str, Any], how: str, directory: str) -> dict[str, Any]:
    """Issue 29 item 4: train with a head that skips every other step (and, with
    ``check_nonfinite`` on, steps that every parameter skips), save, resume into a fresh
    optimizer (another init): whether it trains on bitwise as the uninterrupted run. Any
    layout (the parameters compared are each rank's local values)."""
    plan = dtypeplan.resolve(cfg)
    assert plan.status == "OK", plan.explain()
    model = plan.prepare_model(_SometimesHead(0))
    opt = plan.build(model.parameters())
    _train_skipping(model, opt, range(STEPS_BEFORE))
    saved = opt.state_dict() if how == "state_dict" else None
    if how == "checkpoint":
        checkpoint.save(opt, directory)
    skipped = opt.skipped_steps
    losses = _train_skipping(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    model2 = plan.prepare_model(_SometimesHead(9))
    opt2 = plan.build(model2.parameters())
    if saved is not None:
        opt2.load_state_dict(saved)
    else:
        checkpoint.load(opt2, directory)
    resumed_skipped = opt2.skipped_steps
    losses2 = _train_skipping(model2, opt2, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    got, want = param_bits(model2), param_bits(model)
    diff = [
        float((_local(a).float() - _local(b).float()).abs().max())
        for a, b in zip(model2.parameters(), model.parameters(), strict=True)
        if _local(a).numel()
    ]
    return {
        "same_run": losses2 == losses and not differing(got, want),
        "max_diff": max(diff),
        "skipped": (skipped, resumed_skipped, opt.skipped_steps),
    }
