"""Pipeline parallelism (torch.distributed.pipelining) x data parallelism, against fp32 torch.optim.

Ranks form a (pp=2, dp=N/2) mesh. Stage s holds half of the layers; the optimizer is built on
the stage's parameters with the data-parallel group of that stage; the schedule runs backward
itself, so dtypeplan sees only ``loss.backward()``-style calls through its hooks. The loss
function divides by the number of micro-batches and the schedule's own ``scale_grads`` is off
(dtypeplan consumes ``.grad`` in its hooks, so the schedule would have nothing to scale).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

import dtypeplan
from tests._helpers import master_rel_error
from tests.workers.hot_path import count_host_syncs

WIDTH, LAYERS = 16, 4


def make_layers(seed: int) -> torch.nn.Sequential:
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        linear = torch.nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(WIDTH, WIDTH, generator=generator) * 0.4)
            linear.bias.copy_(torch.randn(WIDTH, generator=generator) * 0.1)
        layers += [linear, torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def run_pipeline_case(case: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """One case on this rank's stages against fp32 torch.optim on the whole model.

    Case keys besides the config: ``schedule`` (``gpipe``, ``1f1b``, ``interleaved``: two
    stages per rank, stage ``s`` on pipeline rank ``s % pp``), ``pipeline_group`` (how the
    optimizer learns the other stages: ``"prepare"``, the default, ``"build"``, ``"schedule"``
    or None for not at all), ``overflow_step`` (an inf in stage 0's gradients at that step: the
    reference skips it), ``pipeline_parallel`` (False: resolved without it), ``stages_first``
    (the pipeline stages are made before the optimizer is built), ``scale_grads`` (the
    schedule's own, off unless given). With ``gradient_clipping`` the reference clips with
    torch's ``clip_grad_norm_`` over the whole model.
    """
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    pp_size, dp_size = mesh["pp"].size(), mesh["dp"].size()
    dp_group, pp_group = mesh["dp"].get_group(), mesh["pp"].get_group()
    plan = dtypeplan.resolve(case["config"], pipeline_parallel=case.get("pipeline_parallel", True))
    assert plan.status == "OK", plan.explain()
    micro, per_micro, steps, seed = (
        case["micro_batches"],
        2,
        case.get("steps", 3),
        case.get("seed", 0),
    )
    per_rank = 2 if case["schedule"] == "interleaved" else 1
    num_stages = pp_size * per_rank
    indices = [pp_rank + k * pp_size for k in range(per_rank)]  # this rank's stages
    linking = case.get("pipeline_group", "prepare")

    reference = make_layers(seed)
    per_stage = len(reference) // num_stages
    chunks = [reference[i * per_stage : (i + 1) * per_stage] for i in indices]
    ref_opt = plan.optimizer.torch_class(reference.parameters(), **plan.optimizer.params)
    linked = {"pipeline_group": pp_group} if linking == "prepare" else {}
    modules = [
        plan.prepare_model(copy.deepcopy(chunk), process_group=dp_group, **linked)
        for chunk in chunks
    ]
    params = [p for module in modules for p in module.parameters()]

    def build() -> dtypeplan.MixedPrecisionOptimizer:
        where = {"build": pp_group, "schedule": schedule if linking == "schedule" else None}
        if where.get(linking) is None:
            return plan.build(params, process_group=dp_group)
        return plan.build(params, process_group=dp_group, pipeline_group=where[linking])

    schedule: Any = None
    optimizer = None if linking == "schedule" or case.get("stages_first") else build()
    # What the schedule's calls of the stage computed in (torch_autocast: the autocast dtype,
    # which only prepare_model can have installed: the schedule calls the module itself).
    output_dtypes: set[str] = set()
    for module in modules:
        module.register_forward_hook(lambda m, a, out: output_dtypes.add(str(out.dtype)))
    overflow = [False]

    def poison(module: Any, args: Any, out: torch.Tensor) -> None:
        if overflow[0]:  # every weight gradient of stage 0 turns inf/NaN, no other stage's
            out.register_hook(lambda grad: grad * float("inf"))

    if 0 in indices:
        modules[0][0].register_forward_hook(poison)

    stages = [
        PipelineStage(module, index, num_stages, torch.device("cpu"), group=pp_group)
        for module, index in zip(modules, indices, strict=True)
    ]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(output.float(), target) / micro
        assert optimizer is not None
        return loss * optimizer.loss_scale

    scale_grads = case.get("scale_grads", False)
    if per_rank > 1:
        schedule = ScheduleInterleaved1F1B(
            stages, n_microbatches=micro, loss_fn=loss_fn, scale_grads=scale_grads
        )
    else:
        schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[case["schedule"]]
        schedule = schedule_class(
            stages[0], n_microbatches=micro, loss_fn=loss_fn, scale_grads=scale_grads
        )
    if optimizer is None:
        optimizer = build()
    if case.get("count_step_syncs"):
        # As tests/workers/hot_path.py: what reads values on the host only on the CPU is off,
        # so that every read counted is one that would wait for a GPU.
        optimizer.norm_probe.enabled = False
        optimizer.hyperparameter_check.enabled = False
    step_syncs: list[int] = []
    clip = plan.gradient_clipping

    generator = torch.Generator().manual_seed(seed + 7)
    losses, ref_losses, norms, ref_norms, scales, skipped = [], [], [], [], [], []
    for step in range(steps):
        batch = dp_size * micro * per_micro
        x = torch.randn(batch, WIDTH, generator=generator)
        y = torch.randn(batch, WIDTH, generator=generator)
        skip = step == case.get("overflow_step")
        ref_opt.zero_grad()
        with reference_autocast(plan):
            ref_out = reference(x)
        ref_loss = torch.nn.functional.mse_loss(ref_out.float(), y)
        ref_loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        if not skip:
            ref_opt.step()
        ref_losses.append(float(ref_loss.detach()))
        ref_norms.append(float(norm))

        mine_x = x.chunk(dp_size)[dp_rank].to(plan.param_dtype)
        mine_y = y.chunk(dp_size)[dp_rank]
        optimizer.zero_grad()
        step_losses: list[torch.Tensor] = []
        overflow[0] = skip
        with count_calls(dist, "reduce_scatter_single") as reduce_scatters:
            if 0 in indices:
                schedule.step(mine_x)
            elif num_stages - 1 in indices:
                schedule.step(target=mine_y, losses=step_losses)
            else:
                schedule.step()
        overflow[0] = False
        optimizer.clear_lp_grads()  # what a pipeline engine calls; must exist and be harmless
        scale = optimizer.loss_scale  # what loss_fn multiplied by (step() may change it)
        with count_host_syncs() as syncs:
            optimizer.step()
        step_syncs.append(len(syncs))
        norms.append(optimizer.grad_norm)
        scales.append(optimizer.loss_scale)
        skipped.append(optimizer.last_step_skipped)
        total = torch.tensor([sum(float(part.detach()) for part in step_losses) / scale])
        dist.all_reduce(total)  # only the last stage contributes
        losses.append(float(total) / dp_size)
    ref_stage = [p for chunk in chunks for p in chunk.parameters()]
    master_error = master_rel_error(optimizer.full_state(), ref_stage)
    optimizer.close()
    return {
        "name": case["name"],
        "losses": losses,
        "ref_losses": ref_losses,
        "grad_norms": norms,
        "ref_norms": ref_norms,
        "loss_scales": scales,
        "skipped_each_step": skipped,
        "step_host_syncs": step_syncs,
        "backward_reduce_scatters": reduce_scatters[0],
        "master_rel_error": master_error,
        "skipped_steps": optimizer.skipped_steps,
        "output_dtypes": sorted(output_dtypes),
        "backward_passes_per_step": (
            None if optimizer.accumulation is None else optimizer.accumulation.micro_batches
        ),
    }


def reference_autocast(plan: dtypeplan.PrecisionPlan) -> contextlib.AbstractContextManager[Any]:
    """Plain torch's forward for the reference: under ``torch.autocast`` with torch_autocast."""
    if plan.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=plan.autocast_dtype)


@contextlib.contextmanager
def count_calls(module: Any, name: str) -> Iterator[list[int]]:
    """Count calls of ``module.name`` inside the block (FSDP2 looks collectives up there)."""
    original = getattr(module, name, None)
    counter = [0]
    if original is None:
        yield counter
        return

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield counter
    finally:
        setattr(module, name, original)


def run_pipeline_cases(
    rank: int, world_size: int, cases: list[dict[str, Any]], pp: int = 2
) -> list[dict[str, Any]]:
    """Every case on one (pp, dp = world / pp) mesh; a failing case is reported, not raised."""
    mesh = init_device_mesh("cpu", (pp, world_size // pp), mesh_dim_names=("pp", "dp"))
    results = []
    for case in cases:
        try:
            results.append(run_pipeline_case(case, mesh))
        except Exception as exc:
            import traceback

            results.append({"name": case["name"], "error": f"{exc!r}\n{traceback.format_exc()}"})
    return results
