"""Time of one training step on 2 gloo ranks: dtypeplan against torch and DeepSpeed.

    python -m benchmarks.bench_step_time [--quick] [--steps N] [--no-deepspeed]

One step is ``--micro`` micro-batches of forward + backward, then the optimizer step, on an MLP
of ``--layers`` x Linear(width, width) (6.3 M parameters by default), every rank on its own
data. The methods (each rank single-threaded, on 127.0.0.1 gloo):

* ``torch AdamW fused (1 proc)``: fp32 model and ``torch.optim.AdamW(fused=True)``, no
  communication (each rank trains alone; this is the baseline of the ratios);
* ``DDP + AdamW fused``: the same under DistributedDataParallel, ``no_sync`` for all but the
  last micro-batch;
* ``DDP + ZeroRedundancyOptimizer``: fp32, AdamW(fused=True) on each rank's partition;
* ``FSDP2 bf16/fp32-reduce``: ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, gradient sync only on the last micro-batch;
* ``dtypeplan``: bf16 params + fp32 accumulator + fp32 master at ZeRO 0, 1, 2, and fp32 at 1
  (gradients on the wire in the accumulation dtype, the default); and bf16 at ZeRO 1 and 2 with
  bf16 on the wire reduced by ``fp32_sum``;
  each config has ``gradient_accumulation_steps`` (``--micro``) and the loop calls a bare
  ``loss.backward()``: the optimizer starts the step's reduction inside the last one itself;
* ``DeepSpeed``, when ``import deepspeed`` works in this interpreter (it is never a dependency:
  ``DS_BUILD_OPS=0 pip install deepspeed`` in a separate venv made with
  ``--system-site-packages``, then run this script with that venv's python): BF16_Optimizer
  (bf16 + fp32 gradient accumulation, ZeRO 1; its ZeRO 0 variant is tried too), ZeRO-1 and
  ZeRO-2 with bf16 accumulation. It runs in its own group of ranks together with the baseline
  and dtypeplan's ZeRO-1, so its ratios are measured under the same conditions.

Timing: a barrier, then the wall time of the step; a step's time is the slowest rank's. The
methods are interleaved in rounds (every method runs a few steps per round) so that a change of
load on the machine hits all of them alike. Reported: median ms/step, the median of the
optimizer part (``step()`` and, for DDP, nothing of backward), and the ratio to the baseline.
With ``--profile`` the dtypeplan bf16 ZeRO-1 step is profiled with torch.profiler on rank 0.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from benchmarks._common import (
    base_parser,
    environment,
    finish,
    format_table,
    save_figure,
    write_result,
)
from dtypeplan.launch import spawn

BASELINE = "torch AdamW fused (1 proc)"
DDP = "DDP + AdamW fused"
TARGET = "dtypeplan bf16/fp32acc z1"
LR = 1e-4


@dataclass
class Spec:
    width: int
    layers: int
    rows: int
    micro: int
    warmup_rounds: int
    rounds: int
    steps_per_round: int
    profile: bool = False


def make_model(spec: Spec, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for index in range(spec.layers):
        layers.append(torch.nn.Linear(spec.width, spec.width))
        if index < spec.layers - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class Runner:
    """One method: a model, its optimizer, and ``step(batches) -> (total_s, optimizer_s)``."""

    name: str
    note: str = ""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    micro: int

    def sync_context(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """How this method lets a micro-batch's gradients be reduced (or not) in backward."""
        return contextlib.nullcontext()

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        t0 = time.perf_counter()
        for index, (x, y) in enumerate(batches):
            with self.sync_context(last=index == len(batches) - 1):
                _loss(self.model(x), y, self.micro).backward()
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1


def _loss(out: torch.Tensor, y: torch.Tensor, micro: int) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), y) / micro


class PlainRunner(Runner):
    """An fp32 model with torch.optim.AdamW(fused=True); optionally wrapped in DDP / ZeRO."""

    def __init__(self, name: str, spec: Spec, wrap: str) -> None:
        self.name = name
        self.micro = spec.micro
        model = make_model(spec)
        if wrap in ("ddp", "zero"):
            model = torch.nn.parallel.DistributedDataParallel(model)
        self.model = model
        if wrap == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, fused=True
            )
        else:
            self.opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        self.ddp = wrap in ("ddp", "zero")

    def sync_context(self, last: bool) -> contextlib.AbstractContextManager[None]:
        # DDP reduces only in the last micro-batch's backward.
        return self.model.no_sync() if self.ddp and not last else contextlib.nullcontext()


class FSDP2Runner(Runner):
    def __init__(self, name: str, spec: Spec) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.name = name
        self.micro = spec.micro
        model = make_model(spec)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model = model
        try:
            self.opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
            self.note = "AdamW(fused=True) on the DTensor shards"
        except (RuntimeError, TypeError, ValueError) as error:
            self.opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
            self.note = f"fused AdamW refused ({error}); foreach"

    def sync_context(self, last: bool) -> contextlib.AbstractContextManager[None]:
        # FSDP2 reduce-scatters only in the last micro-batch's backward.
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()


class DtypeplanRunner(Runner):
    def __init__(self, name: str, spec: Spec, config: dict[str, Any]) -> None:
        self.name = name
        self.micro = spec.micro
        # DeepSpeed's key: the optimizer counts the backward passes and starts the step's
        # reduction inside the last one, with nothing passed at the backward.
        plan = dtypeplan.resolve({**config, "gradient_accumulation_steps": spec.micro})
        if plan.status != "OK":
            raise RuntimeError(plan.explain())
        self.model = make_model(spec)
        self.opt = plan.build(self.model.parameters())
        self.dtype = plan.param_dtype
        self.note = f"{plan.implementation}, wire {plan.comm_dtype} {plan.comm_reduction}".replace(
            "torch.", ""
        )

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        t0 = time.perf_counter()
        for x, y in batches:
            loss = _loss(self.model(x.to(self.dtype)), y, self.micro)
            loss.backward()  # a bare backward: the config's count tells the last one
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1


class DeepSpeedRunner(Runner):
    def __init__(self, name: str, spec: Spec, ds_config: dict[str, Any]) -> None:
        import deepspeed

        self.name = name
        model = make_model(spec)
        config = {
            "train_micro_batch_size_per_gpu": spec.rows,
            "gradient_accumulation_steps": spec.micro,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            **ds_config,
        }
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        # DeepSpeed prints memory reports at start-up; they would bury the table.
        with contextlib.redirect_stdout(io.StringIO()):
            self.engine, self.opt, _, _ = deepspeed.initialize(
                model=model, optimizer=opt, config=config, dist_init_required=False
            )
        self.note = f"{type(self.opt).__name__}"

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        t0 = time.perf_counter()
        t1 = t0
        for index, (x, y) in enumerate(batches):
            loss = torch.nn.functional.mse_loss(self.engine(x.to(torch.bfloat16)).float(), y)
            self.engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps
            if index == len(batches) - 1:
                t1 = time.perf_counter()
            self.engine.step()
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1


def _dtypeplan_config(model: str, stage: int, bf16_wire: bool = False) -> dict[str, Any]:
    config: dict[str, Any] = {
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
    }
    if model == "bf16":
        config["bf16"] = {"enabled": True}
        config["gradient_accumulation_dtype"] = "fp32"
    if bf16_wire:
        config["communication_data_type"] = "bf16"
        config["communication_reduction"] = "fp32_sum"
    return config


def torch_methods() -> list[tuple[str, str, Any]]:
    return [
        (BASELINE, "plain", "none"),
        (DDP, "plain", "ddp"),
        ("DDP + ZeroRedundancyOptimizer", "plain", "zero"),
        ("FSDP2 bf16/fp32-reduce", "fsdp2", None),
        ("dtypeplan bf16/fp32acc z0", "dtypeplan", _dtypeplan_config("bf16", 0)),
        (TARGET, "dtypeplan", _dtypeplan_config("bf16", 1)),
        ("dtypeplan bf16/fp32acc z2", "dtypeplan", _dtypeplan_config("bf16", 2)),
        ("dtypeplan fp32 z1", "dtypeplan", _dtypeplan_config("fp32", 1)),
        (
            "dtypeplan bf16/fp32acc z1 bf16-wire fp32_sum",
            "dtypeplan",
            _dtypeplan_config("bf16", 1, bf16_wire=True),
        ),
        (
            "dtypeplan bf16/fp32acc z2 bf16-wire fp32_sum",
            "dtypeplan",
            _dtypeplan_config("bf16", 2, bf16_wire=True),
        ),
    ]


def deepspeed_methods() -> list[tuple[str, str, Any]]:
    bf16_fp32 = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    bf16_bf16 = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}
    return [
        (BASELINE, "plain", "none"),
        (TARGET, "dtypeplan", _dtypeplan_config("bf16", 1)),
        (
            "DeepSpeed BF16_Optimizer z0",
            "deepspeed",
            {**bf16_fp32, "zero_optimization": {"stage": 0}},
        ),
        (
            "DeepSpeed BF16_Optimizer z1",
            "deepspeed",
            {**bf16_fp32, "zero_optimization": {"stage": 1}},
        ),
        (
            "DeepSpeed bf16 z0 (bf16 accum)",
            "deepspeed",
            {**bf16_bf16, "zero_optimization": {"stage": 0}},
        ),
        ("DeepSpeed ZeRO-1 bf16", "deepspeed", {**bf16_bf16, "zero_optimization": {"stage": 1}}),
        ("DeepSpeed ZeRO-2 bf16", "deepspeed", {**bf16_bf16, "zero_optimization": {"stage": 2}}),
    ]


def _build(kind: str, name: str, spec: Spec, arg: Any) -> Runner:
    if kind == "plain":
        return PlainRunner(name, spec, arg)
    if kind == "fsdp2":
        return FSDP2Runner(name, spec)
    if kind == "dtypeplan":
        return DtypeplanRunner(name, spec, arg)
    if kind == "deepspeed":
        return DeepSpeedRunner(name, spec, arg)
    raise ValueError(f"unknown method kind {kind!r}")


def _prepare_deepspeed(rank: int, world: int) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(
        LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world)
    )
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")


def _rank_worker(
    rank: int, world: int, methods: list[tuple[str, str, Any]], spec: Spec
) -> dict[str, Any]:
    if any(kind == "deepspeed" for _, kind, _ in methods):
        _prepare_deepspeed(rank, world)
    generator = torch.Generator().manual_seed(1234 + rank)
    batches = [
        (
            torch.randn(spec.rows, spec.width, generator=generator),
            torch.randn(spec.rows, spec.width, generator=generator),
        )
        for _ in range(spec.micro)
    ]
    runners: list[Runner] = []
    failures: dict[str, str] = {}
    for name, kind, arg in methods:
        try:
            runner = _build(kind, name, spec, arg)
            runner.train_step(batches)  # a method that fails, fails here on every rank
            runners.append(runner)
        except Exception as error:  # noqa: BLE001 - a method that cannot run is reported
            failures[name] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        # Every rank must agree on which methods run, or collectives would pair up wrongly.
        flags = torch.tensor([float(name in failures)])
        dist.all_reduce(flags)
        if flags.item() and name not in failures:
            failures[name] = "failed on another rank"
            runners = [r for r in runners if r.name != name]

    times: dict[str, list[tuple[float, float]]] = {r.name: [] for r in runners}
    for round_index in range(spec.warmup_rounds + spec.rounds):
        for runner in list(runners):
            for _ in range(spec.steps_per_round):
                dist.barrier()
                try:
                    total, opt_part = runner.train_step(batches)
                except Exception:  # noqa: BLE001
                    failures[runner.name] = traceback.format_exc().strip().splitlines()[-1][:300]
                    raise
                if round_index >= spec.warmup_rounds:
                    times[runner.name].append((total, opt_part))
    profile = _profile(runners, batches, rank) if spec.profile and rank == 0 else None
    if spec.profile and rank != 0:
        _profile(runners, batches, rank)
    return {
        "times": times,
        "failures": failures,
        "notes": {r.name: r.note for r in runners},
        "profile": profile,
        "collectives": _collective_times(sum(p.numel() for p in make_model(spec).parameters())),
    }


def _collective_times(numel: int, reps: int = 6) -> dict[str, float]:
    """Median ms of each collective a method uses, on one fp32 buffer of the model's size.

    What DDP needs (one all-reduce) against what ZeRO-1 needs (a reduce-scatter of the
    gradients and an all-gather of the parameters), on this group's backend.
    """
    world = dist.get_world_size()
    full = torch.randn(numel - numel % world)
    shard = torch.empty(full.numel() // world)
    gathered = torch.empty_like(full)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: reduce_scatter(shard, full),
        "all_gather": lambda: all_gather(gathered, shard),
    }
    times: dict[str, float] = {}
    for name, call in calls.items():
        samples = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        times[name] = 1e3 * statistics.median(samples[1:])
    return times


def _profile(
    runners: list[Runner], batches: list[tuple[torch.Tensor, torch.Tensor]], rank: int
) -> str | None:
    """torch.profiler table of the dtypeplan ZeRO-1 step (every rank must take part)."""
    runner = next((r for r in runners if r.name == TARGET), None)
    if runner is None:
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(3):
            dist.barrier()
            runner.train_step(batches)
    if rank != 0:
        return None
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def _summarize(
    results: list[dict[str, Any]], group: str
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Per method: the median over steps of the slowest rank's time."""
    names = list(results[0]["times"])
    failures: dict[str, str] = {}
    for r in results:
        failures.update(r["failures"])
    rows = []
    for name in names:
        per_rank = [r["times"][name] for r in results]
        steps = min(len(t) for t in per_rank)
        if steps == 0:
            continue
        total = [max(t[i][0] for t in per_rank) for i in range(steps)]
        opt_part = [max(t[i][1] for t in per_rank) for i in range(steps)]
        rows.append(
            {
                "group": group,
                "method": name,
                "ms/step": 1e3 * statistics.median(total),
                "p10 ms": 1e3 * sorted(total)[len(total) // 10],
                "p90 ms": 1e3 * sorted(total)[min(len(total) - 1, (9 * len(total)) // 10)],
                "opt ms": 1e3 * statistics.median(opt_part),
                "steps": steps,
                "note": results[0]["notes"].get(name, ""),
            }
        )
    base = next((r for r in rows if r["method"] == BASELINE), None)
    ddp = next((r for r in rows if r["method"] == DDP), None)
    for row in rows:
        row["x baseline"] = row["ms/step"] / base["ms/step"] if base else None
        row["x baseline p10"] = row["p10 ms"] / base["p10 ms"] if base else None
        row["x DDP"] = row["ms/step"] / ddp["ms/step"] if ddp else None
    return rows, failures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rows", type=int, default=8, help="rows per micro-batch per rank")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile the dtypeplan bf16 ZeRO-1 step (torch.profiler, rank 0)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.rounds, args.steps_per_round = 512, 4, 3, 2
    spec = Spec(
        width=args.width,
        layers=args.layers,
        rows=args.rows,
        micro=args.micro,
        warmup_rounds=1,
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
        profile=args.profile,
    )
    num_params = sum(p.numel() for p in make_model(spec).parameters())
    env = environment()
    world = 2
    groups: list[tuple[str, list[tuple[str, str, Any]]]] = [("torch", torch_methods())]
    ds_note = ""
    if args.no_deepspeed:
        ds_note = "DeepSpeed skipped (--no-deepspeed)"
    elif importlib.util.find_spec("deepspeed") is None:
        ds_note = (
            "DeepSpeed not importable in this interpreter; skipped (install it in a "
            "separate venv, see the module docstring)"
        )
    else:
        groups.append(("deepspeed", deepspeed_methods()))
    rows: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    profile_text = None
    collectives: dict[str, float] = {}
    for group, methods in groups:
        started = time.perf_counter()
        results = spawn(_rank_worker, world, methods, spec, timeout_s=1800)
        group_rows, group_failures = _summarize(results, group)
        rows += group_rows
        failures.update({f"{group}: {k}": v for k, v in group_failures.items()})
        profile_text = profile_text or results[0]["profile"]
        collectives = collectives or {
            name: max(r["collectives"][name] for r in results) for name in results[0]["collectives"]
        }
        print(f"[{group}: {time.perf_counter() - started:.0f} s]", flush=True)
    columns = [
        "group",
        "method",
        "ms/step",
        "x baseline",
        "x DDP",
        "opt ms",
        "p10 ms",
        "p90 ms",
        "x baseline p10",
        "steps",
        "note",
    ]
    table = format_table(rows, columns)
    print(
        f"model: MLP {args.layers} x Linear({args.width}), {num_params} parameters; "
        f"{args.micro} micro-batches x {args.rows} rows per rank; 2 gloo ranks, 1 thread each"
    )
    print(table)
    collective_table = format_table(
        [{"collective (fp32, the model's size)": k, "ms": v} for k, v in collectives.items()],
        ["collective (fp32, the model's size)", "ms"],
    )
    print(collective_table)
    for name, error in failures.items():
        print(f"failed: {name}: {error}")
    if profile_text:
        print(profile_text)

    def ms(group: str, method: str) -> float | None:
        row = next((r for r in rows if r["group"] == group and r["method"] == method), None)
        return row["ms/step"] if row else None

    target = ms("torch", TARGET)
    base = ms("torch", BASELINE)
    ratio = target / base if target and base else None
    ds_ratios = {}
    for row in rows:
        if row["group"] == "deepspeed" and row["method"].startswith("DeepSpeed"):
            mine = ms("deepspeed", TARGET)
            ds_ratios[row["method"]] = round(mine / row["ms/step"], 3) if mine else None
    summary = {
        "benchmark": "step_time",
        "num_params": num_params,
        "baseline_ms": base,
        "dtypeplan_bf16_z1_ms": target,
        "dtypeplan_bf16_z1_over_fused_adamw": round(ratio, 3) if ratio else None,
        "target_within_1.5x": bool(ratio is not None and ratio <= 1.5),
        "dtypeplan_z1_over_deepspeed": ds_ratios,
        "ratios": {
            f"{r['group']}:{r['method']}": round(r["x baseline"], 3)
            for r in rows
            if r["x baseline"]
        },
        "failures": failures,
        "deepspeed": ds_note or "measured",
        "collectives_ms": {k: round(v, 2) for k, v in collectives.items()},
    }
    if not args.no_write:
        sections = [
            ("Median time per step", table),
            ("Collectives on this group, alone (slowest rank, median)", collective_table),
        ]
        if failures:
            sections.append(
                (
                    "Methods that did not run",
                    "\n".join(f"- {k}: `{v}`" for k, v in failures.items()),
                )
            )
        if profile_text:
            sections.append(
                (
                    "Profile of the dtypeplan bf16 ZeRO-1 step (rank 0, 3 steps)",
                    "```\n" + profile_text + "\n```",
                )
            )
        plot = _plot(rows, args.out, env["date"])
        sections.append(("Plot", f"![step time]({plot.name})"))
        notes = [
            "x baseline = median ms/step over that of torch.optim.AdamW(fused=True) on an fp32 "
            "model in the same group of ranks with no communication.",
            "opt ms = the optimizer part: step() (for DDP the gradient all-reduce runs inside "
            "the last backward, so it is not in opt ms; for dtypeplan the reduction is in "
            "step()); for DeepSpeed, the engine.step() call of the last micro-batch.",
            "ZeRO-1 moves the bytes of DDP's one all-reduce as a reduce-scatter plus an "
            "all-gather of the parameters after the update, which overlaps only the update: "
            "what each costs alone on this backend is in the collectives table.",
            "bf16 models compute their matmuls in bf16 (AMX/AVX512-BF16 on this CPU), so the "
            "forward/backward part differs between fp32 and bf16 methods.",
        ]
        if ds_note:
            notes.append(ds_note)
        write_result(
            "step_time",
            out=args.out,
            env=env,
            config={
                "model": f"MLP {args.layers} x Linear({args.width})",
                "num_params": num_params,
                "micro_batches": args.micro,
                "rows": args.rows,
                "world_size": world,
                "rounds": args.rounds,
                "steps_per_round": args.steps_per_round,
                "lr": LR,
                "quick": args.quick,
            },
            sections=sections,
            data={"rows": rows, "summary": summary, "profile": profile_text},
            notes=notes,
        )
    finish(summary)
    return summary


def _plot(rows: list[dict[str, Any]], out: Any, date: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['method']}" + (" [ds group]" if r["group"] == "deepspeed" else "") for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    ys = range(len(rows))
    ax.barh(ys, [r["ms/step"] for r in rows], color="#9bbcd9", label="step")
    ax.barh(ys, [r["opt ms"] for r in rows], color="#2d6a9f", label="optimizer part")
    ax.set_yticks(list(ys))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median ms per step (2 gloo ranks)")
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return save_figure(fig, out, "step_time", date)


if __name__ == "__main__":
    main()
