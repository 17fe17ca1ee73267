"""What the optimizer-step benchmarks share: byte counts, the configs, and how one step is timed.

Used by ``bench_optimizer_step`` (CPU, every dtype pair) and ``gpu/bench_engine_step`` (one
H200, a 1B-parameter stack). Both time ``opt.step()`` alone, at the accumulation boundary,
through dtypeplan's public API only, against ``torch.optim.AdamW(fused=True)`` on an fp32 model
of the same size, and against the bytes floor ``numel * bytes_per_param / copy bandwidth``.

Bytes per parameter of a bare AdamW step (fp32 moments, each byte read or written once)::

    dtypeplan   read accumulator A + read/write master 2M + read/write 2 moments 16
                + write the parameter P (only where it is not the master itself)
    reference   read grad 4 + read/write param 8 + read/write 2 moments 16 = 28

so bf16 params with an fp32 accumulator and an fp32 master move 4 + 8 + 16 + 2 = 30 B, bf16 with
a bf16 accumulator 2 + 8 + 16 + 2 = 28 B, fp32 with fp32 4 + 8 + 16 = 28 B (the fp32 master is
the parameter). The floor leaves out what a step need not stream separately: the gradient-norm
read for clipping (4 B more for an fp32 accumulator where it is a pass of its own), scaling and
zeroing passes. A step that does them as passes of their own shows it as a ratio above 1.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

import dtypeplan

__all__ = [
    "DRY_RUN_NOTE",
    "DTYPE_NAMES",
    "REFERENCE_BYTES_PER_PARAM",
    "StepCase",
    "adamw_config",
    "copy_bandwidth",
    "dtypeplan_case",
    "fused_kernel_env",
    "profile_step",
    "reference_adamw",
    "reference_case",
    "release",
    "step_bytes_per_param",
    "sync",
    "time_steps",
]

DRY_RUN_NOTE = "DRY RUN on CPU at a tiny size: the logic ran, its timings mean nothing."
LR = 1e-3
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
EPS = 1e-8
# read grad 4 + read/write the fp32 parameter 8 + read/write exp_avg and exp_avg_sq 16
REFERENCE_BYTES_PER_PARAM = 4 + 8 + 16

DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def step_bytes_per_param(
    param_dtype: torch.dtype, accum_dtype: torch.dtype, master_dtype: torch.dtype
) -> int:
    """Bytes one bare AdamW step must move per parameter (fp32 moments; see the module text)."""
    size = torch.empty((), dtype=accum_dtype).element_size()
    master = torch.empty((), dtype=master_dtype).element_size()
    param = torch.empty((), dtype=param_dtype).element_size()
    write_param = 0 if param_dtype == master_dtype else param
    return size + 2 * master + 2 * 2 * 4 + write_param


def adamw_config(
    param: str, accum: str, *, clip: float, stage: int = 0, lr: float = LR
) -> dict[str, Any]:
    """A DeepSpeed-style config: ``param`` / ``accum`` are ``"fp32"``, ``"bf16"`` or ``"fp16"``."""
    config: dict[str, Any] = {
        "gradient_accumulation_dtype": accum,
        "zero_optimization": {"stage": stage},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "gradient_clipping": clip,
    }
    if param == "bf16":
        config["bf16"] = {"enabled": True}
    elif param == "fp16":
        # A low initial scale: the benchmark's gradients are O(1), and a skipped step would
        # time as a fast one. Skips are counted and reported all the same.
        config["fp16"] = {"enabled": True, "initial_scale_power": 4}
    return config


def reference_adamw(params: Any, lr: float = LR) -> torch.optim.Optimizer:
    """The baseline: ``torch.optim.AdamW(fused=True)`` with the same hyperparameters."""
    return torch.optim.AdamW(
        params, lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
    )


@contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """``name=value`` inside (None: left as it is)."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextmanager
def fused_kernel_env(enabled: bool) -> Iterator[None]:
    """``DTYPEPLAN_FUSED_KERNEL`` (Triton, CUDA) for the optimizers built or stepped inside:
    the documented switch."""
    with _env("DTYPEPLAN_FUSED_KERNEL", "1" if enabled else "0"):
        yield


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    prepare: Callable[[], None],
    step: Callable[[], Any],
    device: torch.device,
    iters: int,
    warmup: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    prepare_times: list[float] | None = None,
) -> list[float]:
    """Milliseconds of ``step()`` alone, ``iters`` times, each after an untimed ``prepare()``.

    Wall time between two device synchronizations: on a GPU this includes the step's host
    work and any host syncs inside it (what the caller waits for at the boundary), which CUDA
    events recorded behind a queue of backward kernels would hide. ``clock=time.thread_time``
    counts only the CPU time of the calling thread: for a one-thread CPU step on a shared
    machine, it leaves out the time the thread waited for a core. ``prepare_times``, if given,
    gets the milliseconds of each timed ``prepare()`` (the backward before the step).
    """
    times: list[float] = []
    for index in range(warmup + iters):
        sync(device)
        begin = clock()
        prepare()
        sync(device)
        start = clock()
        step()
        sync(device)
        if index >= warmup:
            times.append((clock() - start) * 1e3)
            if prepare_times is not None:
                prepare_times.append((start - begin) * 1e3)
    return times


def copy_bandwidth(numel: int, device: torch.device, iters: int) -> dict[str, float]:
    """Bytes read + written per second by ``dst.copy_(src)`` of ``numel`` fp32 values."""
    src = torch.empty(numel, device=device).normal_()
    dst = torch.empty_like(src)
    times = time_steps(lambda: None, lambda: dst.copy_(src), device, iters, warmup=2)
    nbytes = 2 * 4 * numel
    median = statistics.median(times)
    return {
        "numel": numel,
        "bytes": nbytes,
        "median_ms": median,
        "bytes_per_s": nbytes / (median * 1e-3),
        "bytes_per_s_best": nbytes / (min(times) * 1e-3),
    }


@dataclass
class StepCase:
    """One optimizer ready to step: ``prepare()`` runs an (untimed) backward, ``step()`` steps."""

    name: str
    num_params: int
    bytes_per_param: int
    prepare: Callable[[], None]
    step: Callable[[], Any]
    skipped_steps: Callable[[], int]
    release: Callable[[], None]


def _loss(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return model(inputs).float().square().mean()


def dtypeplan_case(
    name: str,
    model: torch.nn.Module,
    inputs: torch.Tensor,
    config: dict[str, Any],
    *,
    fused_kernel: bool = True,
    boundary_known: bool = False,
) -> StepCase:
    """dtypeplan on ``model`` (given in fp32): each ``prepare()`` is one ``opt.backward``.

    The accumulator then holds one micro-batch's gradient, as at any accumulation boundary,
    and ``step()`` is the whole boundary step: reduction (none on one process), norm and
    clipping, the update, and the write-back to the parameters. ``boundary_known``: the
    backward is told it is the last of the window (``last_micro_batch=True``, what a config's
    ``gradient_accumulation_steps`` also gives), so it takes each bucket's gradient norm as
    the bucket completes and the step does not; time the backward too to see both.
    """
    plan = dtypeplan.resolve(config)
    with fused_kernel_env(fused_kernel):
        opt = plan.build(model.parameters())
    x = inputs.to(plan.param_dtype)

    def prepare() -> None:
        with fused_kernel_env(fused_kernel):
            opt.zero_grad()
            opt.backward(_loss(model, x), last_micro_batch=boundary_known)

    def step() -> None:
        # The switch is read when the engine decides (today at its first step): hold it set
        # around every call rather than rely on when that is. Setting it costs microseconds.
        with fused_kernel_env(fused_kernel):
            opt.step()

    def release() -> None:
        # API.md's close() removes the hooks; where an implementation lacks it, dropping the
        # last reference to the optimizer does the same.
        close = getattr(opt, "close", None)
        if callable(close):
            close()

    return StepCase(
        name=name,
        num_params=sum(p.numel() for p in model.parameters()),
        bytes_per_param=step_bytes_per_param(
            plan.param_dtype, plan.grad_accum_dtype, plan.master_dtype
        ),
        prepare=prepare,
        step=step,
        skipped_steps=lambda: int(opt.skipped_steps),
        release=release,
    )


def reference_case(
    name: str, model: torch.nn.Module, inputs: torch.Tensor, *, clip: float = 0.0
) -> StepCase:
    """``torch.optim.AdamW(fused=True)`` on ``model`` in fp32: a bare step, no clipping.

    Each ``prepare()`` is ``zero_grad`` and one ``loss.backward()``, so ``.grad`` holds one
    fresh gradient, as the accumulator does in :func:`dtypeplan_case`. With ``clip`` > 0 the
    step is what a torch user who clips runs: ``clip_grad_norm_(foreach=True)`` (a norm pass
    and a scaling pass over the gradients) and then the fused step.
    """
    opt = reference_adamw(model.parameters())
    x = inputs.float()
    params = list(model.parameters())

    def step() -> None:
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        opt.step()

    def prepare() -> None:
        opt.zero_grad(set_to_none=True)
        _loss(model, x).backward()

    def release() -> None:
        opt.state.clear()

    return StepCase(
        name=name,
        num_params=sum(p.numel() for p in model.parameters()),
        bytes_per_param=REFERENCE_BYTES_PER_PARAM,
        prepare=prepare,
        step=step,
        skipped_steps=lambda: 0,
        release=release,
    )


def release(case: StepCase) -> None:
    """Free what a case holds before the next one is built (a 1B model is 16-18 GB).

    The caller drops its own references to ``case`` afterwards.
    """
    case.release()
    # The closures hold the model and the optimizer: drop them so that the memory goes now.
    case.prepare = case.step = case.release = lambda: None
    case.skipped_steps = lambda: 0
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profile_step(case: StepCase, device: torch.device, top: int = 8) -> dict[str, Any]:
    """One step under torch.profiler: how many kernels (GPU) or aten ops (CPU) it launches.

    Also shows which path ran (the Triton kernel's name, or torch's fused AdamW) without
    reaching into the optimizer.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    case.prepare()
    sync(device)
    with profile(activities=activities) as prof:
        case.step()
        sync(device)
    events = prof.key_averages()
    if device.type == "cuda":
        rows = [e for e in events if e.device_type.name == "CUDA"]
        weight = "device_time_total"
    else:
        rows = [e for e in events if e.key.startswith("aten::")]
        weight = "self_cpu_time_total"
    rows.sort(key=lambda e: getattr(e, weight, 0.0), reverse=True)
    return {
        "launches" if device.type == "cuda" else "aten_ops": sum(e.count for e in rows),
        "top": [
            {"name": e.key[:80], "count": e.count, "us": round(getattr(e, weight, 0.0), 1)}
            for e in rows[:top]
        ],
    }
