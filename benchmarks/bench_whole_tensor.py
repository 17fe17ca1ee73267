"""Optimizers that need each parameter whole, on 2 gloo ranks: dtypeplan against one process.

    python -m benchmarks.bench_whole_tensor [--quick] [--steps N]

One step is ``--micro`` micro-batches of forward + backward and the optimizer step, on an MLP
of ``--layers`` x Linear(width, width) (biases: AdamW's under DeepSpeed's Muon), every rank on
its own data. The methods (each rank single-threaded, on 127.0.0.1 gloo):

* ``torch Muon (1 proc)``: fp32 model, ``torch.optim.Muon`` (the matrices only), no
  communication: each rank trains alone (the baseline of the ratios);
* ``dtypeplan Muon ZeRO k`` (k = 0..3): ``torch.optim.Muon`` through ``optimizers/whole/``;
* ``torch MuonWithAuxAdamW (1 proc)`` and ``dtypeplan DeepSpeed-Muon ZeRO 1/2``: DeepSpeed's
  ``"Muon"`` type (Muon on the matrices, AdamW on the biases) from the config.

Timing: a barrier, then the wall time of the step; a step's time is the slowest rank's; the
methods are interleaved in rounds. Reported: median ms/step, the ratio to its one-process
baseline, the final loss of each, and the owners' balance (largest rank's owned elements over
the mean). DeepSpeed's own Muon against dtypeplan's: ``bench_whole_tensor_deepspeed``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from benchmarks._common import base_parser, environment, finish, format_table, write_result
from dtypeplan.launch import spawn
from dtypeplan.muon import MuonWithAuxAdamW

LR = 0.01


def _model(width: int, layers: int, bias: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width, bias=bias), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks)


def _methods(width: int, layers: int) -> dict[str, Any]:
    deepspeed_muon = {"type": "Muon", "params": {"lr": LR, "adam_lr": 1e-3}}
    methods: dict[str, Any] = {"torch Muon (1 proc)": ("torch", torch.optim.Muon, False)}
    for stage in (0, 1, 2, 3):
        config = {"zero_optimization": {"stage": stage}}
        methods[f"dtypeplan Muon ZeRO {stage}"] = ("plan", (config, torch.optim.Muon), False)
    methods["torch MuonWithAuxAdamW (1 proc)"] = ("torch", MuonWithAuxAdamW, True)
    for stage in (1, 2):
        config = {"zero_optimization": {"stage": stage}, "optimizer": deepspeed_muon}
        methods[f"dtypeplan DeepSpeed-Muon ZeRO {stage}"] = ("plan", (config, None), True)
    return methods


def _build(kind: str, what: Any, bias: bool, width: int, layers: int) -> tuple[Any, Any, Any]:
    model = _model(width, layers, bias)
    if kind == "torch":
        hyper = {"lr": LR} if what is torch.optim.Muon else {"lr": LR, "adam_lr": 1e-3}
        return model, what(model.parameters(), **hyper), None
    config, torch_class = what
    plan = dtypeplan.resolve(config)
    if torch_class is not None:
        plan = plan.with_optimizer(torch_class, {"lr": LR})
    model = plan.prepare_model(model)
    optimizer = plan.build(model.parameters())
    return model, optimizer, optimizer.owners


def _run(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    width, layers, micro, rows = spec["width"], spec["layers"], spec["micro"], spec["rows"]
    built = {
        name: _build(kind, what, bias, width, layers)
        for name, (kind, what, bias) in _methods(width, layers).items()
    }
    times: dict[str, list[float]] = {name: [] for name in built}
    losses: dict[str, float] = {}
    # Each method its own generator, seeded alike: the same batches, so the losses compare.
    generators = {name: torch.Generator().manual_seed(1 + rank) for name in built}
    for round_index in range(spec["warmup"] + spec["rounds"]):
        for name, (model, optimizer, _) in built.items():
            for _ in range(spec["steps_per_round"]):
                x = torch.randn(micro * rows, width, generator=generators[name])
                y = torch.tanh(x.roll(1, dims=1))
                dist.barrier()
                start = time.perf_counter()
                for xm, ym in zip(x.chunk(micro), y.chunk(micro), strict=True):
                    loss = torch.nn.functional.mse_loss(model(xm), ym) / micro
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if round_index >= spec["warmup"]:
                    times[name].append(float(elapsed) * 1e3)
                losses[name] = float(loss.detach()) * micro
    return {
        "ms": {name: statistics.median(values) for name, values in times.items()},
        "loss": losses,
        "balance": {name: b[2].balance for name, b in built.items() if b[2] is not None},
    }


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--steps", type=int, default=3, help="steps per method per round")
    args = parser.parse_args(argv)
    spec = {
        "width": 128 if args.quick else 512,
        "layers": 4 if args.quick else 6,
        "micro": 2,
        "rows": 16,
        "warmup": 1,
        "rounds": 2 if args.quick else 5,
        "steps_per_round": args.steps,
    }
    result = spawn(_run, 2, spec, timeout_s=1200)[0]
    rows = []
    for name, ms in result["ms"].items():
        base = (
            "torch Muon (1 proc)"
            if "DeepSpeed" not in name and "Aux" not in name
            else ("torch MuonWithAuxAdamW (1 proc)")
        )
        rows.append(
            {
                "method": name,
                "ms/step": ms,
                "ratio": ms / result["ms"][base],
                "final loss": result["loss"][name],
                "balance": result["balance"].get(name, ""),
            }
        )
    table = format_table(
        rows,
        formats={
            "ms/step": "{:.1f}",
            "ratio": "{:.2f}",
            "final loss": "{:.5f}",
            "balance": "{:.3f}",
        },
    )
    print(table)
    env = environment()
    params = spec["layers"] * spec["width"] ** 2
    notes = [
        f"{params / 1e6:.2f} M matrix parameters, {spec['micro']} micro-batches of "
        f"{spec['rows']} rows a step, 2 gloo ranks on 127.0.0.1, one thread each.",
        "The one-process baselines train each rank alone (no communication): a ratio is what "
        "the whole-tensor layout costs over it, the communication included.",
        "The losses are of the last micro-batch of each method's last step, on the same "
        "batches; a one-process baseline sees one rank's batches, dtypeplan both ranks' (the "
        "mean gradient), so they differ by the data, not by the optimizer.",
        "DeepSpeed's own Muon against dtypeplan's, at ZeRO-1/2 on 2 gloo ranks: "
        "benchmarks/bench_whole_tensor_deepspeed.py (results whole_tensor_deepspeed-<date>).",
    ]
    if not args.no_write:
        write_result(
            "whole_tensor",
            out=args.out,
            env=env,
            config=spec,
            sections=[("Step time and loss", table)],
            data={"rows": rows},
            notes=notes,
        )
    finish({"rows": rows})


if __name__ == "__main__":
    main()
