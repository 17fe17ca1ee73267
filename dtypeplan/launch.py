"""Start a function on several local ranks, each a spawned process in one gloo/NCCL group.

Public: the demo, the examples, the tests and the benchmarks start their ranks with
:func:`spawn`. What was seen to make CPU groups reliable:
the ``spawn`` start method (forked ranks can deadlock in matmul), one intra-op thread per rank,
a FileStore in a private temporary directory, and a barrier before
``destroy_process_group`` (without it gloo aborted a rank at teardown in half the runs).

Timeouts. A collective waits for a stalled or dead peer as long as its group's timeout
(torch's default: 30 minutes). The config key ``collective_timeout_s`` (default 600 s, carried
as ``plan.collective_timeout_s``) is that timeout. The group :func:`spawn` creates takes it from
the plan passed among ``fn``'s arguments (``spawn(fn, 2, plan, ...)``), unless
``group_timeout_s`` says otherwise; without a plan it is the config's default. For a group you
create yourself pass
``dist.init_process_group(..., timeout=datetime.timedelta(seconds=plan.collective_timeout_s))``
(``dist.new_group`` takes the same ``timeout``). On gloo the timed-out collective raises, and
dtypeplan reports it as a ``CollectiveError``. On NCCL torch's default
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) tears the process down at the timeout instead; set
``TORCH_NCCL_BLOCKING_WAIT=1`` (or ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``) before the group is
created to have it raise in the waiting rank.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtypeplan.resolver import PrecisionPlan

__all__ = ["RankFailure", "spawn"]

DEFAULT_GROUP_TIMEOUT_S = PrecisionPlan.collective_timeout_s
"""A config without ``collective_timeout_s`` gives this; so does :func:`spawn` without a plan."""


class RankFailure(RuntimeError):
    """A rank raised, died or ran out of time. The message holds its traceback."""


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    workdir: str,
    backend: str,
    group_timeout_s: float,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)
    outcome: tuple[str, Any]
    try:
        if backend == "nccl":
            # Before the group exists, so NCCL binds this rank's communicator to its own GPU.
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=group_timeout_s),
        )
        try:
            outcome = ("ok", fn(rank, world_size, *args))
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        outcome = ("error", traceback.format_exc())
    with open(os.path.join(workdir, f"result.{rank}"), "wb") as handle:
        pickle.dump(outcome, handle)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    group_timeout_s: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results.

    ``group_timeout_s`` is the group's collective timeout; by default the
    ``collective_timeout_s`` of the :class:`PrecisionPlan` among ``args`` (plans that differ
    in it are refused: say which with ``group_timeout_s``), else
    :data:`DEFAULT_GROUP_TIMEOUT_S`. ``fn`` and ``args`` must be picklable (a module-level
    function). Raises :class:`RankFailure` with the failing rank's traceback if any rank
    raises, dies or outlives ``timeout_s``.
    """
    if group_timeout_s is None:
        group_timeout_s = _plan_timeout(args)
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="dtypeplan-") as workdir:
        processes = [
            context.Process(
                target=_rank_main,
                args=(fn, rank, world_size, workdir, backend, group_timeout_s, args),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        late = [rank for rank, p in enumerate(processes) if p.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        results: list[Any] = []
        failures: list[str] = []
        for rank, process in enumerate(processes):
            path = os.path.join(workdir, f"result.{rank}")
            if rank in late:
                failures.append(f"rank {rank} did not finish within {timeout_s:g} s")
                continue
            if not os.path.exists(path):
                failures.append(f"rank {rank} died with exit code {process.exitcode} and no result")
                continue
            with open(path, "rb") as handle:
                status, value = pickle.load(handle)
            if status == "ok":
                results.append(value)
            else:
                failures.append(f"rank {rank} raised:\n{value}")
        if failures:
            raise RankFailure("\n".join(failures))
        return results


def _plan_timeout(args: tuple[Any, ...]) -> float:
    """The ``collective_timeout_s`` of the plans among ``args``, or the default."""
    timeouts = sorted({a.collective_timeout_s for a in args if isinstance(a, PrecisionPlan)})
    if len(timeouts) > 1:
        raise ValueError(
            f"spawn(): the plans among the arguments have collective_timeout_s {timeouts}; "
            "pass group_timeout_s to choose the group's timeout"
        )
    return timeouts[0] if timeouts else DEFAULT_GROUP_TIMEOUT_S
