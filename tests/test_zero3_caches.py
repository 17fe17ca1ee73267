"""ZeRO-3: what holds the weights besides the shards follows them, and ``.grad`` after
``step()`` is torch's on every update path (issue 47 items 1, 2, 3 and 8).

One spawned group of 2 gloo ranks runs training-loop programs (``tests/workers/zero3_caches.py``)
through dtypeplan and through plain fp32 ``torch.optim`` on the whole batch, one process:

* item 1: an evaluation forward under ``torch.no_grad()`` between backward and ``step()`` left
  the root unit gathered (the model's root holds CLIP's ``logit_scale``); ``step()``, the
  optimizer's ``load_state_dict``, ``checkpoint.load`` and a write under ``no_grad`` then
  reached the shards only, and the next forward computed with the old root weights (weights
  3.5e-4 off after two steps; after a load the next forward 1e-2 off). hpZ's secondary
  partition: tests/test_hpz.py, on 4 ranks.
* item 2: with the fp8 all-gather, a weight change outside ``step()`` (an EMA swap to weights
  4 times larger, ``model.load_state_dict`` of them) kept the scale the last step computed:
  values above the old maximum saturated at 448 / scale.
* item 3: the kept gradient after ``step()`` was the clipped one on torch's fused path and the
  unclipped one on the host update (``offload_optimizer``) and the low-precision paths; with
  fp16 and an fp32 accumulator the fused kernel left it unscaled, and a second ``step()``
  applied it 16 times too small. Every path now keeps what torch keeps (contract/base.py's
  ``step``): a backward without ``zero_grad`` and a ``step()`` without backward match torch.
* item 8: fp8 all-gather with bf16 master weights crashed at build (the Linear weights, torchao
  wrappers, stayed fp32); it trains as the same plan with a bf16 gather does, bit for bit.
* a seeded sample of random programs (backwards, no-grad forwards, clips, steps, zero_grads,
  saves and the three loads, writes) against torch, fp32.

Bounds: fp32 paths 1e-5 relative (FP32_RTOL: summation order over two ranks); a 16-bit
accumulator, master or state, and fp16 compute, 2e-2 (LOW_PRECISION_MASTER_RTOL); main was
off by 7e-2 (bf16 accumulation, bf16 masters), 1.05 (fp16), 2.96 (bf16 SGD momentum) there.
fp8 (emulated): the model's weights are bf16 values, so the scale from the fp32 shards is the
reference's from its bf16 copy and the forwards agree to 1e-2 (bf16 summation order); a stale
scale is 0.5 off.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from dtypeplan.launch import spawn
from tests._helpers import FP32_RTOL, LOW_PRECISION_MASTER_RTOL
from tests.workers.zero3_caches import run_programs

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
SGD = {"type": "SGD", "params": {"lr": 0.1}}
FP32 = {"zero_optimization": {"stage": 3}, "optimizer": ADAMW}
FP8 = {
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3},
    "fp8": {"enabled": True, "all_gather": "fp8", "emulate": True},
    "optimizer": ADAMW,
}
EVAL_RTOL = 1e-2
"""A forward in bf16 (fp8 layers: the same fp8 values), two ranks against one process."""
GRAD_RTOL = 1e-4
"""The kept fp32 gradients: each sums 512 products over the batch, the scalar's nearly
cancelling (its relative error reaches 2e-5 over two ranks' orders)."""

# A backward without zero_grad after a clipped step, then a step without backward.
REUSE = [("train", 0), ("clip", 0.05), ("step",), ("grads",), ("train", 1), ("step",),
         ("grads",), ("step",)]  # fmt: skip
SAVED = [("train", 0), ("step",), ("zero_grad",), ("save", "a"), ("train", 1), ("step",),
         ("zero_grad",), ("eval", 2)]  # fmt: skip

CASES: dict[str, tuple[dict[str, Any], list[tuple[Any, ...]]]] = {
    # item 1: the root unit gathered by a no_grad forward
    "root: step after an eval": (
        FP32,
        [
            ("train", 0),
            ("eval", 1),
            ("step",),
            ("zero_grad",),
            ("train", 2),
            ("step",),
            ("eval", 3),
        ],
    ),
    "root: write after an eval": (
        FP32,
        [
            ("train", 0),
            ("eval", 1),
            ("write", 0.5),
            ("step",),
            ("zero_grad",),
            ("train", 2),
            ("step",),
            ("eval", 3),
        ],
    ),
    "root: optimizer.load_state_dict after an eval": (
        FP32,
        [*SAVED, ("load_opt", "a"), ("eval", 3), ("train", 4), ("step",)],
    ),
    "root: checkpoint.load after an eval": (
        FP32,
        [*SAVED, ("load_ckpt", "a"), ("eval", 3), ("train", 4), ("step",)],
    ),
    # item 2: fp8 scales after the weights change outside step()
    "fp8: EMA swap": (
        FP8,
        [
            ("train", 0),
            ("step",),
            ("zero_grad",),
            ("swap", 1, 0.8),
            ("eval", 1),
            ("swap", 2, 0.8),
            ("eval", 2),
        ],
    ),
    "fp8: model.load_state_dict": (
        FP8,
        [
            ("swap", 1, 0.8),
            ("save", "a"),
            ("swap", 0, 0.2),
            ("train", 0),
            ("step",),
            ("zero_grad",),
            ("load_model", "a"),
            ("eval", 1),
        ],
    ),
    # item 3: the kept gradient on every update path
    "grad: fused, clip_grad_norm_": (FP32, REUSE),
    "grad: fused, gradient_clipping": ({**FP32, "gradient_clipping": 0.05}, REUSE),
    "grad: host update (offload_optimizer)": (
        {**FP32, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
        REUSE,
    ),
    "grad: bf16 accumulator": ({**FP32, "gradient_accumulation_dtype": "bf16"}, REUSE),
    "grad: bf16 master weights": (
        {**FP32, "bf16": {"enabled": True}, "master_weights": {"dtype": "bf16"}},
        REUSE,
    ),
    "grad: bf16 states, SGD with momentum": (
        {
            **FP32,
            "optimizer_states": "bf16",
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        },
        REUSE,
    ),
    "grad: fp16, fp32 accumulator": (
        {
            "fp16": {"enabled": True, "initial_scale_power": 4},
            "gradient_accumulation_dtype": "fp32",
            "zero_optimization": {"stage": 3},
            "optimizer": SGD,
        },
        [("train", 0), ("step",), ("step",), ("train", 1), ("step",)],
    ),
    # item 8: fp8 all-gather with bf16 master weights, against the same plan gathering bf16
    "fp8: bf16 masters, fp8 gather": (
        {**FP8, "master_weights": {"dtype": "bf16"}},
        [
            ("train", 0),
            ("step",),
            ("zero_grad",),
            ("train", 1),
            ("step",),
            ("zero_grad",),
            ("train", 2),
            ("eval", 3),
        ],
    ),
}
CASES["fp8: bf16 masters, bf16 gather"] = (
    {
        **FP8,
        "master_weights": {"dtype": "bf16"},
        "fp8": {**FP8["fp8"], "all_gather": "param_dtype"},
    },
    CASES["fp8: bf16 masters, fp8 gather"][1],
)

RANDOM_OPS = ["train", "train", "train", "eval", "clip", "step", "step", "zero_grad", "save",
              "load_opt", "load_ckpt", "load_model", "write"]  # fmt: skip


def random_program(seed: int, length: int = 14) -> list[tuple[Any, ...]]:
    """A training loop's calls in a random order: a clip or a step only after some backward,
    a load only of a snapshot saved before it, no backward between a clip and its step (the
    clip applies in the coming step: ``clip_grad_norm_``'s docstring)."""
    rng = random.Random(seed)
    program: list[tuple[Any, ...]] = []
    trained = clipped = False
    saved: list[str] = []
    batch = 0
    while len(program) < length:
        op = rng.choice(RANDOM_OPS)
        if (op in ("clip", "step") and not trained) or (op == "train" and clipped):
            continue
        if op.startswith("load") and not saved:
            continue
        clipped = (clipped or op == "clip") and op not in ("step", "zero_grad")
        if op in ("train", "eval"):
            batch += 1
            program.append((op, batch))
            trained = trained or op == "train"
        elif op == "clip":
            program.append(("clip", rng.choice([0.02, 0.1, 10.0])))
        elif op == "save":
            saved.append(f"s{len(saved)}")
            program.append(("save", saved[-1]))
        elif op.startswith("load"):
            program.append((op, rng.choice(saved)))
        elif op == "write":
            program.append(("write", rng.choice([0.5, 2.0])))
        else:
            program.append((op,))
    return [*program, ("eval", batch + 1)]


RANDOM_SEEDS = range(4)
for _seed in RANDOM_SEEDS:
    CASES[f"random {_seed}"] = (FP32, random_program(_seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    """Every case's result on rank 0 (a case that raised reports its traceback)."""
    names = list(CASES)
    per_rank = spawn(run_programs, 2, [CASES[n] for n in names], timeout_s=900)
    return dict(zip(names, per_rank[0], strict=True))


def _value(results: dict[str, Any], name: str) -> dict[str, Any]:
    result = results[name]
    assert result["ok"], f"{name}: {result['trace']}"
    value: dict[str, Any] = result["value"]
    return value


def _weights_off(value: dict[str, Any]) -> float:
    return max(_rel(a, b) for a, b in zip(value["weights"], value["ref_weights"], strict=True))


def _evals_off(value: dict[str, Any]) -> list[float]:
    return [_rel(a, b) for a, b in zip(value["evals"], value["ref_evals"], strict=True)]


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("root")])
@pytest.mark.slow
def test_a_no_grad_forward_leaves_no_stale_root(results: dict[str, Any], name: str) -> None:
    value = _value(results, name)
    assert _weights_off(value) < FP32_RTOL, name
    assert max(_evals_off(value)) < FP32_RTOL, (name, _evals_off(value))
    for loss, ref in zip(value["losses"], value["ref_losses"], strict=True):
        assert loss == pytest.approx(ref, rel=FP32_RTOL), name


@pytest.mark.parametrize("name", ["fp8: EMA swap", "fp8: model.load_state_dict"])
@pytest.mark.slow
def test_fp8_scales_follow_weights_changed_outside_step(results: dict[str, Any], name: str) -> None:
    evals = _evals_off(_value(results, name))
    assert evals and max(evals) < EVAL_RTOL, (name, evals)


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("grad")])
@pytest.mark.slow
def test_the_kept_gradient_is_torchs_on_every_update_path(
    results: dict[str, Any], name: str
) -> None:
    value = _value(results, name)
    fp32 = "fused" in name or "host" in name
    bound = FP32_RTOL if fp32 else LOW_PRECISION_MASTER_RTOL
    assert _weights_off(value) < bound, (name, _weights_off(value))
    # With an fp32 accumulator and fp32 masters .grad is FSDP2's: read it as torch's (the
    # whole model's: the scalar's gradient alone sums 512 terms that nearly cancel).
    for grads, ref_grads in zip(value["grads"], value["ref_grads"], strict=True):
        mine = torch.cat([g.reshape(-1) for g in grads])
        theirs = torch.cat([g.reshape(-1) for g in ref_grads])
        assert _rel(mine, theirs) < max(bound, GRAD_RTOL), name


@pytest.mark.slow
def test_fp8_all_gather_trains_with_bf16_master_weights(results: dict[str, Any]) -> None:
    fp8_gather = _value(results, "fp8: bf16 masters, fp8 gather")
    bf16_gather = _value(results, "fp8: bf16 masters, bf16 gather")
    # A bf16 master gathered in bf16 and cast with the whole weight's scale in the forward,
    # or cast with that scale before the gather: the same fp8 values.
    assert fp8_gather["losses"] == bf16_gather["losses"]
    for mine, theirs in zip(fp8_gather["weights"], bf16_gather["weights"], strict=True):
        assert torch.equal(mine, theirs)
    for loss, ref in zip(fp8_gather["losses"], fp8_gather["ref_losses"], strict=True):
        assert loss == pytest.approx(ref, rel=LOW_PRECISION_MASTER_RTOL)


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
@pytest.mark.slow
def test_random_training_loop_programs_match_torch(results: dict[str, Any], seed: int) -> None:
    value = _value(results, f"random {seed}")
    program = CASES[f"random {seed}"][1]
    assert _weights_off(value) < FP32_RTOL, program
    assert max(_evals_off(value)) < FP32_RTOL, program
