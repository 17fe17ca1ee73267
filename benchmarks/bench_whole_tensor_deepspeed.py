"""DeepSpeed's own ``"Muon"`` against dtypeplan's at ZeRO-1 and ZeRO-2, on 2 CPU gloo ranks.

    PYTHONPATH=/path/to/deepspeed:. python -m benchmarks.bench_whole_tensor_deepspeed [--quick]

Both run DeepSpeed's ``"Muon"`` optimizer type from one config (Muon on the 2-D hidden matrices,
tagged ``use_muon`` by each library's own ``set_optimizer_flags`` rule; AdamW on the biases) on
the same MLP (6 x Linear(512, 512) + Tanh, one seed), the same batches (each method its own
generator, seeded alike; every rank its own data) and the same hyperparameters
(:data:`OPTIMIZER`; ``gradient_clipping`` 0 in both, :data:`CLIPPING`; ``ns_method``
``"standard"``: the quintic Newton-Schulz in bf16 that ``torch.optim.Muon`` runs, which
DeepSpeed also has; its default ``"gram"`` runs in fp16). A step is 2 micro-batches of
forward + backward and the optimizer step: DeepSpeed's ``engine.backward`` / ``engine.step``
per micro-batch with ``gradient_accumulation_steps``, the loss divided by it by the engine;
dtypeplan the same division by hand.

Timing: a barrier, then the wall time of the step; a step's time is the slowest rank's; the
methods interleave in rounds, so the machine's load falls on all of them alike. Reported: median
ms/step of the measured rounds (and its quartiles) and the ratio dtypeplan / DeepSpeed at each
stage, the global loss (mean over ranks) of every step side by side, and the two libraries'
difference: of the first step's update of the Muon matrices and of the final weights, next to
the Newton-Schulz floor: DeepSpeed's ``muon_update`` against ``torch.optim.Muon`` on one and the
same gradient (the first step's full-batch gradient, computed apart). Both iterate in bf16, in a
different order of operations (DeepSpeed's compiled); on a rank-deficient gradient (fewer rows
in the batch than the matrix has columns) the iteration lifts the bf16 rounding noise of the
null space toward singular value 1, so the two differ by tens of percent on identical input: the
default batch has as many rows as the width, for a full-rank gradient.

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
# Said in both configs: DeepSpeed 0.19.8 clips at 1.0 when the key is absent (dtypeplan does not:
# resolver/_differences.py), and at ZeRO-1/2 it clips Muon's orthogonalized update, whose norm
# it counts as a gradient's (about sqrt(width) a matrix), to a global norm of 1.
CLIPPING = 0.0
EXTENSIONS_DIR = os.path.join(tempfile.gettempdir(), "dtypeplan-bench-torch-extensions")
STAGES = (1, 2)


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
        "gradient_clipping": CLIPPING,
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
            "gradient_clipping": CLIPPING,
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


def _flat_matrices(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in _muon_matrices(model)])


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
    # The first batch of every method, on every rank: the Newton-Schulz floor's gradient.
    first = torch.randn(micro * rows, width, generator=torch.Generator().manual_seed(1 + rank))
    gathered_x = [torch.empty_like(first) for _ in range(world)]
    dist.all_gather(gathered_x, first)
    ns_floor = _ns_floor(spec, torch.cat(gathered_x))
    start_weights = _flat_matrices(_model(width, spec["layers"]))
    first_update: dict[str, torch.Tensor] = {}
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
                if name not in first_update:
                    first_update[name] = _flat_matrices(step.model) - start_weights
    weights = {name: _flat_weights(step.model) for name, step in built.items()}
    # Every rank must end with the same weights: DeepSpeed's rank-divergent updates were a bug.
    spread = {}
    for name, flat in weights.items():
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        spread[name] = max(float((g - flat).abs().max()) for g in gathered)
    return {
        "ms": {name: statistics.median(values) for name, values in times.items()},
        "quartiles": {name: statistics.quantiles(values, n=4) for name, values in times.items()},
        "loss": losses,
        "weights": weights if rank == 0 else None,
        "first_update": first_update if rank == 0 else None,
        "ns_floor": ns_floor,
        "rank_spread": spread,
    }


def _muon_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.dim() == 2]


def _ns_floor(spec: dict[str, Any], x: torch.Tensor) -> float:
    """Relative difference of DeepSpeed's ``muon_update`` and ``torch.optim.Muon``'s update on
    one and the same gradient: ``x``'s full-batch gradient of the Muon matrices at the start."""
    from deepspeed.runtime.zero.muon.original_muon import muon_update

    model = _model(spec["width"], spec["layers"])
    torch.nn.functional.mse_loss(model(x), torch.tanh(x.roll(1, dims=1))).backward()
    theirs, ours = [], []
    for param in _muon_matrices(model):
        assert param.grad is not None  # every matrix is in the loss
        grad = param.grad.detach()
        momentum = torch.zeros_like(grad)
        theirs.append(
            muon_update(grad.clone(), momentum, OPTIMIZER["momentum"], ns_method="standard")
        )
        probe = torch.nn.Parameter(torch.zeros_like(grad))
        probe.grad = grad.clone()
        torch.optim.Muon([probe], lr=1.0, weight_decay=0.0, momentum=OPTIMIZER["momentum"]).step()
        ours.append(-probe.detach())
    a, b = torch.cat([t.flatten() for t in theirs]), torch.cat([t.flatten() for t in ours])
    return float((a - b).norm() / b.norm())


def _quartiles(quartiles: list[float]) -> str:
    return f"{quartiles[0]:.1f}-{quartiles[2]:.1f}"


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
                "DeepSpeed 25-75%": _quartiles(result["quartiles"][ds]),
                "dtypeplan 25-75%": _quartiles(result["quartiles"][mine]),
                "ratio dtypeplan/DeepSpeed": result["ms"][mine] / result["ms"][ds],
            }
        )
        diff = weights[mine] - weights[ds]
        first = result["first_update"]
        first_diff = (first[mine] - first[ds]).norm() / first[mine].norm()
        agreement.append(
            {
                "ZeRO": stage,
                "final loss DeepSpeed": result["loss"][ds][-1],
                "final loss dtypeplan": result["loss"][mine][-1],
                "step-1 update rel diff": float(first_diff),
                "NS floor": result["ns_floor"],
                "final weights rel diff": float(diff.norm() / weights[ds].norm()),
                "weights max abs diff": float(diff.abs().max()),
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
        # Rows a micro-batch such that a step's batch (2 micro-batches on 2 ranks) has as many
        # rows as the width: a full-rank gradient, so the Newton-Schulz floor is small.
        "rows": (64 if args.quick else 512) // 4,
        "warmup": 1,
        "rounds": args.rounds or (1 if args.quick else 20),
        "steps_per_round": args.steps,
        "stages": STAGES,
        "optimizer": OPTIMIZER,
    }
    env = environment()  # the load average at the start
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
                    "step-1 update rel diff": "{:.3f}",
                    "NS floor": "{:.3f}",
                    "final weights rel diff": "{:.2e}",
                    "weights max abs diff": "{:.2e}",
                },
            ),
        ),
        (
            "Loss per step (mean over ranks)",
            format_table(
                per_step, formats={name: "{:.5f}" for name in per_step[0] if name != "step"}
            ),
        ),
    ]
    for title, table in tables:
        print(f"## {title}\n{table}\n")
    env["deepspeed"] = deepspeed.__version__
    env["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    params = spec["layers"] * spec["width"] * (spec["width"] + 1)
    notes = [
        f"1-minute load average at the end {env['load_average_1m_at_end']}: the methods "
        "interleave in rounds, so the load falls on both libraries alike and the ratio holds.",
        f"deepspeed {deepspeed.__version__} (pip install --target, DS_BUILD_OPS=0; its CPU ops "
        "JIT-built by DeepSpeed on first use: the shared-memory comm op and FusedAdam), "
        "DS_ACCELERATOR=cpu, deepspeed.init_distributed(dist_backend='gloo') on the group "
        "dtypeplan.launch.spawn made. No DeepSpeed code patched; no math changed.",
        f"{params / 1e6:.2f} M parameters ({spec['layers']} Linear({spec['width']}, "
        f"{spec['width']}) with biases), {spec['micro']} micro-batches of {spec['rows']} rows a "
        "step on each of 2 gloo ranks (127.0.0.1), one thread each; fp32 model and masters.",
        "Config of both: {'optimizer': {'type': 'Muon', 'params': "
        f"{OPTIMIZER}}}, 'gradient_clipping': {CLIPPING}, zero_optimization.stage 1 or 2 "
        "(DeepSpeed clips at 1.0 when the key is absent, and at ZeRO-1/2 it clips Muon's "
        "orthogonalized update: see the -notes.md of this date). ns_method 'standard' on both: "
        "DeepSpeed's default 'gram' runs Newton-Schulz in fp16 (on square matrices the same "
        "quintic iteration, else on the Gram matrix); dtypeplan runs torch.optim.Muon's bf16 "
        "quintic and refuses 'gram'.",
        "DeepSpeed torch.compile's its Muon update (inductor on CPU); dtypeplan runs "
        "torch.optim.Muon eagerly. The compile falls in the warm-up round, not in the medians.",
        "The loss of a step is the mean of its micro-batches' losses before the step, averaged "
        "over the ranks. NS floor: DeepSpeed's muon_update against torch.optim.Muon on the "
        "same gradient (the first step's full-batch gradient), relative: what the two "
        "libraries' bf16 Newton-Schulz iterations alone differ by; the step-1 update "
        "difference should be of its size (the rest of the step is fp32), and the final "
        "weights differ by the compounding of such steps through the trajectories.",
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
