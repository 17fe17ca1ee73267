"""Training-loop programs run by a dtypeplan optimizer and by plain fp32 torch.optim (issue 47).

A program is a list of the calls a training loop makes (:data:`OPS`), run as written on every
rank of a group by a dtypeplan optimizer (each rank forwards its slice of the op's seeded batch)
and, in the same process, by an fp32 copy of the model with the same ``torch.optim`` class on
the whole batch (the mean of the ranks' losses). Torch's semantics are the oracle: ``.grad``
accumulates across backward passes until zeroed, ``step()`` reads ``.grad``.

The dtypeplan side runs each op first. An op it refuses with one of its errors is recorded
(with the message) and skipped on both sides: a refusal comes before any number changes, so
the program goes on comparing. Any other exception ends the program (recorded as ``crash``).
What is recorded per op: the refusal, the losses of each forward (dtypeplan's on this rank's
slice, the reference's on the same slice), and after each step the relative error of the whole
parameters against the reference's. The parent (``tests/test_training_loop_programs.py``)
judges them.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dtypeplan
from dtypeplan.errors import NotSupportedError, OptimizerUsageError
from tests._helpers import OUT, make_batch, make_model, mse

OPS = (
    "backward",  # forward, loss.backward()
    "opt_backward",  # forward, opt.backward(loss)
    "model_zero_grad",  # model.zero_grad()
    "model_zero_grad_keep",  # model.zero_grad(set_to_none=False)
    "grad_none",  # p.grad = None for every parameter
    "opt_zero_grad",  # opt.zero_grad()
    "no_grad_forward",  # a forward under torch.no_grad() (evaluation, metrics)
    "round_trip",  # opt.load_state_dict(opt.state_dict())
    "step",  # opt.step()
)

# Every explicit, so that no default of DeepSpeed's (AdamW's weight decay 0) or torch's differs
# between the two sides; hyperparameters under which each class's state matters.
HYPER: dict[str, dict[str, Any]] = {
    "AdamW": {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1},
    "SGD": {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0},
}
ROWS_PER_RANK = 4


class RootScaled(torch.nn.Module):
    """The MLP with a parameter of the root module's own (as CLIP's ``logit_scale``): at
    ZeRO-3 the root is a unit of its own that FSDP2 keeps gathered after forward."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.body = make_model(seed)
        self.scale = torch.nn.Parameter(torch.linspace(0.8, 1.3, OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


MODELS: dict[str, Callable[[int], torch.nn.Module]] = {"mlp": make_model, "root_scaled": RootScaled}

REFUSALS = (OptimizerUsageError, NotSupportedError)
"""What dtypeplan raises where it refuses a call by design (the message names the fix)."""


def _whole(param: torch.Tensor) -> torch.Tensor:
    value = param.detach()
    if isinstance(value, DTensor):
        value = value.full_tensor()  # collective: every rank, same order
    return value.float()


def _rel_error(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    mine = [_whole(p) for p in model.parameters()]
    want = [p.detach().float() for p in reference.parameters()]
    diff = sum(float((a - b).square().sum()) for a, b in zip(mine, want, strict=True))
    size = sum(float(b.square().sum()) for b in want)
    return (diff / size) ** 0.5


class Loop:
    """One program's two sides: the dtypeplan-trained model and its fp32 reference."""

    def __init__(self, program: dict[str, Any], rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.seed = program["seed"]
        name = program["optimizer"]
        config: dict[str, Any] = {
            "zero_optimization": {"stage": program["stage"]},
            "optimizer": {"type": name, "params": HYPER[name]},
        }
        if program.get("offload"):
            # The host update (issue 47 item 3: what .grad holds after its step).
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        self.clip = program["clip"]
        if self.clip:
            config["gradient_clipping"] = self.clip
        plan = dtypeplan.resolve(config)
        assert plan.status == "OK", plan.explain()
        self.reference = MODELS[program.get("model", "mlp")](self.seed)
        self.model = plan.prepare_model(copy.deepcopy(self.reference))
        self.opt = plan.build(self.model.parameters())
        self.ref_opt = getattr(torch.optim, name)(self.reference.parameters(), **HYPER[name])

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The op's seeded batch (the reference's) and this rank's slice of it."""
        x, y = make_batch(self.seed * 100 + index, ROWS_PER_RANK * self.world)
        return x, y, x.chunk(self.world)[self.rank], y.chunk(self.world)[self.rank]

    def losses(self, mine: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> list[float]:
        with torch.no_grad():
            return [float(mine.detach()), float(mse(self.reference, xs, ys))]

    # --- the ops: the dtypeplan side, then the reference's ------------------------------------
    def run(self, op: str, index: int) -> dict[str, Any]:
        """Run ``op`` on both sides; what was seen."""
        x, y, xs, ys = self.batch(index)
        seen: dict[str, Any] = {"op": op}
        mine: Callable[[], Any] = getattr(self, f"_mine_{op}")
        try:
            out = mine(xs, ys)
        except REFUSALS as exc:
            seen["refused"] = f"{type(exc).__name__}: {exc}"
            return seen
        if op in ("backward", "opt_backward", "no_grad_forward"):
            seen["loss"] = self.losses(out, xs, ys)
        getattr(self, f"_ref_{op}")(x, y)
        if op == "step":
            seen["error"] = _rel_error(self.model, self.reference)
        return seen

    def _mine_backward(self, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        loss = mse(self.model, xs, ys)
        loss.backward()
        return loss

    def _mine_opt_backward(self, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        loss = mse(self.model, xs, ys)
        self.opt.backward(loss)
        return loss

    def _mine_model_zero_grad(self, xs: torch.Tensor, ys: torch.Tensor) -> None:
        self.model.zero_grad()

    def _mine_model_zero_grad_keep(self, xs: torch.Tensor, ys: torch.Tensor) -> None:
        self.model.zero_grad(set_to_none=False)

    def _mine_grad_none(self, xs: torch.Tensor, ys: torch.Tensor) -> None:
        for param in self.model.parameters():
            param.grad = None

    def _mine_opt_zero_grad(self, xs: torch.Tensor, ys: torch.Tensor) -> None:
        self.opt.zero_grad()

    def _mine_no_grad_forward(self, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return mse(self.model, xs, ys)

    def _mine_round_trip(self, xs: torch.Tensor, ys: torch.Tensor) -> None:
        self.opt.load_state_dict(self.opt.state_dict())

    def _mine_step(self, xs: torch.Tensor, ys: torch.Tensor) -> None:
        self.opt.step()

    def _ref_backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        mse(self.reference, x, y).backward()

    _ref_opt_backward = _ref_backward

    def _ref_model_zero_grad(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.reference.zero_grad()

    def _ref_model_zero_grad_keep(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.reference.zero_grad(set_to_none=False)

    def _ref_grad_none(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for param in self.reference.parameters():
            param.grad = None

    def _ref_opt_zero_grad(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.ref_opt.zero_grad()

    def _ref_no_grad_forward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        pass  # its loss on this rank's slice is taken with the others (losses())

    def _ref_round_trip(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.ref_opt.load_state_dict(copy.deepcopy(self.ref_opt.state_dict()))

    def _ref_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.reference.parameters(), self.clip)
        self.ref_opt.step()


def run_program(program: dict[str, Any], rank: int, world: int) -> list[dict[str, Any]]:
    """Every op's record (see the module's docstring); a crash ends the list."""
    seen: list[dict[str, Any]] = []
    try:
        loop = Loop(program, rank, world)
        for index, op in enumerate(program["ops"]):
            seen.append(loop.run(op, index))
    except Exception as exc:  # noqa: BLE001 - reported per program; the group goes on
        seen.append({"op": "crash", "crash": f"{exc!r}\n{traceback.format_exc(limit=-6)}"})
    return seen


def run_programs(rank: int, world: int, programs: list[dict[str, Any]]) -> list[list[dict]]:
    """Each program in turn on this rank (a barrier between them: a program that crashed on
    one rank only must not pair its collectives with the next program's)."""
    torch.set_num_threads(1)
    results = []
    for program in programs:
        results.append(run_program(program, rank, world))
        if dist.is_initialized():
            dist.barrier()
    return results


# --- the named cases of issue 47 ------------------------------------------------------------------
def item9_programs(stage: int) -> list[dict[str, Any]]:
    """Item 9: ``.grad`` cleared between two bare ``loss.backward()`` calls, each way."""
    return [
        {"stage": stage, "optimizer": "AdamW", "clip": 0.0, "model": "mlp", "seed": 9,
         "ops": ["backward", clear, "backward", "step", "opt_zero_grad", "backward", clear,
                 "backward", "backward", "step"]}
        for clear in ("model_zero_grad", "model_zero_grad_keep", "grad_none")
    ]  # fmt: skip


ITEM1_PROGRAM: dict[str, Any] = {
    "stage": 3, "optimizer": "SGD", "clip": 0.0, "model": "root_scaled", "seed": 46,
    "ops": ["backward", "no_grad_forward", "step", "opt_zero_grad", "backward", "step"],
}  # fmt: skip
"""Item 1 (ZeRO-3, a metrics forward between backward and step): the smallest program found."""

ITEM3_PROGRAM: dict[str, Any] = {
    "stage": 3, "optimizer": "SGD", "clip": 0.05, "model": "mlp", "seed": 5, "offload": True,
    "ops": ["backward", "step", "backward", "step"],
}  # fmt: skip
"""Item 3 (ZeRO-3, offload_optimizer, clipping: a backward onto the gradients a step kept)."""


def _adagrad(stage: int) -> tuple[torch.nn.Module, Any]:
    plan = dtypeplan.resolve(
        {
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": True},
            "master_weights": {"dtype": "bf16", "rounding": "nearest"},
            "optimizer_states": "fp32",
            "optimizer": {
                "type": "Adagrad",
                "params": {"lr": 1e-2, "initial_accumulator_value": 0.1},
            },
        }
    )
    assert plan.status == "OK", plan.explain()
    model = plan.prepare_model(make_model(0))
    return model, plan.build(model.parameters())


def _sums(state_dict: dict[str, Any]) -> set[float]:
    """The distinct values of every ``sum`` (each rank's pieces) of an optimizer state dict."""
    found: set[float] = set()
    for entry in state_dict["state"].values():
        value = entry.get("sum")
        if value is not None:
            assert value.dtype == torch.float32, value.dtype  # the plan's fp32 states
            local = value.to_local() if isinstance(value, DTensor) else value
            found.update(local.unique().tolist())
    return found


def adagrad_sums(stage: int) -> dict[str, set[float]]:
    """Item 5: the values Adagrad's ``sum`` holds with bf16 masters and fp32 states, built and
    after a step on zero gradients (``opt.zero_grad(set_to_none=False)``: ``sum += 0``)."""
    _, opt = _adagrad(stage)
    sums = {"built": _sums(opt.state_dict())}
    opt.zero_grad(set_to_none=False)
    opt.step()
    sums["after a step on zero gradients"] = _sums(opt.state_dict())
    return sums


def other_class_state_refused(stage: int) -> str:
    """Item 4: an SGD optimizer given an AdamW's state dict refuses it; 'ok' or what differs."""
    built = []
    for name, hyper in (("AdamW", {"lr": 1e-3, "weight_decay": 0.1}), ("SGD", HYPER["SGD"])):
        plan = dtypeplan.resolve(
            {"zero_optimization": {"stage": stage}, "optimizer": {"type": name, "params": hyper}}
        )
        model = plan.prepare_model(make_model(0))
        built.append((model, plan.build(model.parameters())))
    (adam_model, adam), (_, sgd) = built
    x, y = make_batch(0, 8)
    mse(adam_model, x, y).backward()
    adam.step()
    saved = adam.state_dict()
    try:
        sgd.load_state_dict(saved)
    except OptimizerUsageError as exc:
        if "saved by a AdamW optimizer" not in str(exc) or "optimizer.type" not in str(exc):
            return f"unclear refusal: {exc}"
    else:
        return "an AdamW state dict loaded into SGD"
    if sgd.param_groups[0]["lr"] != HYPER["SGD"]["lr"]:
        return f"the refused load changed lr to {sgd.param_groups[0]['lr']}"
    adam.load_state_dict(saved)  # its own class loads
    return "ok"


def _outcome(run: Callable[[], Any]) -> Any:
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - reported per case; the group goes on
        return f"{exc!r}\n{traceback.format_exc(limit=-6)}"


def named_cases(rank: int, world: int) -> dict[str, Any]:
    """Items 1, 3, 4, 5 and 9 on this rank of 2, by name (a barrier after each)."""
    torch.set_num_threads(1)
    cases: dict[str, Callable[[], Any]] = {
        "item4-zero3": lambda: other_class_state_refused(3),
        "item5-zero3": lambda: adagrad_sums(3),
        "item1": lambda: run_program(ITEM1_PROGRAM, rank, world),
        "item3": lambda: run_program(ITEM3_PROGRAM, rank, world),
    }
    for stage in (0, 1, 2, 3):
        for index, program in enumerate(item9_programs(stage)):
            cases[f"item9-{stage}-{index}"] = lambda p=program: run_program(p, rank, world)
    results = {}
    for name, run in cases.items():
        results[name] = _outcome(run)
        dist.barrier()
    return results


def default_group(rank: int, world: int, programs: list[dict[str, Any]]) -> dict[str, Any]:
    """The default run's group: the drawn programs, then the named cases."""
    return {"programs": run_programs(rank, world, programs), "named": named_cases(rank, world)}
