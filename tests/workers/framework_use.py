"""Spawn-able workers for tests/test_framework_use.py."""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

import dtypeplan
from dtypeplan.errors import OptimizerUsageError
from dtypeplan.optimizers.grads.owned import is_owned_gradient
from tests._helpers import make_batch, make_model, mse

BULK = 64
"""Collectives over more elements than this carry gradients or parameters (the MLP's smallest
bucket holds hundreds); the smaller ones are bookkeeping (the step summary, DDP's record of
used parameters, its bucket-order broadcast)."""


def _collectives(prof: Any, bulk_only: bool = True) -> list[tuple[str, int]]:
    out = []
    for event in prof.events():
        if event.name.startswith("gloo:") and event.input_shapes:
            numel = sum(int(torch.Size(s).numel()) for s in event.input_shapes if s)
            if numel > BULK or not bulk_only:
                out.append((event.name, numel))
    return sorted(out)


class _CountedHook:
    """dtypeplan's communication hook, counting DDP's calls (each one a bucket DDP filled)."""

    def __init__(self) -> None:
        from dtypeplan.optimizers.grads import ddp as ddp_module

        self.module = ddp_module
        self.original = ddp_module._reduced_by_dtypeplan
        self.calls = 0

    def __enter__(self) -> _CountedHook:
        def _reduced_by_dtypeplan(process_group, bucket):  # type: ignore[no-untyped-def]
            # unannotated: DDP checks annotations as objects, and this module's are strings
            self.calls += 1
            return self.original(process_group, bucket)

        self.module._reduced_by_dtypeplan = _reduced_by_dtypeplan  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        self.module._reduced_by_dtypeplan = self.original  # type: ignore[assignment]


def _watch_ddp_writes(optimizer: Any, model: torch.nn.Module, wrote: list[bool]) -> None:
    """Record, right after DDP's end of backward and before the optimizer drops it, whether
    DDP wrote a ``.grad`` (one entry per backward)."""
    drop = optimizer.reductions.after_wrapped_backward

    def recorded() -> None:
        wrote.append(
            any(p.grad is not None and not is_owned_gradient(p.grad) for p in model.parameters())
        )
        drop()

    optimizer.reductions.after_wrapped_backward = recorded


def _mean_over_ranks(grad: torch.Tensor) -> torch.Tensor:
    """What DDP's all-reduce makes of a gradient: divided by the world size, then summed."""
    out = grad / torch.distributed.get_world_size()
    torch.distributed.all_reduce(out)
    return out


def _ddp_run(rank: int, case: dict[str, Any], wrapped: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "zero_optimization": {"stage": case["stage"]},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
    }
    if case["bf16"]:
        config["bf16"] = {"enabled": True}
        config["gradient_accumulation_dtype"] = "fp32"
    plan = dtypeplan.resolve(config)
    model = plan.prepare_model(make_model(0))
    optimizer = plan.build(model.parameters())
    net: Any = model
    ddp_wrote: list[bool] = []
    if wrapped:
        net = DistributedDataParallel(
            model,
            gradient_as_bucket_view=case["bucket_view"],
            find_unused_parameters=case["find_unused"],
            static_graph=case["static_graph"],
        )
        if case.get("own_hook"):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            net.register_comm_hook(None, allreduce_hook)
        _watch_ddp_writes(optimizer, model, ddp_wrote)
    micro = case["micro_batches"]
    losses: list[float] = []
    wire: list[tuple[str, int]] = []
    all_collectives: list[tuple[str, int]] = []
    grads_after_backward: list[bool] = []
    hook_calls: list[int] = []
    with _CountedHook() as counted:
        for step in range(3):
            # DDP rebuilds its buckets (one broadcast) in the second iteration: the third is
            # steady.
            watch = step == 2
            calls_before = counted.calls
            with (
                profile(activities=[ProfilerActivity.CPU], record_shapes=True)
                if watch
                else (_nullcontext()) as prof
            ):
                for m in range(micro):
                    x, y = make_batch(100 * step + 10 * m + rank, 4)
                    sync = m == micro - 1 or not case["no_sync"] or not wrapped
                    context = net.no_sync() if not sync else _nullcontext()
                    with context:
                        loss = mse(net, x, y) / micro
                        if wrapped and sync and case.get("armed_anyway"):
                            # Accelerate's trigger_sync_in_backward: the reducer armed by hand
                            net.reducer.prepare_for_backward([])
                        loss.backward()
                    losses.append(float(loss))
                    # None or the optimizer's placeholder, never DDP's zeros
                    grads_after_backward.append(
                        any(
                            p.grad is not None and not is_owned_gradient(p.grad)
                            for p in model.parameters()
                        )
                    )
                optimizer.step()
                optimizer.zero_grad()
            hook_calls.append(counted.calls - calls_before)
            if watch:
                wire = _collectives(prof)
                all_collectives = _collectives(prof, bulk_only=False)
    params = [p.detach().float().clone() for p in model.parameters()]
    if case.get("collected"):  # never closed: its parameters owned by nobody once collected
        del optimizer
        gc.collect()
    else:
        optimizer.close()
    # Without its optimizer the wrapper is DDP again: the mean gradient in .grad.
    x, y = make_batch(1000 + rank, 4)
    mse(net, x, y).backward()
    if wrapped:
        after_close = [p.grad.clone() for p in model.parameters()]
    else:
        after_close = [_mean_over_ranks(p.grad) for p in model.parameters()]
    return {
        "losses": losses,
        "params": params,
        "wire": wire,
        "all_collectives": all_collectives,
        "grads_after_backward": grads_after_backward,
        "ddp_wrote": ddp_wrote,
        "hook_calls": hook_calls,
        "after_close": after_close,
    }


def _partly_owned_run(rank: int, wrapped: bool) -> dict[str, Any]:
    """The first layer owned by dtypeplan, the others by torch's SGD; DDP (wrapped) or a hand
    all-reduce of the SGD parameters' gradients (bare) reduces those."""
    plan = dtypeplan.resolve({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}})
    model = plan.prepare_model(make_model(0))
    owned = list(model[0].parameters())
    others = [p for p in model.parameters() if all(p is not q for q in owned)]
    optimizer = plan.build(owned, lr=1e-2)
    sgd = torch.optim.SGD(others, lr=1e-2, momentum=0.9)
    net: Any = DistributedDataParallel(model) if wrapped else model
    losses: list[float] = []
    with _CountedHook() as counted:
        for step in range(3):
            for m in range(2):
                x, y = make_batch(100 * step + 10 * m + rank, 4)
                loss = mse(net, x, y) / 2
                loss.backward()
                if not wrapped:
                    for p in others:
                        p.grad = _mean_over_ranks(p.grad)
                losses.append(float(loss))
            optimizer.step()
            sgd.step()
            optimizer.zero_grad()
            sgd.zero_grad()
    optimizer.close()
    return {
        "losses": losses,
        "params": [p.detach().float().clone() for p in model.parameters()],
        "hook_calls": counted.calls,
    }


def _buffer_run(rank: int, owned: bool) -> list[bool]:
    """Per forward through DDP (accumulation under ``no_sync()``, then without): whether it
    broadcast rank 0's buffer, with the parameters owned by dtypeplan or by torch's SGD."""
    model = make_model(0)
    model[1].register_buffer("mark", torch.zeros(3))
    plan = dtypeplan.resolve({"zero_optimization": {"stage": 1}})
    optimizer: Any = (plan.build if owned else _sgd)(model.parameters())
    net = DistributedDataParallel(model)
    broadcast: list[bool] = []
    for step, schedule in enumerate(([False, True], [False, True], [True, True])):
        for m, sync in enumerate(schedule):
            model[1].mark.fill_(rank + 1)
            x, y = make_batch(100 * step + 10 * m + rank, 4)
            with net.no_sync() if not sync else _nullcontext():
                loss = mse(net, x, y)
                loss.backward()
            broadcast.append(bool((model[1].mark == 1).all()))
        optimizer.step()
        optimizer.zero_grad()
    if owned:
        optimizer.close()
    return broadcast


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2)


class _nullcontext:
    def __enter__(self) -> Any:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def ddp_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[Any]:
    """Each case twice, under DDP and bare; a refusal comes back as its message."""
    torch.set_num_threads(1)
    results: list[Any] = []
    for case in cases:
        if case.get("buffers"):
            results.append((_buffer_run(rank, True), _buffer_run(rank, False)))
            continue
        if case.get("partly_owned"):
            results.append((_partly_owned_run(rank, True), _partly_owned_run(rank, False)))
            continue
        try:
            wrapped = _ddp_run(rank, case, wrapped=True)
        except dtypeplan.errors.OptimizerUsageError as exc:
            results.append(str(exc))
            continue
        results.append((wrapped, _ddp_run(rank, case, wrapped=False)))
    return results


def _zero3_run(rank: int, bf16: bool, moved: bool) -> list[float]:
    config: dict[str, Any] = {
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    plan = dtypeplan.resolve(config)
    model = plan.prepare_model(make_model(0))
    device = next(model.parameters()).device
    if moved:  # what a framework does to a model it receives, before the optimizer exists
        model.to(device)
    optimizer = plan.build(model.parameters())
    losses = []
    for step in range(4):
        if moved:  # and after (Accelerate's prepare(model, optimizer), Lightning's setup)
            model.to(device) if step % 2 else model.cpu()
        x, y = make_batch(10 * step + rank, 4)
        loss = mse(model, x, y)
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    optimizer.close()
    return losses


def zero3_handling(rank: int, world_size: int) -> dict[str, Any]:
    """A ZeRO-3 model moved to its own device before and after build trains as one not moved;
    DDP around it is refused."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for bf16 in (False, True):
        out[f"moved_bf16={bf16}"] = _zero3_run(rank, bf16, moved=True)
        out[f"still_bf16={bf16}"] = _zero3_run(rank, bf16, moved=False)
    plan = dtypeplan.resolve({"zero_optimization": {"stage": 3}})
    model = plan.prepare_model(make_model(0))
    try:
        DistributedDataParallel(model)
        out["ddp"] = "wrapped"
    except (RuntimeError, OptimizerUsageError) as exc:
        out["ddp"] = str(exc)
    return out


ZERO3_CLIP_CASES: dict[str, dict[str, Any]] = {
    "bf16_accumulation": {"gradient_accumulation_dtype": "bf16"},
    "bf16_masters": {"master_weights": {"dtype": "bf16", "rounding": "kahan"}},
    "fp32_accumulation": {"gradient_accumulation_dtype": "fp32"},
}
"""bf16 parameters at ZeRO-3: the optimizer takes the sharded gradients in (the first two) or
FSDP2's fp32 ``.grad`` is the accumulator (the last)."""


def _reference_norm(rank: int, world_size: int, micro_batches: int) -> float:
    """The gradient norm of the first step computed by plain torch on one process: bf16
    weights (the fp32 masters rounded), each rank's loss averaged over ranks."""
    model = make_model(0).to(torch.bfloat16)
    for micro in range(micro_batches):
        for r in range(world_size):
            x, y = make_batch(100 * micro + r, 4)
            (mse(model, x, y) / (world_size * micro_batches)).backward()
    return float(
        torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))
    )


def _zero3_clip_run(rank: int, world_size: int, extra: dict[str, Any], placeholders: bool):
    from dtypeplan.optimizers.fsdp2 import sharding

    config: dict[str, Any] = {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        **extra,
    }
    plan = dtypeplan.resolve(config)
    model = plan.prepare_model(make_model(0))
    clears = getattr(sharding, "CLEARS_OWNED", None)  # absent before the change
    if not placeholders and clears is not None:
        clears._map.clear()  # the code before: .grad left empty after the accumulation hook
    optimizer = plan.build(model.parameters())
    micro_batches = 2
    out: dict[str, Any] = {"losses": [], "torch_clip": [], "norms": [], "placeholders": []}
    for step in range(3):
        for micro in range(micro_batches):
            x, y = make_batch(100 * micro + rank + 1000 * step, 4)
            loss = mse(model, x, y) / micro_batches
            if micro == 0:
                optimizer.backward(loss)
            else:  # a bare backward (what frameworks do) onto the placeholders
                loss.backward()
            out["losses"].append(float(loss.detach()))
        grads = [p.grad for p in model.parameters()]
        out["placeholders"].append(
            "all"
            if all(is_owned_gradient(g) for g in grads)
            else "none"
            if not any(is_owned_gradient(g) for g in grads)
            else "some"
        )
        if step == 0:  # the state between backward and step, with the placeholders in .grad
            out["state_keys"] = sorted(optimizer.state_dict())
        out["held_ok"] = not any(
            is_owned_gradient(t) or t.numel() == 0
            for part in (optimizer.held_tensors().accumulator, optimizer.held_tensors().grads)
            for t in part
        )
        try:
            out["torch_clip"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        except Exception as exc:  # noqa: BLE001 - the test reads the error's type and text
            out["torch_clip"].append(f"{type(exc).__name__}: {exc}")
        out["norms"].append(float(optimizer.clip_grad_norm_(0.5)))
        optimizer.step()
        # step() keeps the gradients until zero_grad, as torch.optim does (issue 29).
        out.setdefault("kept_by_step", []).append(
            all(p.grad is not None for p in model.parameters())
        )
        optimizer.zero_grad()
    mse(model, *make_batch(rank, 4)).backward()
    model.zero_grad()  # the framework's own zero_grad clears placeholders as any .grad
    out["model_zero_grad"] = all(p.grad is None for p in model.parameters())
    optimizer.zero_grad()
    out["params"] = [p.full_tensor().float() for p in model.parameters()]
    optimizer.close()
    return out


def zero3_clipping(rank: int, world_size: int) -> dict[str, Any]:
    """Every case of :data:`ZERO3_CLIP_CASES` with the placeholders and without (as before)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {"reference": _reference_norm(rank, world_size, 2)}
    for name, extra in ZERO3_CLIP_CASES.items():
        for placeholders in (True, False):
            run = _zero3_clip_run(rank, world_size, extra, placeholders)
            out[f"{name}/placeholders={placeholders}"] = run
    return out


def ddp_wrappers_found(rank: int, world: int) -> dict[str, Any]:
    """The first backward on a process group, with a dead weakref.proxy alive (a walk over the
    live objects met it) and the garbage collector's object list made to fail: the DDP wrapper
    whose forward ran is found and cooperates; one whose forward never ran is not (DDP leaves
    no mark on its parameters); nothing warns. Then the watching hook is gone."""
    import gc
    import warnings
    import weakref

    import torch.distributed  # noqa: F401 - its deprecated reduce_op is among the objects

    from dtypeplan.optimizers.grads import ddp as ddp_module

    class Gone:
        pass

    target = Gone()
    proxy = weakref.proxy(target)
    del target
    gc.collect()

    def walked() -> list[Any]:
        raise AssertionError("the live objects were walked")

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    plan = dtypeplan.resolve({"zero_optimization": {"stage": 1}})
    model = make_model(0)
    optimizer = plan.build(model.parameters())
    out["hook_while_watching"] = bool(ddp_module._HOOK)
    net = DistributedDataParallel(model)
    idle = DistributedDataParallel(make_model(1))  # never runs a forward
    walk, gc.get_objects = gc.get_objects, walked  # type: ignore[assignment]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x, y = make_batch(rank, 4)
            optimizer.backward(mse(net, x, y))
            optimizer.step()
            optimizer.zero_grad()
            found = ddp_module.wrappers_of(model.parameters())
            out["idle_found"] = len(ddp_module.wrappers_of(idle.module.parameters()))
    finally:
        gc.get_objects = walk  # type: ignore[assignment]
    assert proxy is not None
    out["found"] = sum(w is net for w in found)
    out["cooperating"] = bool(getattr(net, "_dtypeplan_reduces", False))
    out["hook_after_first_backward"] = bool(ddp_module._HOOK)
    out["warnings"] = [str(w.message) for w in caught]
    optimizer.close()
    return out
