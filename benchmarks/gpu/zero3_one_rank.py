"""ZeRO-3 with bf16 master weights on one rank of an NCCL group bound to the GPU.

    python3 -m benchmarks.gpu.zero3_one_rank [--dry-run] [--out DIR]

What README promises for a model built on the CPU: ``init_process_group("nccl",
device_id=cuda:0)``, ``plan.prepare_model`` on the CPU-built model (each FSDP2 unit moved to
the GPU, broadcast and sharded in turn), ``plan.build``, then 3 steps of a real forward and
backward. Checks: the parameters are DTensors on the GPU, every loss is finite and the last
below the first (a fixed batch), the device memory right before each ``step()`` against
``plan.memory()["total"]`` (reported; FSDP2's own buffers are not in it). With one rank no
collective carries data between GPUs: the all-gathers and reduce-scatters are copies (what a
single GPU cannot reach is listed in ``run_all.sh``'s summary). ``--dry-run``: one gloo rank
on the CPU. Writes ``results/gpu_zero3_one_rank-<date>.json/.md``.
"""

from __future__ import annotations

import datetime
import math
import socket
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._common import base_parser, environment, finish, format_table, write_result

CONFIG: dict[str, Any] = {
    "bf16": {"enabled": True},
    "master_weights": {"dtype": "bf16"},
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
}
STEPS = 3


def log(msg: str) -> None:
    print(msg, flush=True)


def model(width: int, blocks: int) -> torch.nn.Module:
    """Blocks of Linear + GELU, built on the CPU in fp32 (seeded)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        layers += [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 8))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    import dtypeplan

    cuda = args.device == "cuda"
    bound = {"device_id": torch.device("cuda", 0)} if cuda else {}
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
        world_size=1, timeout=datetime.timedelta(seconds=60), **bound,
    )  # fmt: skip
    try:
        plan = dtypeplan.resolve(CONFIG)
        net = model(args.width, args.blocks)
        numels = [p.numel() for p in net.parameters()]
        base = torch.cuda.memory_allocated() if cuda else 0
        net = plan.prepare_model(net)
        opt = plan.build(net.parameters())
        device = torch.device(args.device, 0) if cuda else torch.device("cpu")
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(args.tokens, args.width, generator=generator).to(device)
        y = torch.randn(args.tokens, 8, generator=generator).to(device)
        losses, boundary = [], []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x.to(plan.param_dtype)).float(), y)
            opt.backward(loss)
            if cuda:
                torch.cuda.synchronize()
                boundary.append(torch.cuda.memory_allocated() - base)
            opt.step()
            losses.append(float(loss.detach()))
        params = list(net.parameters())
        placed = all(
            isinstance(p, DTensor) and p.to_local().device.type == device.type for p in params
        )
        predicted = plan.memory(sum(numels), 1, param_numels=numels)["total"]
        record: dict[str, Any] = {
            "backend": dist.get_backend(),
            "bound_device": str(getattr(dist.group.WORLD, "bound_device_id", None)),
            "num_params": sum(numels),
            "losses": losses,
            "sharded_on_device": placed,
            "master_dtype": str(params[0].dtype).removeprefix("torch."),
            "predicted_MiB": round(predicted / 2**20, 2),
        }
        if cuda:
            record["boundary_MiB"] = round(max(boundary) / 2**20, 2)
            record["peak_MiB"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 2)
        record["ok"] = bool(
            placed
            and all(math.isfinite(v) for v in losses)
            and losses[-1] < losses[0]
            and record["master_dtype"] == "bfloat16"
        )
        return record
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="one gloo rank on the CPU")
    parser.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.width, args.blocks, args.tokens = "cpu", 32, 2, 16
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = "gpu_zero3_one_rank" + ("_dryrun" if args.dry_run else "")
    env = environment()
    started = time.perf_counter()
    errors: list[str] = []
    try:
        record = run(args)
    except Exception:  # noqa: BLE001 - recorded; the summary says it failed
        errors.append(traceback.format_exc(limit=-8))
        log(errors[-1])
        record = {"ok": False}
    summary = {
        "benchmark": name,
        "device": args.device,
        "ok": record["ok"] and not errors,
        "losses": record.get("losses"),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if not args.no_write:
        write_result(
            name, out=args.out, env=env,
            config={"plan": CONFIG, "width": args.width, "blocks": args.blocks,
                    "tokens": args.tokens, "steps": STEPS, "dry_run": args.dry_run},
            sections=[("Run", format_table([{k: v for k, v in record.items() if k != "losses"}]))]
            + ([("Errors", "\n".join(f"```\n{e[-1500:]}\n```" for e in errors))] if errors else []),
            data={"record": record, "errors": errors, "summary": summary},
        )  # fmt: skip
    finish(summary)
    if not summary["ok"]:
        raise SystemExit(1)
    return summary


if __name__ == "__main__":
    main()
