"""Pipeline parallelism x ZeRO with dtypeplan: PP=2 x DP=2 on 4 local CPU ranks.

    python examples/pipeline_zero.py [--stage 0|1|2|3] [--schedule gpipe|1f1b]

The pipeline schedule (torch.distributed.pipelining) runs backward itself: dtypeplan's hooks
take each micro-batch's gradients from there, so no special call is needed. Two rules:

* ``scale_grads=False`` in the schedule, and divide the loss by the number of micro-batches in
  ``loss_fn``: dtypeplan consumes ``.grad`` as soon as autograd produces it, so the schedule
  would find nothing to scale (with ``scale_grads=True`` it divides whatever ``.grad`` holds,
  including what earlier steps left there).
* fp16 only: multiply the loss by ``optimizer.loss_scale`` in ``loss_fn``.

``pipeline_group`` tells the optimizer which ranks hold the other stages: the step's gradient
norm (for ``gradient_clipping``) and fp16's overflow decision are then the whole model's, the
same on every stage. Without it, a pipeline plan with clipping or fp16 refuses to build.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import dtypeplan
from dtypeplan.launch import spawn

MICRO_BATCHES, WIDTH = 4, 32


def train(rank: int, world_size: int, stage_index: int, schedule_name: str) -> float:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_group = mesh["pp"].get_local_rank(), mesh["dp"].get_group()
    config = {
        "bf16": {"enabled": True},
        "gradient_accumulation_dtype": "fp32",
        "zero_optimization": {"stage": stage_index},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "gradient_clipping": 1.0,
    }
    # [docs: pipeline] (docs/pipeline.md shows the lines down to the end marker)
    plan = dtypeplan.resolve(config, pipeline_parallel=True)
    if rank == 0:
        print(plan.explain(), flush=True)

    torch.manual_seed(pp_rank)  # each pipeline stage owns different layers
    layers = [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH)]
    module = plan.prepare_model(
        torch.nn.Sequential(*layers), process_group=dp_group, pipeline_group=mesh["pp"]
    )
    optimizer = plan.build(module.parameters(), process_group=dp_group)
    stage = PipelineStage(module, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output.float(), target) / MICRO_BATCHES

    schedule_class = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
    schedule = schedule_class(
        stage, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn, scale_grads=False
    )
    generator = torch.Generator().manual_seed(100 + mesh["dp"].get_local_rank())
    target_map = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)) / WIDTH**0.5
    loss = float("nan")
    for step in range(20):
        x = torch.randn(MICRO_BATCHES * 8, WIDTH, generator=generator)
        losses: list[torch.Tensor] = []
        optimizer.zero_grad()
        if pp_rank == 0:
            schedule.step(x.to(plan.param_dtype))
        else:
            schedule.step(target=x @ target_map, losses=losses)
        optimizer.step()
        # [docs: end pipeline]
        total = torch.tensor([sum(float(part.detach()) for part in losses)], dtype=torch.float32)
        dist.all_reduce(total)  # only the last stage holds losses; average over the dp replicas
        loss = float(total) / (world_size // 2)
        if rank == 0 and step % 5 == 4:
            print(
                f"step {step + 1:2d}  loss {loss:.4f}  grad norm {optimizer.grad_norm:.3f}",
                flush=True,
            )
    return loss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=1, choices=[0, 1, 2, 3])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    args = parser.parse_args(argv)
    losses = spawn(train, 4, args.stage, args.schedule, timeout_s=300)
    print(f"final loss {losses[0]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
