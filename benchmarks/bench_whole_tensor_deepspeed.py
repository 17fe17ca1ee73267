"""DeepSpeed's own ``"Muon"`` against dtypeplan's at ZeRO-1 and ZeRO-2, on 2 CPU gloo ranks.

    PYTHONPATH=/path/to/deepspeed:. python -m benchmarks.bench_whole_tensor_deepspeed [--quick]

Both run DeepSpeed's ``"Muon"`` optimizer type from one config (Muon on the 2-D hidden matrices,
tagged ``use_muon`` by each library's own ``set_optimizer_flags`` rule; AdamW on the biases) on
the same MLP (``--layers`` x Linear(width, width) + Tanh, one seed), the same batches (each
method its own generator, seeded alike; every rank its own data) and the same hyperparameters
(:data:`OPTIMIZER`; ``ns_method`` ``"standard"``: the quintic Newton-Schulz in bf16 that
``torch.optim.Muon`` runs, which DeepSpeed also has; its default ``"gram"`` runs in fp16).
A step is ``--micro`` micro-batches of forward + backward and the optimizer step: DeepSpeed's
``engine.backward`` / ``engine.step`` per micro-batch with ``gradient_accumulation_steps``, the
loss divided by it by the engine; dtypeplan the same division by hand.

Timing: a barrier, then the wall time of the step; a step's time is the slowest rank's; the
methods interleave in rounds, so the machine's load falls on all of them alike. Reported: median
ms/step of the measured rounds and the ratio dtypeplan / DeepSpeed at each stage, the global
loss (mean over ranks) of every step side by side, and the final weights' difference between
the two libraries at each stage against the bound of Muon's bf16 Newton-Schulz.

DeepSpeed on CPU: ``DS_ACCELERATOR=cpu``, ``deepspeed.init_distributed("gloo")`` adopting the
group :func:`dtypeplan.launch.spawn` made. DeepSpeed's comm backend JIT-builds its shared-memory
op (used only by inference all-reduce) and its Muon builds FusedAdam (the CPU C++ op) for the
AdamW side, both with ``torch.utils.cpp_extension`` into ``TORCH_EXTENSIONS_DIR``: the first run
compiles them (minutes on a loaded 2-core machine), later runs load them. A build killed midway
leaves its ``lock`` file behind, and every later load then waits on it forever (this is what
hung the first attempt, see the notes): unless ``TORCH_EXTENSIONS_DIR`` is set, this benchmark
uses its own folder, :data:`EXTENSIONS_DIR`. No DeepSpeed code is patched. Its Muon update is
``torch.compile``'d by DeepSpeed (inductor on CPU): compiled once, in the warm-up round.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from benchmarks._common import base_parser, environment, finish, format_table, write_result
from dtypeplan.launch import spawn

__all__ = ["EXTENSIONS_DIR", "OPTIMIZER", "deepspeed_importable", "main"]

# DeepSpeed's "Muon" parameters, read alike by both libraries (dtypeplan: dtypeplan/muon.py).
OPTIMIZER: dict[str, Any] = {
    "lr": 0.02,
    "adam_lr": 3e-3,
    "momentum": 0.95,
    "weight_decay": 0.01,
    "betas": [0.9, 0.95],
    "eps": 1e-10,
    "ns_method": "standard",
}
EXTENSIONS_DIR = os.path.join(tempfile.gettempdir(), "dtypeplan-bench-torch-extensions")
STAGES = (1, 2)
# torch's and DeepSpeed's Newton-Schulz round to bf16 (8 significant bits) at each of 5 steps.
NS_STEPS, BF16_UNIT = 5, 2.0**-8


def deepspeed_importable() -> bool:
    """Whether ``import deepspeed`` works here (it is not a dependency of dtypeplan)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception:  # missing, or broken against this torch: the benchmark cannot run
        return False
    return True


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks)


def _deepspeed_config(stage: int, spec: dict[str, Any], world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": spec["rows"],
        "gradient_accumulation_steps": spec["micro"],
        "train_batch_size": spec["rows"] * spec["micro"] * world,
        "optimizer": {"type": "Muon", "params": dict(OPTIMIZER)},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


class _DeepSpeedStep:
    """One DeepSpeed engine: a step is ``micro`` engine.backward / engine.step calls."""

    def __init__(self, stage: int, spec: dict[str, Any], world: int) -> None:
        import deepspeed

        model = _model(spec["width"], spec["layers"])
        config = _deepspeed_config(stage, spec, world)
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's start-up reports
            self.engine, *_ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=config
            )
        self.model = self.engine.module

    def __call__(self, xs: tuple[torch.Tensor, ...], ys: tuple[torch.Tensor, ...]) -> float:
        total = 0.0
        for x, y in zip(xs, ys, strict=True):
            loss = torch.nn.functional.mse_loss(self.engine(x), y)
            self.engine.backward(loss)  # divides by gradient_accumulation_steps
            self.engine.step()  # steps the optimizer at the accumulation boundary only
            total += float(loss.detach())
        return total / len(xs)


class _PlanStep:
    """dtypeplan's ``"Muon"`` type from the same config, stepped as a user of the plan does."""

    def __init__(self, stage: int, spec: dict[str, Any], world: int) -> None:
        config = {
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Muon", "params": dict(OPTIMIZER)},
        }
        plan = dtypeplan.resolve(config)
        self.model = plan.prepare_model(_model(spec["width"], spec["layers"]))
        self.optimizer = plan.build(self.model.parameters())

    def __call__(self, xs: tuple[torch.Tensor, ...], ys: tuple[torch.Tensor, ...]) -> float:
        total = 0.0
        for x, y in zip(xs, ys, strict=True):
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            (loss / len(xs)).backward()
            total += float(loss.detach())
        self.optimizer.step()
        self.optimizer.zero_grad()
        return total / len(xs)


def _methods(stages: tuple[int, ...]) -> dict[str, tuple[type, int]]:
    methods: dict[str, tuple[type, int]] = {}
    for stage in stages:
        methods[f"DeepSpeed Muon ZeRO {stage}"] = (_DeepSpeedStep, stage)
        methods[f"dtypeplan Muon ZeRO {stage}"] = (_PlanStep, stage)
    return methods


def _flat_weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _run(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
    )
    os.environ.setdefault("MASTER_PORT", "29500")  # unused: the group exists already
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)
    import deepspeed

    deepspeed.utils.logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo")  # adopts spawn's gloo group
    width, micro, rows = spec["width"], spec["micro"], spec["rows"]
    built = {
        name: cls(stage, spec, world) for name, (cls, stage) in _methods(spec["stages"]).items()
    }
    times: dict[str, list[float]] = {name: [] for name in built}
    losses: dict[str, list[float]] = {name: [] for name in built}
    generators = {name: torch.Generator().manual_seed(1 + rank) for name in built}
    for round_index in range(spec["warmup"] + spec["rounds"]):
        for name, step in built.items():
            for _ in range(spec["steps_per_round"]):
                x = torch.randn(micro * rows, width, generator=generators[name])
                y = torch.tanh(x.roll(1, dims=1))
                dist.barrier()
                start = time.perf_counter()
                loss = step(x.chunk(micro), y.chunk(micro))
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if round_index >= spec["warmup"]:
                    times[name].append(float(elapsed) * 1e3)
                mean_loss = torch.tensor(loss)
                dist.all_reduce(mean_loss)
                losses[name].append(float(mean_loss) / world)
    weights = {name: _flat_weights(step.model) for name, step in built.items()}
    # Every rank must end with the same weights: DeepSpeed's rank-divergent updates were a bug.
    spread = {}
    for name, flat in weights.items():
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        spread[name] = max(float((g - flat).abs().max()) for g in gathered)
    return {
        "ms": {name: statistics.median(values) for name, values in times.items()},
        "loss": losses,
        "weights": weights if rank == 0 else None,
        "rank_spread": spread,
    }


def _weight_bound(spec: dict[str, Any], weights: torch.Tensor) -> float:
    """Relative bound on the final weights' difference from Muon's bf16 Newton-Schulz:
    each step's update differs by at most ``5 * 2^-8`` of it (one bf16 rounding an
    iteration), and the scaled orthogonalized update O of a square matrix has singular values
    below 1.5, so ``||O||_F <= 1.5 sqrt(width)`` per matrix; n steps of lr move the weights
    apart by at most ``n * lr * 5 * 2^-8 * ||O||_F`` (first order: the trajectories' feedback
    through the gradients is not in it)."""
    steps = (spec["warmup"] + spec["rounds"]) * spec["steps_per_round"]
    update_norm = 1.5 * math.sqrt(spec["layers"] * spec["width"])
    return steps * OPTIMIZER["lr"] * NS_STEPS * BF16_UNIT * update_norm / float(weights.norm())


def _rows(result: dict[str, Any], spec: dict[str, Any]) -> tuple[list[dict[str, Any]], ...]:
    timing, agreement = [], []
    weights = result["weights"]
    for stage in spec["stages"]:
        ds, mine = f"DeepSpeed Muon ZeRO {stage}", f"dtypeplan Muon ZeRO {stage}"
        timing.append(
            {
                "ZeRO": stage,
                "DeepSpeed ms/step": result["ms"][ds],
                "dtypeplan ms/step": result["ms"][mine],
                "ratio dtypeplan/DeepSpeed": result["ms"][mine] / result["ms"][ds],
            }
        )
        diff = weights[mine] - weights[ds]
        agreement.append(
            {
                "ZeRO": stage,
                "final loss DeepSpeed": result["loss"][ds][-1],
                "final loss dtypeplan": result["loss"][mine][-1],
                "weights max abs diff": float(diff.abs().max()),
                "weights rel diff": float(diff.norm() / weights[ds].norm()),
                "bound": _weight_bound(spec, weights[ds]),
                "rank spread DS / plan": (
                    f"{result['rank_spread'][ds]:.1e} / {result['rank_spread'][mine]:.1e}"
                ),
            }
        )
    names = list(result["loss"])
    per_step = [
        {"step": i + 1, **{name: result["loss"][name][i] for name in names}}
        for i in range(len(result["loss"][names[0]]))
    ]
    return timing, agreement, per_step


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--steps", type=int, default=3, help="steps per method per round")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds")
    args = parser.parse_args(argv)
    if not deepspeed_importable():
        raise SystemExit(
            "deepspeed is not importable: put a DeepSpeed install on PYTHONPATH "
            "(pip install --target DIR deepspeed with DS_BUILD_OPS=0)"
        )
    import deepspeed

    spec: dict[str, Any] = {
        "width": 64 if args.quick else 512,
        "layers": 2 if args.quick else 6,
        "micro": 2,
        "rows": 16,
        "warmup": 1,
        "rounds": args.rounds or (1 if args.quick else 5),
        "steps_per_round": args.steps,
        "stages": STAGES,
        "optimizer": OPTIMIZER,
    }
    result = spawn(_run, 2, spec, timeout_s=3600)[0]
    timing, agreement, per_step = _rows(result, spec)
    tables = [
        ("Step time", format_table(timing, formats={"ratio dtypeplan/DeepSpeed": "{:.2f}"})),
        (
            "Agreement (final weights, rank 0; every rank's spread in the last column)",
            format_table(
                agreement,
                formats={
                    "final loss DeepSpeed": "{:.6f}",
                    "final loss dtypeplan": "{:.6f}",
                    "weights max abs diff": "{:.2e}",
                    "weights rel diff": "{:.2e}",
                    "bound": "{:.2e}",
                },
            ),
        ),
        ("Loss per step (mean over ranks)", format_table(per_step, formats={})),
    ]
    for title, table in tables:
        print(f"## {title}\n{table}\n")
    env = environment()
    env["deepspeed"] = deepspeed.__version__
    params = spec["layers"] * spec["width"] * (spec["width"] + 1)
    notes = [
        f"deepspeed {deepspeed.__version__} (pip install --target, DS_BUILD_OPS=0; its CPU ops "
        "JIT-built by DeepSpeed on first use: the shared-memory comm op and FusedAdam), "
        "DS_ACCELERATOR=cpu, deepspeed.init_distributed(dist_backend='gloo') on the group "
        "dtypeplan.launch.spawn made. No DeepSpeed code patched; no math changed.",
        f"{params / 1e6:.2f} M parameters ({spec['layers']} Linear({spec['width']}, "
        f"{spec['width']}) with biases), {spec['micro']} micro-batches of {spec['rows']} rows a "
        "step on each of 2 gloo ranks (127.0.0.1), one thread each; fp32 model and masters.",
        "Config of both: {'optimizer': {'type': 'Muon', 'params': "
        f"{OPTIMIZER}}}, zero_optimization.stage 1 or 2. ns_method 'standard' on both: "
        "DeepSpeed's default 'gram' runs Newton-Schulz in fp16 (on square matrices the same "
        "quintic iteration, else on the Gram matrix); dtypeplan runs torch.optim.Muon's bf16 "
        "quintic and refuses 'gram'.",
        "DeepSpeed torch.compile's its Muon update (inductor on CPU); dtypeplan runs "
        "torch.optim.Muon eagerly. The compile falls in the warm-up round, not in the medians.",
        "The loss of a step is the mean of its micro-batches' losses before the step, averaged "
        "over the ranks. The weight bound is first order (see _weight_bound): the two "
        "trajectories feed their differences back through the gradients, so the difference "
        "grows faster than linearly over many steps.",
    ]
    if not args.no_write:
        write_result(
            "whole_tensor_deepspeed",
            out=args.out,
            env=env,
            config=spec,
            sections=tables,
            data={"timing": timing, "agreement": agreement, "loss_per_step": per_step},
            notes=notes,
        )
    summary = {"timing": timing, "agreement": agreement}
    finish(summary)
    return summary


if __name__ == "__main__":
    main()
