"""Spawn-able workers for ``tests/test_reliability.py``.

Every function here runs on each rank of a group started by :func:`dtypeplan.launch.spawn`
and returns plain data (floats, bools, strings, CPU tensors) that the test process checks.
:func:`run_cases` runs many cases in one group, because a 2-rank group costs seconds to start;
a case that raises is reported as ``{"error": traceback}`` and the group goes on. The workers
that kill a rank (:func:`die_mid_step`) need a group of their own, since the group does not
survive them; a stalled rank (:func:`stall_case`) only breaks the optimizer's own group.
"""

from __future__ import annotations

import datetime
import io
import math
import os
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import dtypeplan
from dtypeplan import checkpoint
from dtypeplan.comm import Communicator
from dtypeplan.comm._collectives import CollectiveError
from dtypeplan.optimizers import MinimumLossScaleError
from tests._helpers import make_model as make_mlp

IN, HIDDEN, OUT = 8, 16, 4
MICRO_BATCHES, MICRO_BATCH_SIZE = 2, 3

_FAULT_VALUES = {"inf": math.inf, "nan": math.nan}


def make_model(seed: int, hidden: int = HIDDEN) -> torch.nn.Module:
    return make_mlp(seed, in_features=IN, hidden=hidden, out_features=OUT)


def micro_batches(
    seed: int, step: int, rank: int, world_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of the global batch of ``step`` (the same on every run)."""
    generator = torch.Generator().manual_seed(seed * 1000 + step)
    size = world_size * MICRO_BATCHES * MICRO_BATCH_SIZE
    x = torch.randn(size, IN, generator=generator)
    y = torch.randn(size, OUT, generator=generator)
    return list(
        zip(
            x.chunk(world_size)[rank].chunk(MICRO_BATCHES),
            y.chunk(world_size)[rank].chunk(MICRO_BATCHES),
            strict=True,
        )
    )


def train_step(
    optimizer: dtypeplan.MixedPrecisionOptimizer,
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> float:
    """One accumulation step; returns this rank's loss (the sum over micro-batches)."""
    dtype = next(model.parameters()).dtype
    optimizer.zero_grad()
    total = 0.0
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y) / len(batches)
        optimizer.backward(loss)
        total += float(loss.detach())
    optimizer.step()
    return total


def _build(
    config: dict[str, Any], seed: int, hidden: int = HIDDEN
) -> tuple[torch.nn.Module, dtypeplan.MixedPrecisionOptimizer]:
    plan = dtypeplan.resolve(config)
    assert plan.status == "OK", plan.explain()
    model = make_model(seed, hidden)
    if plan.zero_stage == 3:
        model = plan.prepare_model(model)
    return model, plan.build(model.parameters())


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _tensor_state(state: dict[str, Any]) -> dict[str, Any]:
    """The part of full_state() that a skipped step must not touch."""
    return {k: v for k, v in state.items() if k.startswith("param.") or k == "scalar.step"}


def _bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


# --- cases -------------------------------------------------------------------------------------
def mismatch_case(case: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Build with this rank's config and hidden size; report whether build raised."""
    config = case["configs"][rank]
    hidden = case.get("hidden", [HIDDEN] * world_size)[rank]
    plan = dtypeplan.resolve(config)
    start = time.monotonic()
    try:
        plan.build(make_model(0, hidden).parameters())
    except dtypeplan.RankMismatchError as exc:
        return {
            "raised": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    return {"raised": None, "message": "", "seconds": time.monotonic() - start}


def consistency_case(case: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Communicator.check_consistent with this rank's plan as a dict, entry by entry."""
    plan = dtypeplan.resolve(case["configs"][rank]).to_dict()
    try:
        Communicator().check_consistent({"plan": plan})
    except dtypeplan.RankMismatchError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None, "message": ""}


def fault_case(case: dict[str, Any], rank: int, world_size: int) -> list[dict[str, Any]]:
    """Train with a non-finite value written into one gradient on ``faulty_rank`` at some steps.

    ``case["faults"]`` lists, per step, ``None``, ``"inf"`` or ``"nan"``. Per step the record
    holds the counters after the step and whether the step left the state bitwise unchanged;
    a step that raises MinimumLossScaleError ends the case with ``{"raised": ..., ...}``.
    """
    seed = case.get("seed", 0)
    model, optimizer = _build(case["config"], seed)
    injected: dict[str, float | None] = {"value": None}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if injected["value"] is None:
            return grad
        grad = grad.clone()
        grad.view(-1)[3] = injected["value"]
        return grad

    if rank == case.get("faulty_rank", 1):
        # A tensor hook runs before the optimizer's post-accumulate hook consumes .grad.
        list(model.parameters())[case.get("victim", 2)].register_hook(poison)
    records: list[dict[str, Any]] = []
    for step, fault in enumerate(case["faults"]):
        injected["value"] = _FAULT_VALUES[fault] if fault else None
        before, params_before = _tensor_state(optimizer.full_state()), _params(model)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                train_step(optimizer, model, micro_batches(seed, step, rank, world_size))
        except MinimumLossScaleError as exc:
            records.append(
                {
                    "raised": type(exc).__name__,
                    "message": str(exc),
                    "skipped_steps": optimizer.skipped_steps,
                }
            )
            break
        after = _tensor_state(optimizer.full_state())
        records.append(
            {
                "skipped_steps": optimizer.skipped_steps,
                "loss_scale": optimizer.loss_scale,
                "state_unchanged": _bitwise_equal(before, after),
                "params_unchanged": all(
                    torch.equal(a, b)
                    for a, b in zip(params_before, model.parameters(), strict=True)
                ),
                "masters_finite": all(
                    bool(torch.isfinite(v).all()) for k, v in after.items() if k.endswith(".master")
                ),
                "warnings": [
                    str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                ],
            }
        )
    if case.get("compare_clean_run"):
        # Skipped steps are no-ops, so training on the clean steps' batches alone must give
        # the same state bitwise; stale gradients carried past a skip would not.
        final = _tensor_state(optimizer.full_state())
        model, optimizer = _build(case["config"], seed)
        for step, fault in enumerate(case["faults"]):
            if fault is None:
                train_step(optimizer, model, micro_batches(seed, step, rank, world_size))
        records[-1]["matches_clean_run"] = _bitwise_equal(
            final, _tensor_state(optimizer.full_state())
        )
    return records


def trajectory_case(case: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Train ``steps`` steps; return the losses, the parameters and the full state."""
    seed = case.get("seed", 0)
    model, optimizer = _build(case["config"], seed)
    losses = [
        train_step(optimizer, model, micro_batches(seed, step, rank, world_size))
        for step in range(case["steps"])
    ]
    state = optimizer.full_state()
    return {
        "losses": losses,
        "params": _params(model),
        "state": {k: v for k, v in state.items() if torch.is_tensor(v)},
    }


def resume_case(case: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """``steps`` steps straight through, and the same with a save/load after ``resume_at``.

    The resumed optimizer is built over a model with other initial weights, so only what
    load_state_dict restores can make the two runs agree.
    """
    seed, steps, resume_at = case.get("seed", 0), case["steps"], case["resume_at"]
    config = case["config"]
    model, optimizer = _build(config, seed)
    for step in range(steps):
        train_step(optimizer, model, micro_batches(seed, step, rank, world_size))
    straight = {"params": _params(model), "state": _tensor_state(optimizer.full_state())}

    model, optimizer = _build(config, seed)
    for step in range(resume_at):
        train_step(optimizer, model, micro_batches(seed, step, rank, world_size))
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    del model, optimizer

    model, optimizer = _build(config, seed + 1)
    saved.seek(0)
    optimizer.load_state_dict(torch.load(saved, weights_only=False))
    loaded_params = _params(model)
    for step in range(resume_at, steps):
        train_step(optimizer, model, micro_batches(seed, step, rank, world_size))
    return {
        "straight": straight,
        "resumed": {"params": _params(model), "state": _tensor_state(optimizer.full_state())},
        "loaded_params": loaded_params,
        "skipped_steps": optimizer.skipped_steps,
    }


# --- ranks that die or stall --------------------------------------------------------------------
def _timed(rank: int, action: Callable[[], None]) -> None:
    """Run ``action``; a CollectiveError is chained under one that says how long it took."""
    start = time.monotonic()
    try:
        action()
    except CollectiveError as exc:
        raise RuntimeError(f"rank {rank} gave up after {time.monotonic() - start:.2f} s") from exc


def die_mid_step(rank: int, world_size: int, config: dict[str, Any], where: str) -> str:
    """After one clean step, rank 1 exits at ``where``; the other ranks go on into step 2."""
    model, optimizer = _build(config, seed=0)
    train_step(optimizer, model, micro_batches(0, 0, rank, world_size))
    optimizer.zero_grad()
    batches = micro_batches(0, 1, rank, world_size)
    dtype = next(model.parameters()).dtype

    def backward() -> None:
        for x, y in batches:
            optimizer.backward(torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y))

    if where == "before_save":
        if rank == 1:
            os._exit(3)
        start = time.monotonic()
        directory = tempfile.mkdtemp(prefix="dtypeplan-dead-peer-")
        try:
            checkpoint.save(optimizer, directory)
        except checkpoint.CheckpointError as exc:
            took = time.monotonic() - start
            raise RuntimeError(f"rank {rank} gave up after {took:.2f} s") from exc
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return "saved"
    if where == "before_backward" and rank == 1:
        os._exit(3)
    _timed(rank, backward)
    if where == "before_step" and rank == 1:
        os._exit(3)
    _timed(rank, optimizer.step)
    return "finished"


def stall_case(case: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 sleeps past the optimizer group's timeout before step 2; rank 0 reports its error.

    The optimizer runs on a group of its own with a short timeout, so the default group stays
    healthy and the ranks meet again at the launcher's barrier. Run it last in its group: the
    optimizer's group is broken afterwards.
    """
    timeout_s = case["timeout_s"]
    group = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=timeout_s))
    plan = dtypeplan.resolve(case["config"])
    model = make_model(0)
    optimizer = plan.build(model.parameters(), process_group=group)
    train_step(optimizer, model, micro_batches(0, 0, rank, world_size))
    if rank == 1:
        time.sleep(timeout_s + 2.0)
        return {"raised": None, "message": "stalled", "seconds": 0.0}
    start = time.monotonic()
    try:
        train_step(optimizer, model, micro_batches(0, 1, rank, world_size))
    except CollectiveError as exc:
        return {
            "raised": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    return {"raised": None, "message": "finished", "seconds": time.monotonic() - start}


# --- the group driver ----------------------------------------------------------------------------
_KINDS: dict[str, Callable[[dict[str, Any], int, int], Any]] = {
    "mismatch": mismatch_case,
    "consistency": consistency_case,
    "fault": fault_case,
    "trajectory": trajectory_case,
    "resume": resume_case,
    "stall": stall_case,
}


def run_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Run every case on this rank; ``{name: result or {"error": traceback}}``."""
    results: dict[str, Any] = {}
    for case in cases:
        try:
            results[case["name"]] = _KINDS[case["kind"]](case, rank, world_size)
        except Exception:  # report the case, keep the group alive for the others
            results[case["name"]] = {"error": traceback.format_exc()}
    return results


def group_timeout(rank: int, world_size: int, *plans: Any) -> float:
    """The collective timeout, in seconds, of the group that spawn created for this rank."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    return float(backend.options._timeout.total_seconds())
