"""Optimizer offload: the step's time against the non-offloaded step, and the overlap achieved.

    python3 -m benchmarks.bench_offload [--device cpu|cuda] [--hidden 512] [--blocks 2]
                                        [--steps 5] [--dry-run]

One process, ZeRO-2 on one rank (world size 1: the offload path is the same per rank, without
the all-gathers), bf16 parameters, fp32 gradient accumulation, fp32 master weights, AdamW,
``gradient_clipping`` 1.0, buckets of ``--bucket`` elements. The model is a stack of
``--blocks`` blocks of Linear layers (``benchmarks/gpu/bench_engine_step.py``'s ``Block``, 12
``hidden**2`` parameters each). Two runs, one after the other:

* ``plain``: everything on the device (``zero_optimization.offload_optimizer`` absent);
* ``offloaded``: ``offload_optimizer: {device: cpu}``: masters and states in host memory
  (pinned on CUDA), the update on the host (``dtypeplan/optimizers/buffers/host_offload.py``).

For each: ``opt.step()`` alone, after an untimed backward that fills the accumulator, timed
between device synchronizations (median of ``--steps`` after one warm-up step), and the
parameters after the run (the offloaded run must equal the plain one: same fused kernel on
the same fp32 values; on CUDA within bf16 rounding of each other, the device and host Adam
kernels may round differently). The offloaded step is split, by timing the offload's own
calls, into:

* ``host update``: the fused CPU AdamW calls (sum over bucket chunks);
* ``host waits``: time the host spent waiting for the device (gradient copies not yet
  arrived, the step's factor, the last upload): copy time the pipeline did not hide;
* ``copies alone``: every gradient chunk down and every master chunk up, one after the other,
  synchronized, outside a step: the copy time there is to hide;
* ``overlap`` = 1 - host waits / copies alone: the fraction of the copy time hidden behind
  the host update (1.0: all of it).

On the CPU the "device" is the host: the copies are plain memory copies that run on the host
thread, nothing overlaps, and ``overlap`` is not defined (reported as such); the CPU run is a
correctness-sized check that the offloaded step runs and matches, and its time ratio says
what the extra host copies cost there. ``--dry-run``: tiny sizes (logic only). Writes
``results/offload-<date>.json/.md`` (``gpu_offload-<date>`` on CUDA, ``_dryrun`` appended for a
dry run) and prints one JSON line last.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import dtypeplan
from benchmarks._common import base_parser, environment, finish, format_table, write_result
from benchmarks.gpu.bench_engine_step import Block
from dtypeplan.optimizers.buffers import host_offload
from dtypeplan.optimizers.buffers.host_offload import HostOffload

CLIP = 1.0


def make_model(hidden: int, blocks: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    with device:
        return torch.nn.Sequential(*(Block(hidden, 4) for _ in range(blocks))).float()


def config(bucket: int, offload: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 2, "reduce_bucket_size": bucket}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "bf16": {"enabled": True},
        "gradient_accumulation_dtype": "fp32",
        "zero_optimization": zero,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OffloadTimer:
    """Times the offload's host update and its waits for the device (class-level patches)."""

    def __init__(self) -> None:
        self.update_s = 0.0
        self.wait_s = 0.0

    @contextmanager
    def installed(self) -> Iterator[None]:
        original_wait, original_step = HostOffload._wait, HostOffload.step
        timer = self

        def timed_wait(self: HostOffload, event: Any) -> None:
            started = time.perf_counter()
            original_wait(self, event)
            timer.wait_s += time.perf_counter() - started

        def timed_step(
            self: HostOffload,
            chunks: Any,
            update: Callable[[int, torch.Tensor], None],
            written: Callable[[int], None],
            *,
            upload: bool = True,
        ) -> None:
            def timed_update(k: int, grad: torch.Tensor) -> None:
                started = time.perf_counter()
                update(k, grad)
                timer.update_s += time.perf_counter() - started

            original_step(self, chunks, timed_update, written, upload=upload)

        HostOffload._wait = timed_wait  # type: ignore[method-assign]
        HostOffload.step = timed_step  # type: ignore[method-assign]
        try:
            yield
        finally:
            HostOffload._wait = original_wait  # type: ignore[method-assign]
            HostOffload.step = original_step  # type: ignore[method-assign]

    def reset(self) -> None:
        self.update_s = self.wait_s = 0.0


def copies_alone(opt: Any, device: torch.device) -> float:
    """Seconds to copy every gradient chunk down and every master chunk up, synchronized."""
    offload: HostOffload = opt.offload
    pairs = []
    for state in opt.groups:
        flat = state.flat
        for bucket, master, grad in zip(
            flat.buckets, state.masters, state.acc_chunks or [None] * len(flat.buckets), strict=True
        ):
            param = flat.chunk_view(flat.buffer, bucket, opt.shard_rank)
            source = grad if grad is not None else flat.chunk_view(state.accumulator, bucket, 0)
            pairs.append((source, master, param))
    host = [torch.empty(s.numel(), dtype=s.dtype, pin_memory=offload.pin) for s, _, _ in pairs]
    param_copies = [p.clone() for _, _, p in pairs]
    sync(device)
    started = time.perf_counter()
    for (source, master, _), target, param in zip(pairs, host, param_copies, strict=True):
        target.copy_(source, non_blocking=offload.on_accelerator)
        param.copy_(master, non_blocking=offload.on_accelerator)
    sync(device)
    return time.perf_counter() - started


def run(args: Any, offload: bool, timer: OffloadTimer) -> dict[str, Any]:
    device = torch.device(args.device)
    plan = dtypeplan.resolve(config(args.bucket, offload))
    assert plan.status == "OK", plan.explain()
    model = plan.prepare_model(make_model(args.hidden, args.blocks, device))
    opt = plan.build(model.parameters())
    generator = torch.Generator(device=device).manual_seed(1)
    times, updates, waits = [], [], []
    for step in range(args.steps + 1):
        opt.zero_grad()
        x = torch.randn(args.tokens, args.hidden, device=device, generator=generator)
        opt.backward(model(x.to(plan.param_dtype)).float().square().mean())
        sync(device)
        timer.reset()
        started = time.perf_counter()
        opt.step()
        sync(device)
        if step:  # the first step creates the states
            times.append(time.perf_counter() - started)
            updates.append(timer.update_s)
            waits.append(timer.wait_s)
    result: dict[str, Any] = {
        "step_s": statistics.median(times),
        "params": [p.detach().float().cpu() for p in model.parameters()],
        "num_params": sum(p.numel() for p in model.parameters()),
        "memory": opt.held_tensors().nbytes(),
    }
    if offload:
        result.update(
            host_update_s=statistics.median(updates),
            host_waits_s=statistics.median(waits),
            copies_alone_s=statistics.median(copies_alone(opt, device) for _ in range(3)),
            chunks=sum(len(state.masters) for state in opt.groups),
        )
    return result


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bucket", type=int, default=1 << 22)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (logic only)")
    args = parser.parse_args()
    on_cuda = args.device.startswith("cuda")
    # CUDA: 100 M parameters (16 B/param of host masters and states: 1.6 GB pinned);
    # CPU: a correctness-sized 6.3 M.
    args.hidden = args.hidden or (64 if args.dry_run else 2048 if on_cuda else 512)
    args.blocks = args.blocks or (2 if args.dry_run else 2)
    if args.dry_run:
        args.steps, args.bucket = 2, 1 << 14
    timer = OffloadTimer()
    with timer.installed():
        plain = run(args, offload=False, timer=timer)
        offloaded = run(args, offload=True, timer=timer)
    diffs = [
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        for a, b in zip(offloaded.pop("params"), plain.pop("params"), strict=True)
    ]
    max_rel = max(diffs)
    # Same fused kernel on the same values on the CPU: bit for bit. On CUDA the host kernel may
    # round the fp32 update differently from the device one: within one bf16 ulp (2^-8).
    tolerance = 0.0 if not on_cuda else 2.0**-8
    ratio = offloaded["step_s"] / plain["step_s"]
    overlap: float | None = None
    if on_cuda and offloaded["copies_alone_s"] > 0:
        overlap = max(0.0, 1.0 - offloaded["host_waits_s"] / offloaded["copies_alone_s"])
    rows = [
        {"run": "plain", "step ms": plain["step_s"] * 1e3, "x plain": 1.0},
        {"run": "offloaded", "step ms": offloaded["step_s"] * 1e3, "x plain": ratio},
    ]
    split = [
        {
            "host update ms": offloaded["host_update_s"] * 1e3,
            "host waits ms": offloaded["host_waits_s"] * 1e3,
            "copies alone ms": offloaded["copies_alone_s"] * 1e3,
            "overlap": "n/a (host == device on CPU)" if overlap is None else f"{overlap:.2f}",
            "bucket chunks": offloaded["chunks"],
        }
    ]
    memory = [
        {"run": run_name, **figures["memory"]}
        for run_name, figures in (("plain", plain), ("offloaded", offloaded))
    ]
    table = format_table(rows, formats={"step ms": "{:.2f}", "x plain": "{:.2f}"})
    split_table = format_table(
        split,
        formats={k: "{:.2f}" for k in ("host update ms", "host waits ms", "copies alone ms")},
    )
    memory_table = format_table(memory)
    print(table, split_table, memory_table, sep="\n\n")
    ok = max_rel <= tolerance
    print(f"max relative parameter difference offloaded vs plain: {max_rel:.3g} (ok: {ok})")
    summary = {
        "ok": ok,
        "step_ratio": ratio,
        "overlap": overlap,
        "max_rel_param_diff": max_rel,
        "num_params": plain["num_params"],
    }
    if not args.no_write:
        # The GPU run (benchmarks/gpu/run_all.sh) gets a name of its own next to the CPU one.
        name = ("gpu_offload" if on_cuda else "offload") + ("_dryrun" if args.dry_run else "")
        env = environment()
        write_result(
            name,
            out=args.out,
            env=env,
            config={
                "device": args.device,
                "hidden": args.hidden,
                "blocks": args.blocks,
                "tokens": args.tokens,
                "steps": args.steps,
                "bucket": args.bucket,
                "num_params": plain["num_params"],
                "torch_threads": torch.get_num_threads(),
                "dtypeplan_config": config(args.bucket, True),
            },
            sections=[
                ("opt.step() alone (median)", table),
                ("the offloaded step, split", split_table),
                ("bytes held between steps (held_tensors)", memory_table),
            ],
            data={"plain": plain, "offloaded": offloaded, **summary},
            notes=[
                f"Parameters after the run, offloaded vs plain: max relative difference "
                f"{max_rel:.3g} (allowed {tolerance:g}).",
                *(
                    [
                        "On the CPU the host is the device: the offload's copies are memory "
                        "copies on the same thread, nothing overlaps, and 'host waits' are "
                        "waits that return at once. The step-time ratio is what the extra "
                        "copies (gradient down, master up) cost there; the GPU case of "
                        "benchmarks/gpu/run_all.sh measures the overlap."
                    ]
                    if not on_cuda
                    else []
                ),
            ],
        )
    finish(summary)
    if not ok:
        raise SystemExit(1)


# The patched names must exist (a rename in the module would silently time nothing).
assert hasattr(host_offload.HostOffload, "_wait") and hasattr(host_offload.HostOffload, "step")

if __name__ == "__main__":
    main()
