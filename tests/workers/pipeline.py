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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import dtypeplan
from tests._helpers import master_rel_error

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
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    pp_size, dp_size = mesh["pp"].size(), mesh["dp"].size()
    dp_group = mesh["dp"].get_group()
    plan = dtypeplan.resolve(case["config"], pipeline_parallel=True)
    assert plan.status == "OK", plan.explain()
    micro, per_micro, steps, seed = (
        case["micro_batches"],
        2,
        case.get("steps", 3),
        case.get("seed", 0),
    )

    reference = make_layers(seed)
    per_stage = len(reference) // pp_size
    stage_module = copy.deepcopy(reference[pp_rank * per_stage : (pp_rank + 1) * per_stage])
    ref_opt = plan.optimizer.torch_class(reference.parameters(), **plan.optimizer.params)
    stage_module = plan.prepare_model(stage_module, process_group=dp_group)
    optimizer = plan.build(stage_module.parameters(), process_group=dp_group)
    # What the schedule's calls of the stage computed in (torch_autocast: the autocast dtype,
    # which only prepare_model can have installed: the schedule calls the module itself).
    output_dtypes: set[str] = set()
    stage_module.register_forward_hook(lambda m, a, out: output_dtypes.add(str(out.dtype)))

    stage = PipelineStage(
        stage_module, pp_rank, pp_size, torch.device("cpu"), group=mesh["pp"].get_group()
    )

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(output.float(), target) / micro
        return loss * optimizer.loss_scale

    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[case["schedule"]]
    schedule = schedule_class(stage, n_microbatches=micro, loss_fn=loss_fn, scale_grads=False)

    generator = torch.Generator().manual_seed(seed + 7)
    losses, ref_losses = [], []
    for _ in range(steps):
        batch = dp_size * micro * per_micro
        x = torch.randn(batch, WIDTH, generator=generator)
        y = torch.randn(batch, WIDTH, generator=generator)
        ref_opt.zero_grad()
        with reference_autocast(plan):
            ref_out = reference(x)
        ref_loss = torch.nn.functional.mse_loss(ref_out.float(), y)
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(float(ref_loss.detach()))

        mine_x = x.chunk(dp_size)[dp_rank].to(plan.param_dtype)
        mine_y = y.chunk(dp_size)[dp_rank]
        optimizer.zero_grad()
        step_losses: list[torch.Tensor] = []
        with count_calls(dist, "reduce_scatter_single") as reduce_scatters:
            if pp_rank == 0:
                schedule.step(mine_x)
            else:
                schedule.step(target=mine_y, losses=step_losses)
        optimizer.clear_lp_grads()  # what a pipeline engine calls; must exist and be harmless
        scale = optimizer.loss_scale  # what loss_fn multiplied by (step() may change it)
        optimizer.step()
        total = torch.tensor([sum(float(part.detach()) for part in step_losses) / scale])
        dist.all_reduce(total)  # only the last stage contributes
        losses.append(float(total) / dp_size)
    ref_stage = reference[pp_rank * per_stage : (pp_rank + 1) * per_stage]
    master_error = master_rel_error(optimizer.full_state(), list(ref_stage.parameters()))
    return {
        "name": case["name"],
        "losses": losses,
        "ref_losses": ref_losses,
        "backward_reduce_scatters": reduce_scatters[0],
        "master_rel_error": master_error,
        "skipped_steps": optimizer.skipped_steps,
        "output_dtypes": sorted(output_dtypes),
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
    rank: int, world_size: int, cases: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    results = []
    for case in cases:
        try:
            results.append(run_pipeline_case(case, mesh))
        except Exception as exc:
            import traceback

            results.append({"name": case["name"], "error": f"{exc!r}\n{traceback.format_exc()}"})
    return results
