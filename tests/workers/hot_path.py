"""Spawn-able workers (and their in-process helpers) for the hot-path tests.

What they watch: host syncs during backward and ``step()`` (``tests/test_host_syncs.py``),
the device of every tensor handed to a collective, and the boundary reduction that
``gradient_accumulation_steps`` starts inside the last backward (``tests/test_hot_path.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import dtypeplan
from dtypeplan.comm import _collectives
from tests._helpers import make_batch, make_model, mse

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default


class _DeviceToHost(TorchDispatchMode):
    """Records every op that brings a tensor's value to the host.

    ``.item()``, ``float(t)``, ``int(t)`` and ``bool(t)`` all end in ``_local_scalar_dense``;
    a copy from an accelerator to the CPU is a ``_to_copy``/``copy_`` with a CPU result.
    """

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _SCALAR_READ:
            self.log.append(f"{func} of {tuple(args[0].shape)}")
        result = func(*args, **kwargs)
        sources = [a for a in args if isinstance(a, torch.Tensor)]
        if (
            isinstance(result, torch.Tensor)
            and result.device.type == "cpu"
            and any(s.device.type not in ("cpu", "meta") for s in sources)
        ):
            self.log.append(f"{func} to the host")
        return result


@contextlib.contextmanager
def count_host_syncs() -> Iterator[list[str]]:
    """Log the device-to-host reads made inside: the dispatch-level ones and the Python calls
    ``.tolist()``, ``.cpu()``, ``.numpy()`` (which on a CPU tensor dispatch nothing, but would
    sync on a GPU)."""
    log: list[str] = []
    patched = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def recorder(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            log.append(f"Tensor.{name}")
            return original(self, *args, **kwargs)

        return recorded

    for name, original in patched.items():
        setattr(torch.Tensor, name, recorder(name, original))
    try:
        with _DeviceToHost(log):
            yield log
    finally:
        for name, original in patched.items():
            setattr(torch.Tensor, name, original)


def sync_case(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """Host syncs of two steps of two micro-batches each (after one warm-up step).

    Per step: one ``opt.backward(..., last_micro_batch=True)`` pair, then a bare
    ``loss.backward()`` pair (the pipeline-schedule way). Also counts the syncs of reading
    ``grad_norm`` twice after the last step.
    """
    # A pipeline plan: under fp16 it takes a bare backward of a loss scaled by hand.
    plan = dtypeplan.resolve(config, pipeline_parallel=True)
    model = plan.prepare_model(make_model(0))
    optimizer = plan.build(model.parameters())
    # The non-finite probe reads each norm on the CPU, where that waits for nothing; on an
    # accelerator it only polls an event (tests/test_reliability.py covers what it reports).
    # Off here, so that every host read this counts is one that would wait on a GPU.
    optimizer.norm_probe.enabled = False
    # So is the per-step hyperparameter check, for the same reason: its sums ride on the
    # step's summary all-reduce and are read from pinned memory after an event on a GPU.
    optimizer.hyperparameter_check.enabled = False
    x, y = make_batch(rank, 16)
    micro = list(zip(x.chunk(4), y.chunk(4), strict=True))

    def run_step(bare: bool) -> None:
        for index, (xm, ym) in enumerate(micro[:2]):
            loss = mse(model, xm, ym) / 2
            if bare:
                (loss * optimizer.loss_scale).backward()
            else:
                optimizer.backward(loss, last_micro_batch=index == 1)
        optimizer.step()
        optimizer.zero_grad()

    run_step(bare=False)  # the optimizer states are created at the first step
    per_step = []
    for bare in (False, True):
        with count_host_syncs() as log:
            run_step(bare)
        per_step.append(log)
    with count_host_syncs() as first_read:
        norm = optimizer.grad_norm
    with count_host_syncs() as second_read:
        again = optimizer.grad_norm
    return {
        "per_step": per_step,
        "grad_norm_reads": [len(first_read), len(second_read)],
        "grad_norm": norm,
        "grad_norm_again": again,
        "skipped": optimizer.skipped_steps,
    }


def sync_cases(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[Any]:
    return [sync_case(rank, world_size, config) for config in configs]


# --- the device of every tensor handed to a collective -----------------------------------------


def _rank_device(rank: int) -> torch.device:
    """This rank's GPU under NCCL (made current), else the CPU."""
    if dist.get_backend() != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


@contextlib.contextmanager
def record_devices() -> Iterator[list[tuple[str, str]]]:
    """Wrap the collectives dtypeplan and FSDP2 call; log (op, device) of every tensor argument."""
    log: list[tuple[str, str]] = []
    module_names = ["_reduce_scatter_flat", "_all_gather_flat"]
    dist_names = [
        "all_reduce",
        "all_to_all_single",
        "reduce_scatter_single",
        "all_gather_single",
        "reduce_scatter_tensor",
        "all_gather_into_tensor",
        "broadcast",
    ]
    originals = {name: getattr(_collectives, name) for name in module_names}
    dist_originals = {name: getattr(dist, name) for name in dist_names if hasattr(dist, name)}

    def wrap(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            for value in [*args, *kwargs.values()]:
                tensors = value if isinstance(value, (list, tuple)) else [value]
                for tensor in tensors:
                    if isinstance(tensor, torch.Tensor):
                        log.append((op, str(tensor.device)))
            return fn(*args, **kwargs)

        return recorded

    for name, fn in originals.items():
        setattr(_collectives, name, wrap(name, fn))
    for name, fn in dist_originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(_collectives, name, fn)
        for name, fn in dist_originals.items():
            setattr(dist, name, fn)


def device_case(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """Two micro-batches and a step on the accelerator where there is one, logging devices."""
    device = _rank_device(rank)
    plan = dtypeplan.resolve(config)
    model = plan.prepare_model(make_model(0).to(device))
    optimizer = plan.build(model.parameters())
    x, y = make_batch(rank, 8)
    with record_devices() as log:
        for index, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
            optimizer.backward(mse(model, xm.to(device), ym.to(device)), last_micro_batch=index)
        optimizer.step()
    param_devices = sorted({str(p.device) for p in model.parameters()})
    return {"log": log, "param_devices": param_devices}


# --- gradient_accumulation_steps: the boundary reduction inside the last backward --------------


def boundary_case(
    rank: int, world_size: int, config: dict[str, Any], told: str, per_step: int = 2
) -> dict[str, Any]:
    """Three steps of ``per_step`` bare ``loss.backward()`` micro-batches each.

    ``told``: ``"steps"`` gives the optimizer ``gradient_accumulation_steps = 2`` (the
    plan's field where it exists, else the scheduler's), ``"batch"`` gives DeepSpeed's batch
    sizes instead (``train_batch_size`` = 2 micro-batches of 2 on every rank, from which the
    optimizer works the 2 out), ``"flag"`` marks the last micro-batch
    through ``opt.backward(last_micro_batch=True)`` instead, ``"nothing"`` tells nothing.
    With ``per_step = 3`` and ``"steps"`` the count is wrong (only a sharded accumulator takes
    the third backward). Returns the gradient collectives seen after each backward, how many
    chunk norms the backward had taken when each step began, the steps' gradient norms and the
    final parameters.
    """
    device = _rank_device(rank) if dist.is_initialized() else torch.device("cpu")
    if told == "batch":
        config = {**config, "train_batch_size": 4 * world_size, "train_micro_batch_size_per_gpu": 2}
    plan = dtypeplan.resolve(config)
    model = plan.prepare_model(make_model(0).to(device))
    optimizer = plan.build(model.parameters())
    if told == "steps" and getattr(plan, "gradient_accumulation_steps", None) is None:
        optimizer.reductions.accumulation_steps = 2
    x, y = make_batch(rank, 6 * per_step)
    micro = list(zip(x.chunk(3 * per_step), y.chunk(3 * per_step), strict=True))
    seen: list[list[int]] = []
    known: list[int] = []
    norms: list[float] = []
    with record_devices() as log:
        for step in range(3):
            after: list[int] = []
            for index in range(per_step):
                xm, ym = micro[per_step * step + index]
                loss = mse(model, xm.to(device), ym.to(device)) / per_step
                if told == "flag":
                    optimizer.backward(loss, last_micro_batch=index == per_step - 1)
                else:
                    loss.backward()
                after.append(len(log))
            seen.append(after)
            known.append(len(optimizer.reductions.final_sq_norms))
            optimizer.step()
            norms.append(optimizer.grad_norm)
            optimizer.zero_grad()
            log.clear()
    error = ""
    if told in ("steps", "batch"):
        for xm, ym in micro[:3]:
            try:
                mse(model, xm.to(device), ym.to(device)).backward()
            except RuntimeError as exc:
                error = str(exc)
                break
        optimizer.zero_grad()
    return {
        "collectives_after_backward": seen,
        "norms_known_at_step": known,
        "buckets": sum(len(state.flat.buckets) for state in optimizer.groups),
        "grad_norms": norms,
        "params": [p.detach().to("cpu", copy=True) for p in model.parameters()],
        "third_backward_error": error,
    }


def boundary_cases(
    rank: int, world_size: int, configs: list[dict[str, Any]], told: list[str]
) -> list[Any]:
    return [boundary_case(rank, world_size, config, how) for config in configs for how in told]


SHARDED_BOUNDARY_RUNS = [("steps", 2), ("flag", 2), ("nothing", 2), ("steps", 3), ("nothing", 3)]
"""(told, micro-batches per step) of the sharded-accumulator boundary cases."""


def hot_path_cases(
    rank: int,
    world_size: int,
    device_configs: list[dict[str, Any]],
    boundary_configs: list[Any],
    sharded_config: dict[str, Any],
) -> dict[str, Any]:
    """The 2-rank cases of ``tests/test_hot_path.py`` in one spawned group."""
    return {
        "devices": [device_case(rank, world_size, config) for config in device_configs],
        "boundary": boundary_cases(
            rank, world_size, boundary_configs, ["steps", "flag", "nothing", "batch"]
        ),
        "sharded_boundary": [
            boundary_case(rank, world_size, sharded_config, told, per_step)
            for told, per_step in SHARDED_BOUNDARY_RUNS
        ],
    }
