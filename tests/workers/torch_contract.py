"""Cases of the torch.optim contract (issue 10), run on one process or inside spawned ranks.

Every case is ``fn(rank, world_size, stage, dtype)``; it returns nothing and raises
``AssertionError`` saying what differs from plain fp32 ``torch.optim``. Each rank trains on its
slice of one global batch, so the mean over ranks is the reference's full-batch gradient.
A case may also end in a *clear refusal*: an error raised by dtypeplan whose message says how
to fix the call (see :func:`torch_like_or_refused`), where issue 10 allows that choice.
"""

from __future__ import annotations

import copy
import gc
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dtypeplan
from tests._models import (
    batch,
    decay_groups,
    lm_loss,
    norm_and_frozen,
    regression_loss,
    rel_error,
    tied_lm,
    token_batch,
    two_heads,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp32 against fp32 torch.optim: both are ~20 rounded operations per element and step, over a
# few steps and a forward/backward whose reduction order differs (fused vs foreach kernels,
# sums over ranks): measured ~1e-7, so 1e-5 leaves room and still catches any wrong update
# (one step of lr=1e-2 moves the weights by ~3e-2 relative).
FP32_RTOL = 1e-5
# bf16 keeps 8 mantissa bits (relative rounding 2**-9 = 2e-3 per cast); forward and backward in
# bf16 then Adam's normalisation amplify that over a few steps: tests/test_parity.py measured up
# to 2.1e-3 on the master weights over 4 steps. A wrong or missing update moves them by >3e-2.
BF16_RTOL = 2e-2
# The same, relative to what training changed in each parameter (see Pair.assert_close).
UPDATE_RTOL = 1e-3
BF16_UPDATE_RTOL = 0.5
HYPER: dict[str, Any] = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


def config(stage: int, dtype: str, optimizer: str = "AdamW", **params: Any) -> dict[str, Any]:
    hyper = params if optimizer == "SGD" else {**HYPER, **params}
    cfg: dict[str, Any] = {
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": optimizer, "params": hyper},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    return cfg


def rtol_for(dtype: str) -> float:
    return FP32_RTOL if dtype == "fp32" else BF16_RTOL


def full(param: torch.Tensor) -> torch.Tensor:
    """The whole fp32 value of a parameter (ZeRO-3 parameters are DTensor shards)."""
    value = param.detach()
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return value.float()


def my_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size)[rank]


def clear_refusal(exc: BaseException, hints: tuple[str, ...]) -> bool:
    """An error dtypeplan raised on purpose whose message says what to do instead."""
    message = str(exc).lower()
    return type(exc).__module__.startswith("dtypeplan") and any(h in message for h in hints)


def torch_like_or_refused(action: Callable[[], Any], hints: tuple[str, ...]) -> bool:
    """Run ``action``; True if it ran, False if dtypeplan refused it clearly; else re-raise."""
    try:
        action()
    except Exception as exc:
        if clear_refusal(exc, hints):
            return False
        raise
    return True


class Pair:
    """A dtypeplan-trained model and its plain fp32 torch.optim reference, stepped together."""

    def __init__(
        self,
        stage: int,
        dtype: str,
        model: nn.Module,
        groups: Callable[[nn.Module], Any] | None = None,
        optimizer: str = "AdamW",
        **params: Any,
    ) -> None:
        self.dtype = dtype
        hyper = params if optimizer == "SGD" else {**HYPER, **params}
        self.plan = dtypeplan.resolve(config(stage, dtype, optimizer, **hyper))
        assert self.plan.status == "OK", self.plan.explain()
        self.reference = copy.deepcopy(model)
        self.model = self.plan.prepare_model(model)
        self.groups = groups or (lambda m: m.parameters())
        self.opt = self.plan.build(self.groups(self.model))
        torch_class = getattr(torch.optim, optimizer)
        self.ref_opt = torch_class(self.groups(self.reference), **hyper)
        self.mark_start()

    def mark_start(self) -> None:
        """Remember both models' weights: updates are compared from here."""
        self.start = [full(p).clone() for p in self.model.parameters()]
        self.ref_start = [p.detach().float().clone() for p in self.reference.parameters()]

    def loss(self, model: nn.Module, step: int, rank: int, world: int, **kw: Any) -> torch.Tensor:
        x, y = batch(step, 8 * world)
        if model is self.reference:
            return regression_loss(model, x, y, **kw)
        return regression_loss(model, my_slice(x, rank, world), my_slice(y, rank, world), **kw)

    def step_reference(self, step: int, world: int, **kw: Any) -> None:
        self.ref_opt.zero_grad()
        self.loss(self.reference, step, 0, world, **kw).backward()
        self.ref_opt.step()

    def step_mine(self, step: int, rank: int, world: int, **kw: Any) -> None:
        self.opt.zero_grad()
        self.opt.backward(self.loss(self.model, step, rank, world, **kw))
        self.opt.step()

    def train(self, steps: int, rank: int, world: int, first: int = 0, **kw: Any) -> None:
        for step in range(first, first + steps):
            self.step_reference(step, world, **kw)
            self.step_mine(step, rank, world, **kw)

    def assert_close(self, what: str, rtol: float | None = None) -> None:
        mine = [full(p) for p in self.model.parameters()]
        want = [p.detach().float() for p in self.reference.parameters()]
        error = rel_error(mine, want)
        limit = rtol if rtol is not None else rtol_for(self.dtype)
        assert error <= limit, f"{what}: weights differ from fp32 torch.optim by {error:.3g}"
        # Per parameter, what training changed: a parameter that never trains hides in the
        # whole model's norm, not here. bf16 rounds each stored weight by up to 2**-9 (~2e-3
        # absolute at |w| ~ 1) against updates of ~lr = 1e-2 per step; and Adam moves every
        # element by ~lr whatever its gradient's size, so bf16 noise flips the step of elements
        # whose gradient is near zero. Measured worst: 0.32 of the update (LayerNorm weights of
        # the tiny LM). A parameter that never trains, or trains twice, is off by 1.0.
        update_limit = UPDATE_RTOL if self.dtype == "fp32" else BF16_UPDATE_RTOL
        names = [n for n, _ in self.reference.named_parameters()]
        for name, now, start, ref, ref_start in zip(
            names, mine, self.start, want, self.ref_start, strict=True
        ):
            change, ref_change = now - start, ref - ref_start
            size = float(ref_change.norm())
            off = float((change - ref_change).norm())
            assert off <= update_limit * size + (1e-6 if self.dtype == "fp32" else 4e-3), (
                f"{what}: {name} changed by {float(change.norm()):.3g}, torch by {size:.3g} "
                f"(difference {off:.3g})"
            )


# --- issue 10 items ------------------------------------------------------------------------
def item1_second_optimizer(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0))
    first = pair.opt

    def second() -> None:
        pair.opt = pair.plan.build(pair.model.parameters())

    if not torch_like_or_refused(second, ("close",)):
        return
    assert pair.opt is not first
    pair.train(2, rank, world)
    pair.assert_close("the second optimizer on the same parameters")
    try:
        first.step()
    except dtypeplan.errors.OptimizerUsageError as exc:
        assert "closed" in str(exc), f"unclear refusal of the replaced optimizer: {exc}"
    else:
        raise AssertionError("the replaced optimizer still steps")


def item1_dropped_optimizer_collected(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0))
    pair.train(1, rank, world)
    dropped = weakref.ref(pair.opt)
    del pair.opt
    gc.collect()
    assert dropped() is None, "a dropped optimizer stays alive (its hooks hold it)"


def item1_close_removes_hooks(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0))
    pair.opt.close()
    pair.loss(pair.model, 0, rank, world).backward()
    missing = [n for n, p in pair.model.named_parameters() if p.grad is None]
    assert not missing, f"after close() backward still loses the .grad of {missing}"


def item2_load_state_dict_after_build(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0))
    pair.train(1, rank, world)
    other = two_heads(1)
    # torch.optim keeps its moments across model.load_state_dict (it copies in place)
    pair.reference.load_state_dict(other.state_dict())

    def load_and_train() -> None:
        pair.model.load_state_dict(other.state_dict())
        pair.mark_start()
        pair.train(2, rank, world, first=1)

    if torch_like_or_refused(load_and_train, ("build",)):
        pair.assert_close("model.load_state_dict after build")


def item3_data_rebinding(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0))
    new = torch.randn(pair.reference.trunk.weight.shape, generator=torch.Generator().manual_seed(5))
    pair.reference.trunk.weight.data = new.clone()

    def rebind_and_train() -> None:
        pair.model.trunk.weight.data = new.to(pair.model.trunk.weight.dtype)
        pair.mark_start()
        pair.train(3, rank, world)

    if torch_like_or_refused(rebind_and_train, ("build",)):
        pair.assert_close("param.data = ... after build")


def item3_dtype_round_trip(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0))

    def round_trip_and_train() -> None:
        pair.model.float()
        pair.model.to(pair.plan.param_dtype)
        pair.mark_start()
        pair.train(3, rank, world)

    if torch_like_or_refused(round_trip_and_train, ("build",)):
        pair.assert_close("model.float(); model.to(param_dtype) after build")


def item4_unused_head_not_updated(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0))
    pair.train(1, rank, world)
    before = [full(p).clone() for p in pair.model.head_b.parameters()]
    pair.train(2, rank, world, first=1, use_b=False)
    after = [full(p) for p in pair.model.head_b.parameters()]
    moved = [float((a - b).abs().max()) for a, b in zip(after, before, strict=True)]
    assert max(moved) == 0.0, f"head_b had no gradient but moved by {moved} (torch skips it)"
    pair.assert_close("the used part of the model")


def item4_head_used_on_one_rank(rank: int, world: int, stage: int, dtype: str) -> None:
    # "No gradient" means on no rank: head_b has one on rank 0, so every replica updates it
    # with the mean over ranks (rank 1 contributes zero), as DDP + torch.optim would.
    pair = Pair(stage, dtype, two_heads(0))
    for step in range(2):
        x, y = batch(step, 8 * world)
        pair.ref_opt.zero_grad()
        slices = [(my_slice(x, r, world), my_slice(y, r, world)) for r in range(world)]
        ref_loss = sum(
            regression_loss(pair.reference, xs, ys, use_b=r == 0)
            for r, (xs, ys) in enumerate(slices)
        )
        (ref_loss / world).backward()
        pair.ref_opt.step()
        pair.opt.zero_grad()
        xs, ys = slices[rank]
        pair.opt.backward(regression_loss(pair.model, xs, ys, use_b=rank == 0))
        pair.opt.step()
    pair.assert_close("head_b used on rank 0 only")


def item13_zero_grads_then_head_on_one_rank(rank: int, world: int, stage: int, dtype: str) -> None:
    # zero_grad(set_to_none=False) leaves zero .grad; head_b then gets a gradient on rank 0
    # only: on rank 1 its zero .grad is still there at step(). torch with set_to_none=False
    # updates every parameter (a zero gradient is a gradient): so must every rank here, and
    # no rank may take those zeros for a hand-set gradient (ZeRO-2 would refuse that alone).
    pair = Pair(stage, dtype, two_heads(0))
    for step in range(2):
        x, y = batch(step, 8 * world)
        pair.ref_opt.zero_grad(set_to_none=False)
        slices = [(my_slice(x, r, world), my_slice(y, r, world)) for r in range(world)]
        ref_loss = sum(
            regression_loss(pair.reference, xs, ys, use_b=r == 0)
            for r, (xs, ys) in enumerate(slices)
        )
        (ref_loss / world).backward()
        pair.ref_opt.step()
        pair.opt.zero_grad(set_to_none=False)
        xs, ys = slices[rank]
        pair.opt.backward(regression_loss(pair.model, xs, ys, use_b=rank == 0))
        pair.opt.step()
    pair.assert_close("zero .grad kept, head_b used on rank 0 only")


def item3_left_in_another_dtype(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0))
    pair.model.float()  # and not cast back: the flat buffers cannot hold fp32 parameters
    try:
        pair.train(1, rank, world)
    except dtypeplan.errors.OptimizerUsageError as exc:
        message = str(exc)
        assert "torch.float32" in message and "prepare_model" in message, message
        return
    raise AssertionError("step() trained a model left in fp32 under a 16-bit plan")


def item4_frozen_after_build(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0))
    pair.train(1, rank, world)
    pair.model.head_b.requires_grad_(False)
    pair.reference.head_b.requires_grad_(False)
    before = [full(p).clone() for p in pair.model.head_b.parameters()]
    pair.train(2, rank, world, first=1)
    after = [full(p) for p in pair.model.head_b.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), (
        "a parameter frozen after build still moves"
    )
    pair.assert_close("training after freezing head_b")


def item4_unfrozen_after_build(rank: int, world: int, stage: int, dtype: str) -> None:
    model = two_heads(0)
    model.head_b.requires_grad_(False)
    pair = Pair(stage, dtype, model)

    def unfreeze_and_train() -> None:
        pair.model.head_b.requires_grad_(True)
        pair.reference.head_b.requires_grad_(True)
        pair.train(2, rank, world)

    if torch_like_or_refused(unfreeze_and_train, ("build",)):
        pair.assert_close("a parameter unfrozen after build (torch trains it)")


def item5_hand_set_grad(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0))
    generator = torch.Generator().manual_seed(3)
    for mine, ref in zip(pair.model.parameters(), pair.reference.parameters(), strict=True):
        grad = torch.randn(ref.shape, generator=generator)
        ref.grad = grad
        mine.grad = grad.to(mine.dtype)
    pair.ref_opt.step()
    if pair.plan.accumulator_sharded and world > 1:
        # A sharded accumulator would need every rank to learn of the .grad (a host sync per
        # step) and reduce-scatter it: refused clearly, on the rank that set it.
        try:
            pair.opt.step()
        except dtypeplan.errors.OptimizerUsageError as exc:
            assert "set by hand" in str(exc) and "whole accumulator" in str(exc), exc
            return
        raise AssertionError("a hand-set .grad with a sharded accumulator was not refused")
    pair.opt.step()
    pair.assert_close("a .grad set by hand, then step()")


def item5_grad_filled_in_place(rank: int, world: int, stage: int, dtype: str) -> None:
    # torch's pattern: zero_grad(set_to_none=False), then write into the zeros in place. The
    # written values are a gradient set by hand, not zero_grad's zeros.
    pair = Pair(stage, dtype, two_heads(0))
    pair.opt.zero_grad(set_to_none=False)
    generator = torch.Generator().manual_seed(4)
    for mine, ref in zip(pair.model.parameters(), pair.reference.parameters(), strict=True):
        grad = torch.randn(ref.shape, generator=generator)
        ref.grad = grad.clone()
        mine.grad.copy_(grad.to(mine.dtype))
    pair.ref_opt.step()
    if pair.plan.accumulator_sharded and world > 1:
        try:
            pair.opt.step()
        except dtypeplan.errors.OptimizerUsageError as exc:
            assert "set by hand" in str(exc), exc
            return
        raise AssertionError("a hand-written .grad with a sharded accumulator was not refused")
    pair.opt.step()
    pair.assert_close("zero_grad(set_to_none=False), .grad written in place, then step()")


def item5_clip_grad_norm(rank: int, world: int, stage: int, dtype: str) -> None:
    # torch.nn.utils.clip_grad_norm_ cannot see gradients the optimizer took from .grad (as
    # with DeepSpeed and FSDP1): opt.clip_grad_norm_ mirrors FSDP1's, clipping in the step.
    pair = Pair(stage, dtype, two_heads(0))
    pair.loss(pair.reference, 0, 0, world).backward()
    want = float(nn.utils.clip_grad_norm_(pair.reference.parameters(), 0.5))
    pair.ref_opt.step()
    pair.opt.backward(pair.loss(pair.model, 0, rank, world))
    try:
        pair.opt.clip_grad_norm_(0.5, norm_type=1.0)
    except dtypeplan.errors.OptimizerUsageError as exc:
        assert "2-norm" in str(exc), f"unclear refusal of norm_type=1: {exc}"
    else:
        raise AssertionError("clip_grad_norm_(norm_type=1) was accepted")
    got = float(pair.opt.clip_grad_norm_(0.5))
    # bf16 gradients: each element rounded by 2**-9, the norm by at most as much (2e-3);
    # fp32: the same sum in another order.
    assert abs(got - want) <= 5e-3 * want, f"clip_grad_norm_ returned {got}, torch {want}"
    assert want > 0.5, "the case must clip"
    pair.opt.step()
    pair.assert_close("opt.clip_grad_norm_(0.5), then step()")


def item6_param_listed_twice(rank: int, world: int, stage: int, dtype: str) -> None:
    model = two_heads(0)

    def twice(m: nn.Module) -> list[torch.Tensor]:
        return [*m.parameters(), m.trunk.weight]

    def build_and_train() -> Pair:
        pair = Pair(stage, dtype, model, groups=twice)
        pair.ref_opt = torch.optim.AdamW(pair.reference.parameters(), **HYPER)
        pair.train(2, rank, world)
        return pair

    holder: list[Pair] = []
    if torch_like_or_refused(lambda: holder.append(build_and_train()), ("twice", "duplicate")):
        holder[0].assert_close("a parameter listed twice (trained as if listed once)")


def item7_replicas_equal(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(rank))  # different weights on every rank
    pair.reference = two_heads(0)
    pair.ref_opt = torch.optim.AdamW(pair.reference.parameters(), **HYPER)
    pair.ref_start = [p.detach().float().clone() for p in pair.reference.parameters()]
    pair.start = pair.ref_start  # rank 0's weights are where every replica must start
    pair.train(2, rank, world)
    mine = torch.cat([full(p).reshape(-1) for p in pair.model.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    assert all(torch.equal(everyone[0], other) for other in everyone), "the replicas differ"
    pair.assert_close("rank 0's initial weights, trained")


def item8_rank_freezes_param(rank: int, world: int, stage: int, dtype: str) -> None:
    model = two_heads(0)
    if rank == 1:
        model.head_b.bias.requires_grad_(False)
    plan = dtypeplan.resolve(config(stage, dtype))
    try:
        plan.build(plan.prepare_model(model).parameters())
    except dtypeplan.RankMismatchError:
        return
    # No training after a missed mismatch: mismatched collectives could hang the group.
    raise AssertionError("rank 1 froze a parameter that rank 0 trains and build accepted it")


def item9_tied_weights(rank: int, world: int, stage: int, dtype: str) -> None:
    lm_pair(rank, world, stage, dtype, tie=True)


def item10_module_list_blocks(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = lm_pair(rank, world, stage, dtype, tie=False)
    if stage == 3:
        from torch.distributed.fsdp import FSDPModule

        units = [isinstance(layer, FSDPModule) for layer in pair.model.layers]
        assert all(units), f"ZeRO-3 did not shard each block of the ModuleList: {units}"


def lm_pair(rank: int, world: int, stage: int, dtype: str, tie: bool) -> Pair:
    # item 9 alone: the blocks in a Sequential, which ZeRO-3 can shard today; item 10 alone:
    # a ModuleList of blocks, untied.
    model = tied_lm(0, container=nn.Sequential if tie else nn.ModuleList)
    if not tie:
        model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    pair = Pair(stage, dtype, model, groups=decay_groups)
    for step in range(3):
        tokens = token_batch(step, 4 * world)
        pair.ref_opt.zero_grad()
        lm_loss(pair.reference, tokens).backward()
        pair.ref_opt.step()
        pair.opt.zero_grad()
        pair.opt.backward(lm_loss(pair.model, my_slice(tokens, rank, world)))
        pair.opt.step()
    if tie:
        assert pair.model.head.weight is pair.model.embed.weight, "the tie was broken"
    pair.assert_close(f"{'tied' if tie else 'untied'} LM with a ModuleList of blocks")
    return pair


def item11_prepare_model_casts_whole_model(rank: int, world: int, stage: int, dtype: str) -> None:
    plan = dtypeplan.resolve(config(stage, dtype))
    model = plan.prepare_model(norm_and_frozen(0))
    opt = plan.build(p for p in model.parameters() if p.requires_grad)
    if stage < 3:
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        wrong = {n: t.dtype for n, t in tensors.items() if t.is_floating_point()}
        wrong = {n: d for n, d in wrong.items() if d != plan.param_dtype}
        assert not wrong, f"prepare_model left these in another dtype: {wrong}"
    for step in range(2):
        x, y = batch(step, 8 * world)
        opt.zero_grad()
        loss = regression_loss(model, my_slice(x, rank, world), my_slice(y, rank, world))
        opt.backward(loss)
        opt.step()
        assert torch.isfinite(loss), "loss is not finite"


def item12_add_param_group(rank: int, world: int, stage: int, dtype: str) -> None:
    def head_b_later(m: nn.Module) -> list[torch.Tensor]:
        return [p for n, p in m.named_parameters() if not n.startswith("head_b")]

    pair = Pair(stage, dtype, two_heads(0), groups=head_b_later)
    pair.ref_opt.add_param_group({"params": list(pair.reference.head_b.parameters()), "lr": 3e-3})
    pair.train(1, rank, world, use_b=False)

    def add() -> None:
        pair.opt.add_param_group({"params": list(pair.model.head_b.parameters()), "lr": 3e-3})

    if torch_like_or_refused(add, ("build",)):
        pair.train(2, rank, world, first=1)
        pair.assert_close("add_param_group, then train")


def item13_zero_grad_keeps_zeros(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0))
    pair.train(1, rank, world)
    pair.opt.zero_grad(set_to_none=False)
    grads = {n: p.grad for n, p in pair.model.named_parameters()}
    wrong = [
        n
        for n, g in grads.items()
        if g is None
        or g.shape != dict(pair.model.named_parameters())[n].shape
        or bool(g.ne(0).any())
    ]
    assert not wrong, f"zero_grad(set_to_none=False) did not leave zero .grad on {wrong}"
    pair.opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in pair.model.parameters()), "set_to_none=True left .grad"


def item13_state_dict_layout(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0), groups=decay_groups)
    pair.train(1, rank, world)
    got, want = pair.opt.state_dict(), pair.ref_opt.state_dict()
    assert {"state", "param_groups"} <= set(got), f"state_dict keys {sorted(got)}"
    assert [g["params"] for g in got["param_groups"]] == [
        g["params"] for g in want["param_groups"]
    ], "param_groups do not number the parameters as torch does"
    for mine, ref in zip(got["param_groups"], want["param_groups"], strict=True):
        missing = {k for k in ref if k not in mine}
        assert not missing, f"param group lacks {missing}"
        assert mine["lr"] == ref["lr"] and mine["weight_decay"] == ref["weight_decay"]


def item14_export_model_state(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0))
    pair.train(2, rank, world)
    exported = dtypeplan.checkpoint.export_model_state(pair.opt, pair.model)
    names = {n for n, p in pair.reference.named_parameters()}
    assert set(exported) == names, f"exported {sorted(exported)}, parameters {sorted(names)}"
    for name, ref in pair.reference.named_parameters():
        value = exported[name]
        assert value.dtype == torch.float32 and value.shape == ref.shape, (name, value.dtype)
    mine = [exported[n] for n, _ in pair.reference.named_parameters()]
    error = rel_error(mine, [p.detach() for p in pair.reference.parameters()])
    assert error <= rtol_for(dtype), f"exported weights differ from fp32 torch by {error:.3g}"
    if stage < 3 and dtype != "fp32":
        for name, param in pair.model.named_parameters():
            assert torch.equal(exported[name].to(param.dtype), param.detach()), (
                f"{name}: the export is not the master of the 16-bit parameter"
            )
        assert any(
            not torch.equal(exported[n].to(p.dtype).float(), exported[n])
            for n, p in pair.model.named_parameters()
        ), "exported the 16-bit weights"


def item15_step_reports_skip(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, "fp16", two_heads(0))
    pair.step_mine(0, rank, world)
    assert pair.opt.last_step_skipped is False, "a finite step reported as skipped"
    pair.opt.zero_grad()
    pair.opt.backward(pair.loss(pair.model, 1, rank, world) * float("inf"))
    pair.opt.step()
    assert pair.opt.skipped_steps == 1
    assert pair.opt.last_step_skipped is True, "an overflowed fp16 step gave no sign of its skip"
    # what a training loop (or plan.build_scheduler's user) keys off
    scheduler = torch.optim.lr_scheduler.StepLR(pair.opt, step_size=1, gamma=0.5)
    lr = pair.opt.param_groups[0]["lr"]
    if not pair.opt.last_step_skipped:
        scheduler.step()
    assert pair.opt.param_groups[0]["lr"] == lr


# --- the contract suite, after torch/testing/_internal/common_optim.py -----------------------
def contract_state_dict_round_trip(rank: int, world: int, stage: int, dtype: str) -> None:
    whole = Pair(stage, dtype, two_heads(0), groups=decay_groups)
    whole.train(4, rank, world)
    first = Pair(stage, dtype, two_heads(0), groups=decay_groups)
    first.train(2, rank, world)
    saved = copy.deepcopy(first.opt.state_dict())
    resumed = Pair(stage, dtype, two_heads(7), groups=decay_groups)
    resumed.opt.load_state_dict(saved)
    for step in range(2, 4):
        resumed.step_mine(step, rank, world)
    mine = [full(p) for p in resumed.model.parameters()]
    want = [full(p) for p in whole.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(mine, want, strict=True)), (
        f"resumed run differs from the uninterrupted one by {rel_error(mine, want):.3g}"
    )


def contract_param_groups(rank: int, world: int, stage: int, dtype: str) -> None:
    def groups(m: nn.Module) -> list[dict[str, Any]]:
        a, b = decay_groups(m, weight_decay=0.2)
        return [{**a, "lr": 2e-2, "betas": (0.8, 0.95)}, {**b, "lr": 5e-3, "eps": 1e-6}]

    pair = Pair(stage, dtype, two_heads(0), groups=groups)
    pair.train(3, rank, world)
    pair.assert_close("param groups with their own lr, betas, eps and weight_decay")


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=5),
}


def contract_schedulers(rank: int, world: int, stage: int, dtype: str) -> None:
    for name, make in SCHEDULERS.items():
        pair = Pair(stage, dtype, two_heads(0), groups=decay_groups)
        mine, ref = make(pair.opt), make(pair.ref_opt)
        lrs = []
        for step in range(4):
            pair.train(1, rank, world, first=step)
            mine.step()
            ref.step()
            lrs.append(pair.opt.param_groups[0]["lr"])
            assert lrs[-1] == pair.ref_opt.param_groups[0]["lr"], f"{name}: lr differs"
        assert len(set(lrs)) == len(lrs), f"{name}: lr did not change every step: {lrs}"
        pair.assert_close(f"{name} scheduler")


def contract_step_closure(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0))
    for step in range(3):

        def ref_closure(step: int = step) -> torch.Tensor:
            pair.ref_opt.zero_grad()
            loss = pair.loss(pair.reference, step, 0, world)
            loss.backward()
            return loss

        def closure(step: int = step) -> torch.Tensor:
            pair.opt.zero_grad()
            loss = pair.loss(pair.model, step, rank, world)
            pair.opt.backward(loss)
            return loss

        want = pair.ref_opt.step(ref_closure)
        got = pair.opt.step(closure)
        assert got is not None and torch.is_tensor(got), "step(closure) did not return the loss"
        if world == 1:
            got_f, want_f = float(got.detach()), float(want.detach())
            assert abs(got_f - want_f) <= rtol_for(dtype) * abs(want_f) + 1e-6
    pair.assert_close("step(closure)")


def contract_frozen_params_skipped(rank: int, world: int, stage: int, dtype: str) -> None:
    model = two_heads(0)
    model.head_b.requires_grad_(False)
    pair = Pair(stage, dtype, model)
    before = [full(p).clone() for p in pair.model.head_b.parameters()]
    pair.train(2, rank, world)
    after = [full(p) for p in pair.model.head_b.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "frozen moved"
    pair.assert_close("a frozen parameter in the param list")


def contract_sgd_momentum(rank: int, world: int, stage: int, dtype: str) -> None:
    pair = Pair(stage, dtype, two_heads(0), optimizer="SGD", lr=0.1, momentum=0.9)
    pair.train(3, rank, world)
    pair.assert_close("SGD with momentum")


def contract_complex_and_integer_refused(rank: int, world: int, stage: int, dtype: str) -> None:
    plan = dtypeplan.resolve(config(stage, dtype))
    for bad in (
        nn.Parameter(torch.zeros(4, dtype=torch.complex64)),
        torch.zeros(4, dtype=torch.int64),
    ):
        name = str(bad.dtype).split(".")[-1]
        try:
            plan.build([bad])
        except ValueError as exc:  # every dtypeplan error is a ValueError
            assert name in str(exc), f"unclear refusal of {name}: {exc}"
            continue
        raise AssertionError(f"build accepted a {name} parameter")


CASES: dict[str, Callable[[int, int, int, str], None]] = {
    name: fn for name, fn in globals().items() if name.startswith(("item", "contract_"))
}


def run_named(rank: int, world: int, name: str, stage: int, dtype: str) -> str:
    """'ok', or the failure with its traceback."""
    try:
        CASES[name](rank, world, stage, dtype)
    except Exception as exc:  # noqa: BLE001 - reported per case; the group goes on
        return f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"
    return "ok"


def run_cases(rank: int, world: int, cases: list[tuple[str, int, str]]) -> dict[str, str]:
    """Every case in order (item 8's possible collective mismatch last); keyed by case id."""
    results = {}
    for name, stage, dtype in cases:
        results[f"{name}-stage{stage}-{dtype}"] = run_named(rank, world, name, stage, dtype)
        if dist.is_initialized():
            dist.barrier()
    return results
